"""A real OpenSSH server on loopback for the tests of the launchers that reach their hosts over ssh (pdsh).

`running_sshd(folder)` starts `/usr/sbin/sshd -D` on 127.0.0.1 and a free port with everything of its own in
`folder`: host key, `sshd_config`, `authorized_keys`, the client key, the PID file, the log. Nothing is written to
`~/.ssh` or `/etc/ssh` (only `/run/sshd`, sshd's privilege separation directory, is created when missing). The
client side is what a user's `~/.ssh/config` and key give ssh: a config file (`Sshd.client_config`) and a folder
(`Sshd.bin_dir`) holding an `ssh` that is the real one with `-F` that config, to put first on PATH, so that every
program that runs `ssh` (DeepSpeed's and launch's ssh checks, pdsh's ssh module) reaches this server with the key
and without a known_hosts entry. `pdsh_ssh_args` is the same for pdsh alone (PDSH_SSH_ARGS). The server is stopped
by its PID (SIGTERM, then SIGKILL) and waited for, however the test ends. The `sshd` fixture skips, saying why,
where sshd, ssh, ssh-keygen or pdsh is not installed or the tests do not run as root (.ci/run installs them:
openssh-server, pdsh)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from launcher.distributed import free_port

SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if Path("/usr/sbin/sshd").is_file() else None)
SSH = shutil.which("ssh")
SSH_KEYGEN = shutil.which("ssh-keygen")
PDSH = shutil.which("pdsh")
PRIVSEP_DIR = Path("/run/sshd")  # sshd refuses to start without its privilege separation directory


def missing() -> str | None:
    """Why a real sshd + pdsh cannot run here, or None."""
    programs = (("sshd", SSHD), ("ssh", SSH), ("ssh-keygen", SSH_KEYGEN), ("pdsh", PDSH))
    absent = [name for name, path in programs if path is None]
    if absent:
        return f"{', '.join(absent)} not installed (apt-get install openssh-server openssh-client pdsh; .ci/run does)"
    if os.geteuid() != 0:
        return "the loopback sshd must run as root (it starts each login's session as that user); these tests do not"
    return None


@dataclass(frozen=True)
class Sshd:
    """A running sshd: where it listens and what a client needs to log in to it."""

    port: int
    pid: int
    key: Path  # the client's private key (its public half is the server's authorized_keys)
    client_config: Path  # ssh_config: the key, no host key checking, no known_hosts written, batch mode
    bin_dir: Path  # holds `ssh`: the real one with `-F client_config` (put it first on PATH)
    log: Path

    @property
    def pdsh_ssh_args(self) -> str:
        """PDSH_SSH_ARGS for pdsh's ssh module (its default is `-2 -a -x -l%u %h`), this server's port included."""
        return f"-F {self.client_config} -p {self.port} -l%u %h"

    def env(self, environ: dict[str, str] | None = None) -> dict[str, str]:
        """`environ` (default this process's) with `bin_dir` first on PATH."""
        environ = dict(os.environ if environ is None else environ)
        return dict(environ, PATH=os.pathsep.join([str(self.bin_dir), environ.get("PATH", os.defpath)]))


def _keygen(path: Path, comment: str) -> None:
    subprocess.run(
        [SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        capture_output=True,
        timeout=60,
    )


def _stop(proc: subprocess.Popen, wait_s: float = 10.0) -> None:
    """SIGTERM to the process of PID `proc.pid`, SIGKILL if it is still there after `wait_s`; reaped either way. Its
    ssh sessions (sshd's children, each in its own session) end with their commands."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:  # ended by itself: reaped below
            break
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.wait(timeout=wait_s)


@contextlib.contextmanager
def running_sshd(folder: Path, start_timeout_s: float = 30.0) -> Iterator[Sshd]:
    """A real sshd on 127.0.0.1 with its keys, configuration, PID file and log in `folder` (see the module's
    docstring); stopped by its PID and reaped on exit."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)  # the keys readable by their owner only, as ssh wants them
    host_key, key = folder / "ssh_host_ed25519_key", folder / "id_ed25519"
    _keygen(host_key, "loopback sshd host key")
    _keygen(key, "loopback sshd client key")
    authorized = folder / "authorized_keys"
    authorized.write_text((folder / "id_ed25519.pub").read_text())
    authorized.chmod(0o600)
    port, pid_file, log = free_port(), folder / "sshd.pid", folder / "sshd.log"
    config = folder / "sshd_config"
    config.write_text(
        "\n".join(
            [
                "ListenAddress 127.0.0.1",
                f"Port {port}",
                f"HostKey {host_key}",
                f"PidFile {pid_file}",
                f"AuthorizedKeysFile {authorized}",
                "PermitRootLogin prohibit-password",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",  # PAM (Debian's default) would ask /etc/pam.d and the login records
                "StrictModes no",  # it refuses authorized_keys under the tests' tmp folder (/tmp is world-writable)
                "PrintMotd no",
                "PrintLastLog no",
                "X11Forwarding no",
                "MaxStartups 100",  # pdsh logs in to every host at once
                "LogLevel VERBOSE",
                "",
            ]
        )
    )
    client_config = folder / "ssh_config"
    client_config.write_text(
        "\n".join(
            [
                "Host *",
                f"  IdentityFile {key}",
                "  IdentitiesOnly yes",
                "  StrictHostKeyChecking no",
                "  UserKnownHostsFile /dev/null",
                "  GlobalKnownHostsFile /dev/null",
                "  BatchMode yes",
                "  LogLevel ERROR",
                "  ConnectTimeout 10",
                "",
            ]
        )
    )
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "ssh"
    shim.write_text(f'#!/bin/sh\nexec {SSH} -F {client_config} "$@"\n')
    shim.chmod(0o755)
    if not PRIVSEP_DIR.is_dir():
        PRIVSEP_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
    subprocess.run([SSHD, "-t", "-f", str(config)], check=True, capture_output=True, text=True, timeout=30)
    with open(log, "wb") as log_out:  # sshd has its own copy of the descriptor
        proc = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log_out,
            start_new_session=True,  # a Ctrl-C to the tests reaches it through the stop below, not the terminal
        )
    server = Sshd(port=port, pid=proc.pid, key=key, client_config=client_config, bin_dir=bin_dir, log=log)
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"sshd exited with status {proc.returncode}: {log.read_text()[-2000:]}")
            probe = subprocess.run(
                [str(shim), "-p", str(port), "127.0.0.1", "true"],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=30,
            )
            if probe.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"sshd on 127.0.0.1:{port} refuses a login after {start_timeout_s:g} s: {probe.stderr[-1000:]}"
                    f"\n{log.read_text()[-2000:]}"
                )
            time.sleep(0.2)
        yield server
    finally:
        _stop(proc)


@pytest.fixture
def sshd(tmp_path) -> Iterator[Sshd]:
    """A real sshd on loopback for one test (`running_sshd` in `tmp_path/sshd`); skips where it cannot run."""
    why = missing()
    if why:
        pytest.skip(why)
    with running_sshd(tmp_path / "sshd") as server:
        yield server
