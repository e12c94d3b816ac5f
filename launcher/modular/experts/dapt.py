"""Domain-adaptive training runs through the launcher (DEMix §6.1): DEMix-DAPT trains only the new expert
(`train.trainable=experts` with `data.domains=[new]`) with the original run's recipe and a 10x smaller learning rate;
Dense-DAPT continues training all parameters of the dense model on the new domain for the same budget."""

from __future__ import annotations

import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from launcher.checkpoint import CheckpointError, Consolidated, load_consolidated
from launcher.checkpoint_data import data_source
from launcher.typed import to_dict

REPO_ROOT = Path(__file__).resolve().parents[3]


def dapt_overrides(
    c: Consolidated,
    arch: str,
    init_from: str,
    domain: str,
    steps: int,
    data: str | None = None,
    tokenizer: str | None = None,
    lr: float | None = None,
    lr_scale: float = 0.1,
) -> list[str]:
    """`--set` overrides of a DAPT run on top of the checkpoint's own run config. DEMix-DAPT (§6.1): only the
    experts of the run's domains train (here the new one), lr = lr_scale x the original lr. Dense-DAPT: all
    parameters, natural mixture; the same steps and the same (10x smaller) lr, as the paper adapts both."""
    kind = c.cfg.model.ffn.kind
    if arch != kind:
        raise CheckpointError(f"dapt --arch {arch} needs a {arch} checkpoint, got a {kind!r} one")
    if arch not in ("demix", "dense"):
        raise CheckpointError(f"dapt --arch {arch}: choose demix or dense")
    if arch == "demix" and domain not in c.domains:
        raise CheckpointError(
            f"the checkpoint has no expert for {domain!r}: run `python -m launcher.modular.experts add` first"
        )
    t = c.cfg.train
    new_lr = lr if lr is not None else t.lr * lr_scale
    data, tokenizer = data_source(c, data, tokenizer)
    sets = [
        f"train.init_from={init_from}",
        f"data.domains=[{domain}]",
        f"data.path={data}",
        f"data.tokenizer={tokenizer}",
        f"train.steps={steps}",
        f"train.lr={new_lr}",
        f"train.min_lr={min(t.min_lr, new_lr)}",
        "train.save_interval=0",
        "train.eval_interval=0",
    ]
    if arch == "demix":
        sets += ["data.mixture=by_domain", "train.trainable=experts", "model.ffn.num_experts=0"]
    else:
        sets += ["data.mixture=natural", "train.trainable=all"]
    return sets


def run_dapt(
    ckpt: str | Path,
    arch: str,
    domain: str,
    steps: int,
    run_dir: str | Path,
    nproc: int = 2,
    data: str | None = None,
    tokenizer: str | None = None,
    lr: float | None = None,
    lr_scale: float = 0.1,
    extra_sets: Sequence[str] = (),
    dry_run: bool = False,
    launch_args: Sequence[str] = (),
) -> Path:
    """Launch a DAPT run (`python -m launcher.launch`: `nproc` local ranks, or the hosts that `launch_args` name,
    e.g. `--hostfile H`, which replaces `--nproc`); returns `<run_dir>/model`."""
    c = load_consolidated(ckpt)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    base = run_dir / "base_config.yaml"  # the checkpoint's own run config: the recipe DAPT keeps
    base.write_text(yaml.safe_dump(to_dict(c.cfg), sort_keys=False))
    sets = dapt_overrides(c, arch, str(Path(ckpt).resolve()), domain, steps, data, tokenizer, lr, lr_scale)
    sets += [f"logging.out_dir={run_dir}", *extra_sets]
    ranks = [] if "--hostfile" in launch_args else ["--nproc", str(nproc)]
    argv = ["--config", str(base), *ranks, *launch_args, "--run-dir", str(run_dir), "--resume", "never"] + [
        a for s in sets for a in ("--set", s)
    ]
    print(f"[experts] {arch}-DAPT: python -m launcher.launch {shlex.join(argv)}", file=sys.stderr, flush=True)
    from launcher.launch import parse_args as launch_args
    from launcher.launch import prepare_run

    # validates the whole run, writes config/DeepSpeed JSON/command
    _, cmd, env = prepare_run(launch_args(argv))
    if dry_run:
        return run_dir / "model"
    rc = subprocess.call(cmd, env=env, cwd=REPO_ROOT)
    if rc != 0:
        raise RuntimeError(f"{arch}-DAPT run failed (exit {rc}); see {run_dir}")
    return run_dir / "model"
