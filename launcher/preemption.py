"""Preemption: SIGTERM or SIGUSR1 to any rank ends the run after the current step with that step's state saved.

What SLURM does at a time limit or `scancel` (SIGTERM to every process of the job, SIGKILL `KillWait`, 30 s,
later) and what `#SBATCH --signal=...USR1@N` sends N seconds before the limit. In each rank (`PreemptWatch`):

- the signal handler only records the signal (a Python handler, run between bytecodes, plus the C-level wakeup
  byte of `signal.set_wakeup_fd`, written even while the main thread waits in a collective);
- after every optimizer step all ranks agree whether any rank was signalled: one all-reduce (MAX) of one scalar on
  the training device, at the same place on every rank (`PreemptWatch.at_step_end`). Its cost: one tiny collective
  and one host read per step (on a GPU, a synchronisation at the step's end, where the step has synchronised
  already); it is not counted in the steps' communication statistics;
- then every rank writes the training state of that step through the normal atomic, checksummed save, rank 0 prints
  one line (`preempted (SIGTERM) at step S: training state saved at ...; resume with: ...`) and every rank exits
  with `PREEMPTED_EXIT` (75).

A watchdog thread bounds it: a second signal (one arriving `DUPLICATE_WINDOW_S` or more after the first: SLURM, the
launchers and DeepSpeed's per-node launcher deliver the same SIGTERM several times within milliseconds), or
`train.preempt_grace_s` seconds after the first signal without a finished save, ends the rank at once with
`ABORTED_EXIT` (143), rank 0 saying that the state of the step in progress was not saved (or that it was still
starting, or past the last step in the final export: `begin`, `end`) and which state is the last.
A signal after the save has finished changes nothing: the rank is exiting with 75 anyway.

Exit statuses: 75 is sysexits.h's EX_TEMPFAIL ("temporary failure, retry later"): nothing is wrong with the run, it
should be requeued and resumed; distinct from 1 (a crash), 2 (an input problem) and 130 (Ctrl-C). 143 is 128 + 15,
the status a shell reports for a process SIGTERM ended, which is what an unsaved abort is.
"""

from __future__ import annotations

import os
import select
import shlex
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

PREEMPTED_EXIT = 75  # state of the last step saved: requeue and resume
ABORTED_EXIT = 143  # signalled, and the state of the step in progress was not saved
SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)
DUPLICATE_WINDOW_S = 2.0  # signals this close to the first are the same request delivered again
# The command that resumes the run, set by launcher.launch (its own command line) or a batch script; without it
# rank 0 names its own command line.
RESUME_ENV = "DEMIX_RESUME_COMMAND"
_AGREED = (
    0  # the wakeup byte `at_step_end` writes: another rank was signalled, the grace period starts here too
)


class Preempted(Exception):
    """Raised in every rank after the state of `step` was saved at `state` on a preemption signal."""

    def __init__(self, signame: str, step: int, state: Path) -> None:
        super().__init__(f"preempted ({signame}) at step {step}")
        self.signame, self.step, self.state = signame, step, state


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def resume_command(argv: Sequence[str] | None = None) -> str:
    """$DEMIX_RESUME_COMMAND, else this process's command (`python -m launcher.train ...`) without `--resume`
    (its default, `auto`, picks the newest intact state), run from the current directory."""
    if os.environ.get(RESUME_ENV):
        return os.environ[RESUME_ENV]
    args = drop_resume(list(sys.argv[1:] if argv is None else argv))
    return f"cd {shlex.quote(os.getcwd())} && " + shlex.join([sys.executable, "-m", "launcher.train", *args])


def drop_resume(args: list[str]) -> list[str]:
    """`args` without `--resume X` / `--resume=X`."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--resume":
            skip = True
        elif not a.startswith("--resume="):
            out.append(a)
    return out


class PreemptWatch:
    """One rank's preemption state: the signal handlers, the watchdog thread and the per-step agreement."""

    def __init__(self, grace_s: float, rank: int, run_dir: Path | None) -> None:
        self.grace_s, self.rank, self.run_dir = grace_s, rank, run_dir
        self.signum = 0  # the first preemption signal this rank received (0: none)
        self.step: int | None = None  # the step in progress, for the abort message (None: start-up)
        self.final = False  # the loop is over: the final evaluation, save and export are under way
        self.saved = False
        self._rsock, self._wsock = socket.socketpair()
        self._wsock.setblocking(False)

    def install(self) -> PreemptWatch:
        """Handlers for SIGTERM and SIGUSR1 and the watchdog; main thread only."""
        for sig in SIGNALS:
            signal.signal(sig, self._handler)
        signal.set_wakeup_fd(self._wsock.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="preempt-watchdog", daemon=True).start()
        return self

    def _handler(self, signum: int, frame: object) -> None:
        if not self.signum:
            self.signum = signum

    def _watch(self) -> None:
        first: float | None = None
        while True:
            timeout = None if first is None else max(0.0, first + self.grace_s - time.monotonic())
            ready, _, _ = select.select([self._rsock], [], [], timeout)
            if not ready:  # the grace period is over
                if self.saved:
                    os._exit(PREEMPTED_EXIT)
                self._abort(f"train.preempt_grace_s={self.grace_s:g} s passed")
            now = time.monotonic()
            for byte in self._rsock.recv(64):
                if byte == _AGREED:
                    first = now if first is None else first
                elif byte in SIGNALS:
                    if first is None:
                        self.signum, first = self.signum or byte, now
                    elif now - first >= DUPLICATE_WINDOW_S and not self.saved:
                        self._abort(f"a second {signal_name(byte)}")

    def _abort(self, reason: str) -> None:
        if self.rank == 0:
            os.write(2, (self.abort_line(reason) + "\n").encode())
        os._exit(ABORTED_EXIT)

    def abort_line(self, reason: str) -> str:
        """Rank 0's line when it aborts unsaved."""
        from launcher.checkpoint import CheckpointError
        from launcher.state_discovery import latest_checkpoint

        try:
            last = latest_checkpoint(self.run_dir) if self.run_dir is not None else None
        except CheckpointError:
            last = None
        where = f"the last saved state is {last}" if last is not None else "no training state was saved yet"
        if self.step is None:
            lost = "during start-up, before the first step"
        elif self.final:
            lost = f"after the last step ({self.step}), during the final evaluation, save and export"
        else:
            lost = f"the state of step {self.step} was not saved"
        return f"preempted ({signal_name(self.signum or signal.SIGTERM)}) and aborted ({reason}): {lost}; {where}"

    def begin(self, start: int) -> None:
        """The training loop starts after step `start` (0, or the step resumed from): step `start + 1` is in
        progress."""
        self.step = start + 1

    def end(self, last: int) -> None:
        """The training loop is over at step `last`: the final evaluation, save and export follow (a signal now
        ends nothing unless the grace period runs out)."""
        self.step, self.final = last, True

    def requested(self, device: object) -> int:
        """The preemption signal any rank received (0: none): an all-reduce MAX, collective."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([self.signum], dtype=torch.int32, device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def at_step_end(self, step: int, device: object, save: Callable[[], Path]) -> None:
        """After optimizer step `step` (collective): if any rank was signalled, save through `save` and raise
        `Preempted`; otherwise note that step `step + 1` is in progress."""
        signum = self.requested(device)
        if not signum:
            self.step = step + 1
            return
        if not self.signum:
            self.signum = signum
            self._wsock.send(bytes([_AGREED]))
        self.step = step
        state = save()
        self.saved = True
        raise Preempted(signal_name(signum), step, state)

    def saved_line(self, e: Preempted) -> str:
        """Rank 0's line after a saved preemption."""
        return (
            f"preempted ({e.signame}) at step {e.step}: training state saved at {e.state}; resume with: "
            f"{resume_command()}"
        )


_current: PreemptWatch | None = None


def install(grace_s: float, rank: int, run_dir: Path | None) -> PreemptWatch:
    """This process's watch (the trainer's `main`); `current()` returns it to the loop."""
    global _current
    _current = PreemptWatch(grace_s, rank, run_dir).install()
    return _current


def current() -> PreemptWatch | None:
    """The installed watch, or None (ranks not started through `launcher.train`'s main: tests, notebooks)."""
    return _current
