"""A training state -> the single-process fp32 model, as a consolidated checkpoint (DeepSpeed's `zero_to_fp32`, for
this project's checkpoints).

    python -m launcher.zero_to_fp32 RUN/checkpoints/step_00000400 --out RUN/fp32-400
    python -m launcher.zero_to_fp32 RUN --out RUN/fp32-latest        # the state `checkpoints/latest` names

A training state (launcher/state.py) keeps every parameter's fp32 master weight whole, by its name in the plain
model (DeepSpeed's universal-checkpoint layout, `zero/<name>/fp32.pt`), so conversion reads those files and the
buffers and writes the consolidated format that evaluation, expert surgery and the Hugging Face export read. No
process group, no GPU, one tensor at a time.

DeepSpeed's own `zero_to_fp32.py` cannot do this for expert models: it rebuilds each ZeRO group by concatenating
its partitions from *every* rank's optimizer file and slicing them with rank 0's parameter shapes, whereas DEMix's
expert groups are partitioned over their domain's ranks only (and each domain's ranks hold other experts).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from data.cli import check_output_dir, cli_main, exit_process, usage_error
from launcher.checkpoint import (
    CheckpointError,
    check_weight_shapes,
    load_consolidated,
    load_weights_only,
    save_consolidated,
)
from launcher.config import RunConfig
from launcher.ffn_kinds import ffn_kind
from launcher.state_discovery import checksum_damage, latest_checkpoint, read_state_meta, state_damage
from launcher.typed import from_dict
from model.gpt import expert_of_key
from parallel.universal import FP32


def resolve_state(path: Path) -> Path:
    """A training-state directory, or a run directory (then the state its `checkpoints/latest` names)."""
    if (path / "meta.json").is_file() and (path / "zero").is_dir():
        return path
    if (path / "checkpoints").is_dir():
        ckpt = latest_checkpoint(path, checksums=True)
        if ckpt is not None:
            return ckpt
    raise CheckpointError(
        f"{path} is neither a training state (meta.json and zero/) nor a run directory with one in "
        "checkpoints/"
    )


def fp32_state_dict(ckpt: Path) -> tuple[dict[str, torch.Tensor], RunConfig, dict]:
    """(the plain model's state dict in fp32 with its buffers, the run config, the state's meta.json)."""
    meta = read_state_meta(ckpt)
    if (why := state_damage(ckpt) or checksum_damage(ckpt)) is not None:
        raise CheckpointError(f"{ckpt} is damaged ({why}); convert another state")
    cfg = from_dict(RunConfig, meta["config"], source=str(ckpt / "meta.json"))
    state: dict[str, torch.Tensor] = {}
    for name in meta["params"]:
        path = ckpt / "zero" / name / f"{FP32}.pt"
        if not path.is_file():
            raise CheckpointError(f"{ckpt} is incomplete: {path.relative_to(ckpt)} is missing")
        state[name] = load_weights_only(path)["param"]
    state.update(load_weights_only(ckpt / "trainer.pt")["buffers"])
    return state, cfg, meta


def convert(src: Path, out: Path) -> Path:
    """Write the consolidated fp32 checkpoint of training state (or run directory) `src` into `out`."""
    ckpt = resolve_state(src)
    state, cfg, meta = fp32_state_dict(ckpt)
    check_weight_shapes(state, cfg, ckpt)  # before reading an init checkpoint or writing anything
    layout = meta["layout"]
    domains = list(layout.get("expert_domains") or layout["domains"])
    present = {expert_of_key(k) for k in state} - {None}
    untrained = sorted(set(range(len(domains))) - present) if ffn_kind(cfg).domain_experts else []
    if untrained:  # DEMix-DAPT trains only the new expert: the others are its init checkpoint's
        if not cfg.train.init_from:
            raise CheckpointError(
                f"{ckpt} has no weights for experts {untrained} and names no train.init_from"
            )
        state.update(load_consolidated(cfg.train.init_from, experts=untrained).state_dict)
    extra = {
        "tokenizer": layout.get("tokenizer"),
        "vocab_size": meta.get("vocab_size"),
        "tokenizer_sha256": layout.get("tokenizer_sha256"),
        "converted_from": str(ckpt),
    }
    return save_consolidated(out, state, cfg, domains, int(meta["step"]), extra=extra)


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("state", type=Path, help="a training state (RUN/checkpoints/step_N) or a run directory")
    p.add_argument("--out", type=Path, required=True, help="where to write the consolidated fp32 checkpoint")
    args = p.parse_args(argv)
    # the output rule: a file or a dangling symbolic link at --out is refused
    check_output_dir(args.out, (), ())
    if args.out.exists():
        return usage_error(f"{args.out} exists; choose a new --out (nothing is overwritten)")
    try:
        out = convert(args.state, args.out)
    except (CheckpointError, OSError, json.JSONDecodeError) as e:
        return usage_error(e)
    print(json.dumps({"out": str(out), "from": str(resolve_state(args.state))}))
    return 0


if __name__ == "__main__":
    exit_process(main())
