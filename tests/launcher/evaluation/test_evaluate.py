"""All-experts batched evaluation, the evaluation command end to end on a tiny prepared corpus, and generation."""

import json
import math

import pytest
import torch

from launcher.checkpoint import load_consolidated, save_consolidated
from launcher.config import load_run_config
from model.batched import expert_log_likelihoods, next_token_log_probs, sequential_log_likelihoods
from model.gpt import GPT

WORDS = {
    "news": "the council voted on tuesday to approve the budget for road repairs officials said shares fell".split(),
    "code": "def return self class import for in range if else print lambda yield none true false".split(),
    "legal": "permission is hereby granted free of charge to any person obtaining a copy warranty liability".split(),
}
SEQ = 32


def _cfg(kind="demix", experts=2, mixture="by_domain", domains=("news", "code")):
    return load_run_config(
        None,
        [
            "model.preset=tiny",
            "model.n_layers=2",
            "model.d_model=32",
            "model.n_heads=2",
            f"model.seq_len={SEQ}",
            f"model.ffn.kind={kind}",
            f"model.ffn.num_experts={experts if kind == 'demix' else 0}",
            f"data.mixture={mixture}",
            f"data.domains=[{', '.join(domains)}]",
        ],
    )


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    from data.prepare import prepare_corpus

    root = tmp_path_factory.mktemp("evaldata")
    corpus = root / "corpus"
    corpus.mkdir()
    g = torch.Generator().manual_seed(0)
    for name, words in WORDS.items():
        lines = []
        for i in range(20):
            idx = torch.randint(0, len(words), (40,), generator=g).tolist()
            lines.append(
                json.dumps({"id": f"{name}-{i}", "domain": name, "text": " ".join(words[j] for j in idx)})
            )
        (corpus / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    prepare_corpus(
        corpus,
        root / "tokens",
        workers=1,
        valid_fraction=0.2,
        test_fraction=0.2,
        anonymise=False,
        progress=False,
    )
    return root / "tokens"


@pytest.fixture(scope="module")
def demix_ckpt(tmp_path_factory):
    cfg = _cfg()
    model = GPT(cfg.model, init_seed=3)
    return save_consolidated(
        tmp_path_factory.mktemp("ckpt") / "demix", model.state_dict(), cfg, ["news", "code"], 7
    )


def test_batched_all_experts_equals_sequential_passes():
    cfg = _cfg(experts=3, domains=("a", "b", "c"))
    model = GPT(cfg.model, init_seed=1).eval()
    x = torch.randint(0, 1000, (3, SEQ + 1), generator=torch.Generator().manual_seed(0))
    b = sequential_log_likelihoods(model, x[:, :-1], x[:, 1:])  # the reference: GPT.forward per expert
    # default blocks, several vocabulary blocks (288 rows x 173 entries), many small blocks (288 x 10)
    for budget in (None, 50_000, 3_000):
        a = expert_log_likelihoods(model, x[:, :-1], x[:, 1:], logit_budget=budget)
        assert a.shape == (3, 3, SEQ) and a.dtype == torch.float32
        assert (a - b).abs().max() <= 1e-5, budget
    assert (a[0] - a[1]).abs().max() > 1e-3  # the experts really differ
    sub = expert_log_likelihoods(model, x[:, :-1], x[:, 1:], expert_ids=[2, 0])
    assert (sub - b[[2, 0]]).abs().max() <= 1e-5
    for j in range(3):  # one expert at a time: the fair sequential baseline of the benchmark
        assert (expert_log_likelihoods(model, x[:, :-1], x[:, 1:], [j])[0] - b[j]).abs().max() <= 1e-5
    last = next_token_log_probs(model, x[:, :-1])
    full = model(x[:, :-1], torch.full((3,), 1)).logits[:, -1].log_softmax(-1)
    assert torch.allclose(last[1], full, atol=1e-5)


def test_batched_dense_is_one_expert():
    model = GPT(_cfg("dense").model, init_seed=1).eval()
    x = torch.randint(0, 1000, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    for budget in (None, 50_000):
        a = expert_log_likelihoods(model, x[:, :-1], x[:, 1:], logit_budget=budget)
        assert a.shape == (1, 2, SEQ)
        assert (a - sequential_log_likelihoods(model, x[:, :-1], x[:, 1:])).abs().max() <= 1e-5


def test_evaluate_checkpoint_writes_the_tables_and_both_figures(data_root, demix_ckpt, tmp_path):
    from launcher.evaluation.evaluate import evaluate_checkpoint
    from launcher.evaluation.results import DEMIX_MODES as ALL_MODES
    from launcher.evaluation.results import ROUTER_MODES

    DEMIX_MODES = [
        m for m in ALL_MODES if m not in ROUTER_MODES
    ]  # no router vectors: no router mode by default
    out = tmp_path / "eval"
    res = evaluate_checkpoint(
        demix_ckpt, data_root, max_blocks=4, cached_blocks=3, out_dir=out, progress=False
    ).to_dict()
    assert res["experts"] == ["news", "code"] and res["step"] == 7 and res["modes"] == list(DEMIX_MODES)
    doms = res["domains"]
    assert {d: r["role"] for d, r in doms.items()} == {"code": "train", "legal": "novel", "news": "train"}
    for r in doms.values():
        assert set(r["ppl"]) == set(DEMIX_MODES)
        assert all(1.0 < v < 1e6 for v in r["ppl"].values())
        assert sum(r["posterior"]["updating_mean_end_of_block"].values()) == pytest.approx(1.0)
        assert r["topk"]["experts_evaluated"] == 2 and r["blocks"] <= 4
    assert doms["news"]["naive_expert"] == "news" and doms["code"]["naive_expert"] == "code"
    best = min(doms["legal"]["expert_ppl"], key=doms["legal"]["expert_ppl"].get)
    assert doms["legal"]["naive_expert"] == best
    assert doms["legal"]["ppl"]["naive"] == pytest.approx(doms["legal"]["expert_ppl"][best])
    assert doms["news"]["ppl"]["naive"] == pytest.approx(doms["news"]["expert_ppl"]["news"])
    assert res["tables"]["novel_average"]["cached"] == pytest.approx(doms["legal"]["ppl"]["cached"])
    mean = (doms["news"]["ppl"]["uniform"] + doms["code"]["ppl"]["uniform"]) / 2
    assert res["tables"]["in_domain_average"]["uniform"] == pytest.approx(mean)
    for d, r in doms.items():  # per-block NLLs recorded: they give the perplexity and its interval back
        assert len(r["block_tokens"]) == r["blocks"] and sum(r["block_tokens"]) == r["tokens"]
        for m, nll in r["block_nll"].items():
            assert math.exp(sum(nll) / r["tokens"]) == pytest.approx(r["ppl"][m], rel=1e-9)
            lo, hi = res["tables"]["per_domain_ci"][d][m]
            assert lo <= r["ppl"][m] <= hi
        u = r["unigram"]  # the domain's own add-k unigram on the same test targets
        assert u["train_tokens"] > 0 and math.exp(sum(u["block_nll"]) / r["tokens"]) == pytest.approx(
            u["ppl"]
        )
    assert res["tables"]["unigram_in_domain_average"] == pytest.approx(
        (doms["news"]["unigram"]["ppl"] + doms["code"]["unigram"]["ppl"]) / 2
    )
    for m in DEMIX_MODES:
        lo, hi = res["tables"]["in_domain_average_ci"][m]
        assert lo <= res["tables"]["in_domain_average"][m] <= hi
    for name in ("eval.json", "eval.md", "posteriors.png", "specialisation.png", "cached_priors/legal.json"):
        assert (out / name).is_file(), name
    assert (out / "posteriors.png").read_bytes()[:4] == b"\x89PNG"
    # Figure 4 for every cached-prior estimator x posterior mode, from the same dev log-likelihoods
    variants = doms["legal"]["cached_prior_variants"]
    assert set(variants) == {
        f"{e}/{p}" for e in ("mean", "ewm", "updating") for p in ("prefix", "previous_token")
    }
    assert variants["mean/prefix"] == pytest.approx(doms["legal"]["cached_prior"]["probs"])
    for e in ("mean", "ewm", "updating"):
        for p in ("prefix", "previous_token"):
            assert (out / f"cached_prior_{e}_{p}.png").read_bytes()[:4] == b"\x89PNG"
    md = (out / "eval.md").read_text()
    assert "Table 3" in md and "Table 4" in md and "Table 5" in md and "DEMix (cached)" in md
    assert "| unigram (own train split) |" in md
    assert json.loads((out / "eval.json").read_text())["tables"] == json.loads(json.dumps(res["tables"]))


def test_posterior_mode_and_cached_estimator_are_applied_and_recorded(data_root, demix_ckpt, tmp_path):
    """--posterior previous_token and --cached-estimator ewm reach every mixture and are written down: the
    uniform-prior mixture equals model/mixture.py's previous-token mixture on the same log-likelihoods, the cached
    prior file says how it was made, and the default run (prefix, mean) differs."""
    from launcher.evaluation.evaluate import evaluate_checkpoint, main
    from model import mixture as mx

    kw = dict(max_blocks=3, cached_blocks=3, modes=["uniform", "cached"], domains=["legal"], progress=False)
    default = evaluate_checkpoint(demix_ckpt, data_root, **kw).to_dict()
    ref = evaluate_checkpoint(
        demix_ckpt,
        data_root,
        posterior="previous_token",
        cached_estimator="ewm",
        out_dir=tmp_path / "ref",
        **kw,
    ).to_dict()
    assert (default["posterior"], default["cached_estimator"]) == ("prefix", "mean")
    assert (ref["posterior"], ref["cached_estimator"]) == ("previous_token", "ewm")
    legal = ref["domains"]["legal"]
    assert (
        legal["cached_prior"]["estimator"] == "ewm" and legal["cached_prior"]["posterior"] == "previous_token"
    )
    saved = mx.CachedPrior.load(tmp_path / "ref" / "cached_priors" / "legal.json")
    assert (saved.estimator, saved.posterior, saved.decay) == ("ewm", "previous_token", mx.EWM_ALPHA)
    assert legal["ppl"]["uniform"] != pytest.approx(default["domains"]["legal"]["ppl"]["uniform"], rel=1e-9)
    assert "posterior: previous_token" in (tmp_path / "ref" / "eval.md").read_text()
    with pytest.raises(SystemExit):  # argparse names the choices
        main([str(demix_ckpt), "--data", str(data_root), "--posterior", "last"])
    with pytest.raises(ValueError, match="cached_estimator='median'"):
        evaluate_checkpoint(demix_ckpt, data_root, cached_estimator="median", **kw)


def test_evaluate_dense_and_domain_token_checkpoints(data_root, tmp_path):
    from launcher.evaluation.evaluate import evaluate_checkpoint

    for mixture in ("natural", "domain_token"):
        cfg = _cfg("dense", mixture=mixture)
        path = save_consolidated(
            tmp_path / mixture, GPT(cfg.model, init_seed=2).state_dict(), cfg, ["news", "code"]
        )
        res = evaluate_checkpoint(
            path, data_root, max_blocks=2, out_dir=tmp_path / f"out-{mixture}", progress=False
        ).to_dict()
        assert res["modes"] == ["ppl"] and res["experts"] == []
        assert set(res["domains"]) == {"news", "code", "legal"}
        assert res["tables"]["novel_average"]["ppl"] > 1.0
        if mixture == "domain_token":
            assert res["domains"]["news"]["naive_expert"] == "news"
            assert set(res["domains"]["legal"]["expert_ppl"]) == {"news", "code"}
        assert (tmp_path / f"out-{mixture}" / "eval.md").is_file()


def test_generation_is_deterministic_given_a_seed(demix_ckpt):
    from launcher.evaluation.generate import generate

    model = load_consolidated(demix_ckpt).build_model()
    prompt = [50256, 464, 3139]
    kw = dict(max_new_tokens=6, temperature=1.0, top_k=50, top_p=0.9)
    a = generate(model, prompt, expert=1, seed=5, **kw)
    assert a.new_ids == generate(model, prompt, expert=1, seed=5, **kw).new_ids and len(a.new_ids) == 6
    m = generate(model, prompt, mixture=True, seed=5, **kw)
    assert m.new_ids == generate(model, prompt, mixture=True, seed=5, **kw).new_ids
    assert len(m.posteriors) == 6 and all(sum(p) == pytest.approx(1.0) for p in m.posteriors)
    outs = {tuple(generate(model, prompt, mixture=True, seed=s, **kw).new_ids) for s in range(4)}
    assert len(outs) > 1  # the seed matters
    greedy = generate(model, prompt, expert=0, temperature=0.0, max_new_tokens=3)
    x = torch.tensor([prompt])
    assert greedy.new_ids[0] == int(model(x, torch.zeros(1, dtype=torch.long)).logits[0, -1, :50264].argmax())
    with pytest.raises(ValueError):
        generate(model, prompt, max_new_tokens=1)


def test_generate_command(demix_ckpt, capsys):
    from launcher.evaluation.generate import main

    assert (
        main(
            [
                str(demix_ckpt),
                "--prompt",
                "The council",
                "--mixture",
                "--max-new-tokens",
                "4",
                "--seed",
                "1",
                "--json",
            ]
        )
        == 0
    )
    rec = json.loads(capsys.readouterr().out)
    assert len(rec["new_ids"]) == 4 and rec["experts"] == ["news", "code"] and isinstance(rec["text"], str)
    assert main([str(demix_ckpt), "--prompt", "def", "--expert", "code", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("def")


def _eval_worker(rank, world, ckpt, data_root):
    from launcher.evaluation.evaluate import evaluate_checkpoint

    res = evaluate_checkpoint(ckpt, data_root, max_blocks=5, cached_blocks=3, progress=False).to_dict()
    return {d: r["ppl"] for d, r in res["domains"].items()}


@pytest.mark.slow
def test_evaluation_sharded_over_two_gloo_ranks_equals_one_process(demix_ckpt, data_root):
    from launcher.evaluation.evaluate import evaluate_checkpoint
    from tests.harness.multirank import run_ranks

    single = evaluate_checkpoint(
        demix_ckpt, data_root, max_blocks=5, cached_blocks=3, progress=False
    ).to_dict()
    ranks = run_ranks(
        _eval_worker, 2, args=(str(demix_ckpt), str(data_root)), timeout=300, device_strict=True
    )
    for res in ranks:
        for d, ppl in res.items():
            assert ppl == pytest.approx(single["domains"][d]["ppl"], rel=1e-5)
