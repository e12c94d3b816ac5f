"""No device-to-host read inside a training step: every value the step produces stays on the training device
until a log interval (`step_record`) brings it to the host.

On a GPU each read of a device tensor on the host (`.item()`, `float()`, `bool()`, `.tolist()`, `.cpu()`,
`.to("cpu")`) waits for every queued kernel. The device-strict harness (tests/device_strict.py) tells host and
device tensors apart by provenance on a CPU-only machine, and `record_host_reads` lists such reads with where
they happen. Two real ranks over gloo run non-logging steps of each architecture; the project's code must make
none. What torch and DeepSpeed do themselves is allowed only where named below, with the reason.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

import pytest

from tests.multirank import run_ranks

# (file, function) of reads that are not the project's, each with why it stays.
ALLOWED = {
    # torch keeps AdamW's `step` counters on the CPU unless capturable/fused ("special device hosting for step"):
    # created with device="cpu", so the harness sees a named device; on a GPU this is a host read, no sync.
    ("torch/optim/adam.py", "_single_tensor_adam"),
    ("torch/optim/optimizer.py", "_get_value"),
    # DeepSpeed's ZeRO 1/2 optimizer decides overflow and the clipping factor on the host from the global gradient
    # norm: once per optimizer step (per parameter group for the clip), never per micro-batch.
    ("deepspeed/runtime/zero/stage_1_and_2.py", "step"),
    ("deepspeed/runtime/zero/stage_1_and_2.py", "unscale_and_clip_grads"),
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
            events.append(" <- ".join(f"{f.filename.split('site-packages/')[-1].split('/work/main/')[-1]}:"
                                      f"{f.lineno} {f.name}" for f in reversed(frames[-3:])))
            return original(acc, *args, **kwargs)

        self.cls.synchronize = synchronize
        return self.events

    def __exit__(self, *exc) -> None:
        self.cls.synchronize = self.original


def _steps(rank: int, world: int, tokens: str, kind: str, zero: int, domains: str, run_dir: str) -> dict:
    """Host reads and accelerator synchronize() calls of two non-logging training steps (after a first one)."""
    from launcher.config import load_run_config
    from launcher.plan import make_plan
    from launcher.train import Trainer, train_step
    from tests.device_strict import record_host_reads

    sets = ["model.preset=tiny", "model.n_layers=2", "model.d_model=64", "model.n_heads=2", "model.seq_len=32",
            f"model.ffn.kind={kind}", f"data.path={tokens}", "data.tokenizer=gpt2", f"data.domains=[{domains}]",
            f"data.mixture={'by_domain' if kind == 'demix' else 'natural'}", "train.steps=4", "train.micro_batch=2",
            "train.grad_accum=2", f"parallel.zero_stage={zero}", "logging.wandb_mode=disabled",
            "logging.progress_bar=false"]
    plan = make_plan(load_run_config(None, sets, check=False), world)
    trainer = Trainer.setup(plan, Path(run_dir), resume="never")
    n = len(plan.catalog.train_domains)
    # DeepSpeed's throughput timer only starts synchronising from its global step 2 (`start_step`): warm up past
    # it, so that a timer left on is seen in the recorded steps.
    for s in (0, 1):
        train_step(trainer.bundle, plan.cfg, trainer.batches(s), n)  # also: lazy optimizer state
    batches = [trainer.batches(s) for s in (2, 3)]  # the sampler is host work, outside the step
    with record_host_reads() as reads, count_synchronize() as syncs:
        for b in batches:
            train_step(trainer.bundle, plan.cfg, b, n)
    return {"reads": reads, "syncs": syncs}


def _runs(rank: int, world: int, tokens: str, zero: int, combos: list, run_dir: str) -> list:
    """`_steps` of several (kind, domains) in one pair of processes (one start-up, ~9 s, for all of them)."""
    return [(kind, domains, _steps(rank, world, tokens, kind, zero, domains, f"{run_dir}/{i}"))
            for i, (kind, domains) in enumerate(combos)]


def _allowed(trace: str) -> bool:
    """Whether a read happens inside one of the ALLOWED functions (any of the three innermost frames)."""
    for frame in trace.split(" <- "):
        path, _, func = frame.partition(" ")
        if (path.rsplit(":", 1)[0], func) in ALLOWED:
            return True
    return False


# Every FFN kind the host-sync rule covers here (CSE has its own owner and test) at two ZeRO stages each, ZeRO 0 (where
# the project's own clipping and norm run) with all of them; one pair of processes per stage. DEMix runs with one
# domain per rank (the paper's layout) and with a rank holding two domains (rows routed on the host).
_DENSE, _GSHARD = ("dense", "cooking,sailing"), ("gshard", "cooking,sailing")
_DEMIX_ONE, _DEMIX_TWO = ("demix", "cooking,sailing"), ("demix", "cooking,sailing,finance")
_BY_STAGE = {0: [_DENSE, _DEMIX_ONE, _DEMIX_TWO, _GSHARD], 1: [_DENSE, _DEMIX_ONE], 2: [_DEMIX_TWO, _GSHARD]}


@pytest.mark.parametrize("zero", sorted(_BY_STAGE))
def test_a_training_step_reads_nothing_back_and_never_synchronises(tiny_tokens, zero):
    """Neither a host read of a device tensor nor the accelerator's synchronize() outside a logging step."""
    results = run_ranks(_runs, 2, args=(str(tiny_tokens), zero, _BY_STAGE[zero], tempfile.mkdtemp()), device_strict=True)
    problems = []
    for rank, runs in enumerate(results):
        for kind, domains, got in runs:
            ours = Counter((what, trace) for what, trace in got["reads"] if not _allowed(trace))
            problems += [f"rank {rank} {kind} [{domains}] ZeRO {zero}: {n} x {w} at {t}" for (w, t), n in ours.items()]
            syncs = Counter(got["syncs"])
            problems += [f"rank {rank} {kind} [{domains}] ZeRO {zero}: {n} x synchronize() at {t}"
                         for t, n in syncs.items()]
    assert not problems, "device reads or synchronisations inside the step:\n" + "\n".join(problems)


def _probe(rank: int, world: int) -> list:
    import torch

    from tests.device_strict import record_host_reads

    x = torch.ones(3, device=torch.device("cpu"))  # a device tensor (device named)
    with record_host_reads() as reads:
        x.sum().item(), bool(x.any()), x.to("cpu"), torch.zeros(2).tolist()  # the last one is host: not a read
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
    assert "tests/test_host_syncs.py" in where and "_planted" in where


def test_the_generated_config_turns_deepspeeds_synchronising_timers_off():
    """DeepSpeed's throughput timer syncs the device in every engine.forward and engine.step unless disabled; the
    framework owns the key, so `extra_deepspeed` cannot turn it back on."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from launcher.config import load_run_config
    from parallel.engine import deepspeed_config, extra_deepspeed_problems

    for zero in (0, 1, 2):
        for precision in ("fp32", "bf16", "fp16"):
            cfg = load_run_config(None, [f"parallel.zero_stage={zero}", f"train.precision={precision}"], check=False)
            ds = deepspeed_config(cfg.train, cfg.parallel)
            parsed = DeepSpeedConfig(dict(ds, train_batch_size=ds["train_micro_batch_size_per_gpu"]
                                          * ds["gradient_accumulation_steps"]))
            assert not parsed.timers_config.enabled and not parsed.timers_config.synchronized
            assert not parsed.wall_clock_breakdown
    problems = extra_deepspeed_problems({"timers": {"throughput": {"enabled": True}}})
    assert problems and problems[0].startswith("extra_deepspeed.timers is set by the framework")


def test_batch_copies_on_cpu_are_the_plain_copies_they_were(monkeypatch):
    """On CPU `to_device` is `.to(device)`: same values, dtypes and strides, and nothing is pinned (pinning needs
    CUDA; a pinned, non-blocking copy is the CUDA path only)."""
    import torch

    from launcher.train import to_device

    def no_pinning(self, *a, **k):
        raise AssertionError("pin_memory() on a CPU run")

    monkeypatch.setattr(torch.Tensor, "pin_memory", no_pinning)
    cpu = torch.device("cpu")
    for t in (torch.randint(0, 50257, (2, 32)), torch.ones(2, 32), torch.tensor([0, 2]), torch.arange(6).view(2, 3).t()):
        got = to_device(t, cpu)
        assert got.dtype == t.dtype and got.stride() == t.stride() and torch.equal(got, t)
        assert got.data_ptr() == t.to(cpu).data_ptr()  # no copy at all, as before


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_batch_copies_to_cuda_are_pinned_and_exact():
    import torch

    from launcher.train import to_device

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
    opts = [torch.optim.AdamW([{"params": ps[:1], "weight_decay": 0.1}, {"params": ps[1:], "weight_decay": 0.0}], **o)
            for ps, o in ((ref, adamw_options(t, "cpu")), (fused, dict(adamw_options(t, "cuda")) | {"fused": True}))]
    for step in range(3):
        for ps, opt in zip((ref, fused), opts):
            g = torch.Generator().manual_seed(step)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
    for a, b in zip(ref, fused):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
