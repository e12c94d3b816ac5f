"""A one-node SLURM cluster on loopback for the tests that run the real SLURM programs (sbatch, srun, scancel,
scontrol): munged, slurmctld and slurmd started with their configuration and state in a temporary folder, on free
ports, and stopped by PID afterwards. Test modules import the fixture (`from tests.harness.slurm import
slurm_cluster`) and skip with NO_SLURM where HAVE_SLURM is false (.ci/run installs the packages: slurmctld slurmd
slurm-client munge)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher.distributed import free_port

SLURM_PROGRAMS = ("slurmctld", "slurmd", "srun", "sbatch", "scancel", "scontrol", "sinfo", "munged")
_PACKAGES = "slurmctld slurmd slurm-client munge"
NO_SLURM = f"SLURM is not installed (needs {', '.join(SLURM_PROGRAMS)}: apt-get install {_PACKAGES})"
HAVE_SLURM = all(shutil.which(p) or Path("/usr/sbin", p).is_file() for p in SLURM_PROGRAMS)
# The node's CPUs: at least 2, so that 2 tasks (srun -n 2) or a 2-CPU batch task fit on a smaller machine too
# (SlurmdParameters=config_overrides: slurmd takes this count instead of draining the node for having fewer).
NODE_CPUS = max(2, os.cpu_count() or 1)
# How long a requeued job waits before it may start again (AuthInfo cred_expire, SLURM's default 120 s: the
# credentials of its previous run must have expired; SLURM's minimum 5 s), and how often the main scheduler, which
# then starts it (nothing else happening on the cluster wakes the scheduler), runs (sched_interval, default 60 s):
# shortened for the tests that requeue, so a requeued job starts again in about 6 s instead of up to 3 minutes.
CRED_EXPIRE_S = 5
SCHED_INTERVAL_S = 1
# For the node to register with slurmctld: seconds on an idle machine, more than a minute on a loaded one.
UP_TIMEOUT_S = 180


def _tail(log: Path, lines: int = 5) -> str:
    last = log.read_text().splitlines()[-lines:] if log.is_file() else []
    return "".join(f"\n{log.name}: {line}" for line in last)


def _stop(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, 15)
        except ProcessLookupError:
            pass


def slurm_conf(d: Path, sock: Path) -> str:
    """slurm.conf of the one-node cluster whose state and logs are under `d`, authenticated by the munged at `sock`."""
    lines = [
        "ClusterName=demixtest",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        f"AuthInfo=socket={sock},cred_expire={CRED_EXPIRE_S}",
        "CredType=cred/munge",
        f"StateSaveLocation={d / 'state'}",
        f"SlurmdSpoolDir={d / 'spool'}",
        f"SlurmctldPidFile={d / 'slurmctld.pid'}",
        f"SlurmdPidFile={d / 'slurmd.pid'}",
        f"SlurmctldLogFile={d / 'slurmctld.log'}",
        f"SlurmdLogFile={d / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "MpiDefault=none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        f"SchedulerParameters=sched_interval={SCHED_INTERVAL_S}",
        "SlurmdParameters=config_overrides",
        "ReturnToService=2",
        "JobAcctGatherType=jobacct_gather/none",
        f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={NODE_CPUS} State=UNKNOWN",
        "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE",
    ]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def one_node_slurm(d: Path) -> Iterator[dict[str, str]]:
    """Start munged, slurmctld and slurmd with everything under `d`; yield the environment the SLURM clients need
    (SLURM_CONF) once the node is idle; stop every daemon by PID on the way out, whatever happened. Skips the test
    when not root (the daemons run as root) or when the node does not come up."""
    if os.geteuid() != 0:
        pytest.skip("the one-node SLURM cluster runs its daemons as root")
    for sub in ("state", "spool", "munge"):
        (d / sub).mkdir(parents=True)
    (d / "munge").chmod(0o700)
    key = d / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = d / "munge" / "sock"
    munged = shutil.which("munged") or "/usr/sbin/munged"
    subprocess.run(
        [munged, "--force", f"--key-file={key}", f"--socket={sock}", f"--pid-file={d / 'munge/pid'}"]
        + [f"--log-file={d / 'munge/log'}", f"--seed-file={d / 'munge/seed'}"],
        check=True,
        timeout=30,
    )
    pids = [int((d / "munge" / "pid").read_text())]
    daemons: list[subprocess.Popen] = []
    try:
        conf = d / "slurm.conf"
        conf.write_text(slurm_conf(d, sock))
        env = dict(os.environ, SLURM_CONF=str(conf))
        for name, extra in (("slurmctld", []), ("slurmd", ["-N", "localhost"])):
            daemons.append(
                subprocess.Popen(
                    [shutil.which(name) or f"/usr/sbin/{name}", "-D", *extra, "-f", str(conf)],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            pids.append(daemons[-1].pid)
        deadline = time.monotonic() + UP_TIMEOUT_S
        while True:
            up = subprocess.run(
                ["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=30
            )
            if up.stdout.strip() == "idle":
                break
            if time.monotonic() > deadline or any(p.poll() is not None for p in daemons):
                logs = "".join(_tail(d / f"{name}.log") for name in ("slurmctld", "slurmd"))
                pytest.skip(
                    f"the one-node SLURM cluster did not come up: {up.stdout}{up.stderr}{logs}"[-1500:]
                )
            time.sleep(0.5)
        yield {"SLURM_CONF": str(conf)}
    finally:
        _stop(pids)
        for p in daemons:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=30)


@pytest.fixture
def slurm_cluster(tmp_path):
    """A one-node SLURM cluster on loopback (`one_node_slurm` in tmp_path/slurm), stopped by PID afterwards; yields
    the environment the SLURM clients need (SLURM_CONF)."""
    with one_node_slurm(tmp_path / "slurm") as env:
        yield env
