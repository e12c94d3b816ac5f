"""A CSE layer's forward reads the device at most once (no host waits on a GPU): K, the active cluster count, is a
host int kept in step with its buffer, and the routing reads only the per-cluster counts of a clustered layer.

`forward_before` is CSEFFN.forward as it was before (K read back with `int(num_active)` twice per forward, the counts
with `bincount(...).tolist()`): the new forward must give the same outputs, gradients, statistics and centre
accumulators (rtol 1e-6; the arithmetic is the same, so they are in fact equal). The read counts are taken in a
device-strict process (tests/harness/device_strict.py), where the old forward's reads are seen too (the control).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from model.cse import CSEFFN, cse_layers, dispatch
from model.demix import run_grouped
from model.mlp import FFNOutput
from tests.harness.multirank import run_ranks

RTOL = 1e-6
SLOTS = 4


def forward_before(ffn: CSEFFN, x_BTD: torch.Tensor) -> FFNOutput:
    """CSEFFN.forward before K lived on the host: three device reads per layer and micro-batch."""
    v_BP = ffn.embed(x_BTD)
    k = int(ffn.num_active)
    ids_B = (
        torch.zeros(x_BTD.shape[0], dtype=torch.long, device=x_BTD.device)
        if k == 0
        else dispatch(v_BP, ffn.centres_EP[:k], ffn.radii_E[:k])
    )
    if ffn.training and int(ffn.num_active) and torch.is_grad_enabled():
        with torch.no_grad():
            ffn.pending_sum_EP.index_add_(0, ids_B, v_BP.double())
            ffn.pending_count_E.index_add_(0, ids_B, torch.ones_like(ids_B, dtype=torch.float64))
    counts_E = torch.bincount(ids_B, minlength=ffn.num_slots)
    counts = counts_E.tolist()
    order_B = None if sum(n > 0 for n in counts) == 1 else torch.argsort(ids_B, stable=True)
    out_BTD = run_grouped(x_BTD, [ffn.experts[str(e)] for e in range(ffn.num_slots)], counts, order_B)
    stats = {
        "cluster_load_E": counts_E.to(x_BTD.dtype).detach(),
        "num_clusters": ffn.num_active.detach().float(),
    }
    return FFNOutput(hidden=out_BTD, stats=stats)


def _model_cfg():
    from launcher.config import load_run_config

    return load_run_config(
        None,
        [
            "model.preset=tiny",
            "model.n_layers=2",
            "model.vocab_size=128",
            "model.seq_len=16",
            "model.d_model=32",
            "model.n_heads=2",
            "model.ffn.kind=cse",
            f"model.ffn.num_experts={SLOTS}",
            "data.mixture=natural",
        ],
    ).model


# Sequences of x whose embeddings become the cluster centres (sequence centre_rows[j] routes to cluster j).
CLUSTERS = {
    "before-clustering": [],
    "one-cluster": [2],
    "3-of-4-unsorted": [5, 0, 3],  # several clusters, batch not sorted by cluster, slot 3 idle
    "4-of-4": [6, 1, 4, 2],
}


def _layer(x_BTD: torch.Tensor, centre_rows: list[int]) -> CSEFFN:
    torch.manual_seed(0)
    ffn = CSEFFN(_model_cfg(), layer_idx=0)
    if centre_rows:
        ffn.set_clusters(ffn.embed(x_BTD)[centre_rows], torch.ones(len(centre_rows)))
    return ffn.train()


def _run(ffn: CSEFFN, fwd, x_BTD: torch.Tensor, autocast: bool) -> dict:
    """Output, input and parameter gradients, statistics and centre accumulators of one forward + backward."""
    ffn.zero_grad(set_to_none=True)
    ffn.pending_sum_EP.zero_(), ffn.pending_count_E.zero_()
    x = x_BTD.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = fwd(ffn, x)
    w = torch.randn(out.hidden.shape, generator=torch.Generator().manual_seed(7)).to(out.hidden.dtype)
    (out.hidden * w).float().sum().backward()
    return {
        "out": out.hidden.detach(),
        "x.grad": x.grad,
        **{f"grad {n}": p.grad for n, p in ffn.named_parameters()},
        **{f"stat {k}": v for k, v in out.stats.items()},
        "pending_sum": ffn.pending_sum_EP.clone(),
        "pending_count": ffn.pending_count_E.clone(),
    }


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("clusters", list(CLUSTERS))
def test_host_side_forward_matches_the_forward_that_read_the_device(clusters: str, autocast: bool) -> None:
    x = torch.randn(8, 5, 32, generator=torch.Generator().manual_seed(3))
    ffn = _layer(x, CLUSTERS[clusters])
    assert ffn.active == len(CLUSTERS[clusters]) == int(ffn.num_active)
    got = _run(ffn, lambda f, x: f(x), x, autocast)
    want = _run(ffn, forward_before, x, autocast)
    assert got.keys() == want.keys()
    for key, value in got.items():
        assert value is not None, key
        assert value.dtype == want[key].dtype, key
        torch.testing.assert_close(value, want[key], rtol=RTOL, atol=0, msg=key)


def test_active_count_follows_set_clusters_and_state_dict_loads() -> None:
    """K on the host changes with `set_clusters` and comes back with a loaded state dict (an export read into a fresh
    model), also when the loaded model is unclustered, and with buffers copied in place (launcher/state.py's resume)."""
    from model.gpt import GPT

    cfg = _model_cfg()
    clustered = GPT(cfg, init_seed=1)
    for i, layer in enumerate(cse_layers(clustered)):
        layer.set_clusters(torch.randn(2 + i, cfg.ffn.cse.projection_dim), torch.ones(2 + i))
    fresh = GPT(cfg, init_seed=2)
    assert [layer.active for layer in cse_layers(fresh)] == [0, 0]
    fresh.load_state_dict(clustered.state_dict())
    assert [layer.active for layer in cse_layers(fresh)] == [2, 3]
    fresh.load_state_dict(GPT(cfg, init_seed=3).state_dict())
    assert [layer.active for layer in cse_layers(fresh)] == [0, 0]
    with torch.no_grad():  # a training state restored as launcher/state.py does: buffers copied in place
        for name, buf in fresh.named_buffers():
            buf.copy_(dict(clustered.named_buffers())[name])
    assert [layer.active for layer in cse_layers(fresh)] == [2, 3]
    tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    fresh.load_state_dict(clustered.state_dict())
    torch.testing.assert_close(fresh(tokens).logits, clustered(tokens).logits, rtol=0, atol=0)


def _reads(rank: int, world: int) -> dict:
    """Host reads of forward + backward (new and old forward) and of the centre update, per cluster layout."""
    from tests.harness.device_strict import record_host_reads

    device = torch.device("cpu")
    out = {}
    for name, rows in CLUSTERS.items():
        x = torch.randn(8, 5, 32, generator=torch.Generator().manual_seed(3))
        # moved like the engine moves the model: a device tensor from here on
        ffn = _layer(x, rows).to(device)
        x = x.to(device)
        for which, fwd in (("new", lambda f, x: f(x)), ("old", forward_before)):
            with record_host_reads() as reads:
                fwd(ffn, x.requires_grad_(True)).hidden.sum().backward()
                if which == "new":
                    ffn.apply_centre_update()
            out[name, which] = Counter(f"{w} at {t.split(' <- ')[0]}" for w, t in reads)
    # K written from outside (a restored training state): read back once, at the next forward only.
    ffn = _layer(x, []).to(device)
    with torch.no_grad():
        ffn.num_active.copy_(torch.tensor(3, device=device))
        ffn.centres_EP[:3] = ffn.embed(x)[[5, 0, 3]]
    for i in range(2):
        with record_host_reads() as reads:
            ffn(x)
        out["restored", i] = Counter(f"{w} at {t.split(' <- ')[0]}" for w, t in reads)
    return out


def test_a_clustered_layer_reads_its_counts_once_and_nothing_else() -> None:
    """No read before clustering or with one cluster; one (`routed_counts`) per forward with K >= 2; none in the centre
    update; K itself once after the buffer was written from outside. The control: the old forward's reads
    (`int(num_active)` twice, `.tolist()`) are seen by the same recorder."""
    got = run_ranks(_reads, 1, init_pg=False, device_strict=True)[0]
    for name, rows in CLUSTERS.items():
        new = got[name, "new"]
        if len(rows) <= 1:
            assert not new, (name, new)
        else:
            assert sum(new.values()) == 1, (name, new)
            assert next(iter(new)).startswith("tolist at model/cse.py:") and "routed_counts" in next(
                iter(new)
            )
        old = got[name, "old"]
        assert sorted(w.split(" ")[0] for w in old.elements()) == ["__int__", "__int__", "tolist"], (
            name,
            old,
        )
    first, second = got["restored", 0], got["restored", 1]
    assert sorted(w.split(" at ")[0] for w in first.elements()) == ["__int__", "tolist"], first
    assert any("model/cse.py" in w and " active" in w for w in first), first
    assert sorted(w.split(" at ")[0] for w in second.elements()) == ["tolist"], second
