"""A killed JIT build's lock: torch's FileBaton waits for it with no timeout, so one build killed by a signal would
hang every later CPU run at the process group's start. `clear_stale_build_lock` removes it when it is old and
nothing builds there; a fresh lock, or one whose build is under way, is kept."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.rundir import SHM_OP, clear_stale_build_lock, extensions_root

REPO = Path(__file__).resolve().parents[2]


def _lock(root: Path, age_s: float) -> Path:
    lock = root / SHM_OP / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_an_old_lock_nobody_builds_under_is_removed_and_named(tmp_path):
    lock = _lock(tmp_path, 600)
    said = clear_stale_build_lock({"TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert not lock.exists() and said and str(lock) in said and "killed" in said


def test_a_fresh_lock_is_kept(tmp_path):
    lock = _lock(tmp_path, 5)
    assert clear_stale_build_lock({"TORCH_EXTENSIONS_DIR": str(tmp_path)}) is None and lock.exists()


def test_a_lock_whose_build_is_under_way_is_kept(tmp_path):
    lock = _lock(tmp_path, 600)
    builder = subprocess.Popen(
        ["sleep", "30"], cwd=lock.parent
    )  # stands in for ninja, which runs in the folder
    try:
        time.sleep(0.2)
        assert clear_stale_build_lock({"TORCH_EXTENSIONS_DIR": str(tmp_path)}) is None and lock.exists()
    finally:
        builder.kill()
        builder.wait()
    assert clear_stale_build_lock({"TORCH_EXTENSIONS_DIR": str(tmp_path)}) and not lock.exists()


def test_no_lock_no_message(tmp_path):
    assert clear_stale_build_lock({"TORCH_EXTENSIONS_DIR": str(tmp_path)}) is None


@pytest.mark.long
@pytest.mark.slow
def test_a_launch_after_a_killed_build_starts_instead_of_hanging(tiny_tokens, tmp_path):
    """The built op and a lock left 10 minutes ago: without the rule every rank waits on the lock for ever (the
    launch then times out here)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the shm op is built for CPU ranks only")
    from tests.e2e.test_train import _overrides

    built = extensions_root() / SHM_OP
    if not (built / f"{SHM_OP}.so").exists():
        pytest.skip(f"no built {SHM_OP} in {built} yet (the first CPU launch builds it, ~100 s)")
    root = tmp_path / "ext"
    shutil.copytree(built, root / SHM_OP, ignore=shutil.ignore_patterns("lock"))
    lock = _lock(root, 600)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(root), OMP_NUM_THREADS="1")
    args = ["--nproc", "2", "--run-dir", str(tmp_path / "run"), *_overrides(tiny_tokens, steps=1)]
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.launch", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not lock.exists() and f"removed {lock}" in proc.stderr
