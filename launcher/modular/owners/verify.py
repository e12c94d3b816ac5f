"""The opt-out proof: a merged model without some owners' experts is, bit for bit, the model those owners were never
merged into, and the shared parameters are the anchor's.

    python -m launcher.modular.experts verify MERGED --without D[,D2] [--packages PKG ...] [--anchor A] [--out F]

1. The opt-out model: MERGED loaded without D (launcher/expert_surgery.py `load_without`, which never reads D's
   shard: what `evaluate --exclude-experts D` and `hf_export --exclude-experts D` use).
2. The reference: a fresh merge (merge.py `merged_state`) of the anchor and every package but D's (the anchor without
   D when D is one of the anchor's own experts). The packages and the anchor are the ones the merge record names,
   or those given; each package must be the one merged (the manifest sha256 the merge recorded).
3. Checked: the same experts in the same order, the same tensor names, every tensor equal byte for byte (dtype and
   shape included), the same router vectors for the kept experts, and the shared tensors' fingerprint equal to the
   anchor's (recomputed from the anchor, and as the merge recorded it).

The audit record (`--out`, JSON): what was removed (domains and their packages' manifest sha256), what was kept, the
fingerprints, the date, each check's result and `passed`. Exit status 0 when every check holds, 1 otherwise.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from data.atomic import write_json_atomic
from launcher.checkpoint import CheckpointError, load_consolidated, read_meta
from launcher.expert_surgery import load_without, remove_experts_state
from launcher.modular.owners.fingerprint import anchor_fingerprint, first_difference
from launcher.modular.owners.merge import merged_state
from launcher.modular.owners.package import read_package

AUDIT_FORMAT = "demix-opt-out-audit/1"


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaNs included, signed zeros told apart)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().cpu().contiguous().reshape(-1), b.detach().cpu().contiguous().reshape(-1)
    return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8))) if a.numel() else True


def tensor_differences(have: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Names of the tensors that differ between two state dicts (missing, extra, or other bytes), sorted."""
    out = [f"{k}: missing" for k in sorted(set(want) - set(have))]
    out += [f"{k}: extra" for k in sorted(set(have) - set(want))]
    out += [f"{k}: differs" for k in sorted(set(have) & set(want)) if not same_bytes(have[k], want[k])]
    return out


def verify_opt_out(
    merged: str | Path,
    without: Sequence[str],
    packages: Sequence[str | Path] | None = None,
    anchor: str | Path | None = None,
    out: str | Path | None = None,
) -> dict[str, Any]:
    """Run the checks of this module's docstring; returns the audit record (also written to `out` when given)."""
    meta = read_meta(merged)
    record = meta.get("merge")
    if not isinstance(record, dict):
        raise CheckpointError(f"{merged} is not a merged checkpoint (its meta.json has no merge record)")
    without = list(without)
    unknown = [d for d in without if d not in meta["domains"]]
    if not without or unknown:
        raise CheckpointError(
            f"--without {','.join(unknown) or '(empty)'}: name experts of {merged}: {', '.join(meta['domains'])}"
        )
    anchor = anchor or record["anchor"].get("source")
    if not anchor or not Path(anchor, "meta.json").is_file():
        raise CheckpointError(
            f"the anchor {anchor} that {merged} was merged from is not there: pass it with --anchor"
        )
    merged_pkgs = {p["domain"]: p for p in record["packages"]}
    paths = [Path(p) for p in packages] if packages else [Path(p["source"]) for p in record["packages"]]
    pkgs = {}
    for path in paths:
        p = read_package(path)
        if p.domain not in merged_pkgs:
            raise CheckpointError(f"package {path} is for {p.domain!r}, which {merged} was not merged with")
        if p.manifest["manifest_sha256"] != merged_pkgs[p.domain]["manifest_sha256"]:
            raise CheckpointError(
                f"package {path} ({p.domain}) is not the package {merged} was merged from (another manifest sha256)"
            )
        pkgs[p.domain] = p
    kept_pkgs = []
    for d in merged_pkgs:
        if d in without:
            continue
        if d not in pkgs:
            raise CheckpointError(f"the package of {d!r} is missing: pass every kept package with --packages")
        kept_pkgs.append(pkgs[d])
    a = load_consolidated(anchor)
    a_fp = anchor_fingerprint(a.state_dict)
    from_anchor = [d for d in without if d in record["anchor"].get("experts", [])]
    if from_anchor:
        a = remove_experts_state(a, from_anchor)
    # the anchor's own experts' router vectors (merge --anchor-data) come from the anchor's data, not a package
    recorded = (meta.get("router_vectors") or {}).get("vectors", {})
    tokens = (meta.get("router_vectors") or {}).get("tokens", {})
    anchor_router = (
        {d: {"vector": recorded[d], "tokens": tokens.get(d)} for d in a.domains if d in recorded}
        if record.get("anchor_router")
        else None
    )
    reference, _ = merged_state(a, kept_pkgs, anchor_path=anchor, anchor_router=anchor_router)
    opted = load_without(merged, without)
    diffs = tensor_differences(opted.state_dict, reference.state_dict)
    routers_have = (opted.meta.get("router_vectors") or {}).get("vectors", {})
    routers_want = (reference.meta.get("router_vectors") or {}).get("vectors", {})
    router_diff = (
        [d for d in opted.domains if routers_have.get(d) != routers_want.get(d)] if routers_want else []
    )
    shared_fp = anchor_fingerprint(opted.state_dict)
    checks = {
        "same_experts": opted.domains == reference.domains,
        "tensors_compared": len(reference.state_dict),
        "tensors_differing": diffs[:20],
        "equal_to_merge_without": not diffs and opted.domains == reference.domains,
        "router_vectors_equal": not router_diff,
        "shared_equal_anchor": first_difference(shared_fp, a_fp) is None,
        "shared_equal_recorded_anchor": first_difference(shared_fp, record["anchor"]["fingerprint"]) is None,
    }
    passed = all(
        checks[k]
        for k in (
            "equal_to_merge_without",
            "router_vectors_equal",
            "shared_equal_anchor",
            "shared_equal_recorded_anchor",
        )
    )
    audit = {
        "format": AUDIT_FORMAT,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "merged": str(Path(merged).resolve()),
        "merged_meta_sha256": meta.get("sha256"),
        "removed": without,
        "removed_packages": [
            {"domain": d, "manifest_sha256": merged_pkgs[d]["manifest_sha256"]}
            for d in without
            if d in merged_pkgs
        ],
        "removed_anchor_experts": from_anchor,
        "kept": opted.domains,
        "anchor": {"source": str(Path(anchor).resolve()), "fingerprint": a_fp["sha256"]},
        "shared_fingerprint": shared_fp["sha256"],
        "checks": checks,
        "passed": passed,
    }
    if out is not None:
        write_json_atomic(Path(out), audit)
    return audit
