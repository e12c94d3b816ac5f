"""Branch-Train-MiX (Sukhbaatar et al. 2024): branch a dense seed model into a DEMix one, upcycle a DEMix
checkpoint's domain experts into a GShard top-2 MoE, then finetune it (the MiX stage) through the same trainer, on
DeepSpeed's MoE layer. The method, the router initialisation and the averaged layers: docs/btx.md.

    python -m launcher.modular.btx branch DENSE --out DIR [--domains a,b,...] [--overwrite]
    python -m launcher.launch --config configs/demo/demix.yaml --nproc N --set train.init_from=DIR ...   # Train
    python -m launcher.modular.btx [upcycle] CKPT --out DIR [--layers every_other|all] [--router-init data|zero]
        [--data TOKENS_ROOT] [--tokenizer TOK] [--blocks 16] [--router-entropy 0.5] [--experts-per-rank K]
        [--world-size N] [--overwrite]
    python -m launcher.launch --config configs/btx/finetune.yaml --nproc 4 --set train.init_from=DIR ...  # MiX
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence

from data.argtypes import open_unit, positive_int
from data.cli import cli_main, usage_error
from launcher.checkpoint import CheckpointError
from launcher.config import ConfigError
from launcher.modular.btx.branching import branch
from launcher.modular.btx.upcycling import LAYERS, ROUTER_INITS, upcycle


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The upcycle command's arguments (`[upcycle] CKPT --out DIR ...`)."""
    p = argparse.ArgumentParser(
        prog="python -m launcher.modular.btx [upcycle]",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", help="a consolidated DEMix checkpoint (RUN_DIR/model)")
    p.add_argument("--out", required=True, help="where to write the GShard checkpoint (must not exist)")
    p.add_argument(
        "--layers",
        choices=tuple(LAYERS),
        default="every_other",
        help="MoE layers: every_other (GShard's moe_every=2, the rest averaged) or all (BTX)",
    )
    p.add_argument(
        "--router-init",
        choices=ROUTER_INITS,
        default="data",
        help="data: rows from each domain's mean FFN input; zero: uniform routing probabilities",
    )
    p.add_argument(
        "--data", help="prepared tokens root for --router-init data (default: the checkpoint's data.path)"
    )
    p.add_argument("--tokenizer", help="tokenizer directory name (default: the checkpoint's)")
    p.add_argument(
        "--blocks", type=positive_int, default=16, help="training blocks per domain for --router-init data"
    )
    p.add_argument(
        "--router-entropy",
        type=open_unit,
        default=0.5,
        help="target mean routing entropy, as a fraction of log E (--router-init data)",
    )
    p.add_argument(
        "--experts-per-rank",
        type=positive_int,
        default=1,
        help="default expert placement written into the config (E / this = expert-parallel ranks)",
    )
    p.add_argument(
        "--world-size", type=positive_int, help="also check that the expert layout fits this many ranks"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint at --out")
    return p.parse_args(argv)


def parse_branch_args(argv: Sequence[str]) -> argparse.Namespace:
    """The branch command's arguments (`branch DENSE --out DIR [--domains a,b]`)."""
    p = argparse.ArgumentParser(
        prog="python -m launcher.modular.btx branch",
        description="Branch a dense checkpoint into a DEMix one whose every expert is a copy "
        "of the dense FFN of its layer (BTX's branch step).",
    )
    p.add_argument(
        "checkpoint", help="a consolidated dense checkpoint (RUN_DIR/model of a model.ffn.kind=dense run)"
    )
    p.add_argument("--out", required=True, help="where to write the DEMix checkpoint (must not exist)")
    p.add_argument(
        "--domains",
        help="comma-separated expert domains, in expert-id order (default: the dense run's training domains)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint at --out")
    return p.parse_args(argv)


def _branch_main(argv: Sequence[str]) -> int:
    args = parse_branch_args(argv)
    domains = None if args.domains is None else [d.strip() for d in args.domains.split(",") if d.strip()]
    try:
        rec = branch(args.checkpoint, args.out, domains, overwrite=args.overwrite)
    except (CheckpointError, ConfigError) as e:
        return usage_error(e)
    print(json.dumps(rec, indent=1))
    sets = " ".join(f"--set {shlex.quote(s)}" for s in rec["demix_sets"])
    print(
        f"train the branches (DEMix): python -m launcher.launch --config configs/demo/demix.yaml --nproc N {sets}",
        file=sys.stderr,
    )
    return 0


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["branch"]:  # a checkpoint folder named `branch` is ./branch
        return _branch_main(argv[1:])
    args = parse_args(argv[1:] if argv[:1] == ["upcycle"] else argv)
    try:
        rec = upcycle(
            args.checkpoint,
            args.out,
            layers=args.layers,
            router_init=args.router_init,
            data=args.data,
            tokenizer=args.tokenizer,
            blocks=args.blocks,
            router_entropy=args.router_entropy,
            experts_per_rank=args.experts_per_rank,
            world_size=args.world_size,
            overwrite=args.overwrite,
        )
    except (CheckpointError, ConfigError) as e:
        return usage_error(e)
    print(json.dumps(rec, indent=1))
    low = {
        l: round(r, 3)
        for l, r in rec["average_coherence"].items()
        if r < (1 + rec["num_experts"] ** -0.5) / 2
    }
    if low:
        print(
            f"note: the experts of averaged layers {low} (||mean|| / mean ||expert||; 1 = equal, "
            f"{rec['num_experts'] ** -0.5:.3f} = unrelated) look independently initialised: their average keeps "
            "little of any of them; --layers all averages nothing, and `branch` gives experts of one seed",
            file=sys.stderr,
        )
    sets = " ".join(f"--set {shlex.quote(s)}" for s in rec["finetune_sets"])
    print(
        f"finetune (MiX): python -m launcher.launch --config configs/btx/finetune.yaml --nproc N "
        f"--set model.ffn.gshard.experts_per_rank=K {sets}   # {rec['num_experts']} / K must divide N",
        file=sys.stderr,
    )
    return 0
