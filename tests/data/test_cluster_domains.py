"""data/cluster_domains.py: planted clusters are recovered with labels hidden; the saved clusterer reloads safely and
places new text the same way; the written corpus is what data.prepare reads."""

from __future__ import annotations

import json

import numpy as np

from data.cluster_domains import (
    Clusterer,
    agreement,
    balanced_assign,
    fit_clusterer,
    main,
    read_corpus,
    relabel_prepared,
)
from tests.conftest import write_corpus


def test_balanced_assign_respects_capacity_and_distance():
    d = np.array([[0.0, 5.0], [0.1, 5.0], [0.2, 5.0], [3.0, 0.0]])
    lab = balanced_assign(d, capacity=2)
    assert lab.tolist() == [0, 0, 1, 1]  # the third row is pushed to cluster 1 by the capacity
    assert np.bincount(lab).max() <= 2


def test_cluster_corpus_recovers_planted_domains_and_reloads(tmp_path):
    corpus = write_corpus(tmp_path, docs_per_domain=40, seed=1)
    out = tmp_path / "clustered"
    assert main(["--corpus", str(corpus), "--k", "3", "--out", str(out), "--svd-dim", "10"]) == 0
    report = json.loads((out / "cluster_report.json").read_text())
    assert report["purity"] > 0.9 and report["nmi"] > 0.8
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["train_domains"] == ["cluster00", "cluster01", "cluster02"]
    assert all(v["split_role"] == "train" for v in manifest["domains"].values())
    rows = [json.loads(line) for n in manifest["train_domains"] for line in open(out / f"{n}.jsonl")]
    assert len(rows) == 120 and set(rows[0]) == {"id", "domain", "text"}
    # reload (no pickle) and place new text: same cluster as the documents of its domain, prior sums to 1
    c = Clusterer.load(out / "clusterer")
    cluster_of = {}
    for r in rows:
        cluster_of.setdefault(r["id"].split("-")[0], set()).add(r["domain"])
    new = [
        "The oven and the flour, butter and sugar: bake, then knead the dough.",
        "The bond yield and the stock price moved the equity market.",
    ]
    names = c.names()
    got = [names[j] for j in c.assign(new)]
    assert got[0] in cluster_of["cooking"] and got[1] in cluster_of["finance"]
    p = c.prior(new)
    assert np.allclose(p.sum(1), 1.0) and p.argmax(1).tolist() == c.assign(new).tolist()
    texts = [r["text"] for r in read_corpus(corpus)]
    assert np.array_equal(c.assign(texts[:20]), Clusterer.load(out / "clusterer").assign(texts[:20]))


def test_fit_is_deterministic_and_agreement_maths():
    texts = [f"alpha beta gamma {i}" for i in range(10)] + [f"delta epsilon zeta {i}" for i in range(10)]
    a = fit_clusterer(texts, 2, seed=3, svd_dim=2).assign(texts)
    b = fit_clusterer(texts, 2, seed=3, svd_dim=2).assign(texts)
    assert np.array_equal(a, b)
    assert agreement(["x", "x", "y", "y"], [0, 0, 1, 1]) == {"purity": 1.0, "nmi": 1.0, "ari": 1.0}
    assert agreement(["x", "x", "y", "y"], [0, 1, 0, 1])["purity"] == 0.5


def test_relabel_prepared_keeps_tokens_and_splits(tiny_tokens, tmp_path):
    from data.catalog import load_catalog

    report = relabel_prepared(tiny_tokens, "gpt2", tmp_path / "tok", k=3, svd_dim=10)
    assert report["splits"]["train"]["purity"] > 0.9
    src = json.loads((tiny_tokens / "gpt2" / "manifest.json").read_text())["counts"]
    dst = load_catalog(tmp_path / "tok", "gpt2")
    assert dst.train_domains == ("cluster00", "cluster01", "cluster02")
    for split in ("train", "valid", "test"):
        assert sum(dst.counts[n][split]["tokens"] for n in dst.train_domains) == sum(
            v[split]["tokens"] for v in src.values()
        )
