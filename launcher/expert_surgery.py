"""Expert surgery on consolidated checkpoints, below launcher/evaluation/ and launcher/modular/ (both use it): which
experts to keep, a checkpoint without some of them, and the opt-out load that never reads their weights.

    c = load_without("runs/demix/model", ["legal"])   # the model without the legal expert; its shard never read
    c = remove_experts_state(load_consolidated(path), ["legal"])                # the same, from a loaded checkpoint
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from launcher.checkpoint import CheckpointError, Consolidated, load_consolidated, read_meta
from launcher.config import RunConfig
from launcher.ffn_kinds import ffn_kind
from launcher.typed import from_dict

EXPERT_KEY = re.compile(r"^(blocks\.\d+\.ffn\.experts\.)(\d+)(\..+)$")
CkptLike = str | Path | Consolidated


def _load(ckpt: CkptLike) -> Consolidated:
    return ckpt if isinstance(ckpt, Consolidated) else load_consolidated(ckpt)


def _require_demix(c: Consolidated, what: str) -> None:
    if not ffn_kind(c.cfg).domain_experts:
        raise CheckpointError(f"{what} needs a DEMix checkpoint, not a {c.cfg.model.ffn.kind!r} one")


def _with_experts(
    c: Consolidated, state: dict[str, torch.Tensor], domains: list[str], **meta: Any
) -> Consolidated:
    """A copy of `c` with another expert set (config's expert count follows the domain list)."""
    cfg = c.cfg
    cfg = replace(cfg, model=replace(cfg.model, ffn=replace(cfg.model.ffn, num_experts=len(domains))))
    return Consolidated(
        cfg=cfg, domains=list(domains), state_dict=state, step=c.step, meta={**c.meta, **meta}
    )


def _keep_indices(
    domains: Sequence[str], experts: Sequence[str] | None = None, without: Sequence[str] = ()
) -> list[int]:
    names = list(domains)
    unknown = [e for e in list(experts or []) + list(without) if e not in names]
    if unknown:
        raise CheckpointError(f"no expert named {unknown}; experts: {', '.join(names)}")
    wanted = set(experts) if experts is not None else set(names)
    return [j for j, d in enumerate(names) if d in wanted and d not in set(without)]


def remove_experts_state(c: Consolidated, names: Sequence[str]) -> Consolidated:
    """Drop the experts `names`; the kept ones are renumbered 0.. in their old order, every other tensor kept."""
    _require_demix(c, "removing experts")
    keep = _keep_indices(c.domains, None, names)
    if not keep:
        raise CheckpointError(f"removing {list(names)} would leave no expert")
    new_id = {old: new for new, old in enumerate(keep)}
    state = {}
    for key, value in c.state_dict.items():
        m = EXPERT_KEY.match(key)
        if not m:
            state[key] = value
        elif int(m.group(2)) in new_id:
            state[f"{m.group(1)}{new_id[int(m.group(2))]}{m.group(3)}"] = value
    removed = list(c.meta.get("removed_experts", [])) + [d for d in c.domains if d in set(names)]
    kept = [c.domains[j] for j in keep]
    meta: dict[str, Any] = {"removed_experts": removed}
    router = c.meta.get("router_vectors")
    if isinstance(router, dict):  # the removed experts' router vectors go with them
        meta["router_vectors"] = {
            **router,
            **{
                k: {d: v for d, v in router[k].items() if d in kept}
                for k in ("vectors", "tokens")
                if k in router
            },
        }
    return _with_experts(c, state, kept, **meta)


def load_without(ckpt: CkptLike, exclude: Sequence[str]) -> Consolidated:
    """Opt-out: the checkpoint with the experts `exclude` taken out, as `remove_experts_state` (and so a checkpoint
    saved without them) gives it. From a path, the excluded experts' shards are never read (format 2: one file per
    expert; a format-1 file holds every expert and they are dropped as it is read), so their weights cannot take
    part in anything computed from the result: tests/launcher/modular/test_opt_out.py corrupts them and checks
    bit-identical outputs. An empty `exclude` is a plain load."""
    if not exclude:
        return _load(ckpt)
    if isinstance(ckpt, Consolidated):
        return remove_experts_state(ckpt, exclude)
    meta = read_meta(ckpt)
    if not ffn_kind(from_dict(RunConfig, meta["config"], source=str(ckpt))).domain_experts:
        raise CheckpointError(
            f"{ckpt} has no domain experts to exclude ({meta['config']['model']['ffn']['kind']})"
        )
    keep = _keep_indices(meta["domains"], None, exclude)
    if not keep:
        raise CheckpointError(f"excluding {list(exclude)} would leave no expert")
    return remove_experts_state(load_consolidated(ckpt, experts=keep), exclude)
