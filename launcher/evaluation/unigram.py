"""The unigram baseline of a domain: what a model knows if it knows only token frequencies.

    p(v) = (c_v + k) / (N + k V)

c_v = occurrences of token v among the target tokens of the domain's *training* split (N in all), V the vocabulary
size, k (add-k smoothing) chosen from ADD_K_GRID to maximise the likelihood of the domain's development split, so
the baseline is as strong as a unigram model fitted this way can be. It is scored on exactly the target tokens the
models are scored on (the test blocks), as exp(mean NLL). A language model whose perplexity is not well below this
has learnt little beyond the domain's token frequencies; `make reproduce` asks for at most half of it.

Only token counts are needed, never the tokens themselves. They come from the domain's token counts file when the
token manifest names one (`manifest["token_counts"][domain]`: a path relative to `<data_root>/<tokenizer>/` of an
.npy int64 array of shape (3, V'), one row per split in the order of `data.blocks.SPLITS`, every token of the
split's .bin counted, written by data/prepare.py), else they are counted from the split's .bin in blocks of
`_BLOCK_TOKENS` tokens (data prepared before that file existed, or by data/cluster_domains.py): memory O(V + block)
either way, never O(tokens).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

ADD_K_GRID: tuple[float, ...] = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
_BLOCK_TOKENS = 1 << 20  # tokens read from a .bin at a time (bincount casts a block to int64: 8 MiB)


def _vocab_counts(counts: np.ndarray, vocab_size: int, what: str) -> np.ndarray:
    """`counts` (per token id) as float64 of length `vocab_size`: zero-padded, or cut when every count past the
    vocabulary is zero; ValueError (the one `fit_unigram` has always raised) when an id outside it occurs."""
    c = np.asarray(counts).ravel()
    if c.size and not np.issubdtype(c.dtype, np.integer):
        raise ValueError(f"{what} counts must be integers, not {c.dtype}")
    if c.size and c.min() < 0:
        raise ValueError(f"{what} counts must not be negative")
    if len(c) > vocab_size and c[vocab_size:].any():
        raise ValueError(f"token ids outside the vocabulary of {vocab_size}")
    out = np.zeros(vocab_size, dtype=np.float64)
    n = min(len(c), vocab_size)
    out[:n] = c[:n]
    return out


def _nll_counts(counts_V: np.ndarray, k: float, dev_counts_V: np.ndarray) -> float:
    """Mean NLL (nats) of the development tokens (given by their counts) under the add-k unigram of `counts_V`."""
    logp = np.log(counts_V + k) - math.log(counts_V.sum() + k * len(counts_V))
    return float(-(dev_counts_V @ logp) / dev_counts_V.sum())


def fit_unigram_counts(
    train_counts_V: np.ndarray, vocab_size: int, dev_counts_V: np.ndarray | None = None
) -> tuple[np.ndarray, float]:
    """(log p over the vocabulary, k) from per-token-id counts of the training targets (and of the development
    targets: k from ADD_K_GRID by their NLL; the middle of the grid, 0.1, without any). Counts may be shorter than
    `vocab_size` (zero-padded); a nonzero count at an id >= `vocab_size` is a ValueError."""
    counts = _vocab_counts(train_counts_V, vocab_size, "training")
    dev = None if dev_counts_V is None else _vocab_counts(dev_counts_V, vocab_size, "development")
    k = min(ADD_K_GRID, key=lambda kk: _nll_counts(counts, kk, dev)) if dev is not None and dev.sum() else 0.1
    return np.log(counts + k) - math.log(counts.sum() + k * vocab_size), k


def _bincount_ids(targets: np.ndarray, vocab_size: int) -> np.ndarray:
    """Counts per id of a token array, length `vocab_size`; ValueError for ids outside [0, vocab_size)."""
    t = np.asarray(targets, dtype=np.int64).ravel()
    if len(t) and (t.min() < 0 or t.max() >= vocab_size):
        raise ValueError(f"token ids outside the vocabulary of {vocab_size}")
    return np.bincount(t, minlength=vocab_size)


def fit_unigram(
    train_targets: np.ndarray, vocab_size: int, dev_targets: np.ndarray | None = None
) -> tuple[np.ndarray, float]:
    """(log p over the vocabulary, k): counts of the training targets, k from ADD_K_GRID by development NLL (the
    middle of the grid, 0.1, without development tokens). `fit_unigram_counts` on the tokens' bincounts."""
    dev = None if dev_targets is None else _bincount_ids(dev_targets, vocab_size)
    return fit_unigram_counts(_bincount_ids(train_targets, vocab_size), vocab_size, dev)


def unigram_log_probs(log_p_V: np.ndarray, targets_BT: torch.Tensor) -> torch.Tensor:
    """log p(target) for every position, B T (float64)."""
    return torch.from_numpy(log_p_V[targets_BT.numpy()])


def domain_unigram(
    data_root: str | Path,
    tokenizer: str,
    domain: str,
    seq_len: int,
    vocab_size: int,
    test_targets_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    dev_split: str = "valid",
) -> dict[str, Any]:
    """The domain's unigram perplexity on the given test targets, fitted on its train split (k by `dev_split`):
    {"ppl", "k", "train_tokens", "block_nll"} (block_nll: per-block NLL sums, as the models' in eval.json)."""
    from launcher.evaluation.stats import block_sums

    log_p, k, n_train = _fitted(
        str(Path(data_root).resolve()), tokenizer, domain, seq_len, vocab_size, dev_split
    )
    lp_BT = unigram_log_probs(log_p, test_targets_BT)
    nll, tokens = block_sums(lp_BT, mask_BT)
    return {"ppl": math.exp(sum(nll) / sum(tokens)), "k": k, "train_tokens": n_train, "block_nll": nll}


def bin_token_counts(
    path: str | Path, dtype: str | np.dtype, vocab_size: int, block_tokens: int | None = None
) -> np.ndarray:
    """Occurrences of each token id in a token file (a megatron-core .bin: the tokens back to back), int64 of
    length `vocab_size`, read `block_tokens` (default `_BLOCK_TOKENS`) at a time; ValueError naming the file for
    ids outside [0, vocab_size)."""
    dt = np.dtype(dtype)
    block = int(block_tokens or _BLOCK_TOKENS)
    counts = np.zeros(vocab_size, dtype=np.int64)
    with open(path, "rb") as f:
        while True:
            ids = np.fromfile(f, dtype=dt, count=block)
            if not ids.size:
                return counts
            if ids.min() < 0 or ids.max() >= vocab_size:
                raise ValueError(f"{path}: token ids outside the vocabulary of {vocab_size}")
            counts += np.bincount(ids, minlength=vocab_size)


@functools.lru_cache(maxsize=64)
def _fitted(
    data_root: str, tokenizer: str, domain: str, seq_len: int, vocab_size: int, dev_split: str
) -> tuple[np.ndarray, float, int]:
    """The fitted unigram of one domain, once per process (several models are evaluated on the same data), from
    the counts of every token of its train and `dev_split` token files (the documents' tokens, [bos] included,
    back to back: every token a cross-document block can have as a target); see the module docstring for where
    the counts come from."""
    from data.catalog import read_token_manifest

    tok_dir = Path(data_root) / tokenizer
    manifest = read_token_manifest(tok_dir / "manifest.json")
    entries = manifest.get("counts", {}).get(domain, {})
    rel = manifest["token_counts"].get(domain) if isinstance(manifest.get("token_counts"), dict) else None
    stored = _stored_counts(tok_dir, rel, entries) if rel is not None else None
    train, dev = (
        _split_counts(tok_dir, manifest, entries, s, vocab_size, stored) for s in ("train", dev_split)
    )
    n_train = int(train.sum())
    if not n_train:
        raise ValueError(f"{domain}: no training tokens to fit a unigram on")
    log_p, k = fit_unigram_counts(train, vocab_size, dev if dev.sum() else None)
    return log_p, k, n_train


def _stored_counts(tok_dir: Path, rel: Any, entries: dict) -> np.ndarray:
    """The domain's token counts array (SPLITS x V') at `rel`, checked against the manifest's per-split `entries`:
    ValueError naming the file if it is unusable."""
    from data.blocks import SPLITS

    if not isinstance(rel, str) or not rel:
        raise ValueError(
            f"{tok_dir / 'manifest.json'}: token_counts must be a path relative to {tok_dir}, not {rel!r}"
        )
    path = tok_dir / rel
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        why = "it holds pickled data, which is never loaded" if "pickle" in str(e) else str(e)
        raise ValueError(f"{path}: not a readable token counts file ({why}); re-run data.prepare") from None
    if not isinstance(arr, np.ndarray):
        getattr(arr, "close", lambda: None)()  # an .npz archive
    if (
        not isinstance(arr, np.ndarray)
        or arr.ndim != 2
        or arr.shape[0] != len(SPLITS)
        or not np.issubdtype(arr.dtype, np.integer)
    ):
        what = f"shape {arr.shape}, dtype {arr.dtype}" if isinstance(arr, np.ndarray) else type(arr).__name__
        raise ValueError(
            f"{path}: token counts must be an int64 array of shape ({len(SPLITS)}, V) (one row per split "
            f"{', '.join(SPLITS)}), not {what}; re-run data.prepare"
        )
    if arr.size and arr.min() < 0:
        raise ValueError(f"{path}: negative token counts; re-run data.prepare")
    for s, row in zip(SPLITS, arr):
        recorded = entries.get(s, {}).get("tokens") if isinstance(entries.get(s), dict) else None
        if recorded is not None and int(row.sum()) != int(recorded):
            raise ValueError(
                f"{path}: {int(row.sum())} {s} tokens counted, the manifest records {recorded}; "
                "re-run data.prepare"
            )
    return arr.astype(np.int64, copy=False)


def _split_counts(
    tok_dir: Path, manifest: dict, entries: dict, split: str, vocab_size: int, stored: np.ndarray | None
) -> np.ndarray:
    """Counts per token id of one prepared split (all zeros when the split has no tokens): the stored row when
    there is one, else counted from the .bin."""
    from data.blocks import SPLITS

    entry = entries.get(split)
    if not isinstance(entry, dict) or not entry.get("bin"):
        return np.zeros(vocab_size, dtype=np.int64)
    if stored is not None and split in SPLITS:
        return stored[SPLITS.index(split)]
    return bin_token_counts(tok_dir / entry["bin"], manifest["dtype"], vocab_size)
