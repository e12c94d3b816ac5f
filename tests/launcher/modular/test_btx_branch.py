"""BTX's branch step (launcher/modular/btx/ `branch`): a dense checkpoint becomes a DEMix one whose shared tensors
are the dense ones and whose every expert is the dense FFN of its layer, bit for bit; so every expert, and every
mixture of them, computes the dense model's logits; upcycling it (`--layers all`) gives a GShard model that computes
them too whatever the router does; and it starts a 2-rank DEMix run through the launcher (`train.init_from`) whose
first logged loss is the branched (= dense) model's on the same batches."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from launcher.checkpoint import CheckpointError, load_consolidated, save_consolidated
from launcher.modular.btx import branch, demix_overrides, main, upcycle
from tests.launcher.modular.test_btx import _first_step_loss

REPO = Path(__file__).resolve().parents[3]
FFN_NAMES = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


def _tokens(seed: int = 0, batch: int = 3, length: int = 32) -> torch.Tensor:
    return torch.randint(0, 50257, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_branched_checkpoint_copies_the_dense_ffn_into_every_expert(dense, branched):
    a, b = load_consolidated(dense), load_consolidated(branched)
    assert b.cfg.model.ffn.kind == "demix" and b.cfg.model.ffn.num_experts == 3 and b.domains == a.domains
    assert b.cfg.model == replace(a.cfg.model, ffn=b.cfg.model.ffn) and b.cfg.data.mixture == "by_domain"
    # the fixture's domain list is not the catalog's (sorted) order: the config lists it, so a DEMix run of it
    # numbers the domains as the experts are numbered
    assert b.cfg.data.domains == ["cooking", "sailing", "finance"]
    shared = {k: v for k, v in b.state_dict.items() if ".ffn." not in k}
    assert shared.keys() == {k for k in a.state_dict if ".ffn." not in k}
    assert all(torch.equal(v, a.state_dict[k]) for k, v in shared.items())
    for l in range(2):
        for j in range(3):
            for name in FFN_NAMES:
                assert torch.equal(
                    b.state_dict[f"blocks.{l}.ffn.experts.{j}.{name}"],
                    a.state_dict[f"blocks.{l}.ffn.mlp.{name}"],
                )
    assert not any(".ffn.mlp." in k for k in b.state_dict)
    assert set(b.build_model().state_dict()) == set(b.state_dict)  # exactly a DEMix GPT's tensors
    assert sorted(p.name for p in (branched / "experts").iterdir()) == [f"expert_000{j}.pt" for j in range(3)]
    assert b.step == a.step and b.meta["experts"] == {"0": "cooking", "1": "sailing", "2": "finance"}
    for key in ("tokenizer", "tokenizer_sha256", "bos_id", "eod_id", "train_tokens"):
        assert b.meta[key] == a.meta[key]
    assert b.meta["branch"]["source"] == str(dense.resolve()) and b.meta["branch"]["source_step"] == 7
    assert "branched from dense" in b.meta["branch"]["method"]


def test_every_expert_and_every_mixture_computes_the_dense_logits(dense, branched, tiny_tokens):
    from launcher.evaluation.evaluate import evaluate_checkpoint

    ref_model = load_consolidated(dense).build_model().eval()
    model = load_consolidated(branched).build_model().eval()
    x_BT = _tokens()
    with torch.no_grad():
        want = ref_model(x_BT).logits
        for ids in ([0, 0, 0], [1, 1, 1], [2, 2, 2], [2, 0, 1]):
            got = model(x_BT, torch.tensor(ids)).logits
            assert (got - want).abs().max() <= 1e-6, (ids, (got - want).abs().max())
    # the evaluator's mixtures (posterior-weighted sums of the experts' probabilities) are the dense model's too
    kw = dict(max_blocks=2, cached_blocks=2, progress=False, unigram=False)
    d = evaluate_checkpoint(dense, tiny_tokens, modes=("ppl",), **kw).to_dict()
    m = evaluate_checkpoint(branched, tiny_tokens, modes=("naive", "uniform", "cached"), **kw).to_dict()
    for dom, r in d["domains"].items():
        for mode in ("naive", "uniform", "cached"):
            assert m["domains"][dom]["ppl"][mode] == pytest.approx(r["ppl"]["ppl"], rel=1e-6), (dom, mode)


def test_domains_pick_and_order_the_experts_and_the_run_plans_and_loads(dense, tmp_path):
    """`--domains sailing,cooking`: expert 0 is sailing, as a DEMix run with data.domains=[sailing, cooking] numbers
    them; configs/demo/demix.yaml + demix_overrides plans on 2 ranks and every rank loads the dense FFN as its
    expert."""
    from launcher.config import load_run_config
    from launcher.ffn_kinds import ffn_kind
    from launcher.plan import make_plan
    from launcher.state import load_init_weights
    from model.gpt import GPT

    rec = branch(dense, tmp_path / "two", ["sailing", "cooking"])
    c = load_consolidated(tmp_path / "two")
    assert rec["domains"] == c.domains == ["sailing", "cooking"] and c.cfg.data.domains == [
        "sailing",
        "cooking",
    ]
    assert (
        'data.domains=["sailing", "cooking"]' in rec["demix_sets"]
        and "model.ffn.num_experts=2" in rec["demix_sets"]
    )
    cfg = load_run_config(REPO / "configs/demo/demix.yaml", demix_overrides(tmp_path / "two"), check=False)
    plan = make_plan(cfg, 2)
    assert plan.catalog.train_domains == ("sailing", "cooking") and plan.expert_of_domain == [0, 1]
    dense_ffn = load_consolidated(dense).state_dict
    for rank in range(2):
        experts = ffn_kind(plan.cfg).rank_experts(plan.cfg, plan.topo, rank, plan.expert_of_domain)
        assert experts == [rank]
        model = GPT(plan.cfg.model, expert_ids=experts, init_seed=5)
        load_init_weights(model, plan.cfg)
        for l in range(2):
            for name in FFN_NAMES:
                assert torch.equal(
                    model.state_dict()[f"blocks.{l}.ffn.experts.{rank}.{name}"],
                    dense_ffn[f"blocks.{l}.ffn.mlp.{name}"],
                )
    assert demix_overrides(tmp_path / "two")[-1] == f"train.init_from={(tmp_path / 'two').resolve()}"
    # a dense run's own domains in its catalog's order (what the trainer writes): the config keeps data.domains=null
    a = load_consolidated(dense)
    save_consolidated(
        tmp_path / "sorted", a.state_dict, a.cfg, sorted(a.domains), a.step, extra={"train_tokens": 1}
    )
    branch(tmp_path / "sorted", tmp_path / "all")
    assert load_consolidated(tmp_path / "all").cfg.data.domains is None
    assert "data.domains=null" in demix_overrides(tmp_path / "all")
    assert make_plan(
        load_run_config(REPO / "configs/demo/demix.yaml", demix_overrides(tmp_path / "all"), check=False), 3
    ).expert_of_domain == [0, 1, 2]


def test_refusals(dense, branched, random_checkpoint, tmp_path):
    demix = random_checkpoint(tmp_path / "demix", "demix")
    with pytest.raises(
        CheckpointError, match="'demix' checkpoint: its experts are branches already; upcycle"
    ):
        branch(demix, tmp_path / "x")
    upcycle(demix, tmp_path / "gshard", layers="all", router_init="zero")
    with pytest.raises(CheckpointError, match="'gshard' checkpoint .*branch the dense checkpoint"):
        branch(tmp_path / "gshard", tmp_path / "x")
    c = load_consolidated(dense)
    token_cfg = replace(c.cfg, data=replace(c.cfg.data, mixture="domain_token"))
    save_consolidated(tmp_path / "domain-token", c.state_dict, token_cfg, c.domains, c.step)
    with pytest.raises(CheckpointError, match="Domain-Token"):
        branch(tmp_path / "domain-token", tmp_path / "x")
    with pytest.raises(
        CheckpointError,
        match=r"--domains \['knitting'\]: not a domain of the dense run's data.*"
        "cooking, finance, sailing",
    ):
        branch(dense, tmp_path / "x", ["cooking", "knitting"])
    with pytest.raises(CheckpointError, match="more than once"):
        branch(dense, tmp_path / "x", ["cooking", "cooking"])
    with pytest.raises(CheckpointError, match="empty"):
        branch(dense, tmp_path / "x", [])
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="exists and is not a consolidated checkpoint"):
        branch(dense, tmp_path / "taken")
    with pytest.raises(CheckpointError, match="--overwrite"):
        branch(dense, branched)
    with pytest.raises(CheckpointError, match="is the input checkpoint"):
        branch(dense, dense)
    with pytest.raises(CheckpointError, match="a DEMix run starts from a DEMix one"):
        demix_overrides(dense)
    assert not (tmp_path / "x").exists() and (tmp_path / "taken" / "notes.txt").read_text() == "mine"


def test_cli(dense, tmp_path, capsys):
    assert main(["branch", str(dense), "--out", str(tmp_path / "b"), "--domains", "finance,cooking"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert (
        rec["domains"] == ["finance", "cooking"]
        and load_consolidated(tmp_path / "b").domains == rec["domains"]
    )
    assert main(["branch", str(tmp_path / "b"), "--out", str(tmp_path / "c")]) == 2
    assert "upcycle it directly" in capsys.readouterr().err
    assert main(["branch", str(dense), "--out", str(tmp_path / "c"), "--domains", "knitting"]) == 2
    assert "knitting" in capsys.readouterr().err
    assert main(["upcycle", str(tmp_path / "b"), "--out", str(tmp_path / "u"), "--router-init", "zero"]) == 0
    assert json.loads(capsys.readouterr().out)["average_coherence"] == {"0": pytest.approx(1.0)}


@pytest.mark.parametrize("layers,router_init", [("all", "data"), ("all", "zero"), ("every_other", "data")])
def test_upcycled_branches_compute_the_dense_logits(
    dense, branched, tiny_tokens, tmp_path, layers, router_init
):
    """Equal experts: whatever the router picks, the renormalised top-2 combine is the dense FFN (nothing dropped:
    eval capacity factor E); averaged layers average equal tensors. The point of branching before upcycling."""
    rec = upcycle(
        branched, tmp_path / "btx", layers=layers, router_init=router_init, data=str(tiny_tokens), blocks=2
    )
    assert all(r == pytest.approx(1.0) for r in rec["average_coherence"].values())
    c = load_consolidated(tmp_path / "btx")
    ffn = replace(c.cfg.model.ffn, gshard=replace(c.cfg.model.ffn.gshard, eval_capacity_factor=3.0))
    model = replace(c, cfg=replace(c.cfg, model=replace(c.cfg.model, ffn=ffn))).build_model().eval()
    ref = load_consolidated(dense).build_model().eval()
    x_BT = _tokens(1)
    with torch.no_grad():
        out, want = model(x_BT), ref(x_BT).logits
    assert all(float(v) == 0.0 for k, v in out.ffn_stats.items() if k.endswith("dropped_fraction"))
    assert (out.logits - want).abs().max() <= 1e-6, (out.logits - want).abs().max()
    if router_init == "data":  # the router really spreads tokens over several experts
        loads = [v for k, v in out.ffn_stats.items() if k.endswith("expert_load_E")]
        assert all(int((load > 0).sum()) >= 2 for load in loads)


@pytest.mark.slow
def test_demix_run_from_the_branched_checkpoint_on_two_ranks(dense, tmp_path):
    """`launcher.launch --config configs/demo/demix.yaml --nproc 2` + demix_overrides of a 2-domain branch: 2 finite
    steps, the first one's loss the branched model's own loss on the same batches (= the dense model's), and an
    exported DEMix checkpoint whose two experts, equal at the start, moved apart (each trained on its domain)."""
    from launcher.metrics import read_metrics

    branch(dense, tmp_path / "branched", ["sailing", "cooking"])
    run = tmp_path / "run"
    sets = demix_overrides(tmp_path / "branched") + [
        "train.steps=2",
        "train.micro_batch=2",
        "train.warmup_fraction=0.0",
        "train.eval_batches=1",
        "logging.log_interval=1",
        "logging.progress_bar=false",
        "logging.wandb_mode=disabled",
    ]
    argv = ["--config", str(REPO / "configs/demo/demix.yaml"), "--nproc", "2", "--run-dir", str(run)]
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.launch", *argv, *[a for s in sets for a in ("--set", s)]],
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    train = [r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "train"]
    assert [r["step"] for r in train] == [1, 2] and all(math.isfinite(r["loss"]) for r in train)
    loss, _ = _first_step_loss(tmp_path / "branched", run, 2)
    assert train[0]["loss"] == pytest.approx(loss, rel=1e-6), (train[0]["loss"], loss)
    out = load_consolidated(run / "model")
    assert out.cfg.model.ffn.kind == "demix" and out.domains == ["sailing", "cooking"] and out.step == 2
    key = "blocks.1.ffn.experts.{}.fc1.weight"
    start = load_consolidated(tmp_path / "branched").state_dict[key.format(0)]
    # both experts trained
    assert not any(torch.equal(out.state_dict[key.format(j)], start) for j in range(2))
    assert not torch.equal(out.state_dict[key.format(0)], out.state_dict[key.format(1)])
