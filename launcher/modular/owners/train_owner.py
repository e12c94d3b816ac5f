"""An owner's run: a new expert from the anchor, trained on the owner's data alone, everything shared frozen, then
packaged.

    python -m launcher.modular.experts train-owner ANCHOR --domain D --data OWNER_TOKENS --steps N --out PKG \\
        [--nproc 2 | --hostfile H ...] [--source EXPERT] [--lr X | --lr-scale 1.0] [--run-dir DIR] [--tag k=v]

1. The start (RUN_DIR/init): a one-expert DEMix checkpoint whose expert `D` is, in every layer, the anchor's FFN (a
   Dense anchor: BTX's branch) or one of the anchor's experts (a DEMix anchor: `--source`, else its most probable
   expert on the owner's held-out blocks, p(D = j | dev blocks) as `experts add` chooses it); every shared tensor is
   the anchor's own.
2. The run: the launcher (`experts dapt`'s recipe: `train.trainable=experts`, the by-domain mixture over [D],
   `data.path=OWNER_TOKENS`) on `--nproc` local ranks or the hosts a `--hostfile` names: an owner may be a cluster.
   Only the owner's data is opened; the learning rate is `--lr`, else `--lr-scale` x the anchor's (default 1: the
   expert is trained, not adapted).
3. The package (package.py): the trained expert, checked to have left every shared tensor of the anchor unchanged
   bit for bit, with the owner's dev perplexity and router vector computed on the owner's data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from data.catalog import read_token_manifest
from launcher.checkpoint import CheckpointError, Consolidated, load_consolidated, save_consolidated
from launcher.checkpoint_data import check_checkpoint_data
from launcher.ffn_kinds import ffn_kind
from launcher.modular.btx.branching import branch_state
from launcher.modular.experts.dapt import run_dapt
from launcher.modular.experts.editing import estimate_domain_prior
from launcher.modular.lineage import inherited_meta
from launcher.modular.owners.fingerprint import anchor_fingerprint, is_shared_key
from launcher.modular.owners.merge import _ANCHOR_ONLY, merged_config, read_anchor_meta
from launcher.modular.owners.package import (
    DEV_BLOCKS,
    ROUTER_BLOCKS,
    check_package_out,
    package_expert,
    packaged_tensors,
)
from model import mixture as mx


def owner_start(a: Consolidated, domain: str, data: str, tokenizer: str, source: int | None) -> Consolidated:
    """The one-expert DEMix checkpoint an owner's run starts from (step 1 of the module docstring)."""
    if ffn_kind(a.cfg).domain_experts:
        assert source is not None
        expert = packaged_tensors(a.state_dict, source)
        state = {k: v for k, v in a.state_dict.items() if is_shared_key(k)}
        state.update({k.replace(".ffn.expert.", ".ffn.experts.0."): v for k, v in expert.items()})
    else:
        state = branch_state(a.state_dict, 1, a.cfg.model.n_layers)
    cfg = merged_config(a.cfg, [domain])
    cfg = replace(cfg, data=replace(cfg.data, path=str(data), tokenizer=tokenizer))
    return Consolidated(
        cfg=cfg, domains=[domain], state_dict=state, step=0, meta=inherited_meta(a.meta, _ANCHOR_ONLY)
    )


def train_owner(
    anchor: str | Path,
    domain: str,
    data: str | Path,
    out: str | Path,
    *,
    steps: int,
    nproc: int = 2,
    tokenizer: str | None = None,
    source: str | None = None,
    lr: float | None = None,
    lr_scale: float = 1.0,
    run_dir: str | Path | None = None,
    launch_args: Sequence[str] = (),
    overrides: Sequence[str] = (),
    tags: Mapping[str, str] | None = None,
    dev_blocks: int = DEV_BLOCKS,
    router_blocks: int = ROUTER_BLOCKS,
    overwrite: bool = False,
    dry_run: bool = False,
) -> dict[str, Any]:
    """Steps 1-3 of the module docstring; returns the package's manifest (with dry_run: the run's plan only)."""
    out, data = Path(out), Path(data)
    run_dir = Path(run_dir) if run_dir is not None else out.with_name(out.name + ".run")
    check_package_out(out, [anchor, data], overwrite)
    meta, cfg = read_anchor_meta(anchor)
    tokenizer = tokenizer or cfg.data.tokenizer
    check_checkpoint_data(anchor, data, tokenizer)  # the owner's tokens are the anchor's tokenizer's
    have = list(read_token_manifest(data / tokenizer / "manifest.json")["domains"])
    if domain not in have:
        raise CheckpointError(f"{data}/{tokenizer} has no domain {domain!r} (domains: {', '.join(have)})")
    demix = ffn_kind(cfg).domain_experts
    if source is not None and (not demix or source not in meta["domains"]):
        raise CheckpointError(
            f"--source {source!r}: not an expert of the anchor {anchor}"
            + (
                f" (experts: {', '.join(meta['domains'])})"
                if demix
                else " (a Dense anchor starts from its FFN)"
            )
        )
    a = load_consolidated(anchor)
    src = None
    if demix:
        if source is None:
            prior = estimate_domain_prior(a, domain, str(data), tokenizer, "valid", mx.CACHED_PRIOR_BLOCKS)
            src = max(range(len(prior.probs)), key=lambda j: (prior.probs[j], -j))
        else:
            src = a.domains.index(source)
    start = owner_start(a, domain, str(data), tokenizer, src)
    provenance = {
        "anchor": str(Path(anchor).resolve()),
        "anchor_fingerprint": anchor_fingerprint(a.state_dict)["sha256"],
        "from": "the anchor's dense FFN" if src is None else f"the anchor's expert {a.domains[src]!r}",
        "steps": steps,
    }
    del a
    run_dir.mkdir(parents=True, exist_ok=True)
    save_consolidated(
        run_dir / "init",
        start.state_dict,
        start.cfg,
        start.domains,
        0,
        extra={**start.meta, "owner_init": provenance},
    )
    del start
    model = run_dapt(
        run_dir / "init",
        "demix",
        domain,
        steps,
        run_dir,
        nproc,
        str(data),
        tokenizer,
        lr,
        lr_scale,
        overrides,
        dry_run,
        launch_args,
    )
    if dry_run:
        return {"run_dir": str(run_dir), "model": str(model), "owner_init": provenance}
    return package_expert(
        model,
        domain,
        out,
        anchor=anchor,
        data=str(data),
        tokenizer=tokenizer,
        tags={**(tags or {})},
        dev_blocks=dev_blocks,
        router_blocks=router_blocks,
        overwrite=overwrite,
        provenance=provenance,
    )
