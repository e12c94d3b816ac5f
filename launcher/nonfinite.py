"""Stopping a run whose loss, gradient norm or weights stop being finite, before anything from it is saved.

A diverging run (a learning rate far too high, bad data) turns the loss and the weights into NaN or infinity; left
alone it trains to the end, every later training state and the export hold NaN weights, and `train.keep_checkpoints`
pruning pushes out the last good state. With `train.stop_on_nonfinite` (on by default) the trainer stops instead:

* The rule (`should_stop`): in fp32 and bf16, the first optimizer step whose loss (this rank's mean token loss, plus
  GShard's aux loss) or global gradient norm is NaN or infinite. In fp16 a non-finite gradient (or loss) is what
  DeepSpeed's dynamic loss scaling expects now and then: it skips that update and lowers the scale, and the weights
  stay as they were. There the run stops only after `FP16_SKIP_LIMIT` consecutive skipped steps, about what takes the
  scaler from its initial 2^16 down to its minimum (DeepSpeed's own check then raises at the next one).
* No host read inside the step: each rank keeps the first bad step's (step, loss, norm) on the training device
  (`NonFiniteGuard.observe`; fp16 counts DeepSpeed's host-side `skipped_steps`). At each log interval, before each
  evaluation and checkpoint save, and before the final save and export, one small all-reduce of a [ranks, 3] table
  (`NonFiniteGuard.check`) gives every rank the same answer; every rank then raises NonFiniteError at the same point.
* A training state is only published when every parameter file it holds is finite (launcher/state.py counts them
  while writing, in the all-reduce the save does anyway): a state from a step whose weights overflowed although its
  loss and norm were still finite is discarded, never published, so pruning never removes the last good one for it.

The trainer exits with status EXIT_NONFINITE and rank 0 prints `nonfinite_line`: the step, the values, and the
state to resume from.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

# Exit status of a rank (and of launcher.launch) stopped by a non-finite loss, gradient norm or weight.
EXIT_NONFINITE = 3
# fp16: consecutive overflow-skipped steps after which the run stops (initial scale 2^16, hysteresis 2: the scaler
# reaches 1 after 17 overflows in a row).
FP16_SKIP_LIMIT = 16
# "no bad step yet" in the device table (exact in float64)
_NONE = float(2**62)


class NonFiniteError(RuntimeError):
    """Training reached a NaN or infinite loss, gradient norm or weight at `step` (`detail` says which)."""

    def __init__(self, step: int, detail: str) -> None:
        self.step, self.detail = step, detail
        super().__init__(f"training diverged at step {step}: {detail}")


def should_stop(
    precision: str, loss: float, grad_norm: float, skipped_in_a_row: int, limit: int = FP16_SKIP_LIMIT
) -> bool:
    """The rule (module docstring): fp32/bf16 stop at a non-finite loss or gradient norm; fp16 after `limit`
    consecutive overflow-skipped steps (`skipped_in_a_row`), whatever the values."""
    if precision == "fp16":
        return skipped_in_a_row >= limit
    return not (math.isfinite(loss) and math.isfinite(grad_norm))


def describe(precision: str, loss: float, grad_norm: float, rank: int) -> str:
    """The values of a stopped step, for the error line."""
    values = f"loss {loss:.6g}, grad norm {grad_norm:.6g} on rank {rank}"
    if precision == "fp16":
        return (
            f"{FP16_SKIP_LIMIT} consecutive fp16 steps overflowed and were skipped (the loss scaler cannot recover; "
            f"last: {values})"
        )
    return f"{values} (not finite)"


class NonFiniteGuard:
    """One rank's record of the first step that meets `should_stop`, kept on the training device (`observe`, no host
    read), and the collective decision (`check`)."""

    def __init__(self, precision: str, device: torch.device, enabled: bool = True) -> None:
        self.precision, self.device, self.enabled = precision, device, enabled
        self.first = torch.tensor([_NONE, 0.0, 0.0], dtype=torch.float64, device=device)
        self.skipped_in_a_row = 0
        self._skipped_seen = (
            0  # DeepSpeed's engine.skipped_steps at the previous step (0 at start and after a resume)
        )

    def observe(self, step: int, out: Any, engine: Any) -> None:
        """After optimizer step `step` (1-based): record it if it is the first that meets the rule. `out` is the
        step's StepResult (domain sums, grad norm, aux loss on the device)."""
        if not self.enabled:
            return
        sums = out.domain_sums
        loss = sums[0].sum() / sums[1].sum().clamp_min(1)
        if out.aux_loss is not None:
            loss = loss + out.aux_loss.to(loss.dtype)
        known = getattr(out, "grad_norm_known", True)  # a norm DeepSpeed did not report is not a divergence
        norm = torch.as_tensor(out.grad_norm if known else 0.0).to(self.device, torch.float64).reshape(())
        row = torch.stack([torch.tensor(float(step), dtype=torch.float64, device=self.device), loss, norm])
        fresh = self.first[0] == _NONE
        if self.precision == "fp16":
            skipped = int(getattr(engine, "skipped_steps", 0))  # DeepSpeed's own host-side counter
            previous, self._skipped_seen = self._skipped_seen, skipped
            self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped > previous else 0
            if should_stop("fp16", 0.0, 0.0, self.skipped_in_a_row):
                self.first = torch.where(fresh, row, self.first)
            return
        bad = ~(torch.isfinite(loss) & torch.isfinite(norm))
        self.first = torch.where(fresh & bad, row, self.first)

    def check(self, rank: int, world_size: int) -> None:
        """Raise NonFiniteError on every rank if any rank has recorded a bad step (the earliest, lowest rank first).
        Collective: one all-reduce of a [world_size, 3] float64 table on the training device."""
        if not self.enabled:
            return
        import torch.distributed as dist

        table = torch.zeros(world_size, 3, dtype=torch.float64, device=self.device)
        table[rank] = self.first
        dist.all_reduce(table)
        bad = [(row[0], r, row) for r, row in enumerate(table.tolist()) if row[0] < _NONE]
        if bad:
            _, r, (step, loss, norm) = min(bad, key=lambda b: (b[0], b[1]))
            raise NonFiniteError(int(step), describe(self.precision, loss, norm, r))


def nonfinite_line(err: NonFiniteError, run_dir: Path, cfg: Any, resume_from: Path | None) -> str:
    """The one line rank 0 prints: what happened, that nothing from it was saved, what to do, and the state to resume
    from (`resume_from`, the newest intact one, or None)."""
    if resume_from is not None:
        resume = (
            f"then resume from step {resume_step(resume_from)} ({resume_from}; `--resume auto` picks it) or start a "
            "new run directory"
        )
    else:
        resume = f"then start again (no training state in {run_dir / 'checkpoints'} before it)"
    return (
        f"{err}; stopped on every rank, nothing from this step on is saved. Lower train.lr (now {cfg.train.lr:g}) or "
        f"set train.clip_grad (now {cfg.train.clip_grad:g}), check the data, {resume}. "
        "train.stop_on_nonfinite=false turns this check off"
    )


def resume_step(ckpt: Path) -> int:
    """The step of a training state from its folder name (`step_<8 digits>`)."""
    return int(ckpt.name.split("_")[-1])
