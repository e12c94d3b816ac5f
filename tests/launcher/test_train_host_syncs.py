"""No device-to-host read inside a training step: every value the step produces stays on the training device
until a log interval (`step_record`) brings it to the host.

On a GPU each read of a device tensor on the host (`.item()`, `float()`, `bool()`, `.tolist()`, `.cpu()`,
`.to("cpu")`) waits for every queued kernel. The device-strict harness (tests/harness/device_strict.py) tells host
and device tensors apart by provenance on a CPU-only machine, and `record_host_reads` lists such reads with where
they happen. Two real ranks over gloo run non-logging steps of every FFN kind (dense, DEMix with one domain per rank
and with a rank holding two, GShard, CSE clustered) at ZeRO 0, 1 and 2, and fp16 at ZeRO 0 (DeepSpeed's CPU
accelerator refuses fp16 unless oneDNN has it; its guard is lifted as in tests/multirank/test_device_placement.py,
torch's CPU fp16 kernels work on any x86 CPU). Every read is an error unless named in ALLOWED with its reason; the
two the project's own code keeps are also counted exactly (`expected_reads`).
"""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

import pytest

from tests.harness.multirank import run_ranks

# frames shown repo-relative
_REPO_PREFIX = str(__import__("pathlib").Path(__file__).resolve().parents[2]) + "/"

# (file, function) of the reads allowed inside a step, each with why it stays; the project's own two are also counted
# exactly (`expected_reads`).
ALLOWED = {
    # torch keeps AdamW's `step` counters on the CPU unless capturable/fused ("special device hosting for step"):
    # created with device="cpu", so the harness sees a named device; on a GPU this is a host read, no sync.
    ("torch/optim/adam.py", "_single_tensor_adam"),
    ("torch/optim/optimizer.py", "_get_value"),
    # DeepSpeed's ZeRO 1/2 optimizer decides overflow and the clipping factor on the host from the global gradient
    # norm: once per optimizer step (per parameter group for the clip), never per micro-batch.
    ("deepspeed/runtime/zero/stage_1_and_2.py", "step"),
    ("deepspeed/runtime/zero/stage_1_and_2.py", "unscale_and_clip_grads"),
    # fp16 at ZeRO 0: DeepSpeed skips an overflowing update on the host (engine._take_model_step reads
    # optimizer.overflow), so the decision is read once per optimizer step, from the global norm (parallel/overflow.py;
    # DeepSpeed's own FP16_UnfusedOptimizer.step reads 1 + parameters + 2 x groups times: 33 per step here, dense).
    ("parallel/overflow.py", "overflowed"),
    # A clustered CSE layer (K >= 2) computes each sequence's cluster on the device from its own input; the experts run
    # on host-sized slices, so the per-cluster counts are read once per layer and micro-batch (model/cse.py docstring).
    ("model/cse.py", "routed_counts"),
}


class count_synchronize:
    """Context manager: every call of the accelerator's `synchronize()` inside it, as the 'file:line function' of
    the three innermost frames outside the accelerator. On the CPU accelerator `synchronize()` is a no-op, so
    counting its calls (the class method is wrapped, whichever object calls it) is the only way to see on CPU
    the device waits it would be on a GPU (DeepSpeed's CUDA accelerator: `torch.cuda.synchronize()`)."""

    def __enter__(self) -> list:
        from deepspeed.accelerator import get_accelerator

        self.cls, self.events = type(get_accelerator()), []
        self.original = self.cls.__dict__["synchronize"]
        original, events = self.original, self.events

        def synchronize(acc, *args, **kwargs):
            import traceback

            frames = [f for f in traceback.extract_stack()[:-1] if "/accelerator/" not in f.filename]
            events.append(
                " <- ".join(
                    f"{f.filename.split('site-packages/')[-1].split(_REPO_PREFIX)[-1]}:{f.lineno} {f.name}"
                    for f in reversed(frames[-3:])
                )
            )
            return original(acc, *args, **kwargs)

        self.cls.synchronize = synchronize
        return self.events

    def __exit__(self, *exc) -> None:
        self.cls.synchronize = self.original


def _steps(
    rank: int, world: int, tokens: str, kind: str, zero: int, domains: str, precision: str, run_dir: str
) -> dict:
    """Host reads and accelerator synchronize() calls of two non-logging training steps (after two first ones), each
    with the FFN kind's after-step hook as the loop runs it (CSE: clustered after the first step, then the centre
    update)."""
    from launcher.config import load_run_config
    from launcher.plan import make_plan
    from launcher.train import Trainer, train_step
    from model.cse import cse_layers
    from tests.harness.device_strict import record_host_reads

    if precision == "fp16":
        from deepspeed.accelerator import get_accelerator

        # torch's CPU fp16 kernels work on any x86 CPU
        type(get_accelerator()).is_fp16_supported = lambda self: True
    sets = [
        "model.preset=tiny",
        "model.n_layers=2",
        "model.d_model=64",
        "model.n_heads=2",
        "model.seq_len=32",
        f"model.ffn.kind={kind}",
        f"data.path={tokens}",
        "data.tokenizer=gpt2",
        f"data.domains=[{domains}]",
        f"data.mixture={'by_domain' if kind == 'demix' else 'natural'}",
        "train.steps=4",
        "train.micro_batch=2",
        "train.grad_accum=2",
        f"parallel.zero_stage={zero}",
        f"train.precision={precision}",
        "logging.wandb_mode=disabled",
        "logging.progress_bar=false",
        *(_CSE_SETS if kind == "cse" else []),
    ]
    plan = make_plan(load_run_config(None, sets, check=False), world)
    trainer = Trainer.setup(plan, Path(run_dir), resume="never")
    n = len(plan.catalog.train_domains)

    def step(s: int, batches: list) -> None:
        train_step(trainer.bundle, plan.cfg, batches, n)
        if trainer.hook is not None:
            trainer.hook.after_step(s + 1, lambda i, d=s + 1: trainer.batches(d, i, 1)[0])

    # DeepSpeed's throughput timer only starts synchronising from its global step 2 (`start_step`): warm up past
    # it, so that a timer left on is seen in the recorded steps.
    for s in (0, 1):
        step(s, trainer.batches(s))  # also: lazy optimizer state, CSE's clustering
    batches = [trainer.batches(s) for s in (2, 3)]  # the sampler is host work, outside the step
    with record_host_reads() as reads, count_synchronize() as syncs:
        for s, b in zip((2, 3), batches):
            step(s, b)
    clusters = [layer.active for layer in cse_layers(trainer.bundle.engine.module)]
    return {"reads": reads, "syncs": syncs, "clusters": clusters}


def _runs(rank: int, world: int, tokens: str, zero: int, combos: list, run_dir: str) -> list:
    """`_steps` of several (kind, domains, precision) in one pair of processes (one start-up, ~9 s, for all)."""
    return [
        (combo, _steps(rank, world, tokens, combo[0], zero, combo[1], combo[2], f"{run_dir}/{i}"))
        for i, combo in enumerate(combos)
    ]


def _allowed(trace: str) -> bool:
    """Whether a read happens inside one of the ALLOWED functions (any of the three innermost frames)."""
    for frame in trace.split(" <- "):
        path, _, func = frame.partition(" ")
        if (path.rsplit(":", 1)[0], func) in ALLOWED:
            return True
    return False


# CSE clusters after the first step (boundary round(0.25 x 4) = 1); eps is chosen for at least two clusters, so that
# the routed path (several experts, the counts' read) is what runs in the recorded steps.
_CSE_SETS = [
    "model.ffn.num_experts=4",
    "model.ffn.cse.num_samples=16",
    "model.ffn.cse.dbscan_eps=0.0",
    "model.ffn.cse.dbscan_auto=target",
    "model.ffn.cse.min_clusters=2",
    "model.ffn.cse.dbscan_min_samples=2",
    "model.ffn.cse.warmup_fraction=0.25",
]
# Every FFN kind at every ZeRO stage, one pair of processes per stage. DEMix runs with one domain per rank (the paper's
# layout) and with a rank holding two domains (rows routed on the host); ZeRO 0 also in fp16 (DeepSpeed's
# FP16_UnfusedOptimizer, whose overflow test parallel/overflow.py replaces).
_KINDS = [
    ("dense", "cooking,sailing"),
    ("demix", "cooking,sailing"),
    ("demix", "cooking,sailing,finance"),
    ("gshard", "cooking,sailing"),
    ("cse", "cooking,sailing"),
]
_BY_STAGE = {
    0: [(k, d, "fp32") for k, d in _KINDS] + [(k, d, "fp16") for k, d in _KINDS],
    1: [(k, d, "fp32") for k, d in _KINDS],
    2: [(k, d, "fp32") for k, d in _KINDS],
}
_STEPS, _MICRO = 2, 2  # recorded optimizer steps, micro-batches per step


def expected_reads(precision: str, zero: int, clusters: list) -> Counter:
    """How often each ALLOWED read of the project's own code must happen in the recorded steps: the fp16 overflow
    decision once per optimizer step (ZeRO 0), a clustered CSE layer's counts once per layer with K >= 2 and
    micro-batch."""
    return Counter(
        {
            ("parallel/overflow.py", "overflowed"): _STEPS if (precision, zero) == ("fp16", 0) else 0,
            ("model/cse.py", "routed_counts"): _STEPS * _MICRO * sum(k >= 2 for k in clusters),
        }
    )


def _project_read(trace: str) -> tuple:
    """The (file, function) of an ALLOWED read made by the project's code (innermost frame), else ()."""
    path, _, func = trace.split(" <- ")[0].partition(" ")
    key = (path.rsplit(":", 1)[0], func)
    return key if key in ALLOWED and not key[0].startswith(("torch/", "deepspeed/")) else ()


def step_problems(where: str, got: dict, precision: str, zero: int) -> list[str]:
    """What is wrong with one run's recorded reads and synchronize() calls (`_steps`' result)."""
    problems = [
        f"{where}: {n} x {w} at {t}"
        for (w, t), n in Counter((w, t) for w, t in got["reads"] if not _allowed(t)).items()
    ]
    problems += [f"{where}: {n} x synchronize() at {t}" for t, n in Counter(got["syncs"]).items()]
    counted = Counter(k for k in (_project_read(t) for _, t in got["reads"]) if k)
    for key, n in expected_reads(precision, zero, got["clusters"]).items():
        if counted[key] != n:
            problems.append(f"{where}: {counted[key]} reads at {key[0]} {key[1]}, expected {n}")
    return problems


@pytest.mark.parametrize("zero", sorted(_BY_STAGE))
def test_a_training_step_reads_nothing_back_and_never_synchronises(tiny_tokens, zero):
    """Neither a host read of a device tensor nor the accelerator's synchronize() outside a logging step, except the
    ALLOWED reads, and those of the project's code exactly as often as `expected_reads` says."""
    results = run_ranks(
        _runs, 2, args=(str(tiny_tokens), zero, _BY_STAGE[zero], tempfile.mkdtemp()), device_strict=True
    )
    problems = []
    for rank, runs in enumerate(results):
        for (kind, domains, precision), got in runs:
            where = f"rank {rank} {kind} [{domains}] {precision} ZeRO {zero}"
            problems += step_problems(where, got, precision, zero)
            if kind == "cse" and not any(k >= 2 for k in got["clusters"]):
                problems.append(f"{where}: clustered into {got['clusters']}: the routed path did not run")
    assert not problems, "device reads or synchronisations inside the step:\n" + "\n".join(problems)


def test_the_check_fails_on_planted_reads():
    """The control for the counting: a read outside ALLOWED, a synchronize(), a CSE layer's counts read twice per
    micro-batch and overflow reads where no fp16 step runs are each reported; the expected reads alone are not."""
    overflow = ("__bool__", "parallel/overflow.py:33 overflowed <- parallel/overflow.py:66 step_with_norm")
    counts = ("tolist", "model/cse.py:192 routed_counts <- model/cse.py:177 forward")
    exact = {"reads": [overflow] * 2 + [counts] * 4, "syncs": [], "clusters": [3, 1]}
    assert step_problems("x", exact, "fp16", 0) == []
    planted = {
        "reads": [overflow] * 2 + [counts] * 8 + [("item", "launcher/train.py:1 train_step")],
        "syncs": ["deepspeed/runtime/engine.py:1 forward"],
        "clusters": [3, 1],
    }
    got = step_problems("x", planted, "fp16", 0)
    assert len(got) == 3 and "item at launcher/train.py" in got[0] and "synchronize()" in got[1]
    assert got[2] == "x: 8 reads at model/cse.py routed_counts, expected 4"
    assert step_problems("x", exact, "fp32", 0) == [
        "x: 2 reads at parallel/overflow.py overflowed, expected 0"
    ]


def _probe(rank: int, world: int) -> list:
    import torch

    from tests.harness.device_strict import record_host_reads

    x = torch.ones(3, device=torch.device("cpu"))  # a device tensor (device named)
    with record_host_reads() as reads:
        # the last one is host: not a read
        (
            x.sum().item(),
            bool(x.any()),
            x.to("cpu"),
            torch.zeros(2).tolist(),
        )
    return [w for w, _ in reads]


def test_the_harness_sees_a_device_read():
    """The control: the recorder does catch `.item()`, `bool()` and `.to("cpu")` of a device tensor."""
    assert run_ranks(_probe, 1, device_strict=True)[0] == ["item", "__bool__", "to('cpu')"]


def _planted(rank: int, world: int) -> list:
    from deepspeed.accelerator import get_accelerator

    with count_synchronize() as syncs:
        get_accelerator().synchronize()  # what DeepSpeed's throughput timer does in engine.forward / engine.step
        get_accelerator().synchronize()
    get_accelerator().synchronize()  # outside: not counted, and the class method is restored
    return [len(syncs), type(get_accelerator()).synchronize.__qualname__, syncs[0]]


def test_the_counter_sees_a_planted_synchronize():
    """The control: a planted `get_accelerator().synchronize()` is counted, with where it was called."""
    n, restored, where = run_ranks(_planted, 1, init_pg=False)[0]
    assert n == 2
    assert restored.endswith("CPU_Accelerator.synchronize")
    assert "tests/launcher/test_train_host_syncs.py" in where and "_planted" in where


def test_the_generated_config_turns_deepspeeds_synchronising_timers_off():
    """DeepSpeed's throughput timer syncs the device in every engine.forward and engine.step unless disabled; the
    framework owns the key, so `extra_deepspeed` cannot turn it back on."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from launcher.config import load_run_config
    from parallel.ds_config import deepspeed_config, extra_deepspeed_problems

    for zero in (0, 1, 2):
        for precision in ("fp32", "bf16", "fp16"):
            cfg = load_run_config(
                None, [f"parallel.zero_stage={zero}", f"train.precision={precision}"], check=False
            )
            ds = deepspeed_config(cfg.train, cfg.parallel)
            parsed = DeepSpeedConfig(
                dict(
                    ds,
                    train_batch_size=ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"],
                )
            )
            assert not parsed.timers_config.enabled and not parsed.timers_config.synchronized
            assert not parsed.wall_clock_breakdown
    problems = extra_deepspeed_problems({"timers": {"throughput": {"enabled": True}}})
    assert problems and problems[0].startswith("extra_deepspeed.timers is set by the framework")


def test_batch_copies_on_cpu_are_the_plain_copies_they_were(monkeypatch):
    """On CPU `to_device` is `.to(device)`: same values, dtypes and strides, and nothing is pinned (pinning needs
    CUDA; a pinned, non-blocking copy is the CUDA path only)."""
    import torch

    from launcher.batches import to_device

    def no_pinning(self, *a, **k):
        raise AssertionError("pin_memory() on a CPU run")

    monkeypatch.setattr(torch.Tensor, "pin_memory", no_pinning)
    cpu = torch.device("cpu")
    for t in (
        torch.randint(0, 50257, (2, 32)),
        torch.ones(2, 32),
        torch.tensor([0, 2]),
        torch.arange(6).view(2, 3).t(),
    ):
        got = to_device(t, cpu)
        assert got.dtype == t.dtype and got.stride() == t.stride() and torch.equal(got, t)
        assert got.data_ptr() == t.to(cpu).data_ptr()  # no copy at all, as before


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_batch_copies_to_cuda_are_pinned_and_exact():
    import torch

    from launcher.batches import to_device

    t = torch.randint(0, 50257, (8, 1024))
    want = t.clone()
    got = to_device(t, torch.device("cuda"))
    t.zero_()  # the sampler's array may be reused at once: the queued copy reads a pinned copy of it
    torch.cuda.synchronize()
    assert got.is_cuda and torch.equal(got.cpu(), want)


def test_adamw_is_fused_on_cuda_and_unchanged_elsewhere():
    """torch's fused AdamW (one kernel for all parameters) on CUDA; on CPU the default implementation, so every
    CPU parity stays bit-identical. The fused update is the same rule: checked here on CPU, where torch has it too."""
    import torch

    from parallel.config import TrainConfig
    from parallel.engine import adamw_options

    t = TrainConfig()
    assert adamw_options(t, "cuda")["fused"] is True and "fused" not in adamw_options(t, "cpu")
    torch.manual_seed(0)
    ref = [torch.randn(5, 3, requires_grad=True), torch.randn(7, requires_grad=True)]
    fused = [p.detach().clone().requires_grad_() for p in ref]
    opts = [
        torch.optim.AdamW(
            [{"params": ps[:1], "weight_decay": 0.1}, {"params": ps[1:], "weight_decay": 0.0}], **o
        )
        for ps, o in (
            (ref, adamw_options(t, "cpu")),
            (fused, dict(adamw_options(t, "cuda")) | {"fused": True}),
        )
    ]
    for step in range(3):
        for ps, opt in zip((ref, fused), opts):
            g = torch.Generator().manual_seed(step)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
    for a, b in zip(ref, fused):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
