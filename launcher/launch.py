"""Run a config through the `deepspeed` launcher: N local processes (CPU/gloo or local GPUs) or a cluster.

    python -m launcher.launch --config configs/demo/demix.yaml --nproc 4            # local, 4 ranks
    python -m launcher.launch --config configs/gpt3-small-demix.yaml \\
        --hostfile hosts --master-addr node0                                         # every slot of every host (pdsh)
    python -m launcher.launch ... --hostfile hosts --no-ssh --node-rank K \\
        --master-addr node0 --master-port 29500                                      # on each node K (SLURM: srun)
    python -m launcher.launch ... --dry-run                                          # validate, write, print

DeepSpeed's multi-node options pass through (--include/--exclude, --num-nodes, --launcher, --launcher-args,
--ssh-port, --no-ssh with --node-rank, --master-addr/--master-port, --no-ssh-check), and the world size is computed with
DeepSpeed's own resource functions, so the plan is made for exactly the ranks the runner starts. Before
anything starts it validates the whole run for that world size (config, data, layout, resume), then writes
into the run directory: the resolved config (`config.yaml`), the generated DeepSpeed config
(`deepspeed_config.json`, which rank 0 replaces with the one DeepSpeed gets: bucket sizes need the model) and
the exact command (`command.sh`; with --no-ssh, node K > 0 writes only its own
`command.node<K>.sh`). DeepSpeed's runner then runs in this process (`run_runner`): the command that
`command.sh` records, without a second interpreter importing torch and DeepSpeed.

Every host name (hostfile lines, --include/--exclude, --master-addr) must be an RFC 1123 name or an IP address
(data/argtypes.py `check_host`) and every port and count in range, checked before anything runs: DeepSpeed's runner
pastes host names into ssh, pdsh, mpirun and srun command lines. With pdsh on several hosts the trainer's arguments
pass through a remote shell, so they are quoted for it (`pdsh_word`). What each launcher needs (ssh, the one-host
hostfile, the pdsh ranks' `.deepspeed_env`): docs/cluster.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from data.argtypes import check_host, host, host_filter, nonneg_int, positive_int
from data.argtypes import port as tcp_port
from data.atomic import write_json_atomic, write_text_atomic
from data.cli import cli_main, exit_process, usage_error
from data.readers import InputFileError, read_text
from launcher.checkpoint import CheckpointError
from launcher.config import ConfigError, RunConfig, load_run_config
from launcher.distributed import free_port
from launcher.plan import make_plan
from launcher.preemption import ABORTED_EXIT, PREEMPTED_EXIT, RESUME_ENV, drop_resume, signal_name
from launcher.rundir import (
    LAUNCHER_ENV,
    check_run_dir,
    interrupted_line,
    mark_run_dir,
    out_dir_override,
    use_extensions_dir,
)
from launcher.state import check_resumable, layout_changes
from launcher.state_discovery import latest_checkpoint
from launcher.typed import to_dict
from parallel.ds_config import deepspeed_config

REPO_ROOT = Path(__file__).resolve().parents[1]
# What DeepSpeed's runner starts on every rank: a script path, which every runner can run (see its docstring).
RANK_ENTRY = REPO_ROOT / "launcher" / "_rank_entry.py"


def hostfile_slots(path: Path) -> list[tuple[str, int]]:
    """(host, slots) per line of a DeepSpeed hostfile (`host slots=N`), refusing every bad line at once: another
    form, a host name that is not one (data/argtypes.py `check_host`: DeepSpeed pastes it into ssh, pdsh, mpirun
    and srun command lines), a host listed twice (DeepSpeed would refuse it only after planning), slots that are
    not a positive integer."""
    if not path.is_file():
        raise ConfigError([f"hostfile {path} not found"], "launch")
    try:
        text = read_text(path, "hostfile")
    except InputFileError as e:
        raise ConfigError([str(e)], "launch") from None
    out, problems, first = [], [], {}
    for i, line in enumerate(text.splitlines(), 1):
        line = line.split("#")[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].startswith("slots="):
            problems.append(f"{path}:{i}: expected 'HOST slots=N', got {line!r}")
            continue
        name, count = parts[0], parts[1][len("slots=") :]
        bad = []
        try:
            check_host(name, f"{path}:{i}: host")
        except ValueError as e:
            bad.append(str(e))
        if not (count.isascii() and count.isdigit() and int(count) >= 1):
            bad.append(
                f"{path}:{i}: slots={count!r} must be a positive integer (the processes to start on {name})"
            )
        if name in first:
            bad.append(
                f"{path}:{i}: host {name!r} is listed again (first on line {first[name]}): list each host once, "
                "with all its slots"
            )
        first.setdefault(name, i)
        problems += bad
        if not bad:
            out.append((name, int(count)))
    if problems or not out:
        raise ConfigError(problems or [f"{path}: no hosts"], "launch")
    return out


def pdsh_word(arg: str) -> str:
    """`arg` written so that the remote shell pdsh runs it in gives back exactly `arg`. DeepSpeed's PDSHRunner pastes
    the trainer's arguments into one shell command per node, wrapping only words with a space in double quotes (and
    escaping `"`): a `$`, backtick or `;` of a path or `--set` value would be expanded or run there. Words without a
    space are single-quoted here; words with one (DeepSpeed double-quotes those) get `\\`, `$` and backtick escaped."""
    if " " not in arg:
        return shlex.quote(arg)
    return arg.replace("\\", "\\\\").replace("$", "\\$").replace("`", "\\`")


LAUNCHERS: tuple[str, ...] = ("pdsh", "openmpi", "mvapich", "mpich", "impi", "slurm")
# DeepSpeed's MPI runners start every slot of the hostfile: they refuse --include/--exclude/--num_nodes/--num_gpus.
MPI_LAUNCHERS: tuple[str, ...] = ("openmpi", "mvapich", "mpich", "impi")


def node_resources(args: argparse.Namespace) -> dict[str, list[int]]:
    """host -> the slots DeepSpeed's runner will start processes on, computed with the runner's own functions
    (`parse_inclusion_exclusion`, `apply_num_nodes_and_gpus`), so the plan's world size is what it launches.
    Without a hostfile: one host, `--nproc` slots."""
    if not args.hostfile:
        return {"localhost": list(range(args.nproc or 1))}
    from deepspeed.launcher.runner import apply_num_nodes_and_gpus, parse_inclusion_exclusion

    pool = dict(hostfile_slots(Path(args.hostfile)))
    problems = []
    if (args.include or args.exclude) and (args.num_nodes or args.nproc):
        problems.append(
            "--include/--exclude cannot be combined with --num-nodes/--nproc (DeepSpeed's rule): choose "
            "the slots with one or the other"
        )
    if args.include and args.exclude:
        problems.append("--include and --exclude are mutually exclusive")
    if problems:
        raise ConfigError(problems, "launch")
    try:
        active = parse_inclusion_exclusion(pool, args.include or "", args.exclude or "")
    except ValueError as e:
        raise ConfigError([f"--include/--exclude against {args.hostfile}: {e}"], "launch") from None
    return dict(apply_num_nodes_and_gpus(active, args.num_nodes or -1, args.nproc or -1))


def world_size(args: argparse.Namespace) -> int:
    """The number of ranks DeepSpeed's runner will start (see `node_resources`)."""
    return sum(len(slots) for slots in node_resources(args).values())


def _given(*options: tuple[str, object]) -> list[str]:
    """The flags of `(flag, value)` pairs the user set (a truthy value)."""
    return [flag for flag, value in options if value]


def launch_problems(args: argparse.Namespace) -> list[str]:
    """Multi-node options that cannot work together, each with the fix."""
    out = []
    if args.no_ssh:
        if not args.hostfile:
            out.append("--no-ssh starts one node of a multi-node run: give the --hostfile listing every node")
        if args.node_rank is None:
            out.append(
                "--no-ssh needs --node-rank (this node's index in the hostfile, 0 = the master's node)"
            )
        if not args.master_addr:
            out.append(
                "--no-ssh needs --master-addr (the address of node 0) and the same --master-port on every node"
            )
        if not args.master_port:
            out.append("--no-ssh needs --master-port: every node must rendezvous on the same port")
    elif args.node_rank is not None:
        out.append("--node-rank is only used with --no-ssh (with ssh, DeepSpeed starts every node itself)")
    if args.launcher in MPI_LAUNCHERS and not args.no_ssh:
        given = _given(
            ("--include", args.include),
            ("--exclude", args.exclude),
            ("--num-nodes", args.num_nodes),
            ("--nproc", args.nproc),
        )
        if given:
            out.append(
                f"--launcher {args.launcher} starts every slot of every host in the hostfile (DeepSpeed's rule): "
                f"drop {', '.join(given)}, or write a hostfile with only the hosts and slots to use"
            )
    if not args.hostfile:
        given = _given(
            ("--include", args.include),
            ("--exclude", args.exclude),
            ("--num-nodes", args.num_nodes),
            ("--launcher", args.launcher),
            ("--ssh-port", args.ssh_port),
            ("--no-ssh-check", args.no_ssh_check),
        )
        if given:
            out.append(
                f"{', '.join(given)} select among the hosts of a --hostfile: give one (a local run uses --nproc)"
            )
    return out  # the numbers' and hosts' own ranges are the argparse types' (data/argtypes.py)


def remote_launch(args: argparse.Namespace) -> bool:
    """Whether DeepSpeed's runner hands the ranks to a multi-node backend (pdsh, mpirun, srun) instead of starting
    them on this machine: a hostfile without --no-ssh, with several active hosts or an explicit --launcher. DeepSpeed
    starts a one-host hostfile's ranks on this machine whatever --launcher says; an explicit --launcher is honoured
    (`build_command` passes --force_multi), a one-host hostfile without one stays local, as DeepSpeed has it."""
    if not args.hostfile or args.no_ssh:
        return False
    return bool(args.launcher) or len(node_resources(args)) > 1


def build_command(args: argparse.Namespace, run_dir: Path, port: int) -> list[str]:
    """The deepspeed launcher command line, with every multi-node option passed through. The ranks run the script
    RANK_ENTRY (`python -m launcher.train`; it reads LOCAL_RANK from the env), never `--module launcher.train`,
    which SlurmRunner drops. Launch makes the ssh check itself (`ssh_check_problem`), so DeepSpeed's is skipped."""
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--no_local_rank", "--master_port", str(port)]
    if args.hostfile:
        cmd += ["--hostfile", args.hostfile]
        for flag, value in (
            ("--num_nodes", args.num_nodes),
            ("--num_gpus", args.nproc),
            ("--include", args.include),
            ("--exclude", args.exclude),
            ("--ssh_port", args.ssh_port),
            ("--launcher", args.launcher),
            ("--launcher_args", args.launcher_args),
        ):
            if value:  # FLAG=VALUE: a value that starts with "-" (--launcher_args=--exclusive) stays a value
                cmd += [f"{flag}={value}"]
        if args.no_ssh:
            cmd += ["--no_ssh", "--node_rank", str(args.node_rank)]
        else:
            cmd += ["--no_ssh_check"]
        if remote_launch(args) and len(node_resources(args)) == 1:
            cmd += ["--force_multi"]
    else:
        cmd += ["--num_gpus", str(args.nproc or 1)]
    rendezvous = []
    if args.hostfile and args.launcher not in (None, "pdsh"):
        # MPI runners and srun start the ranks themselves: no RANK/MASTER_ADDR/MASTER_PORT reach them (DeepSpeed
        # expects mpi4py to discover them), so the trainer is told the rendezvous and reads its rank from the
        # launcher's variables (launcher/distributed.py: scheduler_env). Default master: the first active host.
        args.master_addr = args.master_addr or next(iter(node_resources(args)))
        rendezvous = ["--master-addr", args.master_addr, "--master-port", str(port)]
    if args.master_addr:
        cmd += ["--master_addr", args.master_addr]
    user = ["--run-dir", str(run_dir), "--resume", args.resume, *rendezvous]
    if args.config:
        user += ["--config", str(args.config)]
    for o in args.overrides:
        user += ["--set", o]
    if remote_launch(args) and args.launcher in (None, "pdsh"):
        user = [pdsh_word(a) for a in user]  # DeepSpeed's pdsh runner hands them to a shell on every node
    return cmd + [str(RANK_ENTRY), *user]


def ssh_check_problem(args: argparse.Namespace, timeout_s: float = 30.0) -> str | None:
    """DeepSpeed's check that the first host answers passwordless ssh, made here so that its failure says how to skip
    it; None when it passes or does not apply: a local or --no-ssh launch, --no-ssh-check, `--launcher slurm` (srun
    reaches the nodes through slurmd, never ssh)."""
    if not remote_launch(args) or args.no_ssh_check or args.launcher == "slurm":
        return None
    first = next(iter(node_resources(args)))
    cmd = ["ssh", "-o", "PasswordAuthentication=no", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
    cmd += [*(["-p", str(args.ssh_port)] if args.ssh_port else []), first, "hostname"]
    try:
        proc = subprocess.run(
            cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s
        )
        if proc.returncode == 0:
            return None
        why = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    except FileNotFoundError:
        why = "no ssh client on this machine"
    except subprocess.TimeoutExpired:
        why = f"no answer in {timeout_s:.0f} s"
    launcher = args.launcher or "pdsh"
    return (
        f"host {first} (the first of {args.hostfile}) does not answer passwordless ssh ({shlex.join(cmd)}: {why}). "
        f"--launcher {launcher} starts the ranks over ssh: set up keys for it, or give --no-ssh-check to skip this "
        "check when the launcher reaches the hosts another way (mpirun inside a scheduler's allocation, an rsh agent "
        "of its own in --launcher-args); --launcher slurm needs no ssh, --no-ssh starts one node without it"
    )


# Settings the ranks of a pdsh launch get from `launch` (DeepSpeed's runner exports only PYTHON*, MV2*, UCX*, MLFLOW*
# and the accelerator's own variables): each as the user set it for `launch`.
REMOTE_SETTINGS: tuple[str, ...] = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "DS_ACCELERATOR",
    "TORCH_EXTENSIONS_DIR",
    "TOKENIZERS_PARALLELISM",
)


def remote_rank_settings(nproc_per_node: int) -> dict[str, str]:
    """The settings of REMOTE_SETTINGS this process's environment has, and OMP_NUM_THREADS as `launch_env` gives local
    ranks when it has none and this machine has no CUDA (its cores over the ranks per node: nodes like this one).
    Machine-specific defaults stay each node's own: DS_ACCELERATOR (a rank takes the CPU where it has no CUDA) and
    TORCH_EXTENSIONS_DIR (the trainer's default on its node)."""
    out = {k: os.environ[k] for k in REMOTE_SETTINGS if k in os.environ}
    if not torch.cuda.is_available():
        out.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, nproc_per_node))))
    return out


def read_env_file(path: Path) -> list[tuple[str, str]]:
    """(KEY, VALUE) of each `KEY=VALUE` line of a DeepSpeed environment file (`.deepspeed_env`), as DeepSpeed's runner
    reads it (split at the first `=`); blank lines and lines without `=` (which DeepSpeed would crash on) skipped."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if "=" in line and line.split("=", 1)[0].strip():
            key, value = line.split("=", 1)
            out.append((key.strip(), value.strip()))
    return out


def user_env_files() -> list[Path]:
    """The user's DeepSpeed environment files (name: $DS_ENV_FILE, default `.deepspeed_env`) that exist: in the home
    directory and the repository root (where DeepSpeed's runner looks: it runs in the repository root) and in the
    directory `launch` runs from."""
    name = os.environ.get("DS_ENV_FILE", ".deepspeed_env")
    found: list[Path] = []
    for where in (Path.home(), REPO_ROOT, Path.cwd()):
        path = (where / name).resolve()
        if path.is_file() and path not in found:
            found.append(path)
    return found


def write_rank_env_file(run_dir: Path, settings: dict[str, str]) -> tuple[Path, str]:
    """Write `run_dir/.deepspeed_env`: `settings`, then every entry of the user's own files (`user_env_files`, which
    win over `settings` and are never modified). Returns its path and a note saying what the ranks get."""
    merged = dict(settings)
    sources = user_env_files()
    for source in sources:
        merged.update(read_env_file(source))
    path = run_dir / ".deepspeed_env"
    write_text_atomic(path, "".join(f"{k}={v}\n" for k, v in merged.items()))
    shown = ", ".join(f"{k}={v}" for k, v in merged.items()) or "nothing"
    users = f", with the entries of {', '.join(map(str, sources))}, which win" if sources else ""
    return path, f"the ranks on the other hosts get {shown} through {path} (DeepSpeed's DS_ENV_FILE{users})"


@contextlib.contextmanager
def deepspeed_env_file(env: dict[str, str]) -> Iterator[None]:
    """Make the in-process DeepSpeed runner read env["DS_ENV_FILE"] when set: the runner module reads $DS_ENV_FILE
    once, at import, and this process imported it before (`node_resources`)."""
    if "DS_ENV_FILE" not in env:
        yield
        return
    from deepspeed.launcher import runner

    saved = runner.DEEPSPEED_ENVIRONMENT_NAME
    runner.DEEPSPEED_ENVIRONMENT_NAME = env["DS_ENV_FILE"]  # absolute: os.path.join keeps it as is
    try:
        yield
    finally:
        runner.DEEPSPEED_ENVIRONMENT_NAME = saved


def launch_env(nproc_per_node: int, ranks_run_here: bool = True) -> dict[str, str]:
    """Environment for the ranks: CPU runs get gloo-friendly settings (one thread per rank), and TORCH_EXTENSIONS_DIR
    the virtualenv's cache unless set (launcher/rundir.py `use_extensions_dir`). Only for ranks that run on this
    machine: srun (`--launcher slurm`, `--export=ALL`) and mpirun carry this environment to the other nodes, and a
    login node without a GPU would otherwise send DS_ACCELERATOR=cpu to every GPU rank (each rank's own start-up
    picks the CPU accelerator where it has no CUDA; its trainer defaults TORCH_EXTENSIONS_DIR on its own node)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env[LAUNCHER_ENV] = "1"
    if ranks_run_here:
        use_extensions_dir(env)
    if ranks_run_here and not torch.cuda.is_available():
        env["DS_ACCELERATOR"] = "cpu"
        cores = os.cpu_count() or 1
        env.setdefault("OMP_NUM_THREADS", str(max(1, cores // max(1, nproc_per_node))))
    return env


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="run YAML")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--nproc",
        type=positive_int,
        default=None,
        help="processes per node (local: the world size, default 1; with a hostfile: default its slots)",
    )
    p.add_argument("--hostfile", help="DeepSpeed hostfile for multi-node runs ('HOST slots=N' per line)")
    p.add_argument("--num-nodes", type=positive_int, default=0, help="use the first N hosts of the hostfile")
    p.add_argument(
        "--include", type=host_filter, help="DeepSpeed's -i: hosts/slots to use, e.g. 'node0@node1:0,2'"
    )
    p.add_argument(
        "--exclude", type=host_filter, help="DeepSpeed's -e: hosts/slots to leave out, e.g. 'node1:0'"
    )
    p.add_argument("--launcher", choices=LAUNCHERS, help="DeepSpeed's multi-node backend (default pdsh)")
    p.add_argument(
        "--launcher-args",
        help="extra arguments for that backend, one quoted string (one option alone: --launcher-args=--exclusive)",
    )
    p.add_argument("--ssh-port", type=tcp_port, help="ssh port of the other nodes")
    p.add_argument(
        "--no-ssh-check",
        action="store_true",
        help="skip the check that the first host answers passwordless ssh (DeepSpeed's --no_ssh_check): for an "
        "mpirun that reaches the hosts another way; --launcher slurm is never checked",
    )
    p.add_argument(
        "--no-ssh",
        action="store_true",
        help="start only this node's ranks (run the same command on every node with its --node-rank)",
    )
    p.add_argument("--node-rank", type=nonneg_int, help="with --no-ssh: this node's index in the hostfile")
    p.add_argument(
        "--master-addr", type=host, help="address of node 0 (DeepSpeed asks node 0 over ssh otherwise)"
    )
    p.add_argument("--run-dir", help="output directory (default: logging.out_dir)")
    p.add_argument("--resume", default="auto", help="auto, never, or a checkpoint directory")
    p.add_argument(
        "--master-port",
        "--port",
        dest="master_port",
        type=tcp_port,
        default=0,
        help="rendezvous port (default: a free one; with --no-ssh: required, the same on every node)",
    )
    p.add_argument("--dry-run", action="store_true", help="validate and write the run files, start nothing")
    return p.parse_args(argv)


PATH_FIELDS: tuple[tuple[str, str], ...] = (("data", "path"), ("train", "init_from"), ("logging", "out_dir"))


def resolve_paths(args: argparse.Namespace, cfg: RunConfig) -> RunConfig:
    """Every user path made absolute once, here, against the directory the user launched from: the ranks run
    in the repository root, so a relative --config, --hostfile, --run-dir, --resume or a relative data.path /
    train.init_from / logging.out_dir would otherwise mean another file to them than to this planner. The
    config's path fields are passed on as extra `--set` overrides (JSON-quoted, read as YAML strings); with
    --run-dir, `logging.out_dir` becomes it, so the saved config.yaml records where the run actually is."""
    for name in ("config", "hostfile", "run_dir"):
        if getattr(args, name):
            setattr(args, name, os.path.abspath(getattr(args, name)))
    if args.resume not in ("auto", "never"):
        args.resume = os.path.abspath(args.resume)
    extra = out_dir_override(args.run_dir)
    for section, key in PATH_FIELDS:
        value = getattr(getattr(cfg, section), key)
        if (
            value
            and not Path(value).is_absolute()
            and not (extra and (section, key) == ("logging", "out_dir"))
        ):
            extra.append(f"{section}.{key}={json.dumps(os.path.abspath(value))}")
    if not extra:
        return cfg
    args.overrides = [*args.overrides, *extra]
    return load_run_config(args.config, args.overrides, check=False)


def prepare_run(args: argparse.Namespace) -> tuple[Path, list[str], dict[str, str]]:
    """Validate for the final world size and write config, DeepSpeed JSON and command; raise on problems.
    With --no-ssh only node 0 writes the shared run files; node k writes its own `command.node<k>.sh`."""
    problems = launch_problems(args)
    if problems:
        raise ConfigError(problems, "launch")
    cfg = load_run_config(args.config, args.overrides, check=False)
    cfg = resolve_paths(args, cfg)
    check_run_dir(Path(os.path.abspath(args.run_dir or cfg.logging.out_dir)), inputs=[Path(cfg.data.path)])
    resources = node_resources(args)
    world = sum(len(slots) for slots in resources.values())
    if args.no_ssh and not 0 <= args.node_rank < len(resources):
        raise ConfigError(
            [
                f"--node-rank {args.node_rank} is not a node of this launch: the hostfile (after "
                f"--include/--exclude/--num-nodes) has {len(resources)}: {', '.join(resources)}"
            ],
            "launch",
        )
    # This machine trains when the launch is local or it is one of the --no-ssh nodes; a hostfile's other nodes
    # check their own device when their ranks plan.
    plan = make_plan(cfg, world, check_local_device=not args.hostfile or args.no_ssh)
    for note in plan.notes:
        print(f"note: {note}", file=sys.stderr)
    run_dir = Path(os.path.abspath(args.run_dir or plan.cfg.logging.out_dir))
    ckpt = (
        latest_checkpoint(run_dir)
        if args.resume == "auto"
        else None
        if args.resume == "never"
        else Path(args.resume)
    )
    if ckpt is not None:
        check_resumable(ckpt, plan)
        for note in layout_changes(ckpt, plan):
            print(f"note: {note}", file=sys.stderr)
    port = args.master_port or free_port()
    cmd = build_command(args, run_dir, port)
    per_node = max(len(slots) for slots in resources.values())
    env = launch_env(per_node, ranks_run_here=not remote_launch(args))
    run_dir.mkdir(parents=True, exist_ok=True)
    mark_run_dir(run_dir)
    if remote_launch(args) and args.launcher in (None, "pdsh"):
        env_file, note = write_rank_env_file(run_dir, remote_rank_settings(per_node))
        env["DS_ENV_FILE"] = str(env_file)
        print(f"note: {note}", file=sys.stderr)
    shown = ("PYTHONPATH", "DS_ACCELERATOR", "OMP_NUM_THREADS", "DS_ENV_FILE")
    shown_env = {k: env[k] for k in shown if k in env}
    line = " ".join(f"{k}={shlex.quote(v)}" for k, v in shown_env.items()) + " " + shlex.join(cmd)
    script = (
        f"#!/usr/bin/env bash\n# world size {world}; written by launcher.launch\n"
        f"cd {shlex.quote(str(REPO_ROOT))}\n{line}\n"
    )
    if args.no_ssh and args.node_rank != 0:
        write_text_atomic(run_dir / f"command.node{args.node_rank}.sh", script)
        return run_dir, cmd, env
    write_text_atomic(run_dir / "config.yaml", yaml.safe_dump(to_dict(plan.cfg), sort_keys=False))
    write_json_atomic(
        run_dir / "deepspeed_config.json",
        deepspeed_config(plan.cfg.train, plan.cfg.parallel, plan.cfg.extra_deepspeed),
    )
    write_text_atomic(run_dir / "command.sh", script)
    return run_dir, cmd, env


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run_dir, cmd, env = prepare_run(args)
    except (ConfigError, CheckpointError) as e:
        return usage_error(e)
    print(f"run dir: {run_dir}\ncommand: {shlex.join(cmd)}", file=sys.stderr)
    if args.dry_run:
        return 0
    problem = ssh_check_problem(args)
    if problem:
        return usage_error(problem)
    # what rank 0 names after a preemption (a batch script may set its own: `sbatch ...`)
    env.setdefault(
        RESUME_ENV,
        f"cd {shlex.quote(os.getcwd())} && "
        + shlex.join([sys.executable, "-m", "launcher.launch", *drop_resume(list(argv or sys.argv[1:]))]),
    )
    with deepspeed_env_file(env):
        return run_and_report(cmd, env, run_dir)


class Terminated(BaseException):
    """SIGTERM or SIGUSR1 reached the launcher (raised by its handler while the runner waits)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated(signum)


def become_subreaper() -> bool:
    """Linux: ranks whose per-node launcher dies are re-parented to this process, not to init, so that they can be
    found, stopped and reaped (`stop_leftovers`). False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def run_and_report(cmd: list[str], env: dict[str, str], run_dir: Path, stop_wait_s: float = 40.0) -> int:
    """`run_runner`, and on Ctrl-C, once the ranks have ended (`wait_for_children`), one line saying where the last
    checkpoint of `run_dir` is and how to resume, instead of a traceback; exit status 130. The ranks stay silent
    (LAUNCHER_ENV). A pdsh launch on several hosts is DeepSpeed's runner's to stop (it exits 1): there rank 0 says
    it, pdsh carrying no LAUNCHER_ENV.

    SIGTERM or SIGUSR1 to the launcher (`kill`, docker stop, SLURM) is forwarded to every process it started (the
    per-node launcher and the ranks: they save the step's state, launcher/preemption.py); it waits up to
    `stop_wait_s`, SIGKILLs what is left and exits with the ranks' status (75 when the state was saved), else 143.
    Whatever way the runner ends, no process it started is left running (`stop_leftovers`)."""
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    become_subreaper()
    previous = {sig: signal.signal(sig, _raise_terminated) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    started: list = []
    try:
        try:
            rc = run_runner(cmd, env, started)
        finally:
            for sig in previous:  # a repeated signal must not break the clean-up
                signal.signal(sig, signal.SIG_IGN)
        stop_leftovers(before, "the runner ended", stop_wait_s)
        return rc
    except KeyboardInterrupt:
        wait_for_children(before)
        stop_leftovers(before, "Ctrl-C", stop_wait_s)
        print(interrupted_line(run_dir), file=sys.stderr, flush=True)
        return 130
    except Terminated as t:
        name = signal_name(t.signum)
        forward_signal(before, t.signum)
        node = started[0] if started else None
        rc = None
        if node is not None:  # its status first (psutil's waiting in stop_leftovers would reap it as 0)
            try:
                rc = node.wait(timeout=stop_wait_s)
            except subprocess.TimeoutExpired:
                node.kill()
                rc = node.wait()
        stop_leftovers(before, name, stop_wait_s, forwarded=True)
        if rc == PREEMPTED_EXIT:  # rank 0 has said where the state is and how to resume
            return rc
        print(
            f"terminated ({name}): the ranks ended with status {rc}; "
            + interrupted_line(run_dir).removeprefix("interrupted; "),
            file=sys.stderr,
            flush=True,
        )
        return rc if rc and rc > 0 else ABORTED_EXIT
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def forward_signal(before: set[int], sig: int) -> None:
    """`sig` to every process this one started since `before` (their pids), descendants included."""
    import psutil

    for p in psutil.Process().children(recursive=True):
        if p.pid not in before:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass


def stop_leftovers(before: set[int], why: str, wait_s: float, forwarded: bool = False) -> None:
    """Every process started since `before` still running (after the per-node launcher died, its ranks): SIGTERM
    (they save, launcher/preemption.py) unless `forwarded` already, then SIGKILL after `wait_s`; each named."""
    import psutil

    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    if not left:
        return
    if not forwarded:
        for p in left:
            try:
                rank = p.environ().get("RANK", "?")
                print(f"rank {rank} (pid {p.pid}) still running after {why}: stopping it", file=sys.stderr)
                p.send_signal(signal.SIGTERM)
            except psutil.Error:
                pass
    _, alive = psutil.wait_procs(left, timeout=wait_s)
    for p in alive:
        try:
            print(f"pid {p.pid} did not stop within {wait_s:g} s: SIGKILL", file=sys.stderr)
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


def wait_for_children(before: set[int], grace_s: float = 3.0, timeout_s: float = 45.0) -> None:
    """Wait for the child processes this one started since `before` (their pids) to end: DeepSpeed's per-node
    launcher, which on Ctrl-C stops its ranks (SIGTERM, then SIGKILL after 30 s). One still running after `grace_s`
    got no SIGINT of its own (the signal went to this process only, not to the terminal's process group): it is
    sent one. A second Ctrl-C stops the waiting."""
    import psutil

    try:
        children = [p for p in psutil.Process().children() if p.pid not in before]
        _, alive = psutil.wait_procs(children, timeout=grace_s)
        for p in alive:
            try:
                p.send_signal(signal.SIGINT)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=timeout_s)
    except KeyboardInterrupt:
        pass


DS_NODE_LAUNCHER, NODE_LAUNCHER = "deepspeed.launcher.launch", "launcher.node_launch"


def node_launcher_command(cmd: Sequence[str]) -> list[str]:
    """`cmd`, a command DeepSpeed's runner starts, with launcher/node_launch.py in place of DeepSpeed's per-node
    launcher: the module of `python -u -m deepspeed.launcher.launch` (started here, or by pdsh on every host), and in
    the pattern of the kill command pdsh's runner runs on every host when it gets SIGINT or SIGTERM (`pdsh -w HOSTS
    'pkill -f ' 'PYTHON\\ -u\\ -m\\ deepspeed.launcher.launc'`), which otherwise matched no process: the per-node
    launchers and ranks on the hosts kept running, training, after the launch had ended (seen over real pdsh)."""
    out = [NODE_LAUNCHER if a == DS_NODE_LAUNCHER else a for a in cmd]
    for i, a in enumerate(out[:-1]):
        if a.strip() == "pkill -f":  # DeepSpeed cuts the module's last letter: "deepspeed.launcher.launc"
            out[i + 1] = out[i + 1].replace(DS_NODE_LAUNCHER[:-1], NODE_LAUNCHER[:-1])
    return out


class _RecordingSubprocess:
    """`subprocess` for DeepSpeed's runner module: records the process it starts (its exit status, negative when a
    signal killed it, which the runner does not check) and starts launcher/node_launch.py in place of DeepSpeed's
    per-node launcher (`node_launcher_command`). Everything else, Popen included, goes to `inner` (the module the
    runner had)."""

    def __init__(self, started: list, inner: Any) -> None:
        self.started = started
        self.inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def Popen(self, cmd: list[str], *args: object, **kwargs: object) -> object:  # noqa: N802
        cmd = node_launcher_command(cmd)
        p = self.inner.Popen(cmd, *args, **kwargs)
        self.started.append(p)
        return p


def run_runner(cmd: list[str], env: dict[str, str], started: list | None = None) -> int:
    """Run `cmd` (`python -m deepspeed.launcher.runner ...`, as command.sh records it) in this process, with the
    environment and working directory the subprocess would have had; return its exit status. DeepSpeed's runner
    only parses its arguments, starts the per-node launcher (or pdsh/mpirun/srun) as a subprocess and waits: run in
    this process it saves one interpreter start that imports torch and DeepSpeed (~2.5 s a launch on 2 cores).
    The per-node launcher is launcher/node_launch.py (DeepSpeed's, stopping all ranks at once and naming a rank a
    signal killed); the process started is appended to `started`; one killed by a signal is named and gives
    128 + the signal (DeepSpeed's runner counts it as success)."""
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    # pdsh's runner sets them
    saved_signals = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    os.environ.clear()
    os.environ.update(env)
    os.chdir(REPO_ROOT)
    sys.stdout.flush()
    sys.stderr.flush()
    started = [] if started is None else started
    try:
        from deepspeed.launcher import runner

        real = runner.subprocess
        runner.subprocess = _RecordingSubprocess(started, real)
        try:
            runner.main(cmd[3:])
        finally:
            runner.subprocess = real
    except SystemExit as e:  # the runner exits with the per-node launcher's status when it failed
        return e.code if isinstance(e.code, int) else 1
    finally:  # a caller in the same process (benchmarks/reproduce.py, tests) keeps its environment and directory
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        for sig, handler in saved_signals.items():
            if signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
    rc = started[0].returncode if started else 0
    if rc is not None and rc < 0:
        print(
            f"DeepSpeed's per-node launcher (pid {started[0].pid}) killed by {signal_name(-rc)}",
            file=sys.stderr,
            flush=True,
        )
        return 128 - rc
    return 0


if __name__ == "__main__":
    exit_process(main())
