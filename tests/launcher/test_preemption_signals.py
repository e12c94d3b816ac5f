"""The preemption watch's edge cases with real signals (launcher/preemption.py): a child process runs the real watch
around a fake training loop (tests/harness/preempt_loop.py: sleeps for the start-up, the steps, the save and the
export) and the test sends it signals with os.kill at a chosen point, so each case takes seconds, not a run.

Each rule has its control beside it, the same checks on a case where the outcome must differ: the same signal
again within the duplicate window (one request) and after it (an abort); a save longer than the grace period (an
abort) and one within it (saved); a second signal before the save (an abort) and after it (still saved)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.preemption import ABORTED_EXIT, DUPLICATE_WINDOW_S, PREEMPTED_EXIT
from launcher.state_discovery import latest_checkpoint
from tests.harness.preempt_loop import write_state

pytestmark = pytest.mark.slow  # a child process each (it imports torch): 4-9 s a test

REPO = Path(__file__).resolve().parents[2]
START = 4  # the step the fake run resumes from: its state is the last saved one until the run saves another


class Loop:
    """A running tests/harness/preempt_loop.py child; its stdout and stderr go to files read while it runs."""

    def __init__(self, tmp_path: Path, **phases: float) -> None:
        self.run_dir = tmp_path / "run"
        self.first = write_state(self.run_dir, START)
        self.out, self.err = tmp_path / "stdout", tmp_path / "stderr"
        opts = {"run_dir": str(self.run_dir), "grace_s": 30.0, "start": START, "steps": 10_000, **phases}
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.harness.preempt_loop", json.dumps(opts)],
                cwd=REPO,
                env=dict(os.environ, OMP_NUM_THREADS="1"),
                stdout=out,
                stderr=err,
            )
        self.signalled: float | None = None  # when the first signal was sent

    def lines(self) -> list[str]:
        return self.out.read_text().splitlines()

    def wait_for(self, line: str, timeout: float = 120) -> None:
        """Until stdout (or, for a line starting `preempted`, stderr) has `line`; the child must still run."""
        path = self.err if line.startswith("preempted") else self.out
        deadline = time.monotonic() + timeout
        while not any(x.startswith(line) for x in path.read_text().splitlines()):
            assert self.proc.poll() is None, f"ended early ({self.proc.returncode}): {self.err.read_text()}"
            assert time.monotonic() < deadline, f"never printed {line!r}: {self.lines()}"
            time.sleep(0.02)

    def kill(self, sig: int = signal.SIGTERM) -> None:
        os.kill(self.proc.pid, sig)
        self.signalled = self.signalled or time.monotonic()

    def finish(self, timeout: float = 60) -> tuple[int, str, float]:
        """(exit status, stderr, seconds from the first signal to the exit)."""
        try:
            rc = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        return rc, self.err.read_text(), time.monotonic() - (self.signalled or 0.0)


def saved_problems(loop: Loop, rc: int, err: str, signame: str) -> list[str]:
    """What is wrong with `loop`'s outcome for a saved preemption by `signame`: not 75, not exactly rank 0's saved
    line naming the signal and the state of the step that was in progress, or that state not the latest."""
    problems = [] if rc == PREEMPTED_EXIT else [f"exit status {rc}, not {PREEMPTED_EXIT}"]
    in_progress = [int(x.split()[1]) for x in loop.lines() if x.startswith("step ")][-1]
    state = loop.run_dir / "checkpoints" / f"step_{in_progress:08d}"
    want = f"preempted ({signame}) at step {in_progress}: training state saved at {state}; resume with: cd "
    lines = err.splitlines()
    if len(lines) != 1 or not lines[0].startswith(want):
        problems.append(f"stderr is not the one line {want!r}...: {err!r}")
    if latest_checkpoint(loop.run_dir) != state:
        problems.append(f"the latest state is {latest_checkpoint(loop.run_dir)}, not {state}")
    return problems


def abort_problems(err: str, rc: int, signame: str, reason: str, lost: str, last: Path) -> list[str]:
    """What is wrong with an outcome for an unsaved abort: not 143, not exactly rank 0's abort line."""
    problems = [] if rc == ABORTED_EXIT else [f"exit status {rc}, not {ABORTED_EXIT}"]
    want = f"preempted ({signame}) and aborted ({reason}): {lost}; the last saved state is {last}"
    if err.splitlines() != [want]:
        problems.append(f"stderr is not the one line {want!r}: {err!r}")
    return problems


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=["SIGUSR1", "SIGTERM"])
def test_a_signal_during_a_step_saves_that_step_and_exits_75(tmp_path, sig):
    """SIGUSR1 (what `#SBATCH --signal=USR1@N` sends) is a preemption like SIGTERM: the step in progress finishes,
    its state is saved, rank 0's line names the signal, exit 75; no further step starts."""
    loop = Loop(tmp_path, step_s=0.5)
    loop.wait_for(f"step {START + 2}")  # a step after one agreement already passed
    loop.kill(sig)
    rc, err, _ = loop.finish()
    assert saved_problems(loop, rc, err, sig.name) == []
    other = "SIGTERM" if sig == signal.SIGUSR1 else "SIGUSR1"
    assert saved_problems(loop, rc, err, other), "the check does not tell the signals apart"


@pytest.mark.parametrize(
    "gaps,step_s,aborts",
    [
        ([0.25, 0.25], 3.0, False),  # SLURM, the launchers, DeepSpeed: the same SIGTERM delivered again
        ([DUPLICATE_WINDOW_S + 1.0], 60.0, True),  # the control: a real second signal
    ],
    ids=["duplicates-within-the-window", "second-signal-after-it"],
)
def test_a_repeated_signal_aborts_only_after_the_duplicate_window(tmp_path, gaps, step_s, aborts):
    """SIGTERM while a (slow) step runs, then SIGTERM again: within DUPLICATE_WINDOW_S of the first it is the same
    request (the step finishes and is saved, 75); later, it is a second request, and the rank ends at once with
    143, rank 0 naming the second signal, the step whose state was lost and the last saved state."""
    loop = Loop(tmp_path, step_s=step_s)
    loop.wait_for(f"step {START + 1}")  # the first step after the resume: nothing agreed yet
    loop.kill()
    for gap in gaps:  # each delivered apart, not merged by the kernel as pending duplicates
        time.sleep(gap)
        loop.kill()
    rc, err, took = loop.finish()
    lost = f"the state of step {START + 1} was not saved"
    aborted = abort_problems(err, rc, "SIGTERM", "a second SIGTERM", lost, loop.first)
    saved = saved_problems(loop, rc, err, "SIGTERM")
    if aborts:
        assert aborted == [] and saved, (aborted, saved)
        assert took < step_s / 2 and f"saving {START + 1}" not in loop.lines()  # at once, not after the step
    else:
        assert saved == [] and aborted, (saved, aborted)


@pytest.mark.parametrize(
    "wait,opts,lost",
    [
        (f"step {START + 1}", {"step_s": 0.3, "save_s": 60}, f"the state of step {START + 1} was not saved"),
        ("starting", {"startup_s": 60}, "during start-up, before the first step"),
        (
            "final",
            {"steps": START + 1, "final_s": 60},
            f"after the last step ({START + 1}), during the final evaluation, save and export",
        ),
        (
            f"step {START + 1}",
            {"step_s": 0.3, "save_s": 1},
            None,
        ),  # the control: a save within the grace period
    ],
    ids=["during-the-save", "during-start-up", "during-the-final-export", "control-a-save-within-it"],
)
def test_the_grace_period_ends_a_rank_that_has_not_saved(tmp_path, wait, opts, lost):
    """SIGTERM, then nothing more: a rank that has not finished the save `train.preempt_grace_s` (here 2 s) after
    the signal ends with 143, rank 0 naming the key and what was lost (the step's state; nothing during the
    start-up; the final export after the last step). The control: a save that ends within the grace period
    exits 75 with the state saved."""
    grace = 2.0 if lost else 30.0
    loop = Loop(tmp_path, grace_s=grace, **opts)
    loop.wait_for(wait)
    loop.kill()
    rc, err, took = loop.finish()
    reason = f"train.preempt_grace_s={grace:g} s passed"
    aborted = abort_problems(err, rc, "SIGTERM", reason, lost or "", loop.first)
    if lost is None:
        assert saved_problems(loop, rc, err, "SIGTERM") == [] and aborted
        return
    assert aborted == [], aborted
    assert grace - 0.5 < took < 30, took  # the grace period, not the phase's 60 s
    assert not any(x.startswith("saved") for x in loop.lines())
    if "save_s" in opts:
        assert f"saving {START + 1}" in loop.lines()  # it ended the save, not the step


def test_a_signal_after_the_save_finished_still_exits_75(tmp_path):
    """A second SIGTERM after the state was saved (while the rank tears down) changes nothing, and the grace period
    running out then ends the rank with 75, not 143: the state is saved. The control is the second signal before
    the save (test_a_repeated_signal_aborts_only_after_the_duplicate_window: 143)."""
    loop = Loop(tmp_path, grace_s=5.0, step_s=0.3, linger_s=60)
    loop.wait_for(f"step {START + 2}")
    loop.kill()
    loop.wait_for("preempted (SIGTERM) at step")  # saved; now in the (slow) teardown
    time.sleep(max(0.0, loop.signalled + DUPLICATE_WINDOW_S + 0.5 - time.monotonic()))
    loop.kill()
    time.sleep(0.5)
    assert loop.proc.poll() is None, "the second signal ended the rank"
    rc, err, took = loop.finish()
    assert saved_problems(loop, rc, err, "SIGTERM") == []
    assert took < 30, took  # the grace period ended the teardown, not its 60 s
