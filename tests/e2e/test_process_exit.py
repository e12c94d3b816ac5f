"""Two costs every launch paid without need (experiments/results/make_test_time.md): a second interpreter for
DeepSpeed's runner (`launcher/launch.py:run_runner` runs it inside the launcher's process) and, in every rank, the
interpreter's teardown of torch, DeepSpeed and megatron-core (`data/cli.py:exit_process` ends the process once the
atexit callbacks ran and the output is flushed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _script(tmp_path: Path, end: str) -> subprocess.CompletedProcess:
    text = f"""
import atexit, sys
sys.path.insert(0, {str(REPO)!r})
from data.cli import exit_process

class Teardown:
    def __del__(self, open=open):  # runs in the interpreter's teardown of this module, which exit_process skips
        open({str(tmp_path / "teardown")!r}, "w").close()

kept = Teardown()
atexit.register(lambda: open({str(tmp_path / "atexit")!r}, "w").write("ran"))
sys.stdout.write("buffered, no newline")
sys.stderr.write("err")
{end}
"""
    return subprocess.run([sys.executable, "-c", text], capture_output=True, text=True, timeout=60)


def test_exit_process_runs_atexit_flushes_keeps_the_status_and_skips_the_teardown(tmp_path):
    proc = _script(tmp_path, "exit_process(3)")
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "buffered, no newline", "err")
    assert (tmp_path / "atexit").read_text() == "ran"
    assert not (tmp_path / "teardown").exists()
    for status, code in (("None", 0), ("'a message'", 1), ("0", 0)):
        assert _script(tmp_path, f"exit_process({status})").returncode == code


def test_the_control_a_normal_exit_tears_down(tmp_path):
    """The planted object is seen by the teardown that sys.exit runs: the check above can fail."""
    proc = _script(tmp_path, "sys.exit(3)")
    assert proc.returncode == 3 and (tmp_path / "teardown").exists() and (tmp_path / "atexit").exists()


def test_the_runner_in_the_launchers_process_gets_the_subprocess_environment_and_restores_the_caller(
    tmp_path, monkeypatch
):
    """DeepSpeed's runner (run in this process) starts its per-node launcher, which starts the "rank" (here a shell
    recording its directory and environment) with the environment and directory the runner's own subprocess would
    have had; afterwards the caller's environment, directory and signal handlers are as they were, and a runner
    failure is returned as its status."""
    import signal

    from launcher.launch import REPO_ROOT, run_runner

    monkeypatch.chdir(tmp_path)
    before, handlers = dict(os.environ), [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    out = tmp_path / "seen"
    env = dict(os.environ, DS_ACCELERATOR="cpu", DEMIX_PROBE="from-the-launcher", PYTHONPATH=str(REPO_ROOT))
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--no_local_rank",
        "--master_port",
        "29591",
        "--num_gpus",
        "1",
        "--no_python",
        "/bin/sh",
        "-c",
        f"pwd > {out}; env >> {out}",
    ]
    assert run_runner(cmd, env) == 0
    seen = out.read_text().splitlines()
    assert seen[0] == str(REPO_ROOT) and "DEMIX_PROBE=from-the-launcher" in seen and "RANK=0" in seen
    assert dict(os.environ) == before and os.getcwd() == str(tmp_path)
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == handlers
    assert run_runner([*cmd[:3], "--no-such-option"], env) == 2
    assert dict(os.environ) == before and os.getcwd() == str(tmp_path)
