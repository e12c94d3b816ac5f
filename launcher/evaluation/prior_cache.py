"""The cached prior's cache: the priors an evaluation estimated on development blocks (launcher/evaluation/evaluate.py
`_cached_prior`: `cached_blocks` blocks of `dev_split` per domain, one all-experts pass each), kept beside the
checkpoint in `CKPT_DIR/eval_prior_cache/<key>.json` and reused by the next evaluation of the same checkpoint.

The key is a fingerprint of everything the priors depend on:

* the checkpoint: the shard sums its meta.json recorded (sha256 of the shard files where it recorded none), its
  format, step, domains, run config and the experts opted out (`--exclude-experts`);
* the data: the sha256 of the token manifest (it records every split file's sha256) and the size and mtime of every
  domain's development split files;
* the settings: dev split, cached blocks, block length, λ, estimator, posterior, precision, device type, experts.

Any change gives another key, so another file: a changed checkpoint or data set is never served an old prior. A file
records its whole fingerprint and is used only when it equals the one asked for. Batch size and the number of ranks
are not part of it (they change the rounding of the log-likelihoods at most).
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from data.atomic import write_json_atomic
from data.readers import InputFileError, read_json_object
from data.tokenizer import sha256_file
from launcher.checkpoint import read_meta
from model import mixture as mx

PRIOR_CACHE_FORMAT = "demix-prior-cache/1"
PRIOR_CACHE_DIR = (
    "eval_prior_cache"  # inside the checkpoint directory (the evaluation's default --out is too)
)

# domain -> {"prior": CachedPrior | None (no development block), "variants": {"<estimator>/<posterior>": {e: p}}}
PriorEntries = dict[str, dict[str, Any]]


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def checkpoint_fingerprint(ckpt_dir: str | Path, excluded: Sequence[str] = ()) -> dict[str, Any]:
    """What identifies a consolidated checkpoint's weights, from its meta.json: the shard sums it recorded (each
    load checks the files against them), or the files' sha256 for a checkpoint written before sums were kept."""
    root = Path(ckpt_dir)
    meta = read_meta(root)
    sums = meta.get("sha256")
    if not sums:
        shards = meta.get("shards", {})
        files = [shards.get("shared", "model.pt"), *shards.get("experts", {}).values()]
        sums = {rel: sha256_file(root / rel) for rel in files if (root / rel).is_file()}
    return {
        "format": meta.get("format"),
        "step": meta.get("step"),
        "domains": list(meta["domains"]),
        "shards_sha256": dict(sums),
        "config_sha256": _digest(meta["config"]),
        "excluded_experts": sorted(excluded),
    }


def data_fingerprint(data_root: str | Path, tokenizer: str, dev_split: str) -> dict[str, Any]:
    """The token manifest's sha256 and the size and mtime of every domain's `dev_split` files."""
    tok = Path(data_root) / tokenizer
    manifest = tok / "manifest.json"
    domains = json.loads(manifest.read_text()).get("domains", [])
    files = {}
    for dom in domains:
        for ext in ("bin", "idx"):
            p = tok / str(dom) / f"{dev_split}.{ext}"
            if p.is_file():
                st = p.stat()
                files[f"{dom}/{p.name}"] = [st.st_size, st.st_mtime_ns]
    return {"manifest_sha256": sha256_file(manifest), "dev_files": files}


@dataclass
class PriorCache:
    """Where the priors of checkpoint `ckpt_dir` (minus the `excluded` experts) are cached: `directory`."""

    directory: Path
    ckpt_dir: Path
    excluded: tuple[str, ...] = ()

    @classmethod
    def beside(
        cls,
        ckpt_dir: str | Path,
        excluded: Sequence[str] = (),
        directory: str | Path | None = None,
    ) -> PriorCache:
        """The cache of checkpoint `ckpt_dir`: `directory`, default `CKPT_DIR/eval_prior_cache`."""
        return cls(
            Path(directory) if directory is not None else Path(ckpt_dir) / PRIOR_CACHE_DIR,
            Path(ckpt_dir),
            tuple(excluded),
        )

    @functools.cached_property
    def checkpoint(self) -> dict[str, Any]:
        """The checkpoint's part of the key (`checkpoint_fingerprint`), read when first needed."""
        return checkpoint_fingerprint(self.ckpt_dir, self.excluded)

    def fingerprint(self, data: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
        """The whole key: checkpoint, data (`data_fingerprint`) and the prior's settings."""
        return {
            "format": PRIOR_CACHE_FORMAT,
            "checkpoint": self.checkpoint,
            "data": data,
            "settings": settings,
        }

    def file(self, fingerprint: dict[str, Any]) -> Path:
        """The cache file of `fingerprint`."""
        return self.directory / f"{_digest(fingerprint)[:16]}.json"

    def read(self, fingerprint: dict[str, Any]) -> tuple[PriorEntries, str | None]:
        """The cached priors of `fingerprint` ({} when none), and why a file that is there was not used."""
        path = self.file(fingerprint)
        if not path.is_file():
            return {}, None
        try:
            data = read_json_object(
                path, {"format": str, "fingerprint": dict, "domains": dict}, what="prior cache"
            )
            if data["format"] != PRIOR_CACHE_FORMAT or data["fingerprint"] != json.loads(
                json.dumps(fingerprint)
            ):
                return {}, f"{path} is for another checkpoint, data or settings"
            return {d: _entry_from_json(e) for d, e in data["domains"].items()}, None
        except (InputFileError, KeyError, TypeError, ValueError) as e:
            return {}, f"{path} is unreadable ({e})"

    def write(self, fingerprint: dict[str, Any], entries: PriorEntries, seconds: float) -> Path:
        """Add `entries` to the cache file of `fingerprint` (atomically; entries already there are kept)."""
        old, _ = self.read(fingerprint)
        old.update(entries)
        path = self.file(fingerprint)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(
            path,
            {
                "format": PRIOR_CACHE_FORMAT,
                "created_unix": int(time.time()),
                "scoring_seconds": round(seconds, 3),
                "fingerprint": fingerprint,
                "domains": {d: _entry_to_json(e) for d, e in old.items()},
            },
        )
        return path


def _entry_to_json(entry: dict[str, Any]) -> dict[str, Any]:
    prior = entry.get("prior")
    return {"prior": asdict(prior) if prior is not None else None, "variants": entry.get("variants", {})}


def _entry_from_json(data: dict[str, Any]) -> dict[str, Any]:
    """A cached entry back; the probabilities exactly as estimated (JSON keeps every double), not renormalised."""
    p = data["prior"]
    prior = (
        None
        if p is None
        else mx.CachedPrior(
            list(p["domains"]),
            [float(x) for x in p["probs"]],
            int(p["blocks"]),
            float(p["decay"]),
            str(p["estimator"]),
            str(p["posterior"]),
        )
    )
    return {"prior": prior, "variants": dict(data.get("variants", {}))}
