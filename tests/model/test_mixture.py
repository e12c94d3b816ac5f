"""The inference-time mixture maths (DEMix §5, eqs. 6-9) against hand-computed values on fixed log-likelihoods."""

import math

import pytest
import torch

from model import mixture as mx

# ll[j, b, t] = log p(x_t | x_<t, D = j): 2 experts, 2 blocks, 3 tokens.
LL = torch.tensor(
    [
        [[-1.0, -2.0, -1.0], [-3.0, -1.0, -2.0]],
        [[-2.0, -1.0, -3.0], [-1.0, -1.0, -1.0]],
    ],
    dtype=torch.float64,
)


def _softmax(xs):
    m = max(xs)
    z = sum(math.exp(x - m) for x in xs)
    return [math.exp(x - m) / z for x in xs]


def _lse(xs):
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))


def test_prefix_likelihood_is_exclusive_and_respects_the_mask():
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    pre = mx.prefix_log_likelihood(LL, mask)
    assert pre[0, 0].tolist() == [0.0, -1.0, -1.0]  # the masked token (t=1) adds nothing
    assert pre[1, 1].tolist() == [0.0, -1.0, -2.0]


def test_posterior_with_uniform_prior_matches_bayes_rule_by_hand():
    post = mx.log_posterior(LL, mx.uniform_log_prior(2)).exp()
    # block 0, t=0: no history -> the prior; t=2: history x_0, x_1 -> joint -3 vs -3 -> 1/2.
    assert post[:, 0, 0].tolist() == pytest.approx([0.5, 0.5])
    assert post[:, 0, 1].tolist() == pytest.approx(_softmax([-1.0, -2.0]))
    assert post[:, 0, 2].tolist() == pytest.approx([0.5, 0.5])
    assert post[:, 1, 2].tolist() == pytest.approx(_softmax([-4.0, -2.0]))
    assert torch.allclose(post.sum(0), torch.ones(2, 3, dtype=torch.float64))


def test_posterior_with_a_non_uniform_prior():
    prior = torch.log(torch.tensor([0.9, 0.1], dtype=torch.float64))
    post = mx.log_posterior(LL, prior).exp()
    assert post[:, 1, 0].tolist() == pytest.approx([0.9, 0.1])
    expected = _softmax([-3.0 + math.log(0.9), -1.0 + math.log(0.1)])
    assert post[:, 1, 1].tolist() == pytest.approx(expected)


def test_mixture_log_prob_is_eq6_by_hand():
    lp = mx.posterior_mixture_log_probs(LL, mx.uniform_log_prior(2))
    g = _softmax([-1.0, -2.0])  # block 0, t = 1
    assert float(lp[0, 1]) == pytest.approx(math.log(g[0] * math.exp(-2.0) + g[1] * math.exp(-1.0)))
    assert float(lp[0, 0]) == pytest.approx(math.log(0.5 * math.exp(-1.0) + 0.5 * math.exp(-2.0)))


def test_average_baseline_uses_fixed_uniform_weights():
    lp = mx.average_log_probs(LL)
    for b in range(2):
        for t in range(3):
            assert float(lp[b, t]) == pytest.approx(
                math.log((math.exp(LL[0, b, t]) + math.exp(LL[1, b, t])) / 2)
            )
    # unlike the uniform-prior posterior mixture, which reweights as the prefix grows
    assert not torch.allclose(lp, mx.posterior_mixture_log_probs(LL, mx.uniform_log_prior(2)))


def test_updating_prior_is_eq9_over_end_of_block_posteriors():
    lam = 0.3
    upd = mx.updating_priors(LL, decay=lam)
    pi0 = _softmax([-4.0 + math.log(0.5), -6.0 + math.log(0.5)])  # block 0 under the uniform prior
    assert upd.log_prior_EB[:, 0].exp().tolist() == pytest.approx([0.5, 0.5])
    assert upd.log_posterior_EB[:, 0].exp().tolist() == pytest.approx(pi0)
    # block 1's prior ∝ λ^1 π_0 (one earlier block) = π_0
    assert upd.log_prior_EB[:, 1].exp().tolist() == pytest.approx(pi0)
    pi1 = _softmax([-6.0 + math.log(pi0[0]), -3.0 + math.log(pi0[1])])
    assert upd.log_posterior_EB[:, 1].exp().tolist() == pytest.approx(pi1)
    # the next prior ∝ λ π_1 + λ² π_0
    s = [lam * pi1[j] + lam**2 * pi0[j] for j in range(2)]
    assert upd.final_log_prior_E.exp().tolist() == pytest.approx([v / sum(s) for v in s])
    # and the mixture of block 1 uses that block's prior
    lp = mx.posterior_mixture_log_probs(LL, upd.log_prior_EB)
    assert float(lp[1, 0]) == pytest.approx(_lse([-3.0 + math.log(pi0[0]), -1.0 + math.log(pi0[1])]))


def test_updating_prior_streams_across_calls():
    one = mx.updating_priors(LL)
    state = mx.UpdatingPrior(2)
    mx.updating_priors(LL[:, :1], state=state)
    two = mx.updating_priors(LL[:, 1:], state=state)
    assert torch.allclose(two.final_log_prior_E, one.final_log_prior_E)
    assert state.blocks == 2


def test_updating_prior_recovers_from_an_underflowing_expert():
    ll = torch.zeros(2, 5, 1, dtype=torch.float64)
    ll[1, 0, 0] = -800.0  # expert 1 is ruled out by block 0 (exp(-800) underflows to 0 in float64) ...
    ll[0, 1:, 0] = -400.0  # ... but is far better on the next blocks
    upd = mx.updating_priors(ll)
    assert upd.log_posterior_EB[1, 0].exp() == 0.0
    assert upd.log_posterior_EB[1, -1].exp() > 0.99


def test_mixture_of_identical_experts_equals_one_expert():
    ll = LL[:1].expand(4, 2, 3)
    one = LL[0]
    cached = mx.estimate_cached_prior(ll, ["a", "b", "c", "d"])
    for lp in (
        mx.average_log_probs(ll),
        mx.posterior_mixture_log_probs(ll, mx.uniform_log_prior(4)),
        mx.posterior_mixture_log_probs(ll, mx.updating_priors(ll).log_prior_EB),
        mx.posterior_mixture_log_probs(ll, cached.log_prior()),
        mx.topk_mixture_log_probs(ll, cached.log_prior(), 2).log_probs_BT,
        mx.topk_mixture_log_probs(ll, cached.log_prior(), 3, select="posterior").log_probs_BT,
    ):
        assert torch.allclose(lp, one, atol=1e-12)
    assert cached.probs == pytest.approx([0.25] * 4)


def test_cached_prior_round_trips_through_json(tmp_path):
    dev = torch.randn(3, 120, 5, dtype=torch.float64) - 3.0
    est = mx.estimate_cached_prior(dev, ["news", "code", "legal"], max_blocks=100, estimator="updating")
    assert est.blocks == 100 and est.estimator == "updating"
    assert torch.allclose(est.log_prior(), mx.updating_priors(dev[:, :100]).final_log_prior_E)
    loaded = mx.CachedPrior.load(est.save(tmp_path / "prior.json"))
    assert loaded == est
    assert torch.allclose(loaded.log_prior(["legal", "news", "code"]), est.log_prior()[[2, 0, 1]])
    with pytest.raises(ValueError):
        loaded.log_prior(["news", "code"])


def test_topk_keeps_the_best_experts_and_reports_cost():
    ll = torch.randn(4, 3, 6, dtype=torch.float64) - 2.0
    prior = torch.log(torch.tensor([0.1, 0.5, 0.3, 0.1], dtype=torch.float64))
    full = mx.topk_mixture_log_probs(ll, prior, 4)
    assert torch.allclose(full.log_probs_BT, mx.posterior_mixture_log_probs(ll, prior))
    two = mx.topk_mixture_log_probs(ll, prior, 2)
    assert two.experts == [1, 2] and two.experts_evaluated == 2
    renorm = prior[[1, 2]] - torch.logsumexp(prior[[1, 2]], 0)
    assert torch.allclose(two.log_probs_BT, mx.posterior_mixture_log_probs(ll[[1, 2]], renorm))
    one = mx.topk_mixture_log_probs(ll, prior, 1)
    assert torch.allclose(one.log_probs_BT, ll[1])
    dyn = mx.topk_mixture_log_probs(ll, prior, 1, select="posterior")
    best_EBT = mx.log_posterior(ll, prior).argmax(0)
    assert torch.allclose(dyn.log_probs_BT, ll.gather(0, best_EBT[None])[0]) and dyn.experts_evaluated == 4


def test_naive_and_perplexity():
    assert mx.naive_expert(LL, known=0) == 0
    ppl = mx.expert_perplexities(LL)
    assert ppl == pytest.approx([math.exp(10 / 6), math.exp(9 / 6)])
    assert mx.naive_expert(LL) == 1
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert mx.perplexity(LL[0], mask) == pytest.approx(math.exp(1.5))


# ---------------------------------------------------------------------------- posterior modes, cached estimators


def test_previous_token_posterior_by_hand():
    """weights at t = softmax_j(log prior_j + mask_{t-1} ll[j, b, t-1]); the prior itself at t = 0 and after an
    unscored token."""
    ll = torch.tensor([[[-1.0, -2.0, -3.0, -0.5]], [[-2.0, -1.0, -0.5, -4.0]]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    prior = torch.log(torch.tensor([0.7, 0.3], dtype=torch.float64))
    post = mx.log_posterior(ll, prior, mask, posterior="previous_token").exp()[:, 0]
    expect = torch.stack(
        [torch.softmax(prior + e, 0) for e in (torch.zeros(2), ll[:, 0, 0], torch.zeros(2), ll[:, 0, 2])],
        dim=1,
    )
    assert torch.allclose(post, expect, atol=1e-12)
    # end of block: the last scored token only (here t = 3); a block with nothing scored gives no evidence
    assert torch.equal(mx.end_of_block_evidence(ll, mask, "previous_token")[:, 0], ll[:, 0, 3])
    assert torch.equal(
        mx.end_of_block_evidence(ll, torch.zeros(1, 4), "previous_token"),
        torch.zeros(2, 1, dtype=torch.float64),
    )
    with pytest.raises(ValueError, match="posterior='last'"):
        mx.log_posterior(ll, prior, mask, posterior="last")


def test_previous_token_weights_stay_soft_where_the_prefix_posterior_is_one_hot():
    """Expert 0 is slightly better on every token of a 256-token block: the whole-prefix posterior is one-hot by
    the end, one token of evidence keeps both experts in play (Figure 4 of the reference comes out soft)."""
    ll = torch.stack([torch.full((1, 256), -3.0), torch.full((1, 256), -3.2)]).double()
    prefix = mx.log_posterior(ll, mx.uniform_log_prior(2)).exp()[0, 0, -1]
    prev = mx.log_posterior(ll, mx.uniform_log_prior(2), posterior="previous_token").exp()[0, 0, -1]
    assert prefix > 1 - 1e-15 and 0.5 < prev < 0.6


def test_cached_estimators_by_hand():
    g = torch.Generator().manual_seed(0)
    dev = torch.randn(3, 5, 4, generator=g, dtype=torch.float64) - 2.0
    post_EB = torch.softmax(dev.sum(dim=2), dim=0)  # end-of-block posteriors under the uniform prior
    mean = mx.estimate_cached_prior(dev, ["a", "b", "c"])
    assert (mean.estimator, mean.posterior, mean.blocks) == ("mean", "prefix", 5)
    assert mean.probs == pytest.approx(post_EB.mean(dim=1).tolist(), abs=1e-12)
    s = post_EB[:, 0]
    for b in range(1, 5):
        s = 0.7 * s + 0.3 * post_EB[:, b]
    ewm = mx.estimate_cached_prior(dev, ["a", "b", "c"], estimator="ewm")
    assert ewm.decay == mx.EWM_ALPHA and ewm.probs == pytest.approx(s.tolist(), abs=1e-12)
    prev = mx.estimate_cached_prior(dev, ["a", "b", "c"], max_blocks=3, posterior="previous_token")
    assert prev.probs == pytest.approx(torch.softmax(dev[:, :3, -1], dim=0).mean(dim=1).tolist(), abs=1e-12)
    with pytest.raises(ValueError, match="estimator='median'"):
        mx.estimate_cached_prior(dev, ["a", "b", "c"], estimator="median")


def test_mean_cached_prior_is_softer_than_the_updating_one():
    """Dev blocks won by expert 0 (60 %) and expert 1 (40 %), interleaved: the mean prior is about 0.6/0.4, the
    updating prior (λ = 0.3: the latest block weighs 0.7) follows the last blocks."""
    wins = [0, 1, 0, 1, 0] * 20
    dev = torch.full((2, 100, 8), -5.0, dtype=torch.float64)
    for b, j in enumerate(wins):
        dev[j, b] = -1.0
    mean = mx.estimate_cached_prior(dev, ["x", "y"])
    upd = mx.estimate_cached_prior(dev, ["x", "y"], estimator="updating")
    assert mean.probs[0] == pytest.approx(0.6, abs=1e-6)
    assert upd.probs[0] > 0.69  # the last block (expert 0) dominates


def test_old_cached_prior_files_load_as_updating(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(
        '{"format": "demix-cached-prior/1", "domains": ["a", "b"], "probs": [0.9, 0.1], "blocks": 100, '
        '"decay": 0.3}'
    )
    old = mx.CachedPrior.load(path)
    assert (old.estimator, old.posterior) == ("updating", "prefix")
    path.write_text(path.read_text()[:-1] + ', "estimator": "mode"}')
    with pytest.raises(ValueError, match="estimator 'mode'"):
        mx.CachedPrior.load(path)
