"""The expert package: one owner's expert, everything a merge needs to check it, and nothing else of the owner's.

    PKG/manifest.json   format, domain, the anchor's fingerprint (fingerprint.py), the tokenizer's fingerprint, the
                        model shape, training (tokens, steps, run config), the owner's dev perplexity, the router
                        vector (router.py), free-form tags (licence, contact), the sha256 of every file, and
                        `manifest_sha256`: the sha256 of the manifest itself without that field
    PKG/expert.pt       the expert's FFN weights of every layer, `blocks.<l>.ffn.expert.<name>` (weights only)

`read_package` verifies both before anything is used: a manifest edited after packaging (its own sha256 no longer
matches) and a damaged `expert.pt` (its sha256 no longer matches the manifest's) are refused with one line each.
The checksums catch damage and careless edits; they are not a signature (whoever rewrites both files rewrites a
package).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from data.atomic import staged_dir, write_json_atomic
from data.cli import OutputError, check_output_dir, read_manifest_format
from data.readers import InputFileError, read_json_object
from data.tokenizer import sha256_file
from launcher.checkpoint import (
    CheckpointError,
    load_consolidated,
    load_weights_only,
    read_meta,
    save_hashed,
)
from launcher.expert_surgery import EXPERT_KEY
from launcher.ffn_kinds import ffn_kind
from launcher.modular.owners.fingerprint import anchor_fingerprint, first_difference
from launcher.typed import to_dict
from model.config import SHAPE_FIELDS

PACKAGE_FORMAT = "demix-expert-package/1"
MANIFEST = "manifest.json"
EXPERT_FILE = "expert.pt"
DEV_BLOCKS = 32  # held-out blocks of the owner's data for its dev perplexity
ROUTER_BLOCKS = 64  # training blocks of the owner's data averaged into its router vector
_PACKAGED_TENSOR = re.compile(r"^(blocks\.\d+\.ffn\.)expert\.(.+)$")


@dataclass
class Package:
    """A verified expert package: its manifest and its expert's tensors (`blocks.<l>.ffn.expert.<name>`)."""

    path: Path
    manifest: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    @property
    def domain(self) -> str:
        return str(self.manifest["domain"])

    def as_expert(self, expert_id: int) -> dict[str, torch.Tensor]:
        """The expert's tensors keyed as expert `expert_id` of a DEMix state dict (the same tensor objects)."""
        out = {}
        for k, v in self.tensors.items():
            m = _PACKAGED_TENSOR.match(k)
            if m is None:
                raise CheckpointError(f"{self.path / EXPERT_FILE}: {k} is not an expert tensor of a package")
            out[f"{m.group(1)}experts.{expert_id}.{m.group(2)}"] = v
        return out


def manifest_digest(manifest: Mapping[str, Any]) -> str:
    """sha256 of a manifest's canonical JSON (sorted keys) without its `manifest_sha256` field."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def packaged_tensors(state: Mapping[str, torch.Tensor], expert_id: int) -> dict[str, torch.Tensor]:
    """Expert `expert_id`'s tensors of a DEMix state dict, re-keyed `blocks.<l>.ffn.expert.<name>`."""
    out = {}
    for k, v in state.items():
        m = EXPERT_KEY.match(k)  # blocks.<l>.ffn.experts.<id>.<name>
        if m is not None and int(m.group(2)) == expert_id:
            out[f"{m.group(1).removesuffix('experts.')}expert{m.group(3)}"] = v
    return out


def model_shape(cfg_model: Any) -> dict[str, Any]:
    """What a merge checks a package's expert against: the model's shape fields and the FFN width."""
    d = to_dict(cfg_model)
    return {**{k: d[k] for k in SHAPE_FIELDS}, "d_ffn": cfg_model.d_ffn}


def tokenizer_record(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The tokenizer fingerprint a checkpoint's meta.json records (name, vocabulary size, sha256)."""
    return {
        "name": meta.get("tokenizer"),
        "vocab_size": meta.get("vocab_size"),
        "sha256": meta.get("tokenizer_sha256"),
    }


def check_package_out(out: str | Path, inputs: Sequence[str | Path] = (), overwrite: bool = False) -> None:
    """Refuse, before any work, a package output that would replace something: an existing package only with
    `overwrite`, anything else never (data/cli.py `check_output_dir`)."""
    out = Path(out)
    try:
        check_output_dir(out, (PACKAGE_FORMAT,), (MANIFEST, EXPERT_FILE), [Path(i) for i in inputs], MANIFEST)
    except OutputError as e:
        raise CheckpointError(str(e)) from None
    if (
        (out / MANIFEST).is_file()
        and read_manifest_format(out / MANIFEST) == PACKAGE_FORMAT
        and not overwrite
    ):
        raise CheckpointError(
            f"--out {out} holds an expert package; choose another path, or pass --overwrite"
        )


def package_expert(
    ckpt: str | Path,
    domain: str,
    out: str | Path,
    *,
    anchor: str | Path | None = None,
    data: str | None = None,
    tokenizer: str | None = None,
    tags: Mapping[str, str] | None = None,
    dev_blocks: int = DEV_BLOCKS,
    router_blocks: int = ROUTER_BLOCKS,
    overwrite: bool = False,
    provenance: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Write expert `domain` of DEMix checkpoint `ckpt` (an owner's trained model) as a package at `out`; returns
    its manifest. With `anchor`, the checkpoint's shared tensors must be the anchor's bit for bit (refused naming
    the first differing tensor otherwise). The dev perplexity and the router vector are computed on the owner's
    data (`data`/`tokenizer`, default the checkpoint's own data.path/data.tokenizer): the valid split's first
    `dev_blocks` blocks, the train split's first `router_blocks` blocks. `provenance` (train-owner's record of the
    start: the anchor, the expert it was copied from) goes into the manifest's `training.owner_init`."""
    from launcher.checkpoint_data import data_source
    from launcher.modular.owners.router import router_vector

    check_package_out(out, [ckpt], overwrite)
    meta = read_meta(ckpt)
    kind = meta["config"]["model"]["ffn"]["kind"]
    if not ffn_kind(kind).domain_experts:
        raise CheckpointError(
            f"{ckpt} is a {kind!r} checkpoint: a package holds one DEMix expert (train it with "
            "`python -m launcher.modular.experts train-owner`)"
        )
    if domain not in meta["domains"]:
        raise CheckpointError(f"{ckpt} has no expert for {domain!r}; experts: {', '.join(meta['domains'])}")
    expert_id = meta["domains"].index(domain)
    c = load_consolidated(ckpt, experts=[expert_id])
    data, tokenizer = data_source(c, data, tokenizer)
    fp = anchor_fingerprint(c.state_dict)
    if anchor is not None:
        want = anchor_fingerprint(load_consolidated(anchor, experts=[]).state_dict)
        diff = first_difference(fp, want)
        if diff is not None:
            raise CheckpointError(
                f"{ckpt} was not trained from the anchor {anchor}: {diff}; an owner's expert is trained with "
                "every shared parameter frozen (train-owner does this)"
            )
    # the owner's model alone: its expert routes every block (the others were not read)
    own = c.build_model(expert_ids=[expert_id]).eval()
    tensors = packaged_tensors(c.state_dict, expert_id)
    if not tensors:
        raise CheckpointError(f"{ckpt}: no tensors of expert {expert_id} ({domain})")
    dev = _dev_perplexity_of(own, data, tokenizer, domain, dev_blocks)
    router = router_vector(own, data, tokenizer, domain, split="train", max_blocks=router_blocks)
    manifest: dict[str, Any] = {
        "format": PACKAGE_FORMAT,
        "domain": domain,
        "anchor": {**fp, "source": None if anchor is None else str(Path(anchor).resolve())},
        "tokenizer": tokenizer_record(c.meta),
        "model": model_shape(c.cfg.model),
        "training": {
            "tokens": c.meta.get("train_tokens"),
            "steps": c.step,
            "config": to_dict(c.cfg),
            "source_checkpoint": str(Path(ckpt).resolve()),
            "owner_init": dict(provenance) if provenance else None,
        },
        "dev": dev,
        "router": router,
        "tags": dict(tags or {}),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    out = Path(out)
    with staged_dir(out, manifest=MANIFEST) as tmp:
        manifest["files"] = {EXPERT_FILE: save_hashed(tensors, tmp / EXPERT_FILE)}
        manifest["manifest_sha256"] = manifest_digest(manifest)
        write_json_atomic(tmp / MANIFEST, manifest)
    return manifest


def _dev_perplexity_of(model: torch.nn.Module, data: str, tokenizer: str, domain: str, blocks: int) -> dict:
    from launcher.modular.experts.scoring import domain_log_likelihoods
    from model import mixture as mx

    ll, mask = domain_log_likelihoods(model, data, tokenizer, domain, "valid", blocks)
    ppl = mx.perplexity(ll[0], mask)
    return {
        "perplexity": ppl if math.isfinite(ppl) else None,
        "split": "valid",
        "blocks": int(ll.shape[1]),
        "tokens": int(mask.sum().item()),
    }


def read_package(path: str | Path) -> Package:
    """A package after checking it: its manifest's format and own sha256, then `expert.pt`'s sha256 against the
    manifest, then the weights (weights only: nothing in a package can run code). CheckpointError names the
    package and what is wrong."""
    root = Path(path)
    if not (root / MANIFEST).is_file():
        raise CheckpointError(
            f"{root} is not an expert package (no {MANIFEST}; `experts package` writes one)"
        )
    try:
        manifest = read_json_object(root / MANIFEST, what="expert package manifest")
    except InputFileError as e:
        raise CheckpointError(str(e)) from None
    if manifest.get("format") != PACKAGE_FORMAT:
        raise CheckpointError(
            f"{root / MANIFEST}: format {manifest.get('format')!r}, expected {PACKAGE_FORMAT!r}"
        )
    if manifest.get("manifest_sha256") != manifest_digest(manifest):
        raise CheckpointError(
            f"{root / MANIFEST} was edited after packaging (its manifest_sha256 no longer matches its content); "
            "ask its owner for the package again"
        )
    for key in ("domain", "anchor", "tokenizer", "model", "files"):
        if key not in manifest:
            raise CheckpointError(f"{root / MANIFEST} has no {key!r}")
    want = (manifest["files"] or {}).get(EXPERT_FILE)
    path_pt = root / EXPERT_FILE
    if not path_pt.is_file():
        raise CheckpointError(f"{root}: {EXPERT_FILE} is missing")
    if sha256_file(path_pt) != want:
        raise CheckpointError(
            f"{path_pt} does not match the sha256 its manifest recorded: the file is damaged; ask its owner for "
            "the package again"
        )
    tensors = load_weights_only(path_pt)
    if not isinstance(tensors, dict) or not all(isinstance(v, torch.Tensor) for v in tensors.values()):
        raise CheckpointError(f"{path_pt} does not hold a dict of tensors")
    return Package(path=root, manifest=manifest, tensors=tensors)
