"""Uncertainty of perplexities: bootstrap over evaluation blocks, paired comparisons, and the spread over seeds.

Perplexity of a set of blocks b with NLL sums n_b (nats) and scored-token counts c_b is

    ppl = exp( sum_b n_b / sum_b c_b ).

Blocks, not tokens, are the resampling unit: tokens of a block share a context and are not independent. A
percentile bootstrap draws R resamples of the B blocks with replacement (one fixed seed, so a report is
reproducible) and takes the (1-level)/2 and (1+level)/2 quantiles of the resampled perplexities. A domain
average (the paper's Tables 3/5: the plain mean of per-domain perplexities) resamples each domain's blocks
independently in every replicate and averages. A paired comparison of two models on the *same* blocks resamples
the block indices once per replicate for both, so the interval of the ratio ppl_A / ppl_B excludes the
block-to-block variation both share (a ratio interval below 1 means A is better on this kind of text, not only on
these blocks). Seeds are summarised by their mean, sample standard deviation, min and max.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

BOOTSTRAP_REPLICATES = 1000
BOOTSTRAP_SEED = 0
LEVEL = 0.95


def block_sums(
    log_probs_BT: torch.Tensor, mask_BT: torch.Tensor | None = None
) -> tuple[list[float], list[int]]:
    """Per-block NLL sums (nats, float64) and scored-token counts of B x T token log-probabilities."""
    lp = log_probs_BT.to(torch.float64)
    m = torch.ones_like(lp) if mask_BT is None else mask_BT.to(torch.float64)
    nll = -(torch.where(m.bool(), lp, torch.zeros((), dtype=torch.float64))).sum(dim=1)
    return nll.tolist(), [int(c) for c in m.sum(dim=1).tolist()]


def _replicate_indices(n_blocks: int, replicates: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_blocks, size=(replicates, n_blocks))


def _check(nll: Sequence[float], tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    n, c = np.asarray(nll, dtype=np.float64), np.asarray(tokens, dtype=np.float64)
    if n.shape != c.shape or n.ndim != 1 or not len(n):
        raise ValueError(f"need one NLL sum and one token count per block, got {n.shape} and {c.shape}")
    if (c <= 0).any():
        raise ValueError("every block needs at least one scored token")
    return n, c


def _interval(samples: np.ndarray, level: float) -> tuple[float, float]:
    lo, hi = np.quantile(samples, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def bootstrap_ppl(
    nll: Sequence[float],
    tokens: Sequence[int],
    replicates: int = BOOTSTRAP_REPLICATES,
    seed: int = BOOTSTRAP_SEED,
    level: float = LEVEL,
) -> tuple[float, float, float]:
    """(perplexity, low, high): the percentile bootstrap interval over blocks."""
    n, c = _check(nll, tokens)
    idx = _replicate_indices(len(n), replicates, seed)
    samples = np.exp(n[idx].sum(axis=1) / c[idx].sum(axis=1))
    return (math.exp(n.sum() / c.sum()), *_interval(samples, level))


def bootstrap_mean_ppl(
    domains: Sequence[tuple[Sequence[float], Sequence[int]]],
    replicates: int = BOOTSTRAP_REPLICATES,
    seed: int = BOOTSTRAP_SEED,
    level: float = LEVEL,
) -> tuple[float, float, float]:
    """(mean of per-domain perplexities, low, high): each domain's blocks resampled independently per replicate."""
    if not domains:
        raise ValueError("no domains to average")
    point, samples = [], np.zeros(replicates)
    for k, (nll, tokens) in enumerate(domains):
        n, c = _check(nll, tokens)
        idx = _replicate_indices(len(n), replicates, seed + 7919 * k)
        samples += np.exp(n[idx].sum(axis=1) / c[idx].sum(axis=1))
        point.append(math.exp(n.sum() / c.sum()))
    return (float(np.mean(point)), *_interval(samples / len(domains), level))


def paired_ratio(
    nll_a: Sequence[float],
    nll_b: Sequence[float],
    tokens: Sequence[int],
    replicates: int = BOOTSTRAP_REPLICATES,
    seed: int = BOOTSTRAP_SEED,
    level: float = LEVEL,
) -> tuple[float, float, float]:
    """(ppl_A / ppl_B, low, high) of two models scored on the same blocks (same token counts), paired bootstrap."""
    a, c = _check(nll_a, tokens)
    b, _ = _check(nll_b, tokens)
    idx = _replicate_indices(len(a), replicates, seed)
    samples = np.exp((a[idx].sum(axis=1) - b[idx].sum(axis=1)) / c[idx].sum(axis=1))
    return (math.exp((a.sum() - b.sum()) / c.sum()), *_interval(samples, level))


def seed_spread(values: Sequence[float]) -> dict[str, float]:
    """Mean, sample standard deviation (0 for one seed), min, max and count of one number over seeds."""
    v = np.asarray(values, dtype=np.float64)
    if not len(v):
        raise ValueError("no values")
    return {
        "mean": float(v.mean()),
        "sd": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
        "min": float(v.min()),
        "max": float(v.max()),
        "n": int(len(v)),
    }
