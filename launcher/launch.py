"""Run a config through the `deepspeed` launcher: N local processes (CPU/gloo or local GPUs) or a cluster.

    python -m launcher.launch --config configs/demo/demix.yaml --nproc 4            # local, 4 ranks
    python -m launcher.launch --config configs/gpt3-small-demix.yaml \\
        --hostfile hosts --nproc 8 --num-nodes 4                                     # multi-node (pdsh)
    python -m launcher.launch ... --dry-run                                          # validate, write, print

Before anything starts it validates the whole run for the final world size (config, data, layout,
resume), then writes into the run directory: the resolved config (`config.yaml`), the generated
DeepSpeed config (`deepspeed_config.json`) and the exact command (`command.sh`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch
import yaml

from launcher.checkpoint import CheckpointError, write_json_atomic
from launcher.config import ConfigError, load_run_config
from launcher.distributed import free_port
from launcher.plan import make_plan
from launcher.state import check_resumable, latest_checkpoint
from launcher.typed import to_dict
from parallel.engine import deepspeed_config

REPO_ROOT = Path(__file__).resolve().parents[1]


def hostfile_slots(path: Path) -> list[tuple[str, int]]:
    """(host, slots) per line of a DeepSpeed hostfile (`host slots=N`); clear errors for bad lines."""
    if not path.is_file():
        raise ConfigError([f"hostfile {path} not found"], "launch")
    out, problems = [], []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#")[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].startswith("slots=") or not parts[1][6:].isdigit():
            problems.append(f"{path}:{i}: expected 'HOST slots=N', got {line!r}")
            continue
        out.append((parts[0], int(parts[1][6:])))
    if problems or not out:
        raise ConfigError(problems or [f"{path}: no hosts"], "launch")
    return out


def world_size(args: argparse.Namespace) -> int:
    if args.hostfile:
        slots = hostfile_slots(Path(args.hostfile))
        nodes = slots[: args.num_nodes] if args.num_nodes else slots
        return sum(min(n, args.nproc) if args.nproc else n for _, n in nodes)
    return args.nproc


def build_command(args: argparse.Namespace, run_dir: Path, port: int) -> list[str]:
    """The deepspeed launcher command line (module launch; the trainer reads LOCAL_RANK from the env)."""
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--no_local_rank", "--master_port", str(port)]
    if args.hostfile:
        cmd += ["--hostfile", args.hostfile]
        if args.num_nodes:
            cmd += ["--num_nodes", str(args.num_nodes)]
        if args.nproc:
            cmd += ["--num_gpus", str(args.nproc)]
    else:
        cmd += ["--num_gpus", str(args.nproc)]
    cmd += ["--module", "launcher.train", "--run-dir", str(run_dir), "--resume", args.resume]
    if args.config:
        cmd += ["--config", str(args.config)]
    for o in args.overrides:
        cmd += ["--set", o]
    return cmd


def launch_env(nproc_per_node: int) -> dict[str, str]:
    """Environment for the ranks: CPU runs get gloo-friendly settings (one thread per rank)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if not torch.cuda.is_available():
        env["DS_ACCELERATOR"] = "cpu"
        cores = os.cpu_count() or 1
        env.setdefault("OMP_NUM_THREADS", str(max(1, cores // max(1, nproc_per_node))))
    return env


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="run YAML")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--nproc", type=int, default=1, help="processes per node (local: the world size)")
    p.add_argument("--hostfile", help="DeepSpeed hostfile for multi-node runs ('HOST slots=N' per line)")
    p.add_argument("--num-nodes", type=int, default=0, help="use the first N hosts of the hostfile")
    p.add_argument("--run-dir", help="output directory (default: logging.out_dir)")
    p.add_argument("--resume", default="auto", help="auto, never, or a checkpoint directory")
    p.add_argument("--port", type=int, default=0, help="rendezvous port (default: a free one)")
    p.add_argument("--dry-run", action="store_true", help="validate and write the run files, start nothing")
    return p.parse_args(argv)


def prepare_run(args: argparse.Namespace) -> tuple[Path, list[str], dict[str, str]]:
    """Validate for the final world size and write config, DeepSpeed JSON and command; raise on problems."""
    cfg = load_run_config(args.config, args.overrides, check=False)
    world = world_size(args)
    plan = make_plan(cfg, world, check_local_device=not args.hostfile)  # a hostfile's nodes are checked by the ranks
    for note in plan.notes:
        print(f"note: {note}", file=sys.stderr)
    run_dir = Path(args.run_dir or plan.cfg.logging.out_dir)
    if args.resume == "auto":
        ckpt = latest_checkpoint(run_dir)
        if ckpt is not None:
            check_resumable(ckpt, plan)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(plan.cfg), sort_keys=False))
    write_json_atomic(run_dir / "deepspeed_config.json", deepspeed_config(plan.cfg.train, plan.cfg.parallel))
    port = args.port or free_port()
    cmd = build_command(args, run_dir, port)
    env = launch_env(args.nproc)
    shown_env = {k: env[k] for k in ("PYTHONPATH", "DS_ACCELERATOR", "OMP_NUM_THREADS") if k in env}
    line = " ".join(f"{k}={shlex.quote(v)}" for k, v in shown_env.items()) + " " + shlex.join(cmd)
    (run_dir / "command.sh").write_text(f"#!/usr/bin/env bash\n# world size {world}; written by launcher.launch\ncd {shlex.quote(str(REPO_ROOT))}\n{line}\n")
    return run_dir, cmd, env


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        run_dir, cmd, env = prepare_run(args)
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"run dir: {run_dir}\ncommand: {(run_dir / 'command.sh').read_text().splitlines()[-1]}", file=sys.stderr)
    if args.dry_run:
        return 0
    return subprocess.call(cmd, env=env, cwd=REPO_ROOT)


if __name__ == "__main__":
    sys.exit(main())
