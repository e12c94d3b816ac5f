"""Router-vector mixing (model/mixture.py, router eqs. R1-R4) on fixed numbers: the weights, their causality, the
centring, a planted case, and the posterior with the router weights as a per-token prior."""

import math

import pytest
import torch

from model import mixture as mx


def _case(E=3, B=2, T=6, D=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, D, generator=g, dtype=torch.float64), torch.randn(
        E, D, generator=g, dtype=torch.float64
    )


def _cos(a, b):
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(x * x for x in b))
    return 0.0 if na == 0 or nb == 0 else sum(x * y for x, y in zip(a, b)) / (na * nb)


def test_router_weights_by_hand():
    """R1-R3 written out for one block: prefix means, the centre, centred cosines, softmax over τ."""
    f = [[1.0, 0.0], [0.0, 2.0], [3.0, 1.0]]  # T = 3, D = 2
    r = [[1.0, 1.0], [-1.0, 2.0], [0.0, -3.0]]  # E = 3
    tau = 0.5
    lw = mx.router_log_weights(torch.tensor([f], dtype=torch.float64), torch.tensor(r), tau)
    assert lw.shape == (3, 1, 3) and lw.dtype == torch.float64
    m = [sum(v[d] for v in r) / 3 for d in range(2)]
    for t in range(3):
        q = [sum(f[s][d] for s in range(t + 1)) / (t + 1) for d in range(2)]
        c = [_cos([q[d] - m[d] for d in range(2)], [v[d] - m[d] for d in range(2)]) for v in r]
        z = sum(math.exp(x / tau) for x in c)
        for j in range(3):
            assert lw[j, 0, t].item() == pytest.approx(c[j] / tau - math.log(z), abs=1e-12)


def test_router_weights_sum_to_one_everywhere():
    f, r = _case()
    mask = torch.ones(2, 6)
    mask[0, :2] = 0  # nothing counted yet at t = 0, 1 of block 0
    for m in (None, mask):
        w = mx.router_log_weights(f, r, 0.1, m).exp()
        assert w.shape == (3, 2, 6)
        assert torch.allclose(w.sum(dim=0), torch.ones(2, 6, dtype=torch.float64), atol=1e-12)
    w = mx.router_log_weights(f, r, 0.1, mask).exp()
    assert torch.allclose(w[:, 0, :2], torch.full((3, 2), 1 / 3, dtype=torch.float64))  # uniform before


def test_router_weights_are_causal():
    """Changing the features after position t changes no weight at positions <= t."""
    f, r = _case(T=8)
    before = mx.router_log_weights(f, r, 0.1)
    for t in range(7):
        g = f.clone()
        g[:, t + 1 :] = 100.0 * torch.randn_like(g[:, t + 1 :])
        after = mx.router_log_weights(g, r, 0.1)
        assert torch.equal(after[:, :, : t + 1], before[:, :, : t + 1]), t
        assert not torch.allclose(after[:, :, t + 1 :], before[:, :, t + 1 :])


def test_one_expert_gets_weight_one():
    f, r = _case(E=1)
    lw = mx.router_log_weights(f, r, 0.1)
    assert lw.shape == (1, 2, 6) and torch.equal(lw, torch.zeros_like(lw))


def test_centring_makes_a_shared_shift_and_a_common_scale_irrelevant():
    """Adding one vector to every r_j and every feature moves q and m alike (R1-R2): nothing changes; nor does
    scaling all of them by a positive factor (a cosine)."""
    f, r = _case(E=4, D=7)
    base = mx.router_log_weights(f, r, 0.1)
    v = 50.0 * torch.randn(7, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert torch.allclose(mx.router_log_weights(f + v, r + v, 0.1), base, atol=1e-9)
    assert torch.allclose(mx.router_log_weights(3.5 * f, 3.5 * r, 0.1), base, atol=1e-12)
    # without the centre the shift would matter: the uncentred cosines change
    shifted = torch.nn.functional.cosine_similarity((f + v)[None], (r + v)[:, None, None], dim=-1)
    plain = torch.nn.functional.cosine_similarity(f[None], r[:, None, None], dim=-1)
    assert not torch.allclose(shifted, plain, atol=1e-3)


def test_features_at_an_experts_vector_route_to_it():
    """A planted case: every feature equals r_k (plus a shared offset): q - m = r_k - m, cosine 1 with expert k,
    so w_k is the largest weight everywhere and close to 1 at τ = 0.1."""
    _, r = _case(E=4, D=16, seed=4)
    for k in range(4):
        f = r[k].expand(2, 5, 16).clone()
        w = mx.router_log_weights(f, r, 0.1).exp()
        assert (w.argmax(dim=0) == k).all()
        assert (w[k] > 0.95).all()


def test_masked_features_take_no_part():
    f, r = _case()
    mask = torch.ones(2, 6)
    mask[:, 2] = 0
    g = f.clone()
    g[:, 2] = 1e3  # the masked position's feature is never read
    a, b = mx.router_log_weights(f, r, 0.1, mask), mx.router_log_weights(g, r, 0.1, mask)
    assert torch.equal(a, b)
    assert torch.equal(a[:, :, 2], a[:, :, 1])  # nothing new counted at t = 2: the same prefix mean


def test_temperature_sharpens_and_bad_inputs_are_refused():
    f, r = _case()
    soft, sharp = mx.router_log_weights(f, r, 10.0).exp(), mx.router_log_weights(f, r, 0.01).exp()
    assert soft.max() < 0.5 < sharp.max()
    for tau in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="temperature"):
            mx.router_log_weights(f, r, tau)
    with pytest.raises(ValueError, match="same D"):
        mx.router_log_weights(f, r[:, :3], 0.1)
    with pytest.raises(ValueError, match="at least one"):
        mx.router_log_weights(f, r[:0], 0.1)


def test_router_posterior_is_eqs_7_8_with_the_router_weights_as_a_per_token_prior():
    """R4 by hand: log w_j(t) + sum_{s<t} ll_j(s), normalised over j; a per-token prior constant in t is the
    per-block prior; the mixture is eq. 6 with those weights."""
    f, r = _case(E=2, B=1, T=4, D=3, seed=5)
    lw = mx.router_log_weights(f, r, 0.2)
    ll = torch.tensor([[[-1.0, -2.0, -0.5, -3.0]], [[-2.0, -0.5, -1.0, -1.0]]], dtype=torch.float64)
    post = mx.log_posterior(ll, lw)
    for t in range(4):
        joint = [lw[j, 0, t].item() + sum(ll[j, 0, :t].tolist()) for j in range(2)]
        lse = max(joint) + math.log(sum(math.exp(x - max(joint)) for x in joint))
        for j in range(2):
            assert post[j, 0, t].item() == pytest.approx(joint[j] - lse, abs=1e-12)
    lp = mx.posterior_mixture_log_probs(ll, lw)
    assert torch.allclose(lp, torch.logsumexp(ll + post, dim=0))
    per_block = torch.log(torch.tensor([[0.3], [0.7]], dtype=torch.float64))  # E B
    assert torch.equal(
        mx.log_posterior(ll, per_block[..., None].expand(2, 1, 4)), mx.log_posterior(ll, per_block)
    )
    with pytest.raises(ValueError, match="per-token prior"):
        mx.log_posterior(ll, lw[:, :, :2])
    router = mx.mixture_log_probs(ll, lw)  # mode "router": eq. 6 with g = w
    assert torch.allclose(router, torch.logsumexp(ll + lw, dim=0))
