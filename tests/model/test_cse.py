"""CSE layer (model/cse.py) and the single-process parts of its controller (parallel/cse.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model.cse import CSEFFN, cse_layers, dispatch, ema_centres


def _cfg(slots: int = 4, layers: int = 2, **cse):
    from launcher.config import load_run_config

    sets = [
        "model.preset=tiny",
        f"model.n_layers={layers}",
        "model.vocab_size=128",
        "model.seq_len=16",
        "model.d_model=32",
        "model.n_heads=2",
        "model.ffn.kind=cse",
        f"model.ffn.num_experts={slots}",
        "train.steps=10",
        "train.micro_batch=4",
        "data.mixture=natural",
    ]
    sets += [f"model.ffn.cse.{k}={v}" for k, v in cse.items()]
    return load_run_config(None, sets)


def test_dispatch_is_argmin_of_distance_over_radius():
    centres = torch.tensor([[0.0, 0.0], [10.0, 0.0]])
    radii = torch.tensor([1.0, 5.0])
    v = torch.tensor([[4.0, 0.0], [1.0, 0.0], [0.0, 3.0]])
    # (4, 0): 4/1 = 4 vs 6/5 = 1.2 -> 1;  (1, 0): 1 vs 9/5 -> 0;  (0, 3): 3 vs sqrt(109)/5 = 2.09 -> 1
    assert dispatch(v, centres, radii).tolist() == [1, 0, 1]


def test_centre_update_batch_form_and_sequential_rule():
    c = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    sums = torch.tensor([[6.0, 2.0], [0.0, 0.0]])
    counts = torch.tensor([2.0, 0.0])
    new = ema_centres(c, sums, counts, alpha=0.5)
    # n=2, mean (3, 1): c <- 0.25 c + 0.75 m = (2.25, 0.75); the empty cluster keeps its centre
    torch.testing.assert_close(new, torch.tensor([[2.25, 0.75], [1.0, 1.0]]))
    # one sequence: exactly c <- α c + (1-α) v'
    one = ema_centres(torch.tensor([[2.0, 4.0]]), torch.tensor([[4.0, 0.0]]), torch.tensor([1.0]), alpha=0.9)
    torch.testing.assert_close(one, torch.tensor([[0.9 * 2 + 0.1 * 4, 0.9 * 4]]))


def test_layer_is_dense_before_clustering_and_routes_after():
    torch.manual_seed(0)
    cfg = _cfg(slots=3, centre_momentum=0.5).model
    layer = CSEFFN(cfg, layer_idx=1)
    x = torch.randn(4, 5, cfg.d_model)
    out = layer(x)
    torch.testing.assert_close(out.hidden, layer.experts["0"](x))
    assert out.stats["cluster_load_E"].tolist() == [4.0, 0.0, 0.0]
    assert layer.pending_count_E.sum() == 0  # nothing to update before clustering
    # two clusters: centre 0 at sequence 0's embedding, centre 1 at sequence 1's
    v = layer.embed(x)
    layer.set_clusters(v[:2].clone(), torch.ones(2))
    ids, _ = layer.assign(x)
    assert ids[:2].tolist() == [0, 1]
    out = layer(x)
    for b in range(4):
        torch.testing.assert_close(out.hidden[b], layer.experts[str(int(ids[b]))](x[b]))
    # training forward accumulated the routed embeddings; the update moves the centres by the batch EMA
    counts = torch.bincount(ids, minlength=3).double()
    torch.testing.assert_close(layer.pending_count_E, counts)
    old = layer.centres_EP[:2].clone()
    layer.apply_centre_update()
    for j in range(2):
        m = v[ids == j].mean(0)
        keep = 0.5 ** counts[j].item()
        torch.testing.assert_close(layer.centres_EP[j], keep * old[j] + (1 - keep) * m)
    assert layer.pending_count_E.sum() == 0
    layer.eval()
    layer(x)
    assert layer.pending_count_E.sum() == 0  # no update in evaluation


def test_cluster_embeddings_recovers_separated_blobs():
    from sklearn.metrics import adjusted_rand_score

    from parallel.cse import cluster_embeddings, cluster_record

    g = torch.Generator().manual_seed(0)
    means = torch.tensor([[0.0] * 8, [10.0] + [0.0] * 7, [0.0, 10.0] + [0.0] * 6])
    sizes = [60, 30, 10]  # a long-tail cluster of 10
    v = torch.cat([means[j] + 0.3 * torch.randn(n, 8, generator=g) for j, n in enumerate(sizes)])
    truth = np.repeat([0, 1, 2], sizes)
    res = cluster_embeddings(v, eps=2.0, min_samples=5, max_clusters=8)
    assert res.num_clusters == 3
    assert adjusted_rand_score(truth, res.dbscan_labels_N) == 1.0
    torch.testing.assert_close(res.centres_KP, means, atol=0.3, rtol=0)  # sorted by size = planted order
    for j in range(3):
        members = v[truth == j]
        want = (members - members.mean(0)).norm(dim=1).mean()
        torch.testing.assert_close(res.radii_K[j], want, atol=1e-5, rtol=1e-5)
    rec = cluster_record(res, v, truth, ["a", "b", "c"])
    assert rec["dispatch_sizes"] == sizes and rec["domain_share"]["2"] == {"c": 1.0}
    # max_clusters keeps the largest; automatic eps finds the same three
    assert cluster_embeddings(v, eps=2.0, min_samples=5, max_clusters=2).num_clusters == 2
    assert cluster_embeddings(v, eps=0.0, min_samples=5, max_clusters=8).num_clusters == 3


def test_checkpoint_round_trip_keeps_cluster_state():
    from model.gpt import GPT

    cfg = _cfg(slots=4).model
    torch.manual_seed(0)
    model = GPT(cfg, init_seed=1)
    layers = cse_layers(model)
    assert [layer.layer_idx for layer in layers] == [0, 1]  # last_layers=2 of 2
    g = torch.Generator().manual_seed(3)
    for layer in layers:
        layer.set_clusters(
            torch.randn(3, cfg.ffn.cse.projection_dim, generator=g), torch.rand(3, generator=g) + 0.5
        )
    tokens = torch.randint(0, 128, (6, 16), generator=g)
    ref = model(tokens)
    again = GPT(cfg, init_seed=2)
    again.load_state_dict(model.state_dict())
    for a, b in zip(layers, cse_layers(again)):
        assert int(b.num_active) == 3
        torch.testing.assert_close(a.centres_EP, b.centres_EP, rtol=0, atol=0)
        torch.testing.assert_close(a.radii_E, b.radii_E, rtol=0, atol=0)
        torch.testing.assert_close(a.projection_DP, b.projection_DP, rtol=0, atol=0)
    out = again(tokens)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
    assert "layer1/cluster_load_E" in out.ffn_stats
    assert "pending_sum_EP" not in " ".join(model.state_dict())


def test_controller_single_process_clusters_and_copies_expert_zero():
    from model.gpt import GPT
    from parallel.cse import CSEController

    cfg = _cfg(slots=4, layers=2, num_samples=24, dbscan_eps=0.0, dbscan_min_samples=3, warmup_fraction=0.2)
    torch.manual_seed(0)
    model = GPT(cfg.model, init_seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # one optimizer step so expert 0 has Adam state
    tokens = torch.randint(0, 128, (4, 16))
    model(tokens, targets_BT=tokens).loss.backward()
    opt.step()
    g = torch.Generator().manual_seed(5)

    def batch_fn(i: int) -> dict:
        return {
            "tokens": torch.randint(0, 128, (4, 16), generator=g),
            "domain_ids": torch.tensor([0, 1, 0, 1]),
        }

    ctl = CSEController(
        model, cfg.model.ffn.cse, cfg.train.steps, None, optimizer=opt, domain_names=["x", "y"]
    )
    assert ctl.boundary == 2
    assert ctl.after_step(1, batch_fn) is None and not ctl.is_clustered
    rec = ctl.after_step(2, batch_fn)
    assert rec is not None and ctl.is_clustered and rec["samples"] == 24
    for layer, k in zip(cse_layers(model), rec["num_clusters"]):
        assert 1 <= k <= 4 and int(layer.num_active) == k
        for j in range(1, k):
            for p0, pj in zip(layer.experts["0"].parameters(), layer.experts[str(j)].parameters()):
                assert torch.equal(p0, pj)
                assert torch.equal(opt.state[p0]["exp_avg"], opt.state[pj]["exp_avg"])
    # later steps apply the centre update and never re-cluster
    model.train()
    model(tokens, targets_BT=tokens).loss.backward()
    before = [layer.centres_EP.clone() for layer in cse_layers(model)]
    assert ctl.after_step(3, batch_fn) is None
    assert any(not torch.equal(b, layer.centres_EP) for b, layer in zip(before, cse_layers(model)))


def test_config_and_seam():
    from model.ffn import DenseFFN
    from model.gpt import GPT

    cfg = _cfg(slots=0, layers=4, max_clusters=5).model
    model = GPT(cfg, init_seed=0)
    assert [type(b.ffn) for b in model.blocks] == [DenseFFN, DenseFFN, CSEFFN, CSEFFN]
    assert all(layer.num_slots == 5 for layer in cse_layers(model))  # num_experts=0 -> max_clusters slots


def test_eps_from_the_data_knee_and_target_cluster_counts():
    """Six blobs of unequal spread: 'target' scans eps and picks the one giving the most clusters (>= min, counted
    up to max), then the least noise (every candidate recorded); 'knee' reads the k-distance curve; purity is 1.0 for
    a perfect clustering and the largest domain's share for one cluster of everything."""
    from parallel.cse import cluster_embeddings, cluster_record, knee_eps, purity

    g = torch.Generator().manual_seed(3)
    centres = 12.0 * torch.eye(8)[:6]
    sizes = [80, 60, 40, 30, 20, 20]
    v = torch.cat(
        [centres[j] + (0.3 + 0.1 * j) * torch.randn(n, 8, generator=g) for j, n in enumerate(sizes)]
    )
    truth = np.repeat(np.arange(6), sizes)
    res = cluster_embeddings(v, eps=0.0, min_samples=5, max_clusters=8, auto="target", min_clusters=4)
    assert res.eps_method == "target" and 4 <= res.num_clusters <= 8 and res.eps_scan
    assert (
        res.eps
        == min(
            (r for r in res.eps_scan if r["clusters"] >= 4),
            key=lambda r: (-min(r["clusters"], 8), r["noise"], r["eps"]),
        )["eps"]
    )
    rec = cluster_record(res, v, truth)
    assert rec["num_clusters"] == 6 and rec["purity"] == 1.0 and rec["eps_method"] == "target"
    assert len(rec["eps_scan"]) == len(res.eps_scan)
    knee = cluster_embeddings(v, eps=0.0, min_samples=5, max_clusters=8, auto="knee")
    # the dense blobs at least
    assert knee.eps == knee_eps(v.double().numpy(), 5) and 2 <= knee.num_clusters <= 6
    assert purity(np.zeros(len(truth), dtype=int), truth) == pytest.approx(80 / 250)
    with pytest.raises(ValueError, match="dbscan_auto='kmeans'"):
        cluster_embeddings(v, eps=0.0, min_samples=5, max_clusters=8, auto="kmeans")


def test_target_eps_does_not_merge_neighbouring_domains():
    """Eight domains in four close pairs: a larger eps joins pairs with no noise left, which "least noise among
    4..8 clusters" (the old rule) chooses (purity <= 0.65); `target` keeps the eight domains apart."""
    from parallel.cse import cluster_embeddings, cluster_record

    g = torch.Generator().manual_seed(5)
    pair = 20.0 * torch.eye(8)[:4]
    # domain j and j+4 are 1.5 apart, pairs 20 apart
    centres = torch.cat([pair, pair + 1.5 * torch.eye(8)[4]])
    v = torch.cat([c + 0.25 * torch.randn(40, 8, generator=g) for c in centres])
    truth = np.repeat(np.arange(8), 40)
    res = cluster_embeddings(v, eps=0.0, min_samples=5, max_clusters=8, auto="target", min_clusters=4)
    old = min((r for r in res.eps_scan if 4 <= r["clusters"] <= 8), key=lambda r: (r["noise"], r["eps"]))
    assert (
        old["clusters"] < 8
        and cluster_record(cluster_embeddings(v, old["eps"], 5, 8), v, truth)["purity"] < 0.65
    )
    assert res.num_clusters == 8 and cluster_record(res, v, truth)["purity"] > 0.95


def test_cse_eps_options_are_validated():
    from launcher.config import load_run_config
    from launcher.typed import ConfigError

    with pytest.raises(ConfigError) as e:
        load_run_config(
            None, ["model.ffn.kind=cse", "model.ffn.cse.dbscan_auto=kmeans", "model.ffn.cse.min_clusters=40"]
        )
    assert "dbscan_auto='kmeans'" in str(e.value) and "min_clusters=40" in str(e.value)
