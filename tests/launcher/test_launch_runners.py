"""The command each of DeepSpeed's multi-node runners builds from `launcher.launch`'s: DeepSpeed's own runner runs in
this process (`run_runner`) with only the final `subprocess.Popen` faked, so every step it takes (arguments, hostfile,
--force_multi, exports, .deepspeed_env, the runner's get_cmd) is DeepSpeed's."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher.config import ConfigError
from launcher.launch import (
    RANK_ENTRY,
    _RecordingSubprocess,
    build_command,
    deepspeed_env_file,
    main,
    parse_args,
    prepare_run,
    run_runner,
    ssh_check_problem,
)

REPO = Path(__file__).resolve().parents[2]
RUNNERS = ("pdsh", "openmpi", "mvapich", "mpich", "impi", "slurm")


def _sets(tokens: Path) -> list[str]:
    sets = [
        "model.preset=tiny",
        "model.n_layers=2",
        "model.d_model=64",
        "model.n_heads=2",
        "model.seq_len=32",
        "model.ffn.kind=demix",
    ]
    sets += [f"data.path={tokens}", "data.tokenizer=gpt2", "data.domains=[cooking,finance]", "train.steps=2"]
    sets += ["logging.wandb_mode=disabled", "logging.wandb_group=a group with spaces"]
    return [a for s in sets for a in ("--set", s)]


class _FakePopen:
    """What DeepSpeed's runner gets instead of the process it would start: the command, recorded."""

    started: list[list[str]] = []

    def __init__(self, cmd: list[str], **kwargs) -> None:
        _FakePopen.started.append(list(cmd))
        self.returncode = 0

    def wait(self) -> int:
        return 0

    def send_signal(self, sig: int) -> None:
        pass


@pytest.fixture
def deepspeed_started(monkeypatch, tmp_path):
    """Run `launch`'s DeepSpeed command in this process; return the command DeepSpeed's runner would start. Every
    backend exists; mvapich's temporary hostfile goes to tmp_path."""
    from deepspeed.launcher import multinode_runner, runner

    for name in ("PDSHRunner", "OpenMPIRunner", "MVAPICHRunner", "MPICHRunner", "IMPIRunner", "SlurmRunner"):
        monkeypatch.setattr(getattr(multinode_runner, name), "backend_exists", lambda self: True)
    monkeypatch.setattr(multinode_runner, "MVAPICH_TMP_HOSTFILE", str(tmp_path / "mvapich_hosts"))

    def no_ssh(cmd, *a, **k):
        raise AssertionError(f"DeepSpeed's runner ran {cmd}")

    fake = SimpleNamespace(
        Popen=_FakePopen,
        check_call=no_ssh,
        check_output=no_ssh,
        CalledProcessError=subprocess.CalledProcessError,
    )
    monkeypatch.setattr(runner, "subprocess", fake)

    def run(args) -> tuple[list[str], Path]:
        _FakePopen.started = []
        run_dir, cmd, env = prepare_run(args)
        with deepspeed_env_file(env):
            assert run_runner(cmd, env) == 0
        (started,) = _FakePopen.started
        return started, run_dir

    return run


def _hostfile(tmp_path: Path, text: str = "node0 slots=2\nnode1 slots=2\n") -> list[str]:
    """--hostfile (and --master-addr: DeepSpeed asks the first host over ssh for it otherwise)."""
    (tmp_path / "hostfile").write_text(text)
    return ["--hostfile", str(tmp_path / "hostfile"), "--master-addr", text.split()[0]]


@pytest.mark.parametrize("launcher", RUNNERS)
def test_every_runner_is_given_a_script_it_can_run(tiny_tokens, tmp_path, deepspeed_started, launcher):
    """Every runner starts `python -u RANK_ENTRY ARGS` (pdsh through the per-node launcher launcher/node_launch.py,
    DeepSpeed's with the project's signal handling): no `--module`,
    which SlurmRunner dropped (srun then ran `python -u launcher.train`, a file that does not exist)."""
    args = parse_args(
        [*_hostfile(tmp_path), "--launcher", launcher, "--run-dir", str(tmp_path / "run")]
        + _sets(tiny_tokens)
    )
    started, _ = deepspeed_started(args)
    assert {"pdsh": "pdsh", "slurm": "srun"}.get(launcher, "mpirun") == started[0], started
    assert "--module" not in started and "-m" not in started[started.index(str(RANK_ENTRY)) - 2 :], started
    at = started.index(str(RANK_ENTRY))
    if launcher == "pdsh":
        assert "launcher.node_launch" in started[:at] and "--no_local_rank" in started[:at]
    elif launcher == "mpich":  # DeepSpeed's helper sets RANK and runs the script
        assert started[at - 2 : at] == ["--launcher", "mpich"] and started[at - 3].endswith(
            "launcher_helper.py"
        )
    else:
        assert started[at - 2 : at] == [sys.executable, "-u"], started
    user = started[at + 1 :]
    assert user[:2] == ["--run-dir", str(tmp_path / "run")] or user[:2] == [
        "--run-dir",
        f"'{tmp_path / 'run'}'",
    ], user
    if (
        launcher != "pdsh"
    ):  # MPI and srun ranks are told the rendezvous (no RANK/MASTER_* from these launchers)
        assert "--master-addr" in user and "--master-port" in user


def test_the_rank_entry_runs_the_trainer():
    """`python -u launcher/_rank_entry.py --help`, as a runner starts it from any directory: the trainer's CLI."""
    proc = subprocess.run(
        [sys.executable, "-u", str(RANK_ENTRY), "--help"],
        cwd="/",
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "--run-dir" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.parametrize("launcher", ["slurm", "openmpi", "pdsh"])
def test_one_host_honours_launcher(tiny_tokens, tmp_path, deepspeed_started, launcher):
    """A one-host hostfile with --launcher goes through that launcher (--force_multi); without --launcher its ranks
    start on this machine, as DeepSpeed has it, with the local ranks' settings."""
    hosts = _hostfile(tmp_path, "node5 slots=2\n")
    args = parse_args([*hosts, "--launcher", launcher, "--run-dir", str(tmp_path / "a")] + _sets(tiny_tokens))
    started, _ = deepspeed_started(args)
    assert started[0] == {"slurm": "srun", "openmpi": "mpirun", "pdsh": "pdsh"}[launcher], started
    local = parse_args([*hosts, "--run-dir", str(tmp_path / "b")] + _sets(tiny_tokens))
    started, _ = deepspeed_started(local)
    assert "launcher.node_launch" in started and "pdsh" not in started, started
    if not __import__("torch").cuda.is_available():
        assert prepare_run(local)[2]["DS_ACCELERATOR"] == "cpu"


def test_pdsh_ranks_get_the_local_ranks_settings(tiny_tokens, tmp_path, deepspeed_started, monkeypatch):
    """Over pdsh, OMP_NUM_THREADS and the user's thread/accelerator settings reach every rank (written to the run
    directory's .deepspeed_env, read by DeepSpeed's runner); a user's own .deepspeed_env entries are kept and win,
    and the user's file is left as it was."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".deepspeed_env").write_text("NCCL_SOCKET_IFNAME=ib0\n\nOMP_NUM_THREADS=7\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("DS_ENV_FILE", raising=False)
    args = parse_args([*_hostfile(tmp_path), "--run-dir", str(tmp_path / "run")] + _sets(tiny_tokens))
    started, run_dir = deepspeed_started(args)
    exports = started[started.index("launcher.node_launch") - 5]
    for piece in (
        "export NCCL_SOCKET_IFNAME=ib0;",
        "export OMP_NUM_THREADS=7;",
        "export TOKENIZERS_PARALLELISM=false;",
    ):
        assert piece in exports, exports
    assert (home / ".deepspeed_env").read_text() == "NCCL_SOCKET_IFNAME=ib0\n\nOMP_NUM_THREADS=7\n"
    assert "DS_ENV_FILE=" in (run_dir / "command.sh").read_text()
    # without the user's file: launch's own thread count, the one local ranks get
    (home / ".deepspeed_env").unlink()
    started, _ = deepspeed_started(args)
    exports = started[started.index("launcher.node_launch") - 5]
    if not __import__("torch").cuda.is_available():
        assert f"export OMP_NUM_THREADS={max(1, (os.cpu_count() or 1) // 2)};" in exports, exports


def test_pdsh_kill_command_names_the_per_node_launcher_launch_starts(tiny_tokens, tmp_path):
    """On SIGINT/SIGTERM DeepSpeed's pdsh runner runs `pdsh -w HOSTS 'pkill -f ' PATTERN` on every host, PATTERN the
    start of the per-node launcher's command. launch starts its own per-node launcher (launcher/node_launch.py), so
    the pattern must name it: DeepSpeed's named `deepspeed.launcher.launc`, matched nothing, and the ranks on the
    hosts kept training after the launch had ended (found over real pdsh and sshd: tests/e2e/test_pdsh.py)."""
    from deepspeed.launcher import runner
    from deepspeed.launcher.multinode_runner import PDSHRunner

    args = parse_args([*_hostfile(tmp_path), "--run-dir", str(tmp_path / "run")] + _sets(tiny_tokens))
    ds_args = runner.parse_args(build_command(args, tmp_path / "run", 29500)[3:])
    node_cmd, kill_cmd, _ = PDSHRunner(ds_args, "WORLD").get_cmd({}, {"node0": [0, 1], "node1": [0, 1]})
    recorded: list[list[str]] = []
    inner = SimpleNamespace(Popen=lambda cmd, *a, **k: recorded.append(cmd))
    for cmd in (node_cmd, kill_cmd):  # what launch's in-process runner starts (`run_runner`)
        _RecordingSubprocess([], inner).Popen(cmd)
    started, kill = recorded
    # the process on each host: the words after `cd DIR;` of pdsh's remote command, as `pkill -f` sees them
    process = " ".join(started[started.index(sys.executable) :])
    assert " -m launcher.node_launch --world_info=" in process, process

    def pattern(cmd: list[str]) -> str:  # pdsh joins its words; the host's shell splits them again
        words = shlex.split(" ".join(cmd[[w.strip() for w in cmd].index("pkill -f") :]))
        assert words[:2] == ["pkill", "-f"] and len(words) == 3, words
        return words[2]

    assert re.search(pattern(kill), process), (pattern(kill), process)
    assert not re.search(pattern(kill_cmd), process)  # DeepSpeed's own: its launcher, which does not run
    # pdsh -w HOSTS as DeepSpeed wrote it
    assert kill[: kill.index("pkill -f ")] == kill_cmd[: kill_cmd.index("pkill -f ")]


def _fake_ssh(tmp_path: Path, monkeypatch, status: int) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "ssh.log"
    (bin_dir / "ssh").write_text(
        f'#!/bin/sh\necho "$@" >> {log}\necho "Permission denied (publickey)." >&2\nexit {status}\n'
    )
    (bin_dir / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return log


def test_the_ssh_check_says_how_to_skip_it(tiny_tokens, tmp_path, monkeypatch, capsys):
    """launch checks passwordless ssh to the first host itself (DeepSpeed's check, told to skip: --no_ssh_check) and
    its error names --no-ssh-check; --no-ssh-check and --launcher slurm skip it; nothing starts on failure."""
    log = _fake_ssh(tmp_path, monkeypatch, 255)
    base = _hostfile(tmp_path)
    problem = ssh_check_problem(parse_args([*base, "--launcher", "openmpi"]))
    assert problem and "node0" in problem and "--no-ssh-check" in problem and "Permission denied" in problem
    assert "-o BatchMode=yes" in log.read_text()
    assert ssh_check_problem(parse_args([*base, "--launcher", "openmpi", "--no-ssh-check"])) is None
    assert ssh_check_problem(parse_args([*base, "--launcher", "slurm"])) is None
    assert ssh_check_problem(parse_args(["--nproc", "2"])) is None
    args = parse_args(
        [*base, "--launcher", "openmpi", "--run-dir", str(tmp_path / "run"), *_sets(tiny_tokens)]
    )
    assert "--no_ssh_check" in build_command(args, tmp_path / "run", 29500)
    assert (
        main([*base, "--launcher", "openmpi", "--run-dir", str(tmp_path / "run"), *_sets(tiny_tokens)]) == 2
    )
    assert "--no-ssh-check to skip" in capsys.readouterr().err
    _fake_ssh(tmp_path, monkeypatch, 0)
    assert ssh_check_problem(parse_args([*base, "--launcher", "openmpi"])) is None


def test_mpi_runners_refuse_slot_selection_before_anything_starts(tiny_tokens, tmp_path):
    args = parse_args(
        [*_hostfile(tmp_path), "--launcher", "openmpi", "--nproc", "1"]
        + ["--run-dir", str(tmp_path / "run"), *_sets(tiny_tokens)]
    )
    with pytest.raises(ConfigError, match="--launcher openmpi starts every slot.*drop --nproc"):
        prepare_run(args)
    with pytest.raises(ConfigError, match="--no-ssh-check select among the hosts of a --hostfile"):
        prepare_run(parse_args(["--no-ssh-check", "--run-dir", str(tmp_path / "x"), *_sets(tiny_tokens)]))
