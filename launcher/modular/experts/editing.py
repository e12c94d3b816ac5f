"""Adding and removing experts (DEMix §6-7). Expert ids are positions in the checkpoint's domain list (`meta.json`
"domains"). Adding appends id E as a copy of the new domain's most probable expert j* = argmax_j p(D = j | dev
blocks), the cached prior of §5 (model/mixture.py); removing renumbers the kept experts in their old order. Every
other tensor is copied unchanged."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from launcher.checkpoint import CheckpointError, Consolidated, save_consolidated
from launcher.checkpoint_data import data_source
from launcher.expert_surgery import (
    EXPERT_KEY,
    CkptLike,
    _load,
    _require_demix,
    _with_experts,
    remove_experts_state,
)
from launcher.modular.experts.scoring import domain_log_likelihoods
from launcher.modular.lineage import inherited_meta
from model import mixture as mx


def save(c: Consolidated, out: str | Path) -> Path:
    """Write `c` as a consolidated checkpoint, keeping the source's extra metadata (tokenizer, lineage)."""
    extra = inherited_meta(c.meta)
    return save_consolidated(out, c.state_dict, c.cfg, c.domains, c.step, extra=extra)


@torch.no_grad()
def estimate_domain_prior(
    ckpt: CkptLike,
    domain: str,
    data: str | None = None,
    tokenizer: str | None = None,
    split: str = "valid",
    dev_blocks: int = mx.CACHED_PRIOR_BLOCKS,
    estimator: str = "mean",
) -> mx.CachedPrior:
    """p(D = j | held-out blocks of `domain`): the cached prior (§5.1; `mx.estimate_cached_prior`) over the
    checkpoint's experts."""
    c = _load(ckpt)
    _require_demix(c, "estimating a domain posterior")
    data, tokenizer = data_source(c, data, tokenizer)
    ll, mask = domain_log_likelihoods(c.build_model().eval(), data, tokenizer, domain, split, dev_blocks)
    return mx.estimate_cached_prior(ll, c.domains, mask, dev_blocks, estimator=estimator)


def add_expert_state(c: Consolidated, domain: str, source: int) -> Consolidated:
    """Append expert E (named `domain`) to every DEMix layer as a copy of expert `source`; every other tensor is
    the same tensor object (bit-identical)."""
    _require_demix(c, "adding an expert")
    if domain in c.domains:
        raise CheckpointError(
            f"the checkpoint already has an expert for {domain!r} (experts: {', '.join(c.domains)})"
        )
    if not 0 <= source < len(c.domains):
        raise CheckpointError(f"source expert {source} out of range for {len(c.domains)} experts")
    new_id = len(c.domains)
    state = dict(c.state_dict)
    copied = 0
    for key, value in c.state_dict.items():
        m = EXPERT_KEY.match(key)
        if m and int(m.group(2)) == source:
            state[f"{m.group(1)}{new_id}{m.group(3)}"] = value.clone()
            copied += 1
    if not copied:
        raise CheckpointError(f"no tensors of expert {source} in the checkpoint")
    return _with_experts(c, state, c.domains + [domain])


def add_expert(
    ckpt: CkptLike,
    domain: str,
    out: str | Path | None,
    data: str | None = None,
    tokenizer: str | None = None,
    dev_blocks: int = mx.CACHED_PRIOR_BLOCKS,
    dev_split: str = "valid",
    source: str | None = None,
) -> tuple[Consolidated, dict[str, Any]]:
    """DEMix §6, step 1-2: estimate the posterior on held-out blocks of `domain`, copy the most probable expert (or
    `source`, given by name) to a new expert id E; write the E+1-expert checkpoint to `out` (unless None). Returns
    the new checkpoint and what was done (also recorded in its meta.json under "added_experts")."""
    c = _load(ckpt)
    _require_demix(c, "adding an expert")
    if domain in c.domains:
        raise CheckpointError(f"{ckpt} already has an expert for {domain!r}")
    if source is not None and source not in c.domains:
        raise CheckpointError(
            f"--source {source!r} is not an expert of {ckpt}; experts: {', '.join(c.domains)}"
        )
    prior = estimate_domain_prior(c, domain, data, tokenizer, dev_split, dev_blocks)
    best = max(range(len(prior.probs)), key=lambda j: (prior.probs[j], -j))
    src = c.domains.index(source) if source is not None else best
    record = {
        "domain": domain,
        "expert_id": len(c.domains),
        "source": c.domains[src],
        "source_id": src,
        "posterior": dict(zip(prior.domains, prior.probs)),
        "dev_blocks": prior.blocks,
        "dev_split": dev_split,
        "data": data_source(c, data, tokenizer)[0],
        "from": None if isinstance(ckpt, Consolidated) else str(ckpt),
    }
    new = add_expert_state(c, domain, src)
    new.meta["added_experts"] = list(c.meta.get("added_experts", [])) + [record]
    if out is not None:
        save(new, out)
    return new, {**record, "out": None if out is None else str(out), "domains": new.domains}


def remove_experts(ckpt: CkptLike, names: Sequence[str], out: str | Path) -> dict[str, Any]:
    new = remove_experts_state(_load(ckpt), names)
    save(new, out)
    return {"removed": list(names), "domains": new.domains, "out": str(out)}
