"""A shared cluster's two common failures end a run promptly and cleanly instead of hanging or saving garbage:

* a rank that stops responding: every collective of every group gives up after `parallel.comm_timeout_s` (start-up,
  saves and the export: `parallel.comm_init_timeout_s`), the waiting rank prints one line naming the key, exit 4;
* a diverging run (NaN/inf loss or gradient norm, or weights that overflow): every rank stops before anything from
  that step is saved, rank 0 names the step and the state to resume from, exit 3; the last good state survives.

The launcher runs are real (2 ranks, gloo, a real SIGSTOP, a real lr of 1e6).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.metrics import read_metrics
from tests.e2e.test_train import REPO, _launch, _overrides
from tests.harness.multirank import run_ranks
from tests.harness.processes import is_rank_command

# ----------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["parallel.comm_timeout_s", "parallel.comm_init_timeout_s"])
@pytest.mark.parametrize("value", ["0", "-5"])
def test_a_timeout_that_is_not_positive_is_a_config_error(key, value):
    from launcher.config import load_run_config
    from launcher.typed import ConfigError

    with pytest.raises(ConfigError) as e:
        load_run_config(None, [f"{key}={value}"])
    assert f"{key}={float(value)}: must be > 0 seconds" in str(e.value)
    with pytest.raises(ConfigError):
        load_run_config(None, [f"{key}=.nan"])  # finite numbers only (the config's Float)
    cfg = load_run_config(None, [f"{key}=2.5", "train.stop_on_nonfinite=false"])
    assert getattr(cfg.parallel, key.split(".")[1]) == 2.5 and cfg.train.stop_on_nonfinite is False


def test_the_launcher_refuses_a_bad_timeout_before_anything_starts(tiny_tokens, tmp_path):
    proc = _launch(
        [
            "--nproc",
            "2",
            "--run-dir",
            str(tmp_path / "x"),
            *_overrides(tiny_tokens),
            "--set",
            "parallel.comm_timeout_s=0",
        ],
        check=False,
    )
    assert proc.returncode == 2 and "parallel.comm_timeout_s=0.0: must be > 0 seconds" in proc.stderr
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------------------------------
# Collective timeouts
# ----------------------------------------------------------------------------------------------------


def _late_peer(rank: int, world: int) -> list:
    """Rank 1 comes 3 s late to a collective on the world group and on a new group; rank 0's give up after 1 s, and
    say which collective on which group."""
    import torch
    import torch.distributed as dist

    from parallel.comm_timeout import (
        failed_collective,
        is_comm_timeout,
        name_group,
        set_comm_timeout,
        timeout_of,
    )

    sub = dist.new_group([0, 1], timeout=timeout_of(600))
    name_group(sub, "the test's group")
    dist.all_reduce(torch.ones(1), group=sub)  # both groups connected
    assert set_comm_timeout(1.0, "test") >= 2  # the world group and `sub`

    class Pending:  # the wait of an asynchronous collective (parallel/demix_sync.py `_Pending`): no c10d frame left
        def __init__(self, handle: object) -> None:
            self.handle = handle

        @property
        def collective(self) -> tuple:
            return "all_reduce", sub

        def finish(self) -> None:
            self.handle.wait()

    seen = []
    for group in (None, sub, "async"):
        if rank == 1:
            time.sleep(3)
            seen.append("late")
            continue
        t0 = time.monotonic()
        try:
            if group == "async":
                Pending(dist.all_reduce(torch.ones(1), group=sub, async_op=True)).finish()
            else:
                dist.all_reduce(torch.ones(1), group=group)
            seen.append("completed")
        except RuntimeError as e:
            seen.append((is_comm_timeout(e), round(time.monotonic() - t0), failed_collective(e)))
    return seen


def test_every_group_gives_up_after_the_timeout_set_on_it():
    """torch's `_set_pg_timeout` reaches gloo's world group and a `new_group` made with another timeout (each group
    otherwise keeps the one it was made with: 30 minutes by default)."""
    got = run_ranks(_late_peer, 2, init_pg=True)
    assert got[0][:2] == [
        (True, 1, "all_reduce on the world group (ranks 0-1)"),
        (True, 1, "all_reduce on the test's group (ranks [0, 1])"),
    ], got
    # the asynchronous one, waited in an object that names its collective (the group's pair already gave up once)
    assert (got[0][2][0], got[0][2][2]) == (True, "all_reduce on the test's group (ranks [0, 1])"), got
    assert got[1] == ["late", "late", "late"]


def _find_rank(launcher: subprocess.Popen, rank: int, timeout: float = 600) -> object:
    """The psutil process of trainer rank `rank` below `launcher`."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in psutil.Process(launcher.pid).children(recursive=True):
            try:
                if is_rank_command(p.cmdline()) and p.environ().get("RANK") == str(rank):
                    return p
            except psutil.Error:
                continue
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} never started")


FROZEN_TIMEOUT_S = 5  # parallel.comm_timeout_s of the frozen-rank test
# when that job must have ended: the timeout, DeepSpeed's SIGTERM grace, start-up slack on busy cores
FROZEN_DEADLINE_S = FROZEN_TIMEOUT_S + 30 + 20


def timeout_end_problems(rc: int | None, err: str, ended: float) -> list[str]:
    """What is wrong with a 2-rank job whose rank 1 froze `ended` seconds ago (rc None: still running), for "the
    collective timeout ended it": not exit status 4, not one `error:` line of rank 0 naming the key, its value and
    how to change it, or later than FROZEN_DEADLINE_S."""
    problems = []
    if rc is None:
        problems.append(f"still running {ended:.0f} s after the freeze")
    elif rc != 4:
        problems.append(f"exit status {rc}, not 4")
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    want = f" waited {FROZEN_TIMEOUT_S} s (parallel.comm_timeout_s)"
    if len(lines) != 1 or want not in lines[0] or "--set parallel.comm_timeout_s=SECONDS" not in lines[0]:
        problems.append(f"not one line {want!r}...: {lines}")
    # what rank 0 waited in, and when: a collective of torch.distributed on a named group, in a training step
    elif not re.match(
        r"error: rank 0: \w+ on (the [\w -]+|a) group .*\(ranks .*\) during training step \d+ waited",
        lines[0],
    ):
        problems.append(f"the line does not name the collective, its group and the step: {lines[0]}")
    if ended >= FROZEN_DEADLINE_S:
        problems.append(f"ended {ended:.0f} s after the freeze")
    return problems


def _frozen_args(tokens: Path, run: Path, *sets: str) -> list[str]:
    args = ["--nproc", "2", "--run-dir", str(run), *_overrides(tokens, kind="dense", steps=10_000, zero=0)]
    return args + [a for s in sets for a in ("--set", s)]


def _start_launch(args: list[str], stderr: object) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "launcher.launch", *args],
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        text=True,
        start_new_session=True,
    )


def _wait_for_step(proc: subprocess.Popen, run: Path, step: int) -> None:
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 600  # start-up only: slow on a loaded machine
    while not (metrics.is_file() and f'"kind": "train", "step": {step},' in metrics.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, f"training never reached step {step}"
        time.sleep(0.1)


def _end(proc: subprocess.Popen, frozen: object) -> None:
    """Never leave a stopped process behind."""
    import psutil

    if frozen is not None:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                frozen.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.long
@pytest.mark.slow
def test_a_frozen_rank_ends_the_job_after_the_timeout(tiny_tokens, tmp_path):
    """SIGSTOP rank 1 of a 2-rank launch once training runs: rank 0's next collective gives up after
    parallel.comm_timeout_s (5 s), it prints one line naming the key, the launch exits 4, and DeepSpeed's launcher
    kills the stopped rank (SIGTERM stays pending in a stopped process: SIGKILL after its 30 s grace). The control,
    where the timeout is long and the job does not end by itself: the first half of
    test_a_second_sigterm_to_a_rank_waiting_for_a_frozen_peer_aborts_it_unsaved."""
    import psutil

    run = tmp_path / "frozen"
    args = _frozen_args(
        tiny_tokens, run, "train.save_interval=0", f"parallel.comm_timeout_s={FROZEN_TIMEOUT_S}"
    )
    proc = _start_launch(args, subprocess.PIPE)
    frozen = None
    try:
        frozen = _find_rank(proc, 1)
        _wait_for_step(proc, run, 2)  # the training timeout is in force
        frozen.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        _, err = proc.communicate(timeout=120)
        ended = time.monotonic() - stopped_at
    finally:
        _end(proc, frozen)
    assert timeout_end_problems(proc.returncode, err, ended) == [], err[-3000:]
    assert not frozen.is_running() or frozen.status() == psutil.STATUS_ZOMBIE
    last = max(r["step"] for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "train")
    assert last >= 2


@pytest.mark.long
@pytest.mark.slow
def test_a_second_sigterm_to_a_rank_waiting_for_a_frozen_peer_aborts_it_unsaved(tiny_tokens, tmp_path):
    """Rank 1 SIGSTOPped, parallel.comm_timeout_s long (300 s): rank 0 waits in a collective.

    First, the control of test_a_frozen_rank_ends_the_job_after_the_timeout: 15 s after the freeze (3 times the
    5 s after which that job's rank 0 gives up) this job still runs and has said nothing, so there it is the
    timeout that ends the job. Then SIGTERM to the waiting rank 0, and again 3 s later (a second request, past
    DUPLICATE_WINDOW_S): rank 0 cannot save (the save is collective), and the second signal ends it at once with
    143 and one line naming the second SIGTERM, the step in progress and the last saved state; the per-node
    launcher then stops the frozen rank and the launch exits 143."""
    import psutil

    from launcher.preemption import ABORTED_EXIT, DUPLICATE_WINDOW_S
    from launcher.state_discovery import latest_checkpoint

    run = tmp_path / "run"
    args = _frozen_args(tiny_tokens, run, "train.save_interval=2", "parallel.comm_timeout_s=300")
    err_file = tmp_path / "stderr"
    with open(err_file, "w") as err_out:
        proc = _start_launch(args, err_out)
    frozen = None
    try:
        frozen, waiting = _find_rank(proc, 1), _find_rank(proc, 0)
        _wait_for_step(proc, run, 3)  # a state saved (step 2), and the training timeout in force
        frozen.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        time.sleep(3 * FROZEN_TIMEOUT_S)
        control = timeout_end_problems(proc.poll(), err_file.read_text(), time.monotonic() - stopped_at)
        waiting.send_signal(signal.SIGTERM)
        time.sleep(DUPLICATE_WINDOW_S + 1)
        assert proc.poll() is None, "the first SIGTERM ended the job"
        waiting.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        proc.wait(timeout=120)
        ended = time.monotonic() - signalled
    finally:
        _end(proc, frozen)
    err = err_file.read_text()
    assert len(control) == 2 and control[0].startswith("still running"), control  # the control
    assert control[1].startswith("not one line"), control
    assert proc.returncode == ABORTED_EXIT, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("preempted (")]
    last = latest_checkpoint(run)
    assert last is not None and len(lines) == 1, err[-3000:]
    head = "preempted (SIGTERM) and aborted (a second SIGTERM): the state of step "
    assert lines[0].startswith(head) and lines[0].endswith(f" was not saved; the last saved state is {last}")
    step = int(lines[0].removeprefix(head).split()[0])
    logged = max(r["step"] for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "train")
    assert step in (logged, logged + 1) and step > int(last.name.split("_")[1]), (step, logged, last)
    assert ended < 5 + 20, ended  # the abort, then the per-node launcher's 5 s for the others after a failure
    assert not frozen.is_running() or frozen.status() == psutil.STATUS_ZOMBIE


# ----------------------------------------------------------------------------------------------------
# Non-finite loss, gradient norm, weights
# ----------------------------------------------------------------------------------------------------


def test_the_stop_rule():
    from launcher.nonfinite import FP16_SKIP_LIMIT, should_stop

    nan, inf = float("nan"), float("inf")
    for precision in ("fp32", "bf16"):
        assert not should_stop(precision, 3.2, 0.7, 0)
        assert should_stop(precision, nan, 0.7, 0) and should_stop(precision, 3.2, inf, 0)
        assert should_stop(precision, -inf, nan, 0)
    # fp16: an overflowing step is DeepSpeed's to skip; only a run of them stops
    assert not should_stop("fp16", nan, inf, 1)
    assert not should_stop("fp16", nan, inf, FP16_SKIP_LIMIT - 1)
    assert should_stop("fp16", nan, inf, FP16_SKIP_LIMIT) and should_stop("fp16", 3.0, 1.0, FP16_SKIP_LIMIT)


class _Step:
    """What the guard reads of a StepResult."""

    def __init__(self, loss: float, norm: float) -> None:
        import torch

        self.domain_sums = torch.tensor([[loss * 4, 0.0], [4.0, 0.0]], dtype=torch.float64)
        self.grad_norm = torch.tensor(norm)
        self.aux_loss = None


class _Engine:
    skipped_steps = 0


def _guard_ranks(rank: int, world: int, bad_step: dict) -> tuple:
    """Each rank observes steps 1..8 with its own bad step (or none), then all check together."""
    import torch

    from launcher.nonfinite import NonFiniteError, NonFiniteGuard

    guard = NonFiniteGuard("fp32", torch.device("cpu"))
    for step in range(1, 9):
        bad = bad_step.get(rank) is not None and step >= bad_step[rank]
        guard.observe(step, _Step(float("nan") if bad else 2.0, 1.0), _Engine())
    try:
        guard.check(rank, world)
    except NonFiniteError as e:
        return e.step, e.detail
    return None


def test_every_rank_takes_the_same_decision_from_the_earliest_bad_step():
    """Rank 2 goes bad at step 5, rank 1 at step 7, rank 0 never: all three stop at step 5, naming rank 2."""
    got = run_ranks(_guard_ranks, 3, args=({1: 7, 2: 5},))
    assert len(set(got)) == 1 and got[0][0] == 5 and "loss nan" in got[0][1] and "on rank 2" in got[0][1], got
    assert run_ranks(_guard_ranks, 2, args=({},)) == [None, None]


def test_fp16_counts_consecutive_skipped_steps_from_deepspeeds_counter():
    import torch

    from launcher.nonfinite import FP16_SKIP_LIMIT, NonFiniteGuard

    guard, engine = NonFiniteGuard("fp16", torch.device("cpu")), _Engine()
    for step in range(1, 2 * FP16_SKIP_LIMIT + 1):  # every other step overflows: never a run
        engine.skipped_steps += step % 2
        guard.observe(step, _Step(float("nan"), float("inf")), engine)
    assert guard.skipped_in_a_row == 0 and guard.first[0] > 1e18
    base = 2 * FP16_SKIP_LIMIT + 1
    for i in range(FP16_SKIP_LIMIT):
        engine.skipped_steps += 1
        guard.observe(base + i, _Step(float("nan"), float("inf")), engine)
    assert int(guard.first[0]) == base + FP16_SKIP_LIMIT - 1


def _finite(path: Path) -> bool:
    import torch

    from launcher.checkpoint import load_weights_only

    for f in path.rglob("*.pt"):
        obj = load_weights_only(f)
        tensors = [obj["param"]] if isinstance(obj, dict) and "param" in obj else []
        tensors += [v for v in (obj.values() if isinstance(obj, dict) else []) if isinstance(v, torch.Tensor)]
        if any(t.is_floating_point() and not torch.isfinite(t).all() for t in tensors):
            return False
    return True


@pytest.mark.long
@pytest.mark.slow
def test_a_diverging_run_stops_before_saving_and_keeps_the_last_good_state(tiny_tokens, tmp_path):
    """The control: 3 steps at a normal lr (the trainer on 2 forked gloo ranks) pass every check, save (keeping 1
    state) and export. Then the same run directory continued through the launcher to step 8 at lr 1e6, saving every
    step: exit 3 with one line naming the step and the state to resume from; every published state and the export
    hold finite values only, and the last good state is intact (pruning kept it)."""
    from launcher.rundir import mark_run_dir
    from launcher.state_discovery import latest_checkpoint, resume_candidates
    from tests.e2e.test_train import reference_run

    run = tmp_path / "run"
    base = [*_overrides(tiny_tokens, kind="dense", steps=3, zero=0), "--set", "train.keep_checkpoints=1"]
    reference_run(base, 2, run)  # the control: a normal lr passes every check
    mark_run_dir(run)
    assert [p.name for p in resume_candidates(run)] == ["step_00000003"] and _finite(run / "model")
    proc = _launch(
        [
            "--nproc",
            "2",
            "--run-dir",
            str(run),
            *base,
            "--set",
            "train.steps=8",
            "--set",
            "train.lr=1e6",
            "--set",
            "train.save_interval=1",
        ],
        check=False,
    )
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert (
        len(lines) == 1
        and "training diverged at step" in lines[0]
        and "Lower train.lr (now 1e+06)" in lines[0]
    )
    good = latest_checkpoint(run)
    step = int(good.name.split("_")[1])
    assert f"resume from step {step} ({good}" in lines[0], lines[0]
    assert int(lines[0].split("diverged at step ")[1].split(":")[0]) > step
    states = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert states == [good.name] and not list((run / "checkpoints").glob(".step_*"))  # nothing staged is left
    assert _finite(good) and _finite(run / "model")
    records = [r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "train"]
    assert records[-1]["loss"] is None or records[-1]["grad_norm"] is None or "parameter file" in lines[0]


def test_a_grad_norm_deepspeed_did_not_report_is_not_a_divergence():
    import torch

    from launcher.nonfinite import NonFiniteGuard

    guard, step = NonFiniteGuard("bf16", torch.device("cpu")), _Step(2.0, float("nan"))
    step.grad_norm_known = False  # train_step: DeepSpeed's get_global_grad_norm() returned None
    guard.observe(1, step, _Engine())
    assert guard.first[0] > 1e18
    step.grad_norm_known = True
    guard.observe(2, step, _Engine())
    assert guard.first.tolist()[:2] == [2.0, 2.0] and guard.first[2].isnan()
    guard.observe(3, step, _Engine())  # the first bad step is kept
    assert int(guard.first[0]) == 2
    off = NonFiniteGuard("fp32", torch.device("cpu"), enabled=False)
    off.observe(1, step, _Engine())
    off.check(0, 1)  # no collective, no error
    assert off.first[0] > 1e18


def test_the_two_messages_name_what_to_change(tmp_path):
    from launcher.config import load_run_config
    from launcher.nonfinite import NonFiniteError, nonfinite_line
    from launcher.train import comm_timeout_line
    from parallel import comm_timeout

    gloo = RuntimeError(
        "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 7000ms for recv operation"
    )
    assert comm_timeout.is_comm_timeout(gloo) and not comm_timeout.is_comm_timeout(
        RuntimeError("shape mismatch")
    )
    saved = comm_timeout.current_comm_timeout()
    try:
        assert comm_timeout.set_comm_timeout(7, "parallel.comm_timeout_s") == 0  # no process group here
        line = comm_timeout_line(3, gloo)
    finally:
        comm_timeout._current = saved
    assert line.startswith(
        "rank 3: a collective during start-up waited 7 s (parallel.comm_timeout_s) for another rank and gave up"
    )  # no collective frame in this exception's traceback: failed_collective names none
    assert "--set parallel.comm_timeout_s=SECONDS" in line and "Timed out waiting 7000ms" in line
    from launcher.train import peer_lost_line

    closed = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41234")
    assert comm_timeout.is_peer_lost(closed) and not comm_timeout.is_peer_lost(gloo)
    assert not comm_timeout.is_comm_timeout(closed)
    line = peer_lost_line(0, closed)
    assert line.startswith("rank 0: a collective during ") and "lost another rank" in line, line
    assert "`--resume auto`" in line and "Connection closed by peer" in line and "\n" not in line
    cfg = load_run_config(None, ["train.lr=2e-3"])
    err = NonFiniteError(9, "loss nan, grad norm 1 on rank 0 (not finite)")
    state = tmp_path / "checkpoints" / "step_00000008"
    line = nonfinite_line(err, tmp_path, cfg, state)
    assert line.startswith("training diverged at step 9: loss nan") and "Lower train.lr (now 0.002)" in line
    assert f"resume from step 8 ({state}; `--resume auto` picks it)" in line
    assert "train.stop_on_nonfinite=false" in line and "\n" not in line
    assert "then start again (no training state in" in nonfinite_line(err, tmp_path, cfg, None)
