"""scripts/slurm_demix.sbatch submitted with the real `sbatch` to a one-node SLURM cluster (tests/harness/slurm.py):
the preemption story of docs/cluster.md end to end, with SLURM's own programs delivering the signals and requeueing
the job. The tiny 2-rank DEMix run of tests/e2e/test_real_launchers.py, 30 steps, no periodic checkpoint (the only
state is the preemption's)."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from launcher.metrics import read_metrics
from tests.e2e.test_real_launchers import _bare_env, _losses, _sets
from tests.e2e.test_train import reference_run
from tests.harness import slurm

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm_demix.sbatch"
STEPS = 30
slurm_cluster = slurm.slurm_cluster  # the fixture
pytestmark = [
    pytest.mark.long,
    pytest.mark.slow,
    pytest.mark.skipif(not slurm.HAVE_SLURM, reason=slurm.NO_SLURM),
]
# The states of a job that has not ended (squeue(1), "JOB STATE CODES"); a requeued job is PENDING again
ACTIVE = (
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "RESIZING",
)


def _trainer_args(tokens: Path) -> list[str]:
    return [*_sets(tokens), "--set", f"train.steps={STEPS}", "--set", "train.save_interval=0"]


def _job(job: str, env: dict[str, str]) -> dict[str, str]:
    """`scontrol show job JOB` as KEY -> VALUE (SLURM keeps a finished job's record MinJobAge, 300 s: no accounting
    database is needed)."""
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True, timeout=30
    ).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _wait(what: str, ready, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            text = log.read_text() if log.is_file() else "(no log)"
            raise AssertionError(f"{what}: not within {timeout:g} s; the job's log:\n{text[-4000:]}")
        time.sleep(0.2)


def _until_step(run: Path, step: int, log: Path) -> None:
    metrics = run / "metrics.jsonl"
    ready = lambda: metrics.is_file() and f'"kind": "train", "step": {step},' in metrics.read_text()  # noqa: E731
    _wait(f"step {step} logged", ready, 300, log)


def _submit(tokens: Path, tmp_path: Path, env: dict[str, str], run: Path) -> tuple[str, Path]:
    """sbatch the real script from the repository root (its SLURM_SUBMIT_DIR) for the tiny run: the #SBATCH lines
    (4 nodes x 8 GPUs, 48 h) overridden on the command line for this one 2-CPU node without GPUs; 2 ranks."""
    log = tmp_path / "slurm-demix.out"
    cmd = ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", f"--cpus-per-task={slurm.NODE_CPUS}"]
    cmd += ["--time=10", f"--output={log}", str(SCRIPT), *_trainer_args(tokens)]
    job_env = _bare_env(**env, GPUS_PER_NODE="2", RUN_DIR=str(run))
    proc = subprocess.run(cmd, cwd=REPO, env=job_env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0], log


def _cancel(job: str, env: dict[str, str]) -> None:
    """No process of the job outlives the test (the cluster's daemons are stopped next; slurmstepd is not)."""
    subprocess.run(["scancel", job], env=env, capture_output=True, timeout=30)
    deadline = time.monotonic() + 60
    while _job(job, env).get("JobState") in ACTIVE and time.monotonic() < deadline:
        time.sleep(0.5)


def test_usr1_before_the_time_limit_saves_requeues_and_resumes_to_the_same_losses(
    tiny_tokens, tmp_path, slurm_cluster
):
    """What `#SBATCH --signal=B:USR1@60` delivers 60 s before the time limit, SIGUSR1 to the batch shell only
    (`scancel --batch --signal=USR1`), mid-run: the script's trap passes it to the job step (each node's launcher and
    its ranks), the ranks finish the step, save it and exit 75, the script requeues the job, and the requeued job
    (restart 1) runs the script again, whose `--resume auto` continues from the saved step to the end: every step
    trained once, with the losses of an uninterrupted run, exactly."""
    env = slurm_cluster
    run = tmp_path / "run"
    job, log = _submit(tiny_tokens, tmp_path, env, run)
    try:
        _until_step(run, 3, log)
        assert _job(job, env)["JobState"] == "RUNNING"
        subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=env, check=True, timeout=30)
        # Nothing to release or start by hand: the requeued job waits AuthInfo's cred_expire (SLURM's default 120 s,
        # 5 s on the test cluster: tests/harness/slurm.py) and is then started by the scheduler, as on a real one.
        _wait("the requeued job finished", lambda: _job(job, env).get("JobState") not in ACTIVE, 300, log)
        info = _job(job, env)
    finally:
        _cancel(job, env)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, text[-4000:])
    assert info["Restarts"] == "1", (info, text[-4000:])
    assert f"job {job} (restart 0) on " in text and f"job {job} (restart 1) on " in text, text[-4000:]
    assert "SIGUSR1 (time limit near): asking the ranks to save" in text, text[-4000:]
    saved = re.findall(r"preempted \(SIGUSR1\) at step (\d+): training state saved at (\S+);", text)
    assert len(saved) == 1, text[-4000:]  # rank 0's line, once
    step, state = int(saved[0][0]), Path(saved[0][1])
    assert 3 <= step < STEPS and state == run / "checkpoints" / f"step_{step:08d}", saved
    assert (state / "meta.json").is_file()
    assert f"preempted with the state saved: requeueing job {job}" in text, text[-4000:]
    records = read_metrics(run / "metrics.jsonl")
    starts = [r for r in records if r.get("kind") == "start"]
    assert [(s["step"], s["world_size"], s["resumed_from"]) for s in starts] == [
        (0, 2, None),
        (step, 2, str(state)),
    ]
    assert [r["step"] for r in records if r.get("kind") == "train"] == list(range(1, STEPS + 1))
    full = reference_run(_trainer_args(tiny_tokens), 2, tmp_path / "full")
    a, b = _losses(full), _losses(run)
    assert max(abs(a[s] - b[s]) for s in a) == 0.0, (a, b)


def test_scancel_stops_the_job_with_the_step_saved_and_no_requeue(tiny_tokens, tmp_path, slurm_cluster):
    """`scancel JOB` (or a time limit reached without the SIGUSR1 warning): SIGTERM to every process of the job at
    once, the batch shell included, SIGKILL KillWait (30 s) later. The ranks save the step within it and exit 75,
    which srun reports; the script, killed, requeues nothing: the job stays cancelled, resubmitting resumes. On a
    real SLURM this found the per-node launcher exiting 1 on the second SIGTERM (launcher/node_launch.py)."""
    env = slurm_cluster
    run = tmp_path / "run"
    job, log = _submit(tiny_tokens, tmp_path, env, run)
    try:
        _until_step(run, 3, log)
        subprocess.run(["scancel", job], env=env, check=True, timeout=30)
        _wait("the job ended", lambda: _job(job, env).get("JobState") not in ACTIVE, 120, log)
        info = _job(job, env)
    finally:
        _cancel(job, env)
    text = log.read_text()
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", (info, text[-4000:])
    saved = re.findall(r"preempted \(SIGTERM\) at step (\d+): training state saved at (\S+);", text)
    assert len(saved) == 1, text[-4000:]
    step, state = int(saved[0][0]), Path(saved[0][1])
    assert state == run / "checkpoints" / f"step_{step:08d}" and (state / "meta.json").is_file(), saved
    assert (run / "checkpoints" / "latest").read_text().strip() == state.name
    assert max(_losses(run)) == step  # every step trained was saved
    assert "task 0: Exited with exit code 75" in text, text[-4000:]  # srun's report of the launcher's status
    assert "terminated (" not in text and "requeueing" not in text, text[-4000:]
