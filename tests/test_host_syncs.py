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


def _steps(rank: int, world: int, tokens: str, kind: str, zero: int, domains: str, run_dir: str) -> list:
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
    train_step(trainer.bundle, plan.cfg, trainer.batches(0), n)  # first step: lazy optimizer state
    batches = [trainer.batches(s) for s in (1, 2)]  # the sampler is host work, outside the step
    with record_host_reads() as reads:
        for b in batches:
            train_step(trainer.bundle, plan.cfg, b, n)
    return reads


def _allowed(trace: str) -> bool:
    """Whether a read happens inside one of the ALLOWED functions (any of the three innermost frames)."""
    for frame in trace.split(" <- "):
        path, _, func = frame.partition(" ")
        if (path.rsplit(":", 1)[0], func) in ALLOWED:
            return True
    return False


@pytest.mark.parametrize("kind,zero,domains", [
    ("demix", 0, "cooking,sailing"),          # one expert per rank (the paper's layout)
    ("demix", 2, "cooking,sailing,finance"),  # a rank holding two experts: rows routed on the host
    ("dense", 1, "cooking,sailing"),
    ("gshard", 0, "cooking,sailing"),
])
def test_a_training_step_reads_nothing_back_from_the_device(tiny_tokens, kind, zero, domains):
    reads = run_ranks(_steps, 2, args=(str(tiny_tokens), kind, zero, domains, tempfile.mkdtemp()), device_strict=True)
    for rank, events in enumerate(reads):
        ours = Counter((what, trace) for what, trace in events if not _allowed(trace))
        assert not ours, f"rank {rank}: device reads inside the step:\n" + "\n".join(
            f"  {n} x {w} at {t}" for (w, t), n in ours.items())


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
