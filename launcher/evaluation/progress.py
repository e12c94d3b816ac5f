"""What an evaluation says while it runs (launcher/evaluation/evaluate.py): one plan line before any work - domains,
blocks per domain, experts, modes, forward passes, the cached prior's fixed cost and an estimated time - then block
counts done/total with an ETA over all the work (the prior's development blocks and every domain's test blocks).

A "block pass" is one forward pass over one block: for DEMix one batched pass of all E experts (model/batched.py;
E block-expert evaluations), shared by every mixing mode; for +Domain-Token one pass per domain token; for dense
models one pass. The estimate is the number of block passes times the seconds per block pass of one timed batch,
divided over the ranks; it is an estimate (a shared machine, a first pass's start-up cost).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


def fmt_seconds(s: float) -> str:
    """`41s`, `2m05s`, `1h02m`: a duration for a progress line."""
    s = max(0, int(round(s)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _per_domain(blocks: dict[str, int], unit: str) -> str:
    counts = set(blocks.values())
    if len(counts) == 1:
        return f"{len(blocks)} domains x {counts.pop()} {unit} blocks"
    return f"{len(blocks)} domains ({', '.join(f'{d} {n}' for d, n in blocks.items())} {unit} blocks)"


def plan_line(
    test_blocks: dict[str, int],
    split: str,
    seq_len: int,
    experts: int,
    modes: Sequence[str],
    passes_per_block: int,
    prior_blocks: dict[str, int],
    dev_split: str,
    prior_note: str,
    seconds_per_pass: float | None,
    timed_blocks: int,
    world: int = 1,
) -> str:
    """The line printed before any work: what will run (domains x blocks, experts, modes, block passes and
    block-expert evaluations), the cached prior's fixed cost (`prior_note`, e.g. "prior: scoring 100 valid blocks
    per domain"), an estimated time where `seconds_per_pass` was measured, and which options bound the work."""
    n_test = sum(test_blocks.values()) * passes_per_block
    n_prior = sum(prior_blocks.values())
    total = n_test + n_prior
    what = [_per_domain(test_blocks, split) + f" of {seq_len} tokens"]
    if experts:
        what.append(f"{experts} experts")
    if passes_per_block > 1:
        what.append(f"{passes_per_block} domain tokens (one pass each)")
    what.append(
        f"{len(modes)} modes ({','.join(modes)})"
        + (" mixed from one all-experts pass per block" if experts and len(modes) > 1 else "")
    )
    line = f"[eval] plan: {', '.join(what)} = {n_test} block passes"
    if experts:
        line += f" ({n_test * experts} block-expert evaluations)"
    if prior_note:
        line += f"; {prior_note}"
        if n_prior:
            line += f" = {n_prior} block passes, {100 * n_prior / max(total, 1):.0f}% of the work"
    line += f"; total {total} block passes" + (f" over {world} ranks" if world > 1 else "")
    if seconds_per_pass is not None:
        line += (
            f"; estimated {fmt_seconds(total * seconds_per_pass / world)} (an estimate: "
            f"{seconds_per_pass:.3f} s per block pass from one timed batch of {timed_blocks})"
        )
    hint = "--max-blocks N bounds the test blocks per domain, --modes a subset"
    if experts:
        hint += f" (without cached,topk no prior is scored), --cached-blocks N the prior's {dev_split} blocks"
    return line + f"; {hint}"


class Progress:
    """Block counts done/total with the elapsed time and an ETA (from the rate so far), said through `say` at
    most every `every` seconds and at the end of each stage (`stage_done`)."""

    def __init__(self, total: int, say: Callable[[str], None], every: float = 10.0) -> None:
        self.total, self.say, self.every = max(int(total), 1), say, every
        self.done = 0
        self.said = -1  # `done` of the last line said
        self.base = 0  # blocks done before the current stage
        self.stage = ""
        self.t0 = self.last = time.perf_counter()

    def start(self, stage: str) -> None:
        """A new stage (e.g. "prior biomed (valid)"); its blocks count from the current total."""
        self.stage, self.base = stage, self.done

    def at(self, stage_done: int) -> None:
        """`stage_done` blocks of the current stage are done; said when `every` seconds passed since the last line."""
        self.done = min(self.total, self.base + int(stage_done))
        if time.perf_counter() - self.last >= self.every:
            self.say(self.line())

    def stage_done(self, stage_blocks: int, note: str = "") -> None:
        """The current stage finished with `stage_blocks` blocks: said (unless its last batch just was, no note)."""
        self.done = min(self.total, self.base + int(stage_blocks))
        if note or self.done != self.said:
            self.say(self.line(note))

    def eta(self) -> float | None:
        """Seconds left at the rate so far (None before the first block)."""
        if not self.done:
            return None
        return (time.perf_counter() - self.t0) / self.done * (self.total - self.done)

    def line(self, note: str = "") -> str:
        """`[eval] 48/1296 block passes (4%) - prior biomed (valid) - 21s elapsed, ETA 9m05s`."""
        self.last, self.said = time.perf_counter(), self.done
        eta = self.eta()
        return (
            f"[eval] {self.done}/{self.total} block passes ({100 * self.done / self.total:.0f}%) - {self.stage}"
            + (f" {note}" if note else "")
            + f" - {fmt_seconds(self.last - self.t0)} elapsed, ETA "
            + (fmt_seconds(eta) if eta is not None else "?")
        )
