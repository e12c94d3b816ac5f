"""scripts/slurm_demix.sbatch run by bash with stand-ins for srun, scontrol and scancel (no SLURM needed, nothing
trained): which launch arguments and environment reach the job step, and what the script does with srun's status.
The real SLURM run of the same script: tests/e2e/test_slurm_batch.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm_demix.sbatch"
DEFAULT = (
    "--config configs/gpt3-small-demix.yaml --set data.path=/path/to/your/tokens --set data.tokenizer=gpt2"
)
STAND_IN = """#!/usr/bin/env bash
{{ printf '%s' "$(basename "$0")"; printf ' <%s>' "$@"; echo; }} >> "{calls}"
[ "$(basename "$0")" = srun ] && echo "GPUS_PER_NODE=$GPUS_PER_NODE RUN_DIR=$RUN_DIR" >> "{calls}"
[ "$(basename "$0")" = srun ] && exit "${{FAKE_SRUN_RC:-0}}"
exit 0
"""


def _run(
    tmp_path: Path, args: list[str], srun_rc: int = 0, **env: str
) -> tuple[subprocess.CompletedProcess, str]:
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir(exist_ok=True)
    for name in ("srun", "scontrol", "scancel"):
        (bin_dir / name).write_text(STAND_IN.format(calls=calls))
        (bin_dir / name).chmod(0o755)
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SLURM_") and k not in ("RUN_DIR", "GPUS_PER_NODE")
    }
    base.update(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID="77", SLURM_SUBMIT_DIR=str(REPO)
    )
    base.update(FAKE_SRUN_RC=str(srun_rc), **env)
    proc = subprocess.run(["bash", str(SCRIPT), *args], env=base, capture_output=True, text=True, timeout=60)
    return proc, calls.read_text() if calls.is_file() else ""


def _srun_args(calls: str) -> str:
    line = next(c for c in calls.splitlines() if c.startswith("srun "))
    return " ".join(a.strip("<>") for a in line.split()[1:])


@pytest.mark.skipif(
    not (REPO / ".venv" / "bin" / "python").exists(), reason="the script wants .venv (make venv)"
)
def test_without_arguments_the_job_step_gets_the_default_run_and_with_them_exactly_those(tmp_path):
    proc, calls = _run(tmp_path, [], RUN_DIR=str(tmp_path / "runs" / "a"))
    assert proc.returncode == 0, proc.stderr
    assert _srun_args(calls).endswith(f"bash scripts/slurm_node.sh {DEFAULT}"), calls
    assert f"GPUS_PER_NODE=8 RUN_DIR={tmp_path / 'runs' / 'a'}" in calls
    (tmp_path / "calls").unlink()
    args = ["--config", "c.yaml", "--set", "data.path=/my data/x", "--set", "train.steps=30"]
    proc, calls = _run(tmp_path, args, GPUS_PER_NODE="2", RUN_DIR=str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stderr
    line = next(c for c in calls.splitlines() if c.startswith("srun "))
    assert line.endswith("<bash> <scripts/slurm_node.sh> " + " ".join(f"<{a}>" for a in args)), line
    assert f"GPUS_PER_NODE=2 RUN_DIR={tmp_path / 'r'}" in calls
    assert "job 77 (restart 0)" in proc.stdout and "scontrol" not in calls


@pytest.mark.skipif(
    not (REPO / ".venv" / "bin" / "python").exists(), reason="the script wants .venv (make venv)"
)
def test_status_75_requeues_the_job_and_any_other_status_is_the_jobs(tmp_path):
    proc, calls = _run(tmp_path, ["--config", "c.yaml"], srun_rc=75, RUN_DIR=str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stderr
    assert "scontrol <requeue> <77>" in calls and "requeueing job 77" in proc.stdout
    (tmp_path / "calls").unlink()
    proc, calls = _run(tmp_path, ["--config", "c.yaml"], srun_rc=1, RUN_DIR=str(tmp_path / "r"))
    assert proc.returncode == 1 and "srun ended with status 1" in proc.stderr
    assert "scontrol" not in calls
