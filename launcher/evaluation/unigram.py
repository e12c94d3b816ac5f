"""The unigram baseline of a domain: what a model knows if it knows only token frequencies.

    p(v) = (c_v + k) / (N + k V)

c_v = occurrences of token v among the target tokens of the domain's *training* split (N in all), V the vocabulary
size, k (add-k smoothing) chosen from ADD_K_GRID to maximise the likelihood of the domain's development split, so
the baseline is as strong as a unigram model fitted this way can be. It is scored on exactly the target tokens the
models are scored on (the test blocks), as exp(mean NLL). A language model whose perplexity is not well below this
has learnt little beyond the domain's token frequencies; `make reproduce` asks for at most half of it.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch

ADD_K_GRID: tuple[float, ...] = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)


def _nll(counts_V: np.ndarray, k: float, targets: np.ndarray) -> float:
    """Mean NLL (nats) of `targets` under the add-k unigram of `counts_V`."""
    logp = np.log(counts_V[targets] + k) - math.log(counts_V.sum() + k * len(counts_V))
    return float(-logp.mean())


def fit_unigram(train_targets: np.ndarray, vocab_size: int, dev_targets: Optional[np.ndarray] = None
                ) -> tuple[np.ndarray, float]:
    """(log p over the vocabulary, k): counts of the training targets, k from ADD_K_GRID by development NLL (the
    middle of the grid, 0.1, without development tokens)."""
    t = np.asarray(train_targets, dtype=np.int64).ravel()
    if len(t) and (t.min() < 0 or t.max() >= vocab_size):
        raise ValueError(f"token ids outside the vocabulary of {vocab_size}")
    counts = np.bincount(t, minlength=vocab_size).astype(np.float64)
    dev = None if dev_targets is None else np.asarray(dev_targets, dtype=np.int64).ravel()
    k = min(ADD_K_GRID, key=lambda kk: _nll(counts, kk, dev)) if dev is not None and len(dev) else 0.1
    return np.log(counts + k) - math.log(counts.sum() + k * vocab_size), k


def unigram_log_probs(log_p_V: np.ndarray, targets_BT: torch.Tensor) -> torch.Tensor:
    """log p(target) for every position, B T (float64)."""
    return torch.from_numpy(log_p_V[targets_BT.numpy()])


def domain_unigram(data_root: Union[str, Path], tokenizer: str, domain: str, seq_len: int, vocab_size: int,
                   test_targets_BT: torch.Tensor, mask_BT: torch.Tensor, dev_split: str = "valid") -> dict[str, Any]:
    """The domain's unigram perplexity on the given test targets, fitted on its train split (k by `dev_split`):
    {"ppl", "k", "train_tokens", "block_nll"} (block_nll: per-block NLL sums, as the models' in eval.json)."""
    from launcher.evaluation.stats import block_sums

    log_p, k, n_train = _fitted(str(Path(data_root).resolve()), tokenizer, domain, seq_len, vocab_size, dev_split)
    lp_BT = unigram_log_probs(log_p, test_targets_BT)
    nll, tokens = block_sums(lp_BT, mask_BT)
    return {"ppl": math.exp(sum(nll) / sum(tokens)), "k": k, "train_tokens": n_train, "block_nll": nll}


@functools.lru_cache(maxsize=64)
def _fitted(data_root: str, tokenizer: str, domain: str, seq_len: int, vocab_size: int,
            dev_split: str) -> tuple[np.ndarray, float, int]:
    """The fitted unigram of one domain, once per process (several models are evaluated on the same data). The
    counts come straight from the split's token file (megatron-core .bin: the documents' tokens, [bos] included,
    back to back: every token a cross-document block can have as a target)."""
    train, dev = _split_tokens(data_root, tokenizer, domain, "train"), _split_tokens(data_root, tokenizer, domain, dev_split)
    if not train.size:
        raise ValueError(f"{domain}: no training tokens to fit a unigram on")
    log_p, k = fit_unigram(train, vocab_size, dev if dev.size else None)
    return log_p, k, int(train.size)


def _split_tokens(data_root: str, tokenizer: str, domain: str, split: str) -> np.ndarray:
    """Every token of a prepared domain split (empty when the split has none)."""
    from data.catalog import read_token_manifest

    tok_dir = Path(data_root) / tokenizer
    manifest = read_token_manifest(tok_dir / "manifest.json")
    entry = manifest.get("counts", {}).get(domain, {}).get(split)
    if not entry:
        return np.zeros(0, dtype=np.int64)
    return np.fromfile(tok_dir / entry["bin"], dtype=np.dtype(manifest["dtype"])).astype(np.int64)
