"""The `--set` values that start a run from a BTX checkpoint: the MiX finetune from an upcycled one
(`finetune_overrides`), the Train stage (DEMix, each expert on its domain) from a branched one (`demix_overrides`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from launcher.checkpoint import CheckpointError, read_meta
from launcher.ffn_kinds import ffn_kind
from model.config import SHAPE_FIELDS


def finetune_overrides(ckpt: str | Path) -> list[str]:
    """`--set` values that make a run config (e.g. configs/btx/finetune.yaml) start from upcycled checkpoint `ckpt`:
    its model shape, GShard expert count and MoE placement, its data, and `train.init_from`. The expert placement
    (`model.ffn.gshard.experts_per_rank`) is left to the run: it depends on the number of ranks."""
    meta = read_meta(ckpt)
    m = meta["config"]["model"]
    return _start_from_sets(
        ckpt,
        meta,
        [
            f"model.ffn.kind={m['ffn']['kind']}",
            f"model.ffn.num_experts={m['ffn']['num_experts']}",
            f"model.ffn.gshard.moe_every={m['ffn']['gshard']['moe_every']}",
        ],
    )


def demix_overrides(ckpt: str | Path) -> list[str]:
    """`--set` values that make a DEMix run config (e.g. configs/demo/demix.yaml) train the experts of DEMix checkpoint
    `ckpt` (a branched one) on their domains: its model shape and expert count, the by-domain mixture over its experts'
    domains in its order (`data.domains`; null: the data's training domains, which are then the experts'), its data
    and `train.init_from`."""
    meta = read_meta(ckpt)
    m, d = meta["config"]["model"], meta["config"]["data"]
    if not ffn_kind(m["ffn"]["kind"]).domain_experts:
        raise CheckpointError(
            f"{ckpt} is a {m['ffn']['kind']!r} checkpoint; a DEMix run starts from a DEMix one "
            "(branch a dense checkpoint first: python -m launcher.modular.btx branch DENSE "
            "--out DIR)"
        )
    listed = "null" if d.get("domains") is None else json.dumps(list(d["domains"]))
    return _start_from_sets(
        ckpt,
        meta,
        [
            f"model.ffn.kind={m['ffn']['kind']}",
            f"model.ffn.num_experts={len(meta['domains'])}",
            "data.mixture=by_domain",
            f"data.domains={listed}",
        ],
    )


def _start_from_sets(ckpt: str | Path, meta: dict[str, Any], ffn_sets: list[str]) -> list[str]:
    """`--set` values for a run starting from `ckpt` (meta `meta`): its model shape, then `ffn_sets`, then its data
    and `train.init_from`."""
    m, d = meta["config"]["model"], meta["config"]["data"]
    return (
        [f"model.{k}={m[k]}" for k in SHAPE_FIELDS]
        + ffn_sets
        + [
            f"data.path={d['path']}",
            f"data.tokenizer={d['tokenizer']}",
            f"train.init_from={Path(ckpt).resolve()}",
        ]
    )
