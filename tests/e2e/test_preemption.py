"""Preemption with real processes and real signals: SIGTERM to the ranks, to the launcher, SIGKILL to the per-node
launcher (launcher/preemption.py, launcher/node_launch.py, launcher/launch.py `run_and_report`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from launcher.preemption import PREEMPTED_EXIT
from tests.e2e.test_train import _launch, _losses, _overrides, reference_run
from tests.harness.processes import is_rank_command

pytestmark = pytest.mark.long  # real cluster programs: make test-long

REPO = Path(__file__).resolve().parents[2]
STEPS = 30


def _args(tokens: Path, run_dir: Path) -> list[str]:
    return [
        "--nproc",
        "2",
        "--run-dir",
        str(run_dir),
        *_overrides(tokens, kind="dense", steps=STEPS),
        "--set",
        "train.save_interval=0",
    ]


def _start(args: list[str]) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-m", "launcher.launch", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _wait_for(proc: subprocess.Popen, ready: Callable[[], bool], timeout: float = 600) -> None:
    """Until `ready()`; the start-up is slow on a loaded machine (300 s ran out there, with other suites running)."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"the run ended early ({proc.returncode}):\n{proc.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, "the run did not get there in time"
        time.sleep(0.01)


def _logged(run_dir: Path, step: int) -> Callable[[], bool]:
    metrics = run_dir / "metrics.jsonl"
    return lambda: metrics.is_file() and f'"kind": "train", "step": {step},' in metrics.read_text()


def _tree(proc: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children(recursive=True)


def _ranks(proc: subprocess.Popen) -> list[psutil.Process]:
    out = []
    for p in _tree(proc):
        try:
            cmd = p.cmdline()
            if is_rank_command(cmd):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _none_alive(procs: list[psutil.Process]) -> list[int]:
    """The pids of `procs` still running (a zombie has ended; one may end while it is asked)."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def _cleanup(proc: subprocess.Popen, tree: list[psutil.Process]) -> None:
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def saved_preemption_problems(rc: int, err: str, run: Path) -> list[str]:
    """What is wrong with a stopped run `run` for "preempted with every trained step saved": the status is not 75;
    there is not one line of rank 0 naming the state of its step and a resume command (`launch`'s, without
    `--resume`); that state is missing or not the latest; or steps were trained (logged) after the latest state.
    Its control: a run SIGKILLed instead (test_train.py) loses the steps after its last save, and it says so."""
    problems = [] if rc == PREEMPTED_EXIT else [f"exit status {rc}, not {PREEMPTED_EXIT}"]
    ptr = run / "checkpoints" / "latest"
    latest = ptr.read_text().strip() if ptr.is_file() else None
    lines = [line for line in err.splitlines() if line.startswith("preempted (SIGTERM) at step ")]
    if len(lines) != 1:
        problems.append(f"{len(lines)} lines `preempted (SIGTERM) at step S: ...`, not 1")
    else:
        step = int(lines[0].split("at step ")[1].split(":")[0])
        state = run / "checkpoints" / f"step_{step:08d}"
        if f"training state saved at {state}; resume with: cd " not in lines[0]:
            problems.append(f"the line does not name {state}: {lines[0]}")
        if "-m launcher.launch" not in lines[0] or "--resume" in lines[0]:
            problems.append(f"the resume command is not launch's without --resume: {lines[0]}")
        if not (state / "meta.json").is_file() or latest != state.name:
            problems.append(f"{state} is not the latest complete state (latest: {latest})")
    trained = max(_losses(run), default=0) if (run / "metrics.jsonl").is_file() else 0
    saved = int(latest.split("_")[1]) if latest else 0
    if trained != saved:
        problems.append(f"steps lost: trained to step {trained}, the latest state is step {saved}")
    return problems


@pytest.mark.slow
def test_sigterm_to_every_rank_saves_the_step_and_resume_reproduces_the_losses(tiny_tokens, tmp_path):
    """SIGTERM to both ranks mid-run (what scancel / a SLURM time limit do): exit 75, rank 0's line, the state of the
    last logged step exists (0 steps lost), and resuming gives the uninterrupted run's losses exactly. Before the
    handler the ranks died on SIGTERM at once: no state, a negative status that the launcher reported as 1. The
    control of `saved_preemption_problems`: test_killed_run_resumes_on_the_uninterrupted_trajectory (SIGKILL)."""
    run, full = tmp_path / "run", tmp_path / "full"
    proc = _start(_args(tiny_tokens, run))
    tree: list[psutil.Process] = []
    try:
        _wait_for(proc, _logged(run, 3))
        ranks = _ranks(proc)
        tree = _tree(proc)
        assert len(ranks) == 2
        for p in ranks:
            p.send_signal(signal.SIGTERM)
        rc, err = _finish(proc)
    finally:
        _cleanup(proc, tree)
    assert saved_preemption_problems(rc, err, run) == [], err[-3000:]
    assert 3 <= max(_losses(run)) < STEPS
    assert not _none_alive(tree)
    _launch(_args(tiny_tokens, run))
    reference_run(_overrides(tiny_tokens, kind="dense", steps=STEPS), 2, full)
    a, b = _losses(full), _losses(run)
    assert sorted(b) == list(range(1, STEPS + 1))
    assert max(abs(a[s] - b[s]) for s in a) == 0.0, (a, b)


@pytest.mark.slow
def test_sigterm_to_the_launcher_only_stops_every_process_of_the_job(tiny_tokens, tmp_path):
    """`kill LAUNCHER` (docker stop): forwarded to the per-node launcher and the ranks, which save; no process of
    the job is left, the status is non-zero (75) and rank 0 says where the state is."""
    run = tmp_path / "run"
    proc = _start(_args(tiny_tokens, run))
    tree: list[psutil.Process] = []
    try:
        _wait_for(proc, _logged(run, 2))
        tree = _tree(proc)
        assert len(_ranks(proc)) == 2
        proc.send_signal(signal.SIGTERM)
        rc, err = _finish(proc)
        left = _none_alive(tree)
    finally:
        _cleanup(proc, tree)
    assert rc == PREEMPTED_EXIT, err[-3000:]
    assert not left, f"left running: {left}"
    assert "preempted (SIGTERM) at step " in err and "training state saved at" in err, err[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_signal_to_every_process_of_the_job_saves_the_step_and_exits_75(tiny_tokens, tmp_path, sig):
    """What SLURM delivers to a job step (`scancel`: SIGTERM; `scancel --signal=USR1`, a batch script's trap before
    the time limit: SIGUSR1), to every process of it at once: the launcher, the per-node launcher and the ranks, the
    launcher forwarding its copy too. The ranks save, every process exits 75, nothing reports a failure. Before
    launcher/node_launch.py handled them, SIGUSR1 killed DeepSpeed's per-node launcher (default action, status
    -10: the launcher exited 143) and the second SIGTERM re-ran DeepSpeed's handler, which exited 1 without waiting
    for the ranks (the launcher exited 1): either way a batch script saw no 75 and did not requeue
    (tests/e2e/test_slurm_batch.py found both on a real SLURM)."""
    run = tmp_path / "run"
    proc = _start(_args(tiny_tokens, run))
    tree: list[psutil.Process] = []
    try:
        _wait_for(proc, _logged(run, 2))
        tree = _tree(proc)
        assert len(_ranks(proc)) == 2 and any("launcher.node_launch" in p.cmdline() for p in tree)
        for p in [psutil.Process(proc.pid), *tree]:
            p.send_signal(sig)
        rc, err = _finish(proc)
        left = _none_alive(tree)
    finally:
        _cleanup(proc, tree)
    assert rc == PREEMPTED_EXIT, err[-3000:]
    assert not left, f"left running: {left}"
    assert f"preempted ({sig.name}) at step " in err and "training state saved at" in err, err[-3000:]
    assert "terminated (" not in err and "killed by" not in err, err[-3000:]


@pytest.mark.slow
def test_the_control_a_killed_launcher_leaves_ranks_that_the_orphan_check_finds(tiny_tokens, tmp_path):
    """The control of "no process of the job is left" (`_none_alive` above and below): SIGKILL to the launcher
    itself, which then can neither forward nor clean up, leaves the per-node launcher and both ranks running, and
    the check lists them. They are killed here (their process group), as soon as both ranks exist."""
    proc = _start(_args(tiny_tokens, tmp_path / "run"))
    tree: list[psutil.Process] = []
    try:
        _wait_for(proc, lambda: len(_ranks(proc)) == 2)
        ranks = [p.pid for p in _ranks(proc)]
        tree = _tree(proc)
        proc.kill()
        proc.wait(timeout=30)
        time.sleep(1)
        left = _none_alive(tree)
    finally:
        _cleanup(proc, tree)
    assert set(ranks) <= set(left), (ranks, left)
    deadline = time.monotonic() + 30
    while _none_alive(tree):  # and the clean-up above got them (SIGKILL takes effect in a moment)
        assert time.monotonic() < deadline, _none_alive(tree)
        time.sleep(0.1)


def kill_problems(rc: int, err: str, named: str, left: list[int]) -> list[str]:
    """What is wrong with a job one of whose processes SIGKILL ended, for "named, and nothing left": the status is
    not 128 + 9, `named` (`WHO (pid N) killed by SIGKILL`) is not in the output, or processes of the job are left."""
    problems = [] if rc == 128 + signal.SIGKILL else [f"exit status {rc}, not {128 + signal.SIGKILL}"]
    if named not in err:
        problems.append(f"no {named!r}")
    if left:
        problems.append(f"left running: {left}")
    return problems


@pytest.mark.slow
def test_a_killed_per_node_launcher_is_named_and_leaves_no_rank(tiny_tokens, tmp_path):
    """SIGKILL to DeepSpeed's per-node launcher (launcher/node_launch.py): DeepSpeed's runner would exit 0 with the
    ranks training on; the launcher names it, exits non-zero and stops the orphaned ranks. The control: the check
    of the test below (rank 1 named) fails here, where no rank was killed."""
    run = tmp_path / "run"
    proc = _start(_args(tiny_tokens, run))
    tree: list[psutil.Process] = []
    try:
        _wait_for(proc, _logged(run, 2))
        tree = _tree(proc)
        node = [p for p in tree if "launcher.node_launch" in p.cmdline()]
        ranks = {p.environ()["RANK"]: p.pid for p in _ranks(proc)}
        assert len(node) == 1 and len(ranks) == 2
        node[0].kill()
        rc, err = _finish(proc)
        left = _none_alive(tree)
    finally:
        _cleanup(proc, tree)
    named = f"DeepSpeed's per-node launcher (pid {node[0].pid}) killed by SIGKILL"
    assert kill_problems(rc, err, named, left) == [], err[-3000:]
    assert kill_problems(rc, err, f"rank 1 (pid {ranks['1']}) killed by SIGKILL", left)


@pytest.mark.slow
def test_a_killed_rank_is_named_and_ends_the_job(tiny_tokens, tmp_path):
    """SIGKILL to rank 1 mid-run (the OOM killer): the per-node launcher names it, `rank 1 (pid N) killed by
    SIGKILL`, the launch exits 137 and stops rank 0, which cannot go on without its peer; nothing is left. The
    control: the check of the test above (the per-node launcher named) fails here, where that launcher lived."""
    run = tmp_path / "run"
    proc = _start(_args(tiny_tokens, run))
    tree: list[psutil.Process] = []
    try:
        _wait_for(proc, _logged(run, 2))
        tree = _tree(proc)
        node = [p for p in tree if "launcher.node_launch" in p.cmdline()]
        ranks = {p.environ()["RANK"]: p for p in _ranks(proc)}
        assert len(node) == 1 and sorted(ranks) == ["0", "1"]
        ranks["1"].kill()
        rc, err = _finish(proc)
        left = _none_alive(tree)
    finally:
        _cleanup(proc, tree)
    named = f"rank 1 (pid {ranks['1'].pid}) killed by SIGKILL"
    assert kill_problems(rc, err, named, left) == [], err[-3000:]
    # rank 0 says in one line that it lost a peer (launcher/train.py peer_lost_line), not with gloo's traceback
    assert "Traceback" not in err, err[-3000:]
    assert kill_problems(
        rc, err, f"DeepSpeed's per-node launcher (pid {node[0].pid}) killed by SIGKILL", left
    )


def test_the_rank_finder_knows_both_ways_a_rank_is_started():
    """The tests above find ranks by command line: `launch` starts `launcher/_rank_entry.py`, mpirun/srun/torchrun
    `-m launcher.train`; the per-node launcher, whose arguments name the script too, is not a rank."""
    entry = "/repo/launcher/_rank_entry.py"
    assert is_rank_command(["python", "-u", entry, "--run-dir", "r"])
    assert is_rank_command(["python", "-m", "launcher.train", "--run-dir", "r"])
    assert not is_rank_command(["python", "-u", "-m", "launcher.node_launch", "--world_info=x", entry])
    assert not is_rank_command(["python", "-u", "-m", "deepspeed.launcher.launch", entry])
    assert not is_rank_command(["python", "-m", "launcher.launch", "--nproc", "2"])
    assert is_rank_command(["python", "-u", entry, "--run-dir", "/tmp/test_killed_per_node_launcher0/run"])
