"""Several experts in one DEMix/CSE layer run as one permutation (model.demix.run_grouped): parity with the former
per-expert scatter, kept here as the reference (`reference_demix_forward`, `reference_cse_forward`).

The reference scatters each expert's rows into the whole activation with an out-of-place `index_put` and adds
`0.0 * p.view(-1)[0]` of every expert parameter to the output ("touch every expert"). The fast path must give the
same outputs and the same gradients (inputs and every expert parameter, an all-zero non-None gradient for an expert
that received no row), in fp32 and under bf16 autocast.
"""

from __future__ import annotations

import pytest
import torch

from experiments.demix_local_experts import reference_demix_hidden
from model.cse import CSEFFN
from model.demix import DemixFFN, run_grouped
from model.mlp import FFNOutput, expert_output_like

RTOL = 1e-6


def reference_cse_forward(ffn: CSEFFN, x_BTD: torch.Tensor) -> FFNOutput:
    """CSEFFN.forward before the permutation."""
    ids_B, v_BP = ffn.assign(x_BTD)
    if ffn.training and int(ffn.num_active) and torch.is_grad_enabled():
        with torch.no_grad():
            ffn.pending_sum_EP.index_add_(0, ids_B, v_BP.double())
            ffn.pending_count_E.index_add_(0, ids_B, torch.ones_like(ids_B, dtype=torch.float64))
    out_BTD = expert_output_like(x_BTD)
    for e in ids_B.unique().tolist():
        rows_N = (ids_B == e).nonzero(as_tuple=True)[0]
        out_BTD = out_BTD.index_put((rows_N,), ffn.experts[str(e)](x_BTD[rows_N]))
    out_BTD = out_BTD + 0.0 * sum(p.view(-1)[0] for p in ffn.experts.parameters())
    load_E = torch.bincount(ids_B, minlength=ffn.num_slots).to(x_BTD.dtype)
    return FFNOutput(hidden=out_BTD, stats={"cluster_load_E": load_E, "num_clusters": ffn.num_active.float()})


def _model_cfg(kind: str, experts: int, d_model: int = 32):
    from launcher.config import load_run_config

    return load_run_config(
        None,
        [
            "model.preset=tiny",
            "model.n_layers=2",
            "model.vocab_size=128",
            "model.seq_len=16",
            f"model.d_model={d_model}",
            "model.n_heads=2",
            f"model.ffn.kind={kind}",
            f"model.ffn.num_experts={experts}",
            "data.mixture=natural",
        ],
    ).model


def _forward_backward(ffn: torch.nn.Module, fwd, x_BTD: torch.Tensor, autocast: bool):
    """(output, input grad, {param name: grad}) of a fixed random projection of the output."""
    ffn.zero_grad(set_to_none=True)
    x = x_BTD.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = fwd(x)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
    (out * w).float().sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in ffn.named_parameters()}


def _assert_parity(got, want) -> None:
    out, gx, grads = got
    ref_out, ref_gx, ref_grads = want
    assert out.dtype == ref_out.dtype
    torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=0)
    torch.testing.assert_close(gx, ref_gx, rtol=RTOL, atol=0)
    assert grads.keys() == ref_grads.keys()
    for n, g in grads.items():
        assert g is not None, f"{n} has no gradient"
        torch.testing.assert_close(g, ref_grads[n], rtol=RTOL, atol=0, msg=n)


IDS = {
    "all-experts-unsorted": [2, 0, 1, 0, 2, 1],
    "all-experts-sorted": [0, 0, 1, 2, 2, 2],
    "one-expert-idle": [2, 2, 0, 2, 0],  # expert 1 gets no row: zero gradient, not None
    "one-expert-has-all": [1, 1, 1],  # identity permutation: no gather, no scatter
    "single-sequence": [2],
}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("ids", list(IDS), ids=list(IDS))
def test_demix_grouped_matches_the_per_expert_scatter(ids: str, autocast: bool) -> None:
    torch.manual_seed(0)
    ffn = DemixFFN(_model_cfg("demix", 3), [0, 1, 2])
    domain_ids_B = torch.tensor(IDS[ids])
    x = torch.randn(len(IDS[ids]), 5, 32)
    got = _forward_backward(ffn, lambda x: ffn(x, domain_ids_B).hidden, x, autocast)
    want = _forward_backward(ffn, lambda x: reference_demix_hidden(ffn, x, domain_ids_B), x, autocast)
    _assert_parity(got, want)
    assert got[0].dtype == (torch.bfloat16 if autocast else torch.float32)
    for e in ffn.expert_ids:
        expected_zero = e not in IDS[ids]
        for n, _p in ffn.experts[str(e)].named_parameters():
            assert (got[2][f"experts.{e}.{n}"].abs().sum() == 0) == expected_zero, (e, n)


def test_demix_holding_some_domains_routes_global_ids_and_reports_missing_ones() -> None:
    torch.manual_seed(0)
    ffn = DemixFFN(_model_cfg("demix", 8), [5, 1, 3])  # a rank's own domains: sparse global ids
    domain_ids_B = torch.tensor([5, 3, 5, 1])
    x = torch.randn(4, 3, 32)
    _assert_parity(
        _forward_backward(ffn, lambda x: ffn(x, domain_ids_B).hidden, x, False),
        _forward_backward(ffn, lambda x: reference_demix_hidden(ffn, x, domain_ids_B), x, False),
    )
    with pytest.raises(
        ValueError, match=r"domain ids \[0, 7\] have no expert here \(this layer holds experts \[1, 3, 5\]\)"
    ):
        ffn(x, torch.tensor([7, 3, 0, 7]))


def test_no_grad_forward_and_frozen_experts() -> None:
    torch.manual_seed(0)
    ffn = DemixFFN(_model_cfg("demix", 3), [0, 1, 2])
    x, ids = torch.randn(3, 4, 32), torch.tensor([2, 0, 2])
    with torch.no_grad():
        torch.testing.assert_close(ffn(x, ids).hidden, reference_demix_hidden(ffn, x, ids), rtol=RTOL, atol=0)
    ffn.experts["1"].requires_grad_(False)  # an idle frozen expert: nothing to touch, no gradient made
    x.requires_grad_(True)
    ffn(x, ids).hidden.sum().backward()
    assert all(p.grad is None for p in ffn.experts["1"].parameters())
    assert all(p.grad is not None for e in "02" for p in ffn.experts[e].parameters())


def test_run_grouped_touch_costs_no_activation_pass() -> None:
    """The zero gradient of an idle expert is made in backward without an activation-sized add in forward: the
    output of an already-sorted batch is the expert's own output tensor (a view of it)."""
    torch.manual_seed(0)
    ffn = DemixFFN(_model_cfg("demix", 3), [0, 1, 2])
    x = torch.randn(2, 4, 32)
    experts = [ffn.experts[str(e)] for e in ffn.expert_ids]
    out = run_grouped(x, experts, [0, 2, 0], None)
    torch.testing.assert_close(out, experts[1](x), rtol=0, atol=0)
    out.sum().backward()
    for e in (0, 2):
        assert all(p.grad is not None and not p.grad.any() for p in experts[e].parameters())


def _cse_layer(x_BTD: torch.Tensor, centre_rows: list[int]) -> CSEFFN:
    """A 4-slot CSE layer whose clusters are centred on these sequences' embeddings (so sequence centre_rows[j]
    routes to cluster j); no clusters (every sequence to expert 0) when `centre_rows` is empty."""
    torch.manual_seed(0)
    ffn = CSEFFN(_model_cfg("cse", 4), layer_idx=0)
    if centre_rows:
        ffn.set_clusters(ffn.embed(x_BTD)[centre_rows], torch.ones(len(centre_rows)))
    return ffn


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("clusters", [0, 3], ids=["before-clustering", "3-of-4-clusters"])
def test_cse_grouped_matches_the_per_expert_scatter(clusters: int, autocast: bool) -> None:
    x = torch.randn(8, 5, 32, generator=torch.Generator().manual_seed(3))
    ffn = _cse_layer(x, [5, 0, 3][:clusters]).train()
    ids = ffn.assign(x)[0]
    if clusters:
        assert 1 < len(set(ids.tolist())) and ids.tolist() != sorted(ids.tolist())  # several, unsorted
    stats = {}

    def fast(x):
        out = ffn(x)
        stats["fast"] = out.stats
        return out.hidden

    def ref(x):
        out = reference_cse_forward(ffn, x)
        stats["ref"] = out.stats
        return out.hidden

    got = _forward_backward(ffn, fast, x, autocast)
    sum_fast, count_fast = ffn.pending_sum_EP.clone(), ffn.pending_count_E.clone()
    ffn.pending_sum_EP.zero_(), ffn.pending_count_E.zero_()
    want = _forward_backward(ffn, ref, x, autocast)
    _assert_parity(got, want)
    torch.testing.assert_close(
        stats["fast"]["cluster_load_E"], stats["ref"]["cluster_load_E"], rtol=0, atol=0
    )
    torch.testing.assert_close(sum_fast, ffn.pending_sum_EP, rtol=0, atol=0)
    torch.testing.assert_close(count_fast, ffn.pending_count_E, rtol=0, atol=0)
    idle = set(range(4)) - set(ids.tolist())
    assert idle  # slot 3 at least
    for e in idle:
        assert all(not got[2][f"experts.{e}.{n}"].any() for n, _ in ffn.experts[str(e)].named_parameters())
