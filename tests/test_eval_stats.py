"""launcher/evaluation/stats.py: bootstrap intervals over blocks, paired ratios and seed spread, against direct
computations and known cases."""

import math

import numpy as np
import pytest
import torch

from launcher.evaluation import stats


def test_block_sums_skip_unscored_tokens():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    nll, tokens = stats.block_sums(lp, mask)
    assert nll == pytest.approx([6.0, 1.0]) and tokens == [3, 2]


def test_bootstrap_interval_contains_the_point_and_shrinks_with_more_blocks():
    rng = np.random.default_rng(1)
    widths = []
    for B in (16, 256):
        tokens = [100] * B
        nll = list(100 * (3.0 + 0.3 * rng.standard_normal(B)))
        ppl, lo, hi = stats.bootstrap_ppl(nll, tokens)
        assert ppl == pytest.approx(math.exp(sum(nll) / sum(tokens)))
        assert lo < ppl < hi
        widths.append(hi - lo)
    assert widths[1] < widths[0] / 2.5  # ~ 1/sqrt(B): 4x fewer with 16x the blocks
    # identical blocks: no uncertainty; reproducible for a fixed seed
    assert stats.bootstrap_ppl([30.0] * 8, [10] * 8)[1:] == pytest.approx((math.exp(3), math.exp(3)))
    assert stats.bootstrap_ppl(nll, tokens) == stats.bootstrap_ppl(nll, tokens)


def test_paired_ratio_removes_shared_block_variation():
    """B is A plus a constant 0.05 nats per token on every block; the blocks themselves vary a lot. The paired
    interval is exactly exp(-0.05), while unpaired intervals of A and B overlap."""
    rng = np.random.default_rng(2)
    tokens = [50] * 64
    a = list(50 * (2.0 + rng.standard_normal(64)).clip(0.5))
    b = [x + 0.05 * 50 for x in a]
    ratio, lo, hi = stats.paired_ratio(a, b, tokens)
    assert ratio == pytest.approx(math.exp(-0.05)) and lo == pytest.approx(ratio) and hi == pytest.approx(ratio)
    _, a_lo, a_hi = stats.bootstrap_ppl(a, tokens)
    _, b_lo, _ = stats.bootstrap_ppl(b, tokens)
    assert b_lo < a_hi  # unpaired: not separable


def test_mean_of_domains_and_seed_spread():
    d1, d2 = ([20.0] * 4, [10] * 4), ([30.0] * 4, [10] * 4)
    mean, lo, hi = stats.bootstrap_mean_ppl([d1, d2])
    assert mean == pytest.approx((math.exp(2) + math.exp(3)) / 2) and lo == pytest.approx(mean) == hi
    s = stats.seed_spread([10.0, 12.0, 14.0])
    assert s == {"mean": 12.0, "sd": 2.0, "min": 10.0, "max": 14.0, "n": 3}
    assert stats.seed_spread([5.0])["sd"] == 0.0
    with pytest.raises(ValueError, match="one NLL sum and one token count per block"):
        stats.bootstrap_ppl([1.0, 2.0], [1])
    with pytest.raises(ValueError, match="at least one scored token"):
        stats.bootstrap_ppl([1.0], [0])


def test_unigram_fit_by_hand_and_k_chosen_on_dev():
    from launcher.evaluation.unigram import ADD_K_GRID, fit_unigram, unigram_log_probs

    train = np.array([0, 0, 0, 1, 2, 2])
    log_p, k = fit_unigram(train, 4, dev_targets=np.array([0, 2, 2, 0]))
    assert k in ADD_K_GRID and np.exp(log_p).sum() == pytest.approx(1.0)
    expect = np.log((np.bincount(train, minlength=4) + k) / (6 + 4 * k))
    assert log_p == pytest.approx(expect)
    assert k == min(ADD_K_GRID)  # the dev set has no unseen token: as little smoothing as the grid allows
    _, k_unseen = fit_unigram(train, 4, dev_targets=np.array([3, 3, 3, 0]))
    assert k_unseen > k  # a dev set full of an unseen token asks for more
    lp = unigram_log_probs(log_p, torch.tensor([[0, 3]]))
    assert lp[0, 1] == pytest.approx(np.log(k / (6 + 4 * k)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        fit_unigram(np.array([5]), 4)
