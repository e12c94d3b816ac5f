"""What only a GPU can show: NCCL collectives, CUDA RNG on resume, fp16 loss scaling on the device.

Skipped without CUDA (tests/conftest.py says so). `scripts/gpu_checks.sh` runs them all and records the result in
benchmarks/results/gpu_checks.md. Each multi-rank check runs at one rank (NCCL still refuses host tensors in every
collective, the fused optimizer and loss scaling run on the device) and at two, which NCCL can only do with two
GPUs (one rank per device): with fewer the two-rank cases skip, saying why, and `ONE_GPU_CANNOT_CHECK` lists what
stays unchecked.

Safe under pytest-xdist (`-n 4`): every run directory is the test's own `tmp_path` (per worker), every launch takes
its rendezvous port from the kernel (launcher/distributed.py `free_port`, asked when the launch starts), and the
prepared corpus is each worker's own session fixture. Concurrent runs share the GPUs, so throughput numbers from
such a run are not measurements (the sweep here checks only that they are positive and finite).
"""

from __future__ import annotations

import math

import pytest

from launcher.metrics import read_metrics
from tests.e2e.test_train import _launch, _launch_and_kill_after_step, _losses, _overrides

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

# What a node with one GPU cannot check: NCCL runs one rank per device, so every run there is a world of one.
ONE_GPU_CANNOT_CHECK = (
    "DEMix domain-group reductions over NCCL (expert gradients all-reduced within a domain's ranks only)",
    "unequal numbers of experts across ranks (3 domains on 2 ranks) and the per-rank expert optimizer groups",
    "GShard's all-to-all token exchange between expert-parallel ranks",
    "ZeRO 1/2 partitioning of the optimizer state across ranks, and its per-parameter fragments all-reduced "
    "over NCCL groups when a training state is read or written",
    "fp16 loss-scale and overflow agreement across ranks",
    "per-rank CUDA RNG streams restored on resume",
    "tensor parallelism (TP > 1)",
)
NEEDS_TWO = (
    "needs >= 2 GPUs: NCCL runs one rank per device; with one GPU the domain-group reductions/all-to-all/TP>1 "
    "over NCCL cannot be checked"
)


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# world 1 runs wherever there is a GPU; world 2 only with two (a one-GPU node would have silently run world 1)
NPROC = pytest.mark.parametrize(
    "nproc",
    [1, pytest.param(2, marks=pytest.mark.skipif(_gpus() < 2, reason=NEEDS_TWO))],
    ids=lambda n: f"{n}rank",
)


def _train_records(run) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "train"]


@pytest.mark.parametrize("zero", [0, pytest.param(2, marks=pytest.mark.quick)])
@NPROC
def test_nccl_demix_trains_evaluates_checkpoints_and_exports(tiny_tokens, tmp_path, zero, nproc):
    run = tmp_path / f"z{zero}"
    _launch(
        [
            "--nproc",
            str(nproc),
            "--run-dir",
            str(run),
            *_overrides(tiny_tokens, steps=6, zero=zero),
            "--set",
            "train.eval_interval=2",
        ]
    )
    start = next(r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "start")
    assert start["device"] != "cpu"
    losses = _losses(run)
    assert len(losses) == 6 and losses[6] < losses[1]
    assert (run / "model" / "meta.json").is_file() and (run / "checkpoints" / "latest").is_file()


@pytest.mark.parametrize("kind", [pytest.param("gshard", marks=pytest.mark.quick), "dense"])
@NPROC
def test_nccl_baselines_train(tiny_tokens, tmp_path, kind, nproc):
    """8 steps over NCCL: a record per step whose numbers are finite and agree with each other (the overall loss
    between the domains' losses, tokens/s x seconds = the global batch's tokens, an aux loss exactly for GShard),
    a first loss at ln(vocabulary) (the initial model predicts nearly uniformly), and a loss that falls over the
    run, not once: the mean of the last three steps below the first three's, every late step below the first."""
    steps = 8
    run = tmp_path / kind
    _launch(
        [
            "--nproc",
            str(nproc),
            "--run-dir",
            str(run),
            *_overrides(tiny_tokens, kind=kind, steps=steps, zero=1),
        ]
    )
    start = next(r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "start")
    assert start["device"] != "cpu" and start["world_size"] == nproc
    recs = _train_records(run)
    assert [r["step"] for r in recs] == list(range(1, steps + 1))
    tokens_per_update = 2 * 2 * nproc * 32  # micro_batch x grad_accum x data-parallel ranks x seq_len
    for r in recs:
        values = [r["loss"], r["grad_norm"], r["lr"], r["tokens_per_s"], r["step_time_s"]]
        assert all(math.isfinite(v) for v in values), r
        domains = [v for k, v in r.items() if k.startswith("loss/")]  # the domains this step's batches held
        assert domains and all(math.isfinite(v) for v in domains), r
        assert min(domains) - 1e-6 <= r["loss"] <= max(domains) + 1e-6, r
        assert r["grad_norm"] > 0 and 0 <= r["lr"] <= 3e-3 and r["peak_mem_gb"] > 0
        assert r["tokens_per_s"] * r["step_time_s"] == pytest.approx(tokens_per_update, rel=1e-6)
        assert ("aux_loss" in r) == (kind == "gshard")
        if kind == "gshard":
            assert math.isfinite(r["aux_loss"]) and r["aux_loss"] >= 0
    lrs = [r["lr"] for r in recs]
    peak = lrs.index(max(lrs))  # linear warm-up, then decay to min_lr (0)
    assert lrs[peak:] == sorted(lrs[peak:], reverse=True) and lrs[-1] < lrs[peak]
    losses = [r["loss"] for r in recs]
    assert losses[0] == pytest.approx(math.log(50304), rel=0.05)  # GPT-2's vocabulary padded to 50,304
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    assert all(loss < losses[0] for loss in losses[steps // 2 :]), losses
    final = [r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "eval"][-1]
    assert final["step"] == steps
    # the domains its validation batches held
    val = [v for k, v in final.items() if k.startswith("val_loss/")]
    assert val and all(math.isfinite(v) for v in val), final


@pytest.mark.parametrize("zero", [0, 1])
@NPROC
def test_fp16_loss_scaling_end_to_end(tiny_tokens, tmp_path, zero, nproc):
    """fp16 with dynamic loss scaling: trains, and the logged (clipped-by) norm is the unscaled one."""
    norms = {}
    for precision in ("fp32", "fp16"):
        run = tmp_path / precision
        _launch(
            [
                "--nproc",
                str(nproc),
                "--run-dir",
                str(run),
                *_overrides(tiny_tokens, steps=6, zero=zero),
                "--set",
                f"train.precision={precision}",
                "--set",
                "train.clip_grad=0.5",
            ]
        )
        recs = _train_records(run)
        assert len(recs) == 6 and recs[-1]["loss"] < recs[0]["loss"]
        norms[precision] = recs[0]["grad_norm"]
    assert norms["fp16"] == pytest.approx(norms["fp32"], rel=5e-2), norms


@pytest.mark.quick
def test_bf16_where_the_gpu_has_it(tiny_tokens, tmp_path):
    import torch

    run = tmp_path / "bf16"
    proc = _launch(
        [
            "--nproc",
            "1",
            "--run-dir",
            str(run),
            *_overrides(tiny_tokens, steps=3),
            "--set",
            "train.precision=bf16",
        ],
        check=False,
    )
    if torch.cuda.get_device_capability() >= (8, 0):  # not is_bf16_supported(): True on V100 by emulation
        assert proc.returncode == 0, proc.stderr[-2000:]
    else:  # refused at plan time, before any process starts
        assert proc.returncode == 2 and "has no bf16" in proc.stderr


@pytest.mark.quick  # the resume path: fused AdamW reads the restored optimizer state on the device
@NPROC
def test_resume_restores_the_cuda_rng_state(tiny_tokens, tmp_path, nproc):
    """Dropout on the GPU draws from the CUDA generator: a killed and resumed run repeats the uninterrupted
    trajectory only if its state is restored."""
    sets = [*_overrides(tiny_tokens, steps=6), "--set", "model.dropout=0.3"]
    full, killed = tmp_path / "full", tmp_path / "killed"
    _launch(["--nproc", str(nproc), "--run-dir", str(full), *sets])
    proc = _launch_and_kill_after_step(["--nproc", str(nproc), "--run-dir", str(killed), *sets], killed, 3)
    assert proc.returncode != 0
    _launch(["--nproc", str(nproc), "--run-dir", str(killed), *sets])
    a, b = _losses(full), _losses(killed)
    for step in range(3, 7):
        assert b[step] == pytest.approx(a[step], rel=1e-4), (step, a, b)


@NPROC
def test_training_state_moves_between_zero_stages_on_the_device(tiny_tokens, tmp_path, nproc):
    """Per-parameter state read and written on the GPU (fragments all-reduced over NCCL groups): 3 steps at ZeRO 2,
    steps 4-6 at ZeRO 0; the loss goes on falling and zero_to_fp32 of the final state is the export."""
    import subprocess
    import sys

    import torch

    run = tmp_path / "run"
    _launch(["--nproc", str(nproc), "--run-dir", str(run), *_overrides(tiny_tokens, steps=3, zero=2)])
    proc = _launch(["--nproc", str(nproc), "--run-dir", str(run), *_overrides(tiny_tokens, steps=6, zero=0)])
    assert "zero_stage 2 -> 0" in proc.stderr
    losses = _losses(run)
    assert sorted(losses) == list(range(1, 7)) and losses[6] < losses[3]
    out = tmp_path / "fp32"
    subprocess.run([sys.executable, "-m", "launcher.zero_to_fp32", str(run), "--out", str(out)], check=True)
    from launcher.checkpoint import load_consolidated

    mine, export = load_consolidated(out).state_dict, load_consolidated(run / "model").state_dict
    assert all(torch.equal(mine[k], v) for k, v in export.items())
