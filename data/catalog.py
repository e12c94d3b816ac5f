"""What a prepared token directory holds: training and novel domains, tokenizer, counts.

Read from `<path>/<tokenizer>/manifest.json` (written by data/prepare.py) and, when present, the corpus
manifest it points to (its `split_role` per domain says which domains are held out as "novel").
Domain ids are positions in `train_domains` (sorted by name unless the config lists them), so expert `i`
of a DEMix model is the expert of `train_domains[i]`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence


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

    def domain_id(self, name: str) -> int:
        return self.train_domains.index(name)

    def total_vocab_size(self, with_domain_tokens: bool) -> int:
        """Token ids the model must cover: the tokenizer's, plus one domain token per training domain."""
        return self.vocab_size + (len(self.train_domains) if with_domain_tokens else 0)

    def tokens(self, domain: str, split: str) -> int:
        return int(self.counts[domain][split]["tokens"])


def load_catalog(path: str | Path, tokenizer: str, domains: Optional[Sequence[str]] = None) -> Catalog:
    """The catalog of a prepared token directory; `domains` (the config's list) picks and orders the
    training domains, else every domain whose corpus role is not "novel"."""
    root = Path(path) / tokenizer
    manifest_path = root / "manifest.json"
    if not manifest_path.is_file():
        raise DataError(
            f"{manifest_path} not found: prepare the data first (`make data` for the demo corpus, or "
            f"`python -m data.prepare --corpus DIR --out {path}` for your own)"
        )
    m = json.loads(manifest_path.read_text())
    available = list(m["domains"])
    roles = _corpus_roles(m)
    if domains is None:
        train = sorted(d for d in available if roles.get(d, "train") != "novel")
    else:
        unknown = [d for d in domains if d not in available]
        if unknown:
            raise DataError(f"data.domains {unknown} are not in {manifest_path}; available: {', '.join(available)}")
        train = list(domains)
    novel = sorted(d for d in available if d not in train)
    empty = [d for d in train if int(m["counts"][d]["train"]["tokens"]) == 0]
    if empty:
        raise DataError(f"training domains {empty} have no training tokens in {manifest_path}")
    tok = m["tokenizer"]
    return Catalog(root, tokenizer, int(tok["vocab_size"]), int(tok["bos_id"]), tuple(train), tuple(novel), m["counts"])


def _corpus_roles(manifest: dict) -> dict[str, str]:
    corpus = manifest.get("corpus", {}) or {}
    cdir = corpus.get("dir")
    if not cdir:
        return {}
    path = Path(cdir) / "manifest.json"
    if not path.is_file():
        return {}
    doms = json.loads(path.read_text()).get("domains", {})
    return {d: v.get("split_role", "train") for d, v in doms.items()} if isinstance(doms, dict) else {}
