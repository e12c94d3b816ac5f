"""The data a consolidated checkpoint reads, checked against it: which prepared tokens (data root and tokenizer),
their compatibility with the checkpoint's tokenizer fingerprint, its blocks as model inputs, its tokenizer, and the
raw texts of a prepared split. Below both launcher/evaluation/ and launcher/modular/, which share it.

    root, tok = checkpoint_data("runs/demix/model")          # the recorded data.path/tokenizer, checked
    blocks_NT1 = load_blocks(root, tok, "legal", "test", seq_len=128, max_blocks=16)
    tokens_NT, targets_NT, mask_NT = block_inputs(blocks_NT1)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from data.blocks import BlockDataset
from data.catalog import DataError, check_tokenizer, read_token_manifest
from launcher.checkpoint import CheckpointError, Consolidated, read_meta
from launcher.config import RunConfig
from launcher.typed import from_dict


def data_manifest(
    data_root: str | Path,
    tokenizer: str,
    model_tokenizer_sha256: str | None = None,
    model_vocab: int | None = None,
) -> dict[str, Any]:
    """The token manifest of `data_root/tokenizer`, refusing (DataError) tokens of another tokenizer than the
    model's (its consolidated checkpoint records the fingerprint): perplexities on them would be meaningless."""
    path = Path(data_root) / tokenizer / "manifest.json"
    manifest = read_token_manifest(path)
    check_tokenizer(manifest, model_tokenizer_sha256, model_vocab, str(path))
    return manifest


def check_token_ids(manifest: dict[str, Any], model_vocab: int, where: str, domain_tokens: int = 0) -> None:
    """DataError unless every token id the data can hold (its tokenizer's vocabulary, plus `domain_tokens` ids after
    it with `data.mixture=domain_token`) is below `model_vocab`, the model's embedding rows: the one check every
    entry point that feeds prepared tokens to a model makes before loading a tensor, instead of torch's "index out
    of range in self" halfway through."""
    tok = manifest["tokenizer"]
    need = int(tok["vocab_size"]) + domain_tokens
    if need > int(model_vocab):
        extra = f" + {domain_tokens} domain tokens" if domain_tokens else ""
        raise DataError(
            f"{where}: the {tok.get('name')!r} tokens use ids up to {need - 1} (a vocabulary of "
            f"{tok['vocab_size']}{extra}), beyond the model's vocabulary of {model_vocab} ids; use tokens "
            "prepared with the model's tokenizer (--data/--tokenizer)"
        )


def model_vocab(cfg: RunConfig) -> int:
    """The token ids a model of `cfg` accepts whatever it was padded for: `model.vocab_size` padded at one rank."""
    return cfg.model.padded_vocab_size(1)


def domain_token_count(cfg: RunConfig, domains: list[str]) -> int:
    """The domain-token ids after the tokenizer's that the data's blocks carry (`data.mixture=domain_token`)."""
    return len(domains) if cfg.data.mixture == "domain_token" else 0


def check_checkpoint_data(
    c: Consolidated | str | Path, data_root: str | Path, tokenizer: str | None = None
) -> dict[str, Any]:
    """`data_manifest` for checkpoint `c` (its tokenizer fingerprint and vocabulary size) and `check_token_ids`
    against its model's vocabulary; a path reads only its meta.json, so a CLI checks the data before loading any
    tensor. `tokenizer` defaults to the checkpoint's."""
    meta = c.meta if isinstance(c, Consolidated) else read_meta(c)
    tokenizer = tokenizer or meta["config"].get("data", {}).get("tokenizer", "gpt2")
    manifest = data_manifest(data_root, tokenizer, meta.get("tokenizer_sha256"), meta.get("vocab_size"))
    cfg = c.cfg if isinstance(c, Consolidated) else from_dict(RunConfig, meta["config"])
    where = str(Path(data_root) / tokenizer / "manifest.json")
    check_token_ids(manifest, model_vocab(cfg), where, domain_token_count(cfg, list(meta["domains"])))
    return manifest


def data_source(c: Consolidated, data: str | None, tokenizer: str | None) -> tuple[str, str]:
    """Where the domain data lives: given, else the checkpoint's own training data; refused (DataError) when its
    tokens come from another tokenizer than the checkpoint's."""
    data, tokenizer = data or c.cfg.data.path, tokenizer or c.cfg.data.tokenizer
    check_checkpoint_data(c, data, tokenizer)
    return data, tokenizer


def checkpoint_data(
    checkpoint: Consolidated | str | Path,
    data: str | Path | None = None,
    tokenizer: str | None = None,
) -> tuple[str, str]:
    """(data root, tokenizer) to evaluate or generate with: the ones given, else the checkpoint's own - the data.path
    and data.tokenizer its run config recorded, by `data_source` (the rule `launcher.modular` uses too) -
    checked against its tokenizer fingerprint. A path reads only meta.json, so a CLI checks the data
    before loading any tensor. When the recorded data is not there, DataError names the recorded path and --data;
    the demo's data is never a silent default."""
    if isinstance(checkpoint, Consolidated):
        c = checkpoint
    else:  # meta.json only: no tensor is read
        meta = read_meta(checkpoint)
        c = Consolidated(
            cfg=from_dict(RunConfig, meta["config"], source=str(Path(checkpoint) / "meta.json")),
            domains=list(meta["domains"]),
            state_dict={},
            step=int(meta.get("step", 0)),
            meta=meta,
        )
    if data is None:
        recorded, name = Path(c.cfg.data.path), tokenizer or c.cfg.data.tokenizer
        if not (recorded / name / "manifest.json").is_file():
            raise DataError(
                f"the checkpoint's recorded data is not there: its run config says data.path={recorded} "
                f"(tokenizer {name}), and {recorded / name / 'manifest.json'} is missing"
                + (f" (relative to {Path.cwd()})" if not recorded.is_absolute() else "")
                + "; pass --data DIR, the prepared tokens root the model was trained on (the directory "
                f"holding {name}/manifest.json, written by python -m data.prepare)"
            )
    root, name = data_source(c, None if data is None else str(data), tokenizer)
    return str(root), name


def load_blocks(
    data_root: str | Path,
    tokenizer: str,
    domain: str,
    split: str,
    seq_len: int,
    max_blocks: int | None,
) -> np.ndarray:
    """The first `max_blocks` blocks (N x (T+1) tokens, in stream order) of a domain's split; N may be 0."""
    try:
        ds = BlockDataset.from_prepared(data_root, tokenizer, domain, split, seq_len)
    except (ValueError, FileNotFoundError):
        return np.zeros((0, seq_len + 1), dtype=np.int64)
    n = len(ds) if max_blocks is None else min(len(ds), max_blocks)
    return np.stack([ds[i] for i in range(n)]) if n else np.zeros((0, seq_len + 1), dtype=np.int64)


def count_blocks(
    data_root: str | Path,
    tokenizer: str,
    domain: str,
    split: str,
    seq_len: int,
    max_blocks: int | None,
) -> int:
    """How many blocks `load_blocks` returns, without reading them."""
    try:
        n = len(BlockDataset.from_prepared(data_root, tokenizer, domain, split, seq_len))
    except (ValueError, FileNotFoundError):
        return 0
    return n if max_blocks is None else min(n, max_blocks)


def block_inputs(blocks_NT1: np.ndarray, domain_token: int | None = None) -> tuple[torch.Tensor, ...]:
    """(tokens_NT, targets_NT, mask_NT) as the sampler builds them (data/sampler.py)."""
    x = torch.from_numpy(blocks_NT1.astype(np.int64))
    if domain_token is None:
        tokens, targets = x[:, :-1], x[:, 1:]
    else:
        T = x.shape[1] - 1
        tokens = torch.cat(
            [torch.full((x.shape[0], 1), domain_token, dtype=torch.long), x[:, : T - 1]], dim=1
        )
        targets = x[:, :T]
    return tokens.contiguous(), targets.contiguous(), torch.ones(targets.shape, dtype=torch.float32)


def load_export_tokenizer(c: Consolidated, data: str | Path | None = None) -> Any:
    """The tokenizer `c` was trained with, from the prepared data root `data` (default: the checkpoint's
    `data.path`), checked against the checkpoint's tokenizer fingerprint. GPT-2 needs no data (offline files)."""
    from data.tokenizer import load_prepared_tokenizer, load_tokenizer

    name = c.meta.get("tokenizer", c.cfg.data.tokenizer)
    root = Path(data if data is not None else c.cfg.data.path)
    if not (root / name / "manifest.json").is_file():
        if name == "gpt2":
            return load_tokenizer("gpt2")
        raise CheckpointError(
            f"the {name} tokenizer of this checkpoint is not under {root / name}: pass --data DIR, "
            "the prepared tokens root the model was trained on (or --no-tokenizer)"
        )
    check_checkpoint_data(c, root, name)
    return load_prepared_tokenizer(root, name)


def split_documents_text(
    data_root: str | Path, prepared: str, split: str = "test", max_docs: int | None = None
) -> tuple[dict[str, list[str]], dict]:
    """The texts of one split of every domain, exactly as `data.prepare` tokenised them: the corpus the token
    manifest `<data_root>/<prepared>/manifest.json` names, read, validated and split by prepare's own code
    (`data.prepare.split_texts`, with the recorded seed, fractions and chunk size), anonymised with the recorded
    policy.
    Returns {domain: texts} (the first `max_docs` of each) and notes: which corpus files no longer have the
    sha256 the manifest recorded (then the split is not the tokenised one)."""
    from data.blocks import SPLITS
    from data.prepare import split_texts
    from data.tokenizer import sha256_file

    if split not in SPLITS:
        raise ValueError(f"split {split!r}: choose one of {', '.join(SPLITS)}")
    m = read_token_manifest(Path(data_root) / prepared / "manifest.json")
    corpus_dir = Path(m["corpus"]["dir"])
    files = {d: corpus_dir / f"{d}.jsonl" for d in m["domains"]}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"corpus files of {data_root}/{prepared} not found: {', '.join(missing)}")
    recorded = m["corpus"].get("files", {})
    changed = [p.name for p in files.values() if recorded.get(p.name) not in (None, sha256_file(p))]
    out = split_texts(
        files, m["split"], SPLITS.index(split), m.get("anonymise", {}).get("policy", {}), max_docs
    )
    return out, {"corpus_dir": str(corpus_dir), "changed_corpus_files": changed}
