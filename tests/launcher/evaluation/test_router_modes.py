"""The router modes of the evaluation (router, router_posterior; model/mixture.py router eqs. R1-R4) on a tiny
DEMix checkpoint whose meta.json holds router vectors: the numbers equal the mixture computed by hand from the
same log-likelihoods and features, a router mode without vectors is refused before any work, and opting an expert
out equals a checkpoint saved without it (its vector takes no part), bit for bit."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from launcher.checkpoint import CheckpointError, load_consolidated, read_meta
from launcher.checkpoint_data import block_inputs, load_blocks
from launcher.evaluation.evaluate import evaluate_checkpoint
from launcher.evaluation.evaluate import main as evaluate_main
from launcher.evaluation.results import DEMIX_MODES, ROUTER_MODES
from launcher.evaluation.scoring import stream_log_likelihoods
from launcher.evaluation.stats import block_sums
from launcher.modular.experts import remove_experts, save
from launcher.modular.owners.router import router_matrix, router_vector, router_vectors_meta
from model import mixture as mx
from model.batched import shared_trunk_features

SETTINGS = dict(max_blocks=3, cached_blocks=2, progress=False, unigram=False, batch_size=2)


@pytest.fixture(scope="module")
def plain(random_checkpoint, tmp_path_factory):
    """A random DEMix checkpoint (cooking, sailing, finance) without router vectors."""
    return random_checkpoint(tmp_path_factory.mktemp("router") / "plain", "demix")


def save_routed(src: Path, tokens_root: Path, out: Path) -> Path:
    """Checkpoint `src` saved to `out` with every expert's router vector (4 train blocks of its domain)."""
    c = load_consolidated(src)
    model = c.build_model().eval()
    recs = {d: router_vector(model, tokens_root, "gpt2", d, max_blocks=4) for d in c.domains}
    c.meta["router_vectors"] = router_vectors_meta(recs)
    return save(c, out)


@pytest.fixture(scope="module")
def routed(plain, tiny_tokens, tmp_path_factory):
    """`plain` with every expert's router vector in meta.json (`save_routed`)."""
    return save_routed(plain, tiny_tokens, tmp_path_factory.mktemp("router") / "routed")


def _without_vector(src, name, out):
    c = load_consolidated(src)
    entry = c.meta["router_vectors"]
    entry["vectors"].pop(name)
    entry["tokens"].pop(name)
    return save(c, out)


def test_router_modes_equal_the_mixture_by_hand(routed, tiny_tokens, tmp_path):
    out = tmp_path / "eval"
    res = evaluate_checkpoint(routed, tiny_tokens, out_dir=out, **SETTINGS).to_dict()
    assert res["modes"] == list(DEMIX_MODES) and res["router_temperature"] == mx.ROUTER_TEMPERATURE
    c = load_consolidated(routed)
    model = c.build_model().eval()
    r_ED = router_matrix(c.meta, c.domains)
    for dom, r in res["domains"].items():
        assert all(math.isfinite(r["ppl"][m]) and r["ppl"][m] > 1 for m in ROUTER_MODES)
        assert sum(r["router"]["mean_weight"].values()) == pytest.approx(1.0)
        blocks = load_blocks(tiny_tokens, "gpt2", dom, "test", 32, 3)
        tokens, targets, mask = block_inputs(blocks)
        ll = stream_log_likelihoods(model, tokens, targets, None, 2)
        with torch.no_grad():  # the features of the same batches of 2 blocks
            f = torch.cat([shared_trunk_features(model, tokens[s : s + 2]) for s in range(0, len(tokens), 2)])
        lw = mx.router_log_weights(f, r_ED, 0.1, mask)
        by_hand = {
            "router": mx.mixture_log_probs(ll, lw),
            "router_posterior": mx.posterior_mixture_log_probs(ll, lw, mask),
        }
        for mode, lp in by_hand.items():
            assert r["ppl"][mode] == mx.perplexity(lp, mask), (dom, mode)
            assert r["block_nll"][mode] == block_sums(lp, mask)[0], (dom, mode)
        w = (lw.exp() * mask).sum(dim=(1, 2)) / mask.sum()
        assert r["router"]["mean_weight"] == dict(zip(c.domains, w.tolist()))
    assert res["domains"]["cooking"]["ppl"]["router"] != res["domains"]["cooking"]["ppl"]["average"]
    md = (out / "eval.md").read_text()
    assert "| DEMix (router) |" in md and "| DEMix (router_posterior) |" in md and "τ = 0.1" in md


def test_router_temperature_is_applied_and_recorded(routed, tiny_tokens, tmp_path, capsys):
    kw = dict(SETTINGS, modes=["router"], domains=["cooking"])
    sharp = evaluate_checkpoint(routed, tiny_tokens, **kw).to_dict()
    soft = evaluate_checkpoint(routed, tiny_tokens, router_temperature=100.0, **kw).to_dict()
    assert soft["router_temperature"] == 100.0 and soft["modes"] == ["router"]
    assert soft["domains"]["cooking"]["ppl"]["router"] != sharp["domains"]["cooking"]["ppl"]["router"]
    # τ = 100: nearly the uniform average of the experts' probabilities
    avg = evaluate_checkpoint(routed, tiny_tokens, **dict(kw, modes=["average"])).to_dict()
    assert soft["domains"]["cooking"]["ppl"]["router"] == pytest.approx(
        avg["domains"]["cooking"]["ppl"]["average"], rel=1e-3
    )
    args = [str(routed), "--data", str(tiny_tokens), "--modes", "router", "--out", str(tmp_path / "o")]
    for bad in ("0", "-1", "nan"):
        with pytest.raises(SystemExit) as stop:  # argparse: one line, status 2, before anything is read
            evaluate_main([*args, "--router-temperature", bad])
        assert stop.value.code == 2 and "argument --router-temperature" in capsys.readouterr().err


def test_a_router_mode_without_vectors_is_refused_before_any_work(
    plain, tiny_tokens, tmp_path, monkeypatch, capsys
):
    def no_work(*a, **k):
        raise AssertionError("work started")

    monkeypatch.setattr("launcher.evaluation.model_evaluation.stream_scores", no_work)
    monkeypatch.setattr("launcher.evaluation.model_evaluation.time_block_pass", no_work)
    with pytest.raises(CheckpointError, match="no router vectors"):
        evaluate_checkpoint(plain, tiny_tokens, **dict(SETTINGS, modes=["naive", "router"]))
    monkeypatch.setattr("launcher.evaluation.evaluate.load_consolidated", no_work)  # the CLI reads no tensor
    out = tmp_path / "o"
    rc = evaluate_main(
        [str(plain), "--data", str(tiny_tokens), "--modes", "router_posterior", "--out", str(out)]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("error: --modes router_posterior: no router vectors"), err
    assert len([line for line in err if line.startswith("error")]) == 1 and not out.exists()


def test_an_expert_without_a_vector_is_named_and_can_be_opted_out(routed, tiny_tokens, tmp_path, capsys):
    partial = _without_vector(routed, "finance", tmp_path / "partial")
    with pytest.raises(CheckpointError, match=r"experts \['finance'\] have no router vector"):
        evaluate_checkpoint(partial, tiny_tokens, **dict(SETTINGS, modes=["router"]))
    # by default the router modes are left out, with a note saying why
    res = evaluate_checkpoint(partial, tiny_tokens, **dict(SETTINGS, progress=True, domains=["cooking"]))
    assert not set(res.modes) & set(ROUTER_MODES) and "router_temperature" not in res.to_dict()
    assert "[eval] no router modes: experts ['finance'] have no router vector" in capsys.readouterr().err
    # without finance every expert present has its vector
    kw = dict(SETTINGS, modes=["router"], domains=["cooking"])
    res = evaluate_checkpoint(partial, tiny_tokens, exclude_experts=["finance"], **kw).to_dict()
    assert res["experts"] == ["cooking", "sailing"] and math.isfinite(
        res["domains"]["cooking"]["ppl"]["router"]
    )


def test_opt_out_in_router_modes_equals_a_checkpoint_saved_without_the_expert(routed, tiny_tokens, tmp_path):
    """Evaluating the merged checkpoint with --exclude-experts sailing gives, bit for bit, what a checkpoint saved
    without sailing (and without its vector) gives: the centre is over the present experts only."""
    kw = dict(SETTINGS, modes=["naive", "router", "router_posterior"])
    remove_experts(routed, ["sailing"], tmp_path / "without")  # `experts remove` drops its router vector too
    without = tmp_path / "without"
    assert set(read_meta(without)["router_vectors"]["vectors"]) == {"cooking", "finance"}
    a = evaluate_checkpoint(routed, tiny_tokens, exclude_experts=["sailing"], **kw).to_dict()
    b = evaluate_checkpoint(without, tiny_tokens, **kw).to_dict()
    assert a["experts"] == b["experts"] == ["cooking", "finance"]
    for dom in ("cooking", "sailing", "finance"):
        ra, rb = a["domains"][dom], b["domains"][dom]
        assert ra["ppl"] == rb["ppl"] and ra["block_nll"] == rb["block_nll"] and ra["router"] == rb["router"]
    full = evaluate_checkpoint(routed, tiny_tokens, **kw).to_dict()  # with sailing present the weights differ
    assert full["domains"]["cooking"]["router"] != a["domains"]["cooking"]["router"]
