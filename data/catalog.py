"""What a prepared token directory holds: training and novel domains, tokenizer, counts.

Read from `<path>/<tokenizer>/manifest.json` (written by data/prepare.py) and, when present, the corpus
manifest it points to (its `split_role` per domain says which domains are held out as "novel").
Domain ids are positions in `train_domains` (sorted by name unless the config lists them), so expert `i`
of a DEMix model is the expert of `train_domains[i]`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from data.readers import InputFileError, read_json_object

# What readers of a token manifest (data/prepare.py) index directly (data/readers.py shapes)
TOKEN_MANIFEST_SHAPE = {"domains": list, "counts": dict, "tokenizer": {"vocab_size": int, "bos_id": int}}


class DataError(ValueError):
    """The prepared data is missing or does not match the configuration."""


@dataclass(frozen=True)
class Catalog:
    root: Path  # <path>/<tokenizer>
    tokenizer: str
    vocab_size: int  # the tokenizer's, without domain tokens
    bos_id: int
    train_domains: tuple[str, ...]
    novel_domains: tuple[str, ...]
    counts: dict  # domain -> split -> {"documents", "tokens", ...}
    tokenizer_sha256: str = ""  # `tokenizer_fingerprint` of the tokenizer that made these tokens
    eod_id: int | None = None  # end-of-document id (manifests before it was recorded: None)

    def total_vocab_size(self, with_domain_tokens: bool) -> int:
        """Token ids the model must cover: the tokenizer's, plus one domain token per training domain."""
        return self.vocab_size + (len(self.train_domains) if with_domain_tokens else 0)

    def tokens(self, domain: str, split: str) -> int:
        return int(self.counts[domain][split]["tokens"])


def load_catalog(path: str | Path, tokenizer: str, domains: Sequence[str] | None = None) -> Catalog:
    """The catalog of a prepared token directory; `domains` (the config's list) picks and orders the
    training domains, else every domain whose corpus role is not "novel"."""
    root = Path(path) / tokenizer
    manifest_path = root / "manifest.json"
    if not manifest_path.is_file():
        raise DataError(
            f"{manifest_path} not found: prepare the data first (`make data` for the demo corpus, or "
            f"`python -m data.prepare --corpus DIR --out {path}` for your own)"
        )
    m = read_token_manifest(manifest_path)
    available = list(m["domains"])
    if domains is None:
        roles = _corpus_roles(m, manifest_path)
        train = sorted(d for d in available if roles.get(d, "train") != "novel")
    else:
        unknown = [d for d in domains if d not in available]
        if unknown:
            raise DataError(
                f"data.domains {unknown} are not in {manifest_path}; available: {', '.join(available)}"
            )
        train = list(domains)
    novel = sorted(d for d in available if d not in train)
    empty = [d for d in train if int(m["counts"][d]["train"]["tokens"]) == 0]
    if empty:
        raise DataError(f"training domains {empty} have no training tokens in {manifest_path}")
    check_token_files(root, m, train, manifest_path)
    tok = m["tokenizer"]
    return Catalog(
        root,
        tokenizer,
        int(tok["vocab_size"]),
        int(tok["bos_id"]),
        tuple(train),
        tuple(novel),
        m["counts"],
        tokenizer_fingerprint(tok),
        None if tok.get("eod_id") is None else int(tok["eod_id"]),
    )


def token_file_problems(root: Path, manifest: dict, domains: Sequence[str]) -> list[str]:
    """Every token file (`.bin`, `.idx`) of `domains`' splits that is missing or not the size the manifest
    recorded when prepare wrote it (a truncated copy, a file replaced by another run). Cheap: one stat per file.
    Manifests written before sizes were recorded are not checked."""
    out = []
    for d in domains:
        for split, rec in sorted(manifest["counts"].get(d, {}).items()):
            if not isinstance(rec, dict):
                continue
            for key in ("bin", "idx"):
                rel, size = rec.get(key), rec.get(f"{key}_bytes")
                if not isinstance(rel, str) or not isinstance(size, int):
                    continue
                path = root / rel
                if ".." in Path(rel).parts or Path(rel).is_absolute():
                    out.append(f"{d}/{split}: the manifest names a file outside {root}: {rel[:80]!r}")
                elif not path.is_file():
                    out.append(f"{path} is missing")
                elif path.stat().st_size != size:
                    out.append(f"{path} has {path.stat().st_size:,} bytes, {size:,} when prepared")
    return out


def check_token_files(root: Path, manifest: dict, domains: Sequence[str], manifest_path: Path) -> None:
    """DataError naming every token file of `domains` that does not match `manifest_path` (`token_file_problems`)."""
    problems = token_file_problems(root, manifest, domains)
    if problems:
        raise DataError(
            f"the token files of {manifest_path} do not match it (prepare them again into a new "
            f"directory, or restore them):\n  "
            + "\n  ".join(problems[:20])
            + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        )


def tokenizer_fingerprint(description: dict) -> str:
    """sha256 over what identifies a tokenizer (name, vocabulary size, bos/eod ids, sha256 of its vocabulary
    files), as a token manifest records it: equal fingerprints mean the same token ids for the same text."""
    keys = ("name", "vocab_size", "bos_id", "eod_id", "files")
    return hashlib.sha256(
        json.dumps({k: description.get(k) for k in keys}, sort_keys=True).encode()
    ).hexdigest()


def read_token_manifest(path: Path) -> dict:
    """A token manifest (data/prepare.py), checked for what readers rely on; DataError naming the file if not."""
    if not Path(path).is_file():
        raise DataError(f"{path} not found: prepare the data first (python -m data.prepare)")
    try:
        m = read_json_object(path, TOKEN_MANIFEST_SHAPE, what="token manifest")
    except InputFileError as e:
        raise DataError(f"{e}; re-run data.prepare") from None
    bad = [d for d in m["domains"] if not isinstance(d, str) or not isinstance(m["counts"].get(d, {}), dict)]
    if bad:
        raise DataError(
            f"{path}: domains {bad[:3]} are not names with a mapping of counts; re-run data.prepare"
        )
    missing = [d for d in m["domains"] if d not in m["counts"]]
    if missing:
        raise DataError(f"{path} lists domains {missing} without counts; re-run data.prepare")
    return m


def check_tokenizer(
    data_manifest: dict, model_fingerprint: str | None, model_vocab: int | None, where: str
) -> None:
    """DataError when tokens were made by another tokenizer than the model was trained with (scores on them would
    be meaningless): the fingerprints differ, or the data's vocabulary is larger than the model's."""
    tok = data_manifest["tokenizer"]
    if model_fingerprint and tokenizer_fingerprint(tok) != model_fingerprint:
        raise DataError(
            f"{where}: the tokens were made by tokenizer {tok.get('name')!r} (vocabulary "
            f"{tok.get('vocab_size')}, fingerprint {tokenizer_fingerprint(tok)[:12]}), not the one the model "
            f"was trained with (fingerprint {model_fingerprint[:12]}); prepare the data with the model's "
            "tokenizer, or pass the model's own --data/--tokenizer"
        )
    if model_vocab is not None and int(tok["vocab_size"]) > int(model_vocab):
        raise DataError(
            f"{where}: the tokens' vocabulary ({tok['vocab_size']}) is larger than the model's "
            f"({model_vocab}); prepare the data with the model's tokenizer"
        )


def _corpus_roles(manifest: dict, manifest_path: Path) -> dict[str, str]:
    """Domain -> "train" | "novel": recorded in the token manifest itself (since roles were copied there), else
    read from the corpus manifest it names. A corpus manifest that was recorded but cannot be found is an error:
    silently treating held-out domains as training domains would train on them."""
    if isinstance(manifest.get("roles"), dict):
        return dict(manifest["roles"])
    corpus = manifest.get("corpus", {}) or {}
    cdir = corpus.get("dir")
    if not cdir or not corpus.get("manifest_sha256"):
        return {}
    path = Path(cdir) / "manifest.json"
    if not path.is_file():
        raise DataError(
            f"{manifest_path} takes its domains' train/novel roles from {path}, which is not there "
            f"(a relative path is read from the current directory); list the training domains in "
            f"data.domains, or re-run data.prepare (newer manifests keep the roles themselves)"
        )
    doms = read_json_object(path, {"domains?": dict}, what="corpus manifest").get("domains", {})
    return {d: v.get("split_role", "train") if isinstance(v, dict) else "train" for d, v in doms.items()}
