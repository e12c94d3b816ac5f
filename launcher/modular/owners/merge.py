"""Merge: one anchor and the owners' expert packages become one DEMix checkpoint.

    python -m launcher.modular.experts merge ANCHOR PKG [PKG ...] --out MERGED

The merged checkpoint holds the anchor's shared tensors (the same bytes), the anchor's own experts if it is a DEMix
checkpoint (ids 0..k-1, in its order), then one expert per package in the order given (ids k..), each the package's
tensors bit for bit. Its run config is the anchor's with `model.ffn.kind=demix`, one expert per domain and the
by-domain mixture, so every tool that reads a DEMix checkpoint reads it: evaluate (every mixing mode, router
vectors included when every expert has one), generate, hf_export, the harness, `experts remove`, BTX upcycling,
and `train.init_from` for further joint training.

Refused, with one line each and before anything is written: a package whose anchor fingerprint is not the anchor's
(naming the first differing shared tensor), another tokenizer, another model shape, two experts for one domain, a
damaged or edited package (package.py `read_package`), an anchor that is neither Dense nor DEMix.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from launcher.checkpoint import (
    CheckpointError,
    Consolidated,
    check_checkpoint_out,
    load_consolidated,
    read_meta,
    save_consolidated,
)
from launcher.config import RunConfig
from launcher.ffn_kinds import ffn_kind
from launcher.modular.lineage import inherited_meta
from launcher.modular.owners.fingerprint import anchor_fingerprint, first_difference, is_shared_key
from launcher.modular.owners.package import (
    ROUTER_BLOCKS,
    Package,
    model_shape,
    read_package,
    tokenizer_record,
)
from launcher.typed import from_dict
from model.gpt import expert_of_key

# meta.json records of the anchor that describe the anchor itself, not the merged model
_ANCHOR_ONLY = ("merge", "router_vectors", "owner_init", "branch", "btx", "added_experts", "removed_experts")


def anchor_problems(cfg: RunConfig) -> list[str]:
    """Why a checkpoint of run config `cfg` cannot be an anchor: it must be Dense (its FFNs are what owners start
    from) or DEMix (its experts stay, owners add theirs), without domain tokens in its inputs."""
    kind = cfg.model.ffn.kind
    if ffn_kind(cfg).has_experts and not ffn_kind(cfg).domain_experts:
        return [f"it is a {kind!r} checkpoint; an anchor is a Dense or a DEMix checkpoint"]
    if cfg.data.mixture == "domain_token":
        return ["it is a +Domain-Token model (data.mixture=domain_token), which a DEMix model never feeds"]
    return []


def read_anchor_meta(anchor: str | Path) -> tuple[dict[str, Any], RunConfig]:
    """The anchor's meta.json and run config, refused (CheckpointError) when it cannot be an anchor."""
    meta = read_meta(anchor)
    cfg = from_dict(RunConfig, meta["config"], source=f"{anchor}/meta.json")
    bad = anchor_problems(cfg)
    if bad:
        raise CheckpointError(f"{anchor} cannot be an anchor: {bad[0]}")
    return meta, cfg


def anchor_experts(meta: dict[str, Any], cfg: RunConfig) -> list[str]:
    """The anchor's own experts' domains, which a merge keeps (none for a Dense anchor)."""
    return list(meta["domains"]) if ffn_kind(cfg).domain_experts else []


def check_packages(
    anchor: str | Path, meta: dict[str, Any], cfg: RunConfig, packages: Sequence[Package]
) -> None:
    """Everything a merge checks from the manifests, before the anchor's tensors are read: the tokenizer, the model
    shape, one expert per domain."""
    own = anchor_experts(meta, cfg)
    tok, shape = tokenizer_record(meta), model_shape(cfg.model)
    seen: dict[str, Path] = {}
    for p in packages:
        if p.domain in own:
            raise CheckpointError(
                f"package {p.path} is for {p.domain!r}, which the anchor {anchor} has an expert for already: one "
                "expert per domain (remove the anchor's first: `experts remove`)"
            )
        if p.domain in seen:
            raise CheckpointError(
                f"packages {seen[p.domain]} and {p.path} are both for {p.domain!r}: one expert per domain"
            )
        seen[p.domain] = p.path
        ptok = p.manifest["tokenizer"]
        if ptok.get("sha256") != tok["sha256"] or ptok.get("vocab_size") != tok["vocab_size"]:
            raise CheckpointError(
                f"package {p.path} was trained with another tokenizer ({ptok.get('name')!r}, sha256 "
                f"{str(ptok.get('sha256'))[:12]}) than the anchor {anchor} ({tok['name']!r}, sha256 "
                f"{str(tok['sha256'])[:12]})"
            )
        if p.manifest["model"] != shape:
            diff = sorted(k for k in shape if p.manifest["model"].get(k) != shape[k])
            raise CheckpointError(
                f"package {p.path} is an expert of another model shape than the anchor {anchor}: "
                + ", ".join(f"{k} {p.manifest['model'].get(k)} vs {shape[k]}" for k in diff)
            )


def check_anchor_fingerprints(anchor: str | Path, fp: dict[str, Any], packages: Sequence[Package]) -> None:
    """Each package's anchor fingerprint equals the anchor's `fp`; refused naming the first differing tensor."""
    for p in packages:
        diff = first_difference(p.manifest["anchor"], fp)
        if diff is not None:
            raise CheckpointError(
                f"package {p.path} ({p.domain}) was trained from another anchor than {anchor}: {diff}; its "
                "owner must train from this anchor"
            )


def merged_config(cfg: RunConfig, domains: Sequence[str]) -> RunConfig:
    """The merged model's run config: the anchor's shape and recipe with one DEMix expert per domain and the
    by-domain mixture over those domains (expert j is domains[j]); no init checkpoint."""
    return replace(
        cfg,
        model=replace(cfg.model, ffn=replace(cfg.model.ffn, kind="demix", num_experts=len(domains))),
        data=replace(cfg.data, mixture="by_domain", domains=list(domains)),
        parallel=replace(cfg.parallel, allocation=None),
        train=replace(cfg.train, init_from=None, trainable="all"),
    )


def anchor_router_vectors(
    a: Consolidated, data: str | Path, tokenizer: str | None = None, max_blocks: int = ROUTER_BLOCKS
) -> dict[str, dict[str, Any]]:
    """Router vectors of a DEMix anchor's own experts, each on its domain's training blocks of the anchor's data
    (`data`/`tokenizer`): the public side's counterpart of what each owner computes on its data (router.py)."""
    from launcher.checkpoint_data import data_source
    from launcher.modular.owners.router import router_vector

    own = anchor_experts(a.meta, a.cfg)
    if not own:
        raise CheckpointError(
            "--anchor-data: the anchor has no experts of its own to compute router vectors for"
        )
    data, tokenizer = data_source(a, str(data), tokenizer)
    model = a.build_model(
        expert_ids=[0]
    ).eval()  # the features use shared parameters only: any expert will do
    return {d: router_vector(model, data, tokenizer, d, split="train", max_blocks=max_blocks) for d in own}


def merged_state(
    anchor: str | Path | Consolidated,
    packages: Sequence[Package],
    anchor_path: str | Path | None = None,
    anchor_router: dict[str, dict[str, Any]] | None = None,
) -> tuple[Consolidated, dict[str, Any]]:
    """The merged checkpoint in memory and its merge record (checks of `check_packages` and
    `check_anchor_fingerprints` included). `anchor` may be a loaded checkpoint (e.g. the anchor without some of its
    experts, for the opt-out proof); `anchor_path` names it in the record. `anchor_router`: router vectors of the
    anchor's own experts (`anchor_router_vectors`), without which a DEMix anchor's merge has none."""
    if isinstance(anchor, Consolidated):
        a, where = anchor, anchor_path or "the anchor"
        bad = anchor_problems(a.cfg)
        if bad:
            raise CheckpointError(f"{where} cannot be an anchor: {bad[0]}")
    else:
        read_anchor_meta(anchor)
        where = anchor_path or anchor
        a = load_consolidated(anchor)
    own = anchor_experts(a.meta, a.cfg)
    check_packages(where, a.meta, a.cfg, packages)
    fp = anchor_fingerprint(a.state_dict)
    check_anchor_fingerprints(where, fp, packages)
    state: dict[str, torch.Tensor] = {}
    for k, v in a.state_dict.items():
        if is_shared_key(k) or (own and expert_of_key(k) is not None):
            state[k] = v
    domains = own + [p.domain for p in packages]
    for i, p in enumerate(packages):
        state.update(p.as_expert(len(own) + i))
    record = {
        "anchor": {
            "source": None
            if anchor_path is None and isinstance(anchor, Consolidated)
            else str(Path(where).resolve()),
            "kind": a.cfg.model.ffn.kind,
            "step": a.step,
            "experts": own,
            "fingerprint": fp,
        },
        "packages": [
            {
                "domain": p.domain,
                "expert_id": len(own) + i,
                "source": str(p.path.resolve()),
                "manifest_sha256": p.manifest["manifest_sha256"],
                "files": p.manifest["files"],
                "training": {k: p.manifest.get("training", {}).get(k) for k in ("tokens", "steps")},
                "dev": p.manifest.get("dev"),
                "tags": p.manifest.get("tags", {}),
            }
            for i, p in enumerate(packages)
        ],
    }
    meta = {**inherited_meta(a.meta, drop=_ANCHOR_ONLY), "merge": record}
    routers = {d: r for d, r in (anchor_router or {}).items() if d in own}
    routers.update({p.domain: p.manifest.get("router") for p in packages})
    if all(routers.get(d) for d in domains):
        from launcher.router_vectors import router_vectors_meta

        meta["router_vectors"] = router_vectors_meta({d: routers[d] for d in domains})
    cfg = merged_config(a.cfg, domains)
    return Consolidated(cfg=cfg, domains=domains, state_dict=state, step=a.step, meta=meta), record


def merge(
    anchor: str | Path,
    packages: Sequence[str | Path],
    out: str | Path,
    *,
    overwrite: bool = False,
    anchor_data: str | Path | None = None,
    anchor_tokenizer: str | None = None,
) -> dict[str, Any]:
    """`experts merge`: check everything, then write the merged DEMix checkpoint to `out` (staged: a failure leaves
    nothing). Returns what was merged (domains in expert-id order, the anchor's fingerprint, the output).
    `anchor_data` (a DEMix anchor's own data): compute its experts' router vectors there, so that every expert of the
    merged model has one."""
    if not packages:
        raise CheckpointError("merge needs at least one package")
    check_checkpoint_out(out, [anchor], overwrite)
    meta, cfg = read_anchor_meta(anchor)
    if anchor_data is not None:
        from launcher.checkpoint_data import check_checkpoint_data

        if not anchor_experts(meta, cfg):
            raise CheckpointError(f"--anchor-data: {anchor} has no experts of its own (a Dense anchor)")
        check_checkpoint_data(anchor, anchor_data, anchor_tokenizer)
    pkgs = [read_package(p) for p in packages]
    a = load_consolidated(anchor)
    router = None if anchor_data is None else anchor_router_vectors(a, anchor_data, anchor_tokenizer)
    c, record = merged_state(a, pkgs, anchor_path=anchor, anchor_router=router)
    if router is not None:
        record["anchor_router"] = {"data": str(Path(anchor_data).resolve()), "tokenizer": anchor_tokenizer}
    record["created"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    c.meta["merge"] = record
    save_consolidated(out, c.state_dict, c.cfg, c.domains, c.step, extra=inherited_meta(c.meta))
    return {
        "out": str(out),
        "domains": c.domains,
        "anchor_fingerprint": record["anchor"]["fingerprint"]["sha256"],
        "packages": [p["source"] for p in record["packages"]],
        "router_vectors": "router_vectors" in c.meta,
    }
