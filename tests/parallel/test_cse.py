"""`copy_expert` under every optimizer wrapper the project builds (ZeRO 0/1/2 x fp32/bf16/fp16), on the real
DeepSpeed engine: after the copy the destination expert's fp32 master weight and Adam moments are the source's, so
a step with lr 0 leaves the two experts equal and a step with lr > 0 and identical gradients moves them identically.

fp16 at ZeRO 0 is DeepSpeed's FP16_UnfusedOptimizer around our AdamW: it keeps fp32 masters (`fp32_groups`) and
writes them back into the fp16 module at every step, so a copy of the module weights alone is undone by the next
step. DeepSpeed's CPU accelerator refuses fp16 unless oneDNN has it; as in tests/multirank/test_device_placement.py the
guard is lifted (torch's CPU fp16 kernels work everywhere) to run the real fp16 optimizer.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

from tests.conftest import random_lm_batch
from tests.harness.multirank import run_ranks

MB, SEQ, VOCAB = 4, 8, 64
COMBOS = [(precision, zero) for precision in ("fp32", "bf16", "fp16") for zero in (0, 1, 2)]
KEYS = ("master", "exp_avg", "exp_avg_sq")


def _cfg(precision: str, zero: int) -> Any:
    from launcher.config import load_run_config

    return load_run_config(
        None,
        [
            "model.preset=tiny",
            "model.n_layers=1",
            f"model.vocab_size={VOCAB}",
            f"model.seq_len={SEQ}",
            "model.d_model=16",
            "model.n_heads=2",
            "model.ffn.kind=cse",
            "model.ffn.num_experts=2",
            "model.ffn.cse.last_layers=1",
            "data.mixture=natural",
            f"parallel.zero_stage={zero}",
            f"train.precision={precision}",
            f"train.micro_batch={MB}",
            "train.grad_accum=1",
            "train.steps=10",
            "train.lr=1e-2",
            "train.warmup_fraction=0.0",
            "train.schedule=constant",
            "train.weight_decay=0.1",
        ],
    )


def _batch(i: int) -> dict[str, torch.Tensor]:
    return random_lm_batch(i, MB, SEQ, VOCAB)


def _fp32_state(p: nn.Parameter, optimizer: Any) -> dict[str, torch.Tensor]:
    """p's fp32 master weight and Adam moments, read straight from whichever wrapper holds them (independently of
    parallel/cse.py's own lookup, except for ZeRO's partitions)."""
    from tests.harness.full_state import partitioned_state

    if hasattr(p, "_hp_mapping"):  # ZeRO 1/2: flat fp32 partitions
        return {k: partitioned_state(p, optimizer, None if k == "master" else k).clone() for k in KEYS}
    inner, master = optimizer, p
    if hasattr(optimizer, "fp32_groups"):  # FP16_UnfusedOptimizer: one fp32 master per parameter
        inner = optimizer.optimizer
        master = next(
            hp
            for lp_g, hp_g in zip(optimizer.fp16_groups, optimizer.fp32_groups)
            for lp, hp in zip(lp_g, hp_g)
            if lp is p
        )
    st = inner.state[master]
    return {
        "master": master.detach().float().clone(),
        "exp_avg": st["exp_avg"].clone(),
        "exp_avg_sq": st["exp_avg_sq"].clone(),
    }


@torch.no_grad()
def _diffs(e0: nn.Module, e1: nn.Module, optimizer: Any) -> dict[str, float]:
    """Largest |src - dst| over the experts' module weights and each fp32 state."""
    out = {"weight": 0.0, **{k: 0.0 for k in KEYS}}
    for p0, p1 in zip(e0.parameters(), e1.parameters()):
        out["weight"] = max(out["weight"], (p0.float() - p1.float()).abs().max().item())
        s0, s1 = _fp32_state(p0, optimizer), _fp32_state(p1, optimizer)
        for k in KEYS:
            out[k] = max(out[k], (s0[k] - s1[k]).abs().max().item())
    return out


def _twin_forward(e0: nn.Module, e1: nn.Module) -> None:
    """Make expert 0 (which the dense, unclustered layer sends every sequence to) compute (e0(x) + e1(x)) / 2:
    two equal experts then get bitwise-identical gradients."""
    own = type(e0).forward.__get__(e0)
    e0.forward = lambda x: 0.5 * (own(x) + e1(x))


def _set_lr(optimizer: Any, lr: float) -> None:
    from parallel.cse import _torch_optimizer

    for group in _torch_optimizer(optimizer).param_groups:
        group["lr"] = lr  # the engine's scheduler restores the configured lr after the step


def _engine_case(precision: str, zero: int) -> dict[str, Any]:
    from launcher.ffn_kinds import ffn_kind
    from launcher.train import train_step
    from model.cse import cse_layers
    from model.gpt import GPT
    from parallel.cse import copy_expert
    from parallel.groups import ProcessGroups
    from parallel.topology import build_topology

    cfg = _cfg(precision, zero)
    torch.manual_seed(0)
    model = GPT(cfg.model, init_seed=3)
    bundle = ffn_kind(cfg).build_engine(model, cfg, ProcessGroups.create(build_topology(1, 1, 1)))
    engine, opt = bundle.engine, bundle.engine.optimizer
    layer = cse_layers(engine.module)[0]
    e0, e1 = layer.experts["0"], layer.experts["1"]
    for i in range(3):  # expert 0 trains (and gets Adam moments); expert 1 only gets zero gradients
        train_step(bundle, cfg, [_batch(i)], 1)
    out: dict[str, Any] = {"wrapper": type(opt).__name__, "before": _diffs(e0, e1, opt)}
    out["src_moments"] = min(_fp32_state(p, opt)["exp_avg_sq"].abs().max().item() for p in e0.parameters())
    copy_expert(e0, e1, opt)
    out["copied"] = _diffs(e0, e1, opt)
    _twin_forward(e0, e1)
    _set_lr(opt, 0.0)
    train_step(bundle, cfg, [_batch(10)], 1)
    out["lr0"] = _diffs(e0, e1, opt)
    w = [p.detach().float().clone() for p in e1.parameters()]
    train_step(bundle, cfg, [_batch(11)], 1)
    out["moved"] = max((p.float() - q).abs().max().item() for p, q in zip(e1.parameters(), w))
    out["lr"] = _diffs(e0, e1, opt)
    return out


def _fused_fp16_case() -> dict[str, Any]:
    """DeepSpeed's other ZeRO-0 fp16 wrapper, FP16_Optimizer (flat fp32 masters per group; the engine picks it for
    a FusedAdam client optimizer only, which the project never builds): built directly around a torch AdamW."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer

    from parallel.cse import copy_expert

    torch.manual_seed(0)
    experts = nn.ModuleDict(
        {str(e): nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 8)) for e in range(3)}
    )
    experts = experts.half()
    decay = [p for p in experts.parameters() if p.dim() >= 2]
    no_decay = [p for p in experts.parameters() if p.dim() < 2]
    inner = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2
    )
    opt = FP16_Optimizer(inner, static_loss_scale=1.0)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1)).half()
    e0, e2 = experts["0"], experts["2"]  # expert 1 in between: the copy must find the right slices

    def step(f: Any) -> None:
        f(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step(e0)
    copy_expert(e0, e2, opt)
    out: dict[str, Any] = {"wrapper": type(opt).__name__}
    _twin_forward(e0, e2)
    for name, lr in (("lr0", 0.0), ("lr", 1e-2)):
        for g in inner.param_groups:
            g["lr"] = lr
        step(e0)
        out[name] = {
            "weight": max(
                (p0.float() - p2.float()).abs().max().item()
                for p0, p2 in zip(e0.parameters(), e2.parameters())
            )
        }
    # whole flat groups: experts 0, 1, 2 one after the other in each
    out["flat"] = {
        k: [(t if k == "master" else inner.state[t][k]).detach().clone() for t in opt.fp32_groups_flat]
        for k in KEYS
    }
    out["numel"] = [[p.numel() for p in g] for g in opt.fp16_groups]
    return out


def _worker(rank: int, world: int) -> dict[Any, Any]:
    from deepspeed.accelerator import get_accelerator

    # As tests/multirank/test_device_placement.py: run DeepSpeed's real fp16 optimizer on a CPU without oneDNN fp16.
    type(get_accelerator()).is_fp16_supported = lambda self: True
    out: dict[Any, Any] = {}
    for combo in COMBOS:
        try:
            out[combo] = _engine_case(*combo)
        except Exception as e:  # one combo's failure must not hide the others'
            out[combo] = {"error": f"{type(e).__name__}: {e}"}
    out["fused"] = _fused_fp16_case()
    return out


@pytest.fixture(scope="module")
def results() -> dict[Any, Any]:
    return run_ranks(_worker, 1)[0]  # one rank: DeepSpeed needs a process group, no path here needs two


@pytest.mark.parametrize("precision,zero", COMBOS, ids=[f"{p}-zero{z}" for p, z in COMBOS])
def test_copy_expert_copies_master_weights_and_adam_moments(results, precision, zero):
    r = results[(precision, zero)]
    assert "error" not in r, r
    if (precision, zero) == ("fp16", 0):
        assert r["wrapper"] == "FP16_UnfusedOptimizer"
    assert r["before"]["weight"] > 0 and r["before"]["exp_avg"] > 0  # the experts differed before the copy
    assert r["src_moments"] > 0  # the source's moments are not the zero state: the check is not vacuous
    # lr 0: nothing moves, so the copy must survive the step (a stale fp32 master would be written back)
    assert r["lr0"]["weight"] == 0.0, f"{r['wrapper']}: a step with lr 0 undid the copy: {r['lr0']}"
    assert r["copied"] == {"weight": 0.0, **{k: 0.0 for k in KEYS}}, r["copied"]
    assert r["lr0"] == {"weight": 0.0, **{k: 0.0 for k in KEYS}}, r["lr0"]
    # lr > 0 with identical gradients: identical updates (tolerance for vectorised arithmetic's last bit)
    assert r["moved"] > 1e-4, r  # the step did move the copy
    assert max(r["lr"].values()) < 1e-6, r["lr"]


def test_copy_expert_under_deepspeeds_flat_fp16_optimizer(results):
    r = results["fused"]
    assert r["wrapper"] == "FP16_Optimizer"
    assert r["lr0"]["weight"] == 0.0, f"FP16_Optimizer: a step with lr 0 undid the copy: {r['lr0']}"
    assert r["lr"]["weight"] < 1e-3, r["lr"]
    # experts 0 and 2 hold the same slices of every flat master and moment (nonzero ones)
    for k, flats in r["flat"].items():
        for flat, sizes in zip(flats, r["numel"]):
            parts = torch.split(flat, sizes)
            n = len(sizes) // 3
            for a, c in zip(parts[:n], parts[2 * n :]):
                assert torch.equal(a, c) and a.any(), k
