"""fp16 at ZeRO 0 decides overflow from the step's global gradient norm (parallel/overflow.py): the same training as
DeepSpeed's own FP16_UnfusedOptimizer.step, with one device read per optimizer step instead of one per parameter.

Two engines from the same seed train on the same batches through `launcher.train.train_step`, one with DeepSpeed's
step, one with `step_with_norm`; a step with a planted overflow (a loss scale of 2^40 makes the fp16 gradients inf)
is skipped by both. After every step the fp16 weights, fp32 masters, Adam moments, loss scale, skipped-step count
and learning rate must be bitwise equal. DeepSpeed's CPU accelerator refuses fp16 unless oneDNN has it; as in
tests/multirank/test_device_placement.py its guard is lifted (torch's CPU fp16 kernels work on any x86 CPU).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from tests.conftest import random_lm_batch
from tests.harness.multirank import run_ranks

MB, SEQ, VOCAB = 4, 8, 64


def _cfg(precision: str = "fp16", zero: int = 0) -> Any:
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
            "data.mixture=natural",
            f"parallel.zero_stage={zero}",
            f"train.precision={precision}",
            f"train.micro_batch={MB}",
            "train.grad_accum=2",
            "train.steps=10",
            "train.lr=1e-2",
            "train.warmup_fraction=0.0",
            "train.schedule=constant",
            "train.clip_grad=0.1",
        ],
    )


def _batch(i: int) -> dict[str, torch.Tensor]:
    return random_lm_batch(i, MB, SEQ, VOCAB)


def _engine(cfg: Any, install: bool) -> tuple[Any, bool]:
    from launcher.ffn_kinds import ffn_kind
    from model.gpt import GPT
    from parallel.groups import ProcessGroups
    from parallel.overflow import install_norm_overflow_check
    from parallel.topology import build_topology

    torch.manual_seed(0)
    bundle = ffn_kind(cfg).build_engine(
        GPT(cfg.model, init_seed=3), cfg, ProcessGroups.create(build_topology(1, 1, 1))
    )
    return bundle, install and install_norm_overflow_check(bundle.engine.optimizer)


def _state(bundle: Any) -> dict[str, Any]:
    opt = bundle.engine.optimizer
    masters = [p for g in opt.fp32_groups for p in g]
    adam = opt.optimizer.state
    return {
        "fp16": [p.detach().clone() for p in bundle.engine.module.parameters()],
        "fp32": [p.detach().clone() for p in masters],
        "exp_avg": [adam[p]["exp_avg"].clone() for p in masters if p in adam],
        "exp_avg_sq": [adam[p]["exp_avg_sq"].clone() for p in masters if p in adam],
        "scale": opt.loss_scale_config.cur_scale,
        "skipped": bundle.engine.skipped_steps,
        "steps": bundle.engine.global_steps,
        "lr": bundle.scheduler.get_last_lr(),
    }


def _train(rank: int, world: int) -> dict[str, Any]:
    from deepspeed.accelerator import get_accelerator

    from launcher.train import train_step
    from tests.harness.device_strict import record_host_reads

    type(get_accelerator()).is_fp16_supported = lambda self: True
    cfg = _cfg()
    out: dict[str, Any] = {"installed": {}, "states": {}, "reads": {}}
    for name in ("deepspeed", "norm"):
        bundle, out["installed"][name] = _engine(cfg, install=name == "norm")
        states, reads = [], []
        for step in range(5):
            if step == 3:  # planted overflow: the scaled fp16 gradients become inf, the step is skipped
                bundle.engine.optimizer.loss_scale_config.cur_scale = 2.0**40
            if step == 4:  # and a normal step after it
                bundle.engine.optimizer.loss_scale_config.cur_scale = 2.0**10
            micro = [_batch(2 * step), _batch(2 * step + 1)]
            with record_host_reads() as got:
                train_step(bundle, cfg, micro, 1)
            # AdamW's step counters
            reads.append(
                Counter(
                    t.split(" <- ")[0].split(":")[0] + " " + t.split(" <- ")[0].split(" ")[1]
                    for _, t in got
                    if not t.startswith("torch/optim")
                )
            )
            states.append(_state(bundle))
        out["states"][name], out["reads"][name] = states, reads
        out["params"] = sum(1 for _ in bundle.engine.module.parameters())
    out["others"] = {
        f"{p} ZeRO {z}": _engine(_cfg(p, z), install=True)[1]
        for p, z in (("fp32", 0), ("bf16", 0), ("fp16", 1))
    }
    return out


def test_norm_overflow_step_trains_as_deepspeeds_step_with_one_read() -> None:
    got = run_ranks(_train, 1, device_strict=True)[0]
    assert got["installed"] == {"deepspeed": False, "norm": True}
    assert not any(got["others"].values()), got["others"]  # every other optimizer keeps DeepSpeed's own step
    ds, ours = got["states"]["deepspeed"], got["states"]["norm"]
    assert [s["skipped"] for s in ours] == [s["skipped"] for s in ds]
    # the planted overflow
    assert ours[3]["skipped"] == ours[2]["skipped"] + 1 and ours[3]["scale"] == 2.0**39
    assert ours[4]["skipped"] == ours[3]["skipped"] and ours[4]["steps"] == ours[3]["steps"] + 1
    for step, (a, b) in enumerate(zip(ds, ours)):
        for key in ("scale", "skipped", "steps", "lr"):
            assert a[key] == b[key], (step, key, a[key], b[key])
        for key in ("fp16", "fp32", "exp_avg", "exp_avg_sq"):
            assert len(a[key]) == len(b[key]) > 0, key
            for x, y in zip(a[key], b[key]):
                assert torch.equal(x, y), (step, key)
    # Reads per optimizer step (AdamW's step counters aside): ours one, DeepSpeed's one per parameter and more.
    for step, reads in enumerate(got["reads"]["norm"]):
        assert reads == Counter({"parallel/overflow.py overflowed": 1}), (step, reads)
    # the control: the recorder sees DeepSpeed's reads
    for step, reads in enumerate(got["reads"]["deepspeed"]):
        if step != 3:  # (at the overflow its per-parameter test stops at the first inf gradient)
            assert sum(reads.values()) >= got["params"] + 1, (step, reads)
