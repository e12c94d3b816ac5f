"""The GPU path's device rules, checked on CPU: the whole trainer under device-strict mode
(tests/harness/device_strict.py).

On NCCL every tensor that enters a collective must live on the training device. These tests run the real
trainer (training steps, per-domain loss sums, peak memory, the ZeRO 0 global norm, evaluation, checkpoints and
the consolidated export) on gloo ranks whose collectives reject host tensors, so a tensor made without
`device=` fails here exactly where it would crash the first NCCL run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.e2e.test_train import _overrides
from tests.harness.device_strict import DevicePlacementError
from tests.harness.multirank import run_ranks


def _train(rank: int, world: int, sets: list[str], run_dir: str) -> dict:
    from launcher.config import load_run_config
    from launcher.plan import make_plan
    from launcher.train import train

    cfg = load_run_config(None, sets, check=False)
    return train(make_plan(cfg, world), Path(run_dir), resume="never")


def _sets(tokens: Path, kind: str, zero: int, *extra: str) -> list[str]:
    args = _overrides(tokens, kind=kind, steps=3, zero=zero)
    sets = [a for a in args if a != "--set"]
    return sets + ["train.eval_interval=2", "train.save_interval=2", *extra]


def _placement_checks(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    device = torch.device("cpu")
    seen = []
    for make in (
        lambda: torch.zeros(3),
        lambda: torch.tensor([1.0]),
        lambda: torch.zeros(3, device=device).cpu(),
        lambda: torch.zeros(3) + torch.ones(3),
    ):
        try:
            dist.all_reduce(make())
        except DevicePlacementError:
            seen.append("rejected")
    dist.all_reduce(torch.zeros(3).to(device))
    dist.all_reduce(torch.ones(3, device=device) * 2 + torch.zeros(3).to(device))
    host = torch.zeros(())
    host += torch.ones((), device=device)  # in place: stays a host tensor
    try:
        dist.all_reduce(host)
    except DevicePlacementError:
        seen.append("rejected")
    return seen


def test_strict_mode_rejects_a_host_tensor_in_a_collective():
    """The harness itself: a tensor made without device= fails a collective; one moved with .to(device) passes,
    as does arithmetic on device tensors; `.cpu()` makes a host tensor again."""
    assert run_ranks(_placement_checks, 2, device_strict=True) == [["rejected"] * 5] * 2


@pytest.mark.slow
@pytest.mark.parametrize("kind,zero", [("demix", 0), ("demix", 2), ("gshard", 1)])
def test_trainer_keeps_every_collective_on_the_training_device(tiny_tokens, tmp_path, kind, zero):
    """Training, logging, evaluation, checkpointing and export on 2 ranks (DEMix: 3 domains, so one rank holds
    two experts), with collectives that reject host tensors as NCCL does."""
    sets = _sets(tiny_tokens, kind, zero)
    results = run_ranks(_train, 2, args=(sets, str(tmp_path / "run")), device_strict=True)
    assert results[0] == results[1] and any(k.startswith("val_loss/") for k in results[0])
    assert (tmp_path / "run" / "model" / "meta.json").is_file()


def _train_fp16(rank: int, world: int, sets: list[str], run_dir: str, lift_guard: bool) -> dict:
    if lift_guard:
        # torch's CPU fp16 kernels work on any x86 CPU; DeepSpeed's CPU accelerator only refuses fp16 where
        # oneDNN lacks it. Lifting that guard runs DeepSpeed's real fp16 optimizer, loss scaler and overflow check.
        from deepspeed.accelerator import get_accelerator

        type(get_accelerator()).is_fp16_supported = lambda self: True
    return _train(rank, world, sets, run_dir)


def _fp16_demix_zero0(tiny_tokens: Path, tmp_path: Path, lift_guard: bool) -> None:
    """DEMix, 3 domains on 2 ranks, ZeRO 0, fp16 (DeepSpeed's FP16_UnfusedOptimizer around our AdamW): the
    overflow check finds the expert groups (it parses `ep_size_<N>` names), the run trains, and the norm we clip
    and log is the unscaled one (close to an fp32 run's, not 2^16 times larger)."""
    from launcher.metrics import read_metrics

    norms = {}
    for precision in ("fp32", "fp16"):
        run = tmp_path / precision
        sets = _sets(tiny_tokens, "demix", 0, f"train.precision={precision}", "train.clip_grad=0.5")
        run_ranks(_train_fp16, 2, args=(sets, str(run), lift_guard), device_strict=True)
        recs = [r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "train"]
        assert len(recs) == 3 and all(r["loss"] == r["loss"] for r in recs)
        norms[precision] = recs[0]["grad_norm"]
    assert norms["fp16"] == pytest.approx(norms["fp32"], rel=5e-2), norms


@pytest.mark.slow
@pytest.mark.skipif(
    not __import__("parallel.precision", fromlist=["x"]).cpu_supports_fp16(),
    reason="this CPU has no fp16 kernels in oneDNN (needs avx512_fp16 or AMX-FP16): DeepSpeed refuses fp16",
)
def test_fp16_demix_zero0_native(tiny_tokens, tmp_path):
    _fp16_demix_zero0(tiny_tokens, tmp_path, lift_guard=False)


@pytest.mark.slow
def test_fp16_demix_zero0_with_deepspeeds_cpu_guard_lifted(tiny_tokens, tmp_path):
    """The same on any x86 CPU: torch computes fp16 in software where oneDNN cannot."""
    _fp16_demix_zero0(tiny_tokens, tmp_path, lift_guard=True)


def _resume_with_fused_adamw(rank: int, world: int, sets: list[str], run_dir: str) -> list[str]:
    """Resume `run_dir` through the trainer (Trainer.setup, resume="auto") with torch's fused AdamW, as on CUDA
    (parallel/engine.py `adamw_options`; torch has a fused CPU kernel too); return every optimizer state tensor
    that is not where its parameter is: another device, made on the host (device-strict provenance), or a `step`
    of another dtype than the fused kernel's float32."""
    import parallel.engine as engine_mod
    from launcher.config import load_run_config
    from launcher.plan import make_plan
    from launcher.train import Trainer
    from tests.harness.device_strict import is_host

    plain = engine_mod.adamw_options
    engine_mod.adamw_options = lambda t, device_type: {**plain(t, device_type), "fused": True}
    trainer = Trainer.setup(make_plan(load_run_config(None, sets, check=False), world), Path(run_dir))
    assert trainer.start == 2
    opt, wrong = trainer.bundle.engine.optimizer, []
    optimizers = [o for o in (opt, getattr(opt, "optimizer", None)) if isinstance(o, torch.optim.Optimizer)]
    for o in optimizers:
        for group in o.param_groups:
            assert group["fused"]
            for p in group["params"]:
                for key, value in o.state[p].items():
                    if value.device != p.device or is_host(value):
                        wrong.append(f"{key} on {value.device}{' (host)' if is_host(value) else ''}")
                    if key == "step" and value.dtype != torch.float32:
                        wrong.append(f"step of {value.dtype}")
    assert optimizers and any(o.state for o in optimizers)
    return wrong


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 2])
def test_resumed_optimizer_state_sits_where_its_parameter_sits(tiny_tokens, tmp_path, zero):
    """After a resume every Adam state tensor (the moments and `step`, which CUDA's fused AdamW reads on the
    device) is on its parameter's device, made there, at the dtype torch's fused kernel expects; ZeRO 0 (torch's
    AdamW state per parameter) and ZeRO 2 (per flat partition) load through different paths."""
    run = tmp_path / "run"
    first = [*_sets(tiny_tokens, "demix", zero), "train.steps=2", "train.eval_interval=0"]
    run_ranks(_train, 1, args=(first, str(run)))
    second = [*_sets(tiny_tokens, "demix", zero), "train.eval_interval=0"]
    assert run_ranks(_resume_with_fused_adamw, 1, args=(second, str(run)), device_strict=True) == [[]]
