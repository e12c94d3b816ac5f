"""`launch --hostfile H --launcher pdsh` through the real programs: pdsh's ssh module logging in to a real sshd on
loopback (tests/harness/sshd.py), with two names of this machine standing in for two hosts. Each test skips, saying
why, where sshd, ssh, ssh-keygen or pdsh is missing or the tests do not run as root (.ci/run installs them).

What a user does, and nothing else: passwordless ssh to every host (here the harness's `ssh` first on PATH stands for
the user's `~/.ssh/config` and key, which a test must not write), `--ssh-port` for a server on a non-default port
(DeepSpeed gives pdsh `-p PORT` through PDSH_SSH_ARGS_APPEND, and launch's own ssh check uses it), and
`--master-addr` (without it DeepSpeed asks the first host for `hostname -I`, which is no loopback address). Launch's
ssh check runs (no `--no-ssh-check`): it is the first thing a user meets."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from launcher.launch import REMOTE_SETTINGS
from launcher.metrics import read_metrics
from tests.e2e.test_real_launchers import _same_world_and_losses, _sets, launched  # noqa: F401 (a fixture)
from tests.e2e.test_train import _launch
from tests.harness.processes import is_rank_command
from tests.harness.sshd import Sshd, missing, running_sshd, sshd  # noqa: F401 (a fixture)

pytestmark = pytest.mark.long  # real cluster programs: make test-long

REPO = Path(__file__).resolve().parents[2]
# Two names of this machine that DeepSpeed takes for two hosts and pdsh logs in to separately.
HOSTS = ("localhost", "127.0.0.1")


def _pdsh_args(tmp_path: Path, server: Sshd, run: Path) -> list[str]:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{h} slots=1\n" for h in HOSTS))
    args = ["--hostfile", str(hostfile), "--launcher", "pdsh", "--ssh-port", str(server.port)]
    return args + ["--master-addr", "127.0.0.1", "--run-dir", str(run)]


def _python_of_run(cmd: list[str], run: Path) -> bool:
    """Whether `cmd` is a Python process of the run in `run`: a rank or a per-node launcher (launcher/node_launch.py),
    never launch itself nor pdsh or ssh, whose command lines carry the remote command's words."""
    ours = cmd[:1] == [sys.executable] and str(run) in cmd
    return ours and (is_rank_command(cmd) or "launcher.node_launch" in cmd)


def _run_processes(run: Path) -> list[psutil.Process]:
    """The ranks and per-node launchers of the run in `run`, wherever they were started."""
    return [p for p in psutil.process_iter(["cmdline"]) if _python_of_run(p.info["cmdline"] or [], run)]


class RankWatcher:
    """Records, while a launch runs, every rank process of `run_dir` (tests/harness/processes.py `is_rank_command`):
    the environment it was started with and whether the sshd of PID `sshd_pid` is among its ancestors."""

    def __init__(self, run_dir: Path, sshd_pid: int) -> None:
        self.run_dir, self.sshd_pid = run_dir, sshd_pid
        self.ranks: dict[int, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> RankWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _watch(self) -> None:
        while not self._stop.is_set():
            for p in psutil.process_iter(["pid", "cmdline"]):
                cmd = p.info["cmdline"] or []
                if (
                    p.info["pid"] in self.ranks
                    or not _python_of_run(cmd, self.run_dir)
                    or not is_rank_command(cmd)
                ):
                    continue
                try:
                    env = p.environ()
                    ancestors = [a.pid for a in p.parents()]
                except psutil.Error:
                    continue
                self.ranks[p.info["pid"]] = {"env": env, "under_sshd": self.sshd_pid in ancestors}
            time.sleep(0.05)


def test_the_loopback_sshd_serves_pdsh_and_is_stopped_by_its_pid(tmp_path):
    """The harness itself (tests/harness/sshd.py): pdsh with PDSH_SSH_ARGS alone (no `ssh` of the harness on PATH)
    runs a command on both names of this machine, each in its own ssh session (`%n` their ranks); the server is
    gone once the block ends, and nothing was written to ~/.ssh."""
    why = missing()
    if why:
        pytest.skip(why)
    home_ssh = Path.home() / ".ssh"
    before = sorted(home_ssh.iterdir()) if home_ssh.is_dir() else None
    with running_sshd(tmp_path / "sshd") as server:
        assert int((tmp_path / "sshd" / "sshd.pid").read_text()) == server.pid
        env = dict(os.environ, PDSH_RCMD_TYPE="ssh", PDSH_SSH_ARGS=server.pdsh_ssh_args)
        proc = subprocess.run(
            ["pdsh", "-S", "-w", ",".join(HOSTS), "echo rank %n $SSH_CONNECTION"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr + server.log.read_text()[-2000:]
        lines = sorted(proc.stdout.splitlines())
        assert [line.split()[:3] for line in lines] == [
            ["127.0.0.1:", "rank", "1"],
            ["localhost:", "rank", "0"],
        ]
        assert all(line.endswith(f"127.0.0.1 {server.port}") for line in lines), lines
    assert not psutil.pid_exists(server.pid)
    assert (sorted(home_ssh.iterdir()) if home_ssh.is_dir() else None) == before


@pytest.mark.slow
def test_launch_with_pdsh_over_real_ssh_trains_one_world(tiny_tokens, tmp_path, launched, sshd: Sshd):  # noqa: F811
    """`launch --hostfile (localhost, 127.0.0.1; one slot each) --launcher pdsh --ssh-port PORT --master-addr
    127.0.0.1`: DeepSpeed's PDSHRunner runs `pdsh -w localhost,127.0.0.1 "export ...; cd REPO; python -u -m
    launcher.node_launch --node_rank=%n ..."`, pdsh logs in to the loopback sshd once per host, and the two ranks,
    each under its own ssh session, train as one world of 2 to the losses of `launch --nproc 2`.

    Started by sshd, the ranks have none of the launching shell's environment: they must get the settings local ranks
    get through the `.deepspeed_env` launch writes (launcher/launch.py `write_rank_env_file`): OMP_NUM_THREADS (one
    thread each, as `_launch` gives local ranks; without it torch takes every core in each rank) and the user's own
    thread settings (MKL_NUM_THREADS here). DS_ACCELERATOR stays each host's own: a rank without CUDA takes the CPU."""
    run = tmp_path / "launch-pdsh"
    with RankWatcher(run, sshd.pid) as watcher:
        proc = _launch(
            [*_pdsh_args(tmp_path, sshd, run), *_sets(tiny_tokens)],
            env_extra={"PATH": sshd.env()["PATH"], "MKL_NUM_THREADS": "1"},
        )
    out = proc.stdout + proc.stderr
    assert f"cmd = pdsh -S -f 1024 -w {','.join(HOSTS)}" in out, out[-3000:]
    _same_world_and_losses(run, launched, out)
    # one world on the loopback rendezvous, each rank started in an ssh session of the loopback sshd
    ranks = sorted(watcher.ranks.values(), key=lambda r: int(r["env"].get("RANK", -1)))
    assert [r["env"].get("RANK") for r in ranks] == ["0", "1"], (ranks, out[-3000:])
    assert all(r["under_sshd"] and "SSH_CONNECTION" in r["env"] for r in ranks), ranks
    assert {r["env"]["MASTER_ADDR"] for r in ranks} == {"127.0.0.1"}
    # the settings launch had (the user's, OMP_NUM_THREADS=1 from _launch), through RUN_DIR/.deepspeed_env
    env_file = run / ".deepspeed_env"
    assert f"DS_ENV_FILE={env_file}" in (run / "command.sh").read_text()
    written = dict(line.split("=", 1) for line in env_file.read_text().splitlines())
    assert written["OMP_NUM_THREADS"] == "1" and written["MKL_NUM_THREADS"] == "1", written
    assert set(written) <= set(REMOTE_SETTINGS), written
    for r in ranks:
        assert {k: r["env"].get(k) for k in written} == written, r["env"]


@pytest.mark.slow
def test_sigterm_to_a_pdsh_launch_stops_the_ranks_on_every_host(tiny_tokens, tmp_path, sshd: Sshd):  # noqa: F811
    """SIGTERM to `launch --launcher pdsh` (`kill`, a scheduler ending the job) while the ranks train: DeepSpeed's
    pdsh runner interrupts pdsh and runs `pdsh -w HOSTS 'pkill -f ' 'PYTHON\\ -u\\ -m\\ launcher.node_launc'` on every
    host; each per-node launcher (launcher/node_launch.py) stops its ranks, which save the step's state
    (launcher/preemption.py) and exit; none trains on. launch exits 1 (DeepSpeed's pdsh runner's status) at once.
    Found here: the pattern named DeepSpeed's per-node launcher, which launch replaces, so it matched nothing and
    both ranks trained to the last step after launch had exited (launcher/launch.py `node_launcher_command`). The
    pkill runs on this machine (both hosts are it): it matches only per-node launchers of this Python."""
    run, steps = tmp_path / "launch-pdsh-term", 500  # far more steps than run before the signal
    log = tmp_path / "launch.log"
    cmd = [sys.executable, "-m", "launcher.launch", *_pdsh_args(tmp_path, sshd, run), *_sets(tiny_tokens)]
    env = sshd.env(dict(os.environ, OMP_NUM_THREADS="1"))
    metrics = run / "metrics.jsonl"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*cmd, "--set", f"train.steps={steps}"], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 300
        while not (metrics.is_file() and '"kind": "train"' in metrics.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        assert len(_run_processes(run)) == 4  # both hosts' per-node launchers and ranks
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
        deadline = time.monotonic() + 90  # the ranks save (up to node_launch's STOP_WAIT_S), then exit
        while _run_processes(run) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = [(p.pid, p.cmdline()[:4]) for p in _run_processes(run)]
    finally:
        for p in (
            [*_run_processes(run), psutil.Process(proc.pid)] if proc.poll() is None else _run_processes(run)
        ):
            try:
                p.kill()
            except psutil.Error:
                pass
        proc.wait(timeout=60)
    text = log.read_text()
    assert rc == 1, text[-3000:]
    assert not left, (left, text[-3000:])
    trained = [r["step"] for r in read_metrics(metrics) if r.get("kind") == "train"]
    assert trained and trained[-1] < steps and not (run / "model").exists(), trained
    assert (run / "checkpoints" / "latest").is_file(), text[-3000:]  # the ranks saved the step on the way out
