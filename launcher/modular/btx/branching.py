"""BTX's branch step (docs/btx.md, "Branching a dense seed model"): a dense checkpoint becomes the DEMix checkpoint
whose every expert, in every layer, is a copy of the dense FFN of that layer."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from data.catalog import DataError, load_catalog, read_token_manifest
from launcher.checkpoint import (
    CheckpointError,
    Consolidated,
    check_checkpoint_out,
    read_meta,
    save_consolidated,
)
from launcher.config import RunConfig
from launcher.expert_surgery import EXPERT_KEY, CkptLike, _load
from launcher.ffn_kinds import ffn_kind
from launcher.modular.btx.run_sets import demix_overrides
from launcher.modular.lineage import inherited_meta
from launcher.typed import from_dict

# blocks.<l>.ffn.mlp.<name> (model/mlp.py DenseFFN)
_DENSE_FFN_KEY = re.compile(r"^(blocks\.(\d+)\.ffn\.)mlp\.(.+)$")


def branch_source_problems(cfg: RunConfig) -> list[str]:
    """Why a checkpoint of run config `cfg` cannot be branched: it must be a plain dense model (no experts of any
    kind, no domain tokens in its inputs)."""
    name = cfg.model.ffn.kind
    if ffn_kind(cfg).domain_experts:
        return [
            f"it is a {name!r} checkpoint: its experts are branches already; upcycle it directly "
            "(`python -m launcher.modular.btx CKPT --out DIR`)"
        ]
    if ffn_kind(cfg).has_experts:
        return [
            f"it is a {name!r} checkpoint (experts of its own, not one FFN per layer): branch the dense "
            "checkpoint of a `model.ffn.kind=dense` run"
        ]
    if cfg.data.mixture == "domain_token":
        return [
            "it is a +Domain-Token model (data.mixture=domain_token: a domain token before every block, rows for "
            "them in its embedding), which a DEMix run never feeds: branch a dense model trained with the "
            "natural or balanced mixture"
        ]
    return []


def branch_domains(cfg: RunConfig, trained: Sequence[str], domains: Sequence[str] | None = None) -> list[str]:
    """The experts' domains in expert-id order: `domains` as given (each must be a domain of the dense run's data,
    `data.path`/`data.tokenizer`), else the dense run's training domains `trained` (its meta's order, the catalog's)."""
    if domains is None:
        if not trained:
            raise CheckpointError(
                "the dense checkpoint's meta.json lists no training domains: name the experts' "
                "domains with --domains"
            )
        return list(trained)
    domains = list(domains)
    if not domains:
        raise CheckpointError(
            "--domains is empty: name at least one domain, or leave it out for the dense run's "
            f"training domains ({', '.join(trained)})"
        )
    dup = sorted({d for d in domains if domains.count(d) > 1})
    if dup:
        raise CheckpointError(f"--domains names {dup} more than once: one expert per domain")
    manifest = Path(cfg.data.path) / cfg.data.tokenizer / "manifest.json"
    try:
        known, where = list(read_token_manifest(manifest)["domains"]), f"the dense run's data ({manifest})"
    except DataError:
        known, where = list(trained), f"the dense run's training domains ({manifest} is unreadable)"
    unknown = [d for d in domains if d not in known]
    if unknown:
        raise CheckpointError(
            f"--domains {unknown}: not a domain of {where}; known: {', '.join(known)}. Prepare "
            "data for it first (python -m data.prepare), or choose among these"
        )
    return domains


def catalog_domains(cfg: RunConfig, trained: Sequence[str]) -> list[str]:
    """The training domains, in order, that a run of `cfg` reads (launcher/plan.py's catalog: `data.domains`, else the
    data's non-novel domains sorted by name); `trained` (the checkpoint's list) when the data cannot be read."""
    try:
        return list(load_catalog(cfg.data.path, cfg.data.tokenizer, cfg.data.domains).train_domains)
    except DataError:
        return list(trained)


def branch_config(cfg: RunConfig, domains: Sequence[str], trained: Sequence[str]) -> RunConfig:
    """The DEMix run config of the branched model: the dense run's shape and recipe with `kind=demix`, one expert per
    domain, the by-domain mixture (each expert trains on its own domain, DEMix §3), no init checkpoint. `data.domains`
    stays the dense run's when its catalog gives exactly `domains` in this order, else lists `domains`: a DEMix run of
    this config numbers its domains as the experts are numbered (`domains[j]` is expert j)."""
    ffn = replace(cfg.model.ffn, kind="demix", num_experts=len(domains))
    listed = cfg.data.domains if catalog_domains(cfg, trained) == list(domains) else list(domains)
    return replace(
        cfg,
        model=replace(cfg.model, ffn=ffn),
        data=replace(cfg.data, mixture="by_domain", domains=listed),
        parallel=replace(cfg.parallel, allocation=None),
        train=replace(cfg.train, init_from=None, trainable="all"),
    )


def branch_state(state: dict[str, torch.Tensor], num_experts: int, n_layers: int) -> dict[str, torch.Tensor]:
    """The DEMix state dict of `num_experts` branches of a dense one: `blocks.<l>.ffn.mlp.<name>` becomes
    `blocks.<l>.ffn.experts.<j>.<name>` (surgery.EXPERT_KEY) for every j, each the same tensor object; every other
    tensor is kept (the same object: bit-identical)."""
    if any(EXPERT_KEY.match(k) for k in state):
        raise CheckpointError(
            "the state dict already has expert tensors (blocks.<l>.ffn.experts.<j>.*): not dense"
        )
    out: dict[str, torch.Tensor] = {}
    layers = set()
    for k, v in state.items():
        m = _DENSE_FFN_KEY.match(k)
        if m is None:
            out[k] = v
            continue
        layers.add(int(m.group(2)))
        out.update({f"{m.group(1)}experts.{j}.{m.group(3)}": v for j in range(num_experts)})
    missing = sorted(set(range(n_layers)) - layers)
    if missing:
        raise CheckpointError(
            f"layers {missing} have no dense FFN (blocks.<l>.ffn.mlp.*): not a dense state dict"
        )
    return out


def branch(
    dense_ckpt: CkptLike,
    out: str | Path,
    domains: Sequence[str] | None = None,
    *,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write the DEMix checkpoint whose every expert, in every layer, is dense checkpoint `dense_ckpt`'s FFN of that
    layer (BTX's branch step; docs/btx.md) to `out`; returns a record: source, domains, the `--set` values that
    start a DEMix run from it (`demix_sets`). `domains` (default: the dense run's training domains) orders the
    experts. Refuses (CheckpointError) a source with experts or domain tokens, an unknown domain and an existing
    `out` (unless `overwrite` and it holds a consolidated checkpoint: check_checkpoint_out)."""
    t0 = time.perf_counter()
    if isinstance(dense_ckpt, Consolidated):
        meta, cfg, source = dense_ckpt.meta, dense_ckpt.cfg, None
    else:  # every refusal below reads meta.json only, before any tensor
        check_checkpoint_out(out, [dense_ckpt], overwrite)
        meta, source = read_meta(dense_ckpt), str(Path(dense_ckpt).resolve())
        cfg = from_dict(RunConfig, meta["config"], source=f"{dense_ckpt}/meta.json")
    bad = branch_source_problems(cfg)
    if bad:
        raise CheckpointError(
            f"branching needs a dense checkpoint (one FFN per layer) to copy into every expert; "
            f"{source or 'the checkpoint'}: {bad[0]}"
        )
    names = branch_domains(cfg, meta["domains"], domains)
    c = _load(dense_ckpt)
    state = branch_state(c.state_dict, len(names), c.cfg.model.n_layers)
    rec = {
        "source": source,
        "source_step": c.step,
        "method": "branched from dense: every expert of every layer is "
        "a copy of the dense model's FFN of that layer (BTX branch)",
        "expert_domains": {str(j): d for j, d in enumerate(names)},
    }
    extra = inherited_meta(c.meta, drop=("btx", "branch"))
    save_consolidated(
        out, state, branch_config(c.cfg, names, c.domains), names, c.step, extra={**extra, "branch": rec}
    )
    return {
        "out": str(out),
        **rec,
        "domains": names,
        "num_experts": len(names),
        "demix_sets": demix_overrides(out),
        "seconds": round(time.perf_counter() - t0, 2),
    }
