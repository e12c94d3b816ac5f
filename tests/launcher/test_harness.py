"""The DEMix mixture inside lm-evaluation-harness (launcher/harness/), offline: local tasks written from
a prepared split; the harness's token perplexity equals launcher.evaluation.evaluate's functions on the same
document windows (cached / uniform mixtures, dense); loglikelihood equals a direct computation through GPT.forward;
the multiple-choice task runs; the stock `hf` model on an exported expert equals `expert=<name>`."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install lm_eval==0.4.13)")

import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from launcher import harness as H  # noqa: E402

DOMAINS = ["cooking", "sailing", "finance"]
CACHED_BLOCKS = 4  # dev blocks of the cached prior: small, the same on both sides


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_tokens, random_checkpoint):
    from data.tokenizer import load_prepared_tokenizer

    root = tmp_path_factory.mktemp("harness")
    tasks = root / "tasks"
    rec = H.write_tasks(tiny_tokens, "gpt2", tasks, max_docs=3)
    return SimpleNamespace(
        root=root,
        data=tiny_tokens,
        tasks=tasks,
        rec=rec,
        demix=random_checkpoint(root / "demix", "demix"),
        dense=random_checkpoint(root / "dense", "dense"),
        tok=load_prepared_tokenizer(tiny_tokens, "gpt2"),
        tm=TaskManager(include_path=str(tasks), include_defaults=False),
    )


def _evaluate(env, model: str, model_args: str, tasks: list[str], **kw) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = lm_eval.simple_evaluate(
            model=model,
            model_args=model_args,
            tasks=tasks,
            task_manager=env.tm,
            log_samples=False,
            bootstrap_iters=0,
            device="cpu",
            **kw,
        )
    return {t: {k.split(",")[0]: v for k, v in r.items()} for t, r in res["results"].items()}


def _rolling(text: str, domain: str, i: int = 0) -> Instance:
    return Instance(
        "loglikelihood_rolling", {"domain": domain, "text": text}, (text,), i, (H.PPL_PREFIX + domain, i, 1)
    )


def _ll_request(ctx: str, cont: str, domain: str, i: int = 0) -> Instance:
    return Instance("loglikelihood", {"domain": domain}, (ctx, cont), i, ("t", i, 1))


def test_task_files_hold_the_prepared_split(env):
    from launcher.checkpoint_data import split_documents_text
    from launcher.modular.hf_tokenizer import stored_equal

    texts, _ = split_documents_text(env.data, "gpt2", "test", 3)
    names = set(env.tm.all_tasks)
    assert {"demix_ppl", "demix_continuation", *(H.PPL_PREFIX + d for d in DOMAINS)} <= names
    assert env.rec["format"] == H.TASKS_FORMAT and set(env.rec["domains"]) == set(DOMAINS)
    for d in DOMAINS:
        rows = [json.loads(x) for x in (env.tasks / "data" / f"ppl_{d}.jsonl").read_text().splitlines()]
        assert [r["text"] for r in rows] == texts[d] and len(rows) == 3
        assert [r["n_tokens"] for r in rows] == [len(env.tok.encode(r["text"])) for r in rows]
        # [bos] + enc(text) = the token files
        assert stored_equal(env.tok, env.data, d, "test", texts[d]) == 3
        assert env.rec["domains"][d]["tokens"] == sum(r["n_tokens"] for r in rows)
    assert H.read_task_documents(env.tasks) == texts
    mc = [json.loads(x) for x in (env.tasks / "data" / "continuation.jsonl").read_text().splitlines()]
    assert mc and all(len(r["choices"]) == 4 and 0 <= r["gold"] < 4 for r in mc)
    for r in mc:
        doc = texts[r["domain"]][r["doc_index"]]
        assert doc.startswith(r["context"] + r["choices"][r["gold"]])
        assert r["domain"] not in r["distractor_domains"]
    ns: dict = {}
    exec((env.tasks / "utils.py").read_text(), ns)  # self-contained: the tasks load without this project
    got = ns["process_ppl_results"]({"text": "a b  c", "n_tokens": 4}, [-2.0])
    assert got == {
        "word_perplexity": (-2.0, 3),
        "byte_perplexity": (-2.0, 6),
        "bits_per_byte": (-2.0, 6),
        "token_perplexity": (-2.0, 4),
    }


def test_task_writer_refuses_a_foreign_directory(env, tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "utils.py").write_text("x = 1\n")
    assert H.main(["tasks", "--data", str(env.data), "--out", str(tmp_path / "mine")]) == 2
    assert "error:" in capsys.readouterr().err and (tmp_path / "mine" / "utils.py").read_text() == "x = 1\n"
    assert H.main(["tasks", "--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "t")]) == 2
    assert "manifest.json not found" in capsys.readouterr().err


def test_windows_are_evaluates_blocks_for_a_one_document_stream(env):
    from launcher.checkpoint_data import block_inputs, load_blocks

    T = 32
    text = H.read_task_documents(env.tasks, ["sailing"])["sailing"][0]
    ids = env.tok.encode(text)
    wins = H.document_windows(ids, T, env.tok.bos_id)
    assert sum(n for *_, n in wins) == len(ids) and all(
        len(w[0]) == len(w[1]) == n for w in wins for n in [w[2]]
    )
    tokens, targets, _ = block_inputs(load_blocks(env.data, "gpt2", "sailing", "test", T, None))
    full = len(ids) // T  # evaluate's blocks lying wholly inside the first document of the stream
    assert full >= 1
    for w in range(full):
        assert wins[w][0] == tokens[w].tolist() and wins[w][1] == targets[w].tolist()
    lm_wins = H.document_windows(ids, T, env.tok.bos_id, "lm_eval")
    assert [w[1][-w[2] :] for w in lm_wins] == [w[1] for w in wins]  # the same targets, each scored once
    assert len(lm_wins[-1][0]) == min(T, len(ids))  # ... the last one with the full context


@pytest.mark.parametrize("kind,mode", [("demix", "cached"), ("demix", "uniform"), ("dense", None)])
def test_harness_perplexity_equals_evaluate(env, kind, mode):
    """The mixture's (or the dense model's) per-domain token perplexity through lm_eval.simple_evaluate equals
    evaluate's stream_log_likelihoods + _demix_domain on the same windows, with the same cached prior."""
    ckpt = env.demix if kind == "demix" else env.dense
    args = f"checkpoint={ckpt},data={env.data},cached_blocks={CACHED_BLOCKS},batch_size=16"
    got = _evaluate(env, "demix", args + (f",mode={mode}" if mode else ""), ["demix_ppl"])
    ev = H.evaluate_documents(
        ckpt,
        env.data,
        H.read_task_documents(env.tasks),
        modes=[mode or "ppl"],
        cached_blocks=CACHED_BLOCKS,
        batch_size=16,
    )
    per_domain = []
    for d in DOMAINS:
        h, e = got[H.PPL_PREFIX + d]["token_perplexity"], ev["domains"][d]["ppl"][mode or "ppl"]
        assert abs(h - e) / e < 1e-4, (d, h, e)
        per_domain.append(h)
        assert got[H.PPL_PREFIX + d]["bits_per_byte"] > 0 and got[H.PPL_PREFIX + d]["word_perplexity"] > 1
    assert got["demix_ppl"]["token_perplexity"] == pytest.approx(sum(per_domain) / 3, rel=1e-9)
    if mode == "cached":
        assert all(ev["domains"][d]["cached_prior"] is not None for d in DOMAINS)


def _silence_padding_rows(ckpt: Path, out: Path) -> Path:
    """The checkpoint with its padding embedding rows (ids >= the tokenizer's 50257) given no probability: the
    exported Hugging Face model has only the real tokens in its softmax, ours also the padding rows, so a random
    model (where they hold ~47/50304 of the mass) would differ by that much. ln_f.bias = 10 and padding rows = -1
    make their logits ~-320 (exp underflows to 0) and leave the real tokens' logits O(1)."""
    from launcher.checkpoint import load_consolidated
    from launcher.modular.experts import save

    c = load_consolidated(ckpt)
    c.state_dict["ln_f.bias"] = torch.full_like(c.state_dict["ln_f.bias"], 10.0)
    wte = c.state_dict["wte.weight"].clone()
    wte[50257:] = -1.0
    c.state_dict["wte.weight"] = wte
    return save(c, out)


def test_stock_hf_model_on_an_export_equals_the_expert(env):
    """lm-eval's own `hf` model on `hf_export`'s folder (trimmed vocabulary, exported tokenizer) scores the domain's
    task like `expert=<domain>` with lm-eval's window convention. add_bos_token=False: lm-eval's rolling windows
    already start with the prefix token (bos); the exported tokenizer would add a second one."""
    from launcher.modular.hf_export import main as export_main

    ckpt = _silence_padding_rows(env.demix, env.root / "demix-silent")
    out = env.root / "hf_sailing"
    assert export_main([str(ckpt), "--domain", "sailing", "--out", str(out), "--data", str(env.data)]) == 0
    task = H.PPL_PREFIX + "sailing"
    hf = _evaluate(env, "hf", f"pretrained={out},tokenizer={out},dtype=float32,add_bos_token=False", [task])
    ours = _evaluate(
        env, "demix", f"checkpoint={ckpt},data={env.data},expert=sailing,windows=lm_eval", [task]
    )
    a, b = hf[task]["token_perplexity"], ours[task]["token_perplexity"]
    assert abs(a - b) / b < 1e-5, (a, b)


def test_loglikelihood_equals_a_direct_computation(env):
    """(sum log p(continuation), is_greedy) against GPT.forward's logits: dense, one expert, and the uniform
    mixture (eqs. 6-8 written out here); a context longer than seq_len is cut to the last tokens."""
    from launcher.checkpoint import load_consolidated

    tok = env.tok
    doc = H.read_task_documents(env.tasks, ["finance"])["finance"][0]
    words = doc.split(" ")
    # the last one: > 32 tokens, trailing space
    cases = [
        (" ".join(words[:6]), " " + " ".join(words[6:9])),
        ("", " ".join(words[:4])),
        (" ".join(words[:40]) + " ", " ".join(words[40:43])),
    ]
    for kind, margs in (("dense", {}), ("demix", {"expert": "finance"}), ("demix", {"mode": "uniform"})):
        ckpt = env.dense if kind == "dense" else env.demix
        lm = H.DemixLM(checkpoint=str(ckpt), data=str(env.data), **margs)
        got = lm.loglikelihood([_ll_request(c, x, "finance", i) for i, (c, x) in enumerate(cases)])
        model = load_consolidated(ckpt).build_model().eval()
        E = len(lm.experts) if "mode" in margs else 1
        for (ctx, cont), (lp, greedy) in zip(cases, got):
            n = len(ctx) - len(ctx.rstrip())
            ctx, cont = (ctx[:-n], ctx[-n:] + cont) if n else (ctx, cont)
            c_ids = tok.encode(ctx) if ctx else []
            x_ids = tok.encode(ctx + cont)[len(c_ids) :]
            seq = torch.tensor([([tok.bos_id] + c_ids + x_ids)[-33:]])
            C = len(x_ids)
            if kind == "dense":
                experts = [None]
            else:
                experts = [lm.experts.index("finance")] if "expert" in margs else list(range(E))
            with torch.no_grad():  # GPT.forward routed to each expert: full logits, E T V
                logp = torch.stack(
                    [
                        torch.log_softmax(
                            model(seq[:, :-1], None if j is None else torch.tensor([j])).logits[0].double(),
                            -1,
                        )
                        for j in experts
                    ]
                )
            tgt = seq[0, 1:]
            ll_ET = logp.gather(2, tgt.expand(len(experts), -1)[..., None])[..., 0]
            # posterior before t (eqs. 7-8, uniform prior) over the whole window, mixture (eq. 6)
            prefix = torch.cat(
                [torch.zeros(len(experts), 1, dtype=torch.float64), ll_ET.cumsum(1)[:, :-1]], 1
            )
            log_g = torch.log_softmax(prefix, 0)
            mix_TV = torch.logsumexp(logp + log_g[..., None], 0)
            want = float(mix_TV[-C:].gather(1, tgt[-C:, None]).sum())
            assert lp == pytest.approx(want, rel=1e-5, abs=1e-4)
            assert greedy == bool((mix_TV[-C:, : tok.vocab_size].argmax(-1) == tgt[-C:]).all())
    # a greedy continuation (one that tokenises back to the same ids) is recognised as such
    from launcher.evaluation.generate import generate

    lm = H.DemixLM(checkpoint=str(env.dense), data=str(env.data))
    found = 0
    for prompt in ("The hull", "Bond yield", "Oven flour", "Market rate", "Wind"):
        new = generate(
            lm.model,
            [tok.bos_id] + tok.encode(prompt),
            temperature=0.0,
            max_new_tokens=2,
            vocab_limit=tok.vocab_size,
        ).new_ids
        cont = tok.decode(new)
        if tok.encode(prompt + cont) == tok.encode(prompt) + new:
            assert lm.loglikelihood([_ll_request(prompt, cont, "sailing")])[0][1] is True
            found += 1
    assert found


def test_multiple_choice_task_runs(env):
    """The harness's acc and acc_norm on the first 3 documents are the accuracies computed here from the model
    class's own log-likelihoods of the same (context, choice) pairs (checked against GPT.forward above): acc picks
    the choice of the highest log-likelihood, acc_norm of the highest per character of the choice."""
    got = _evaluate(
        env,
        "demix",
        f"checkpoint={env.demix},data={env.data},mode=uniform,batch_size=16",
        ["demix_continuation"],
        limit=3,
    )["demix_continuation"]
    rows = [json.loads(x) for x in (env.tasks / "data" / "continuation.jsonl").read_text().splitlines()][:3]
    requests = [
        Instance("loglikelihood", r, (r["context"], choice), k, ("demix_continuation", n, 1))
        for n, r in enumerate(rows)
        for k, choice in enumerate(r["choices"])
    ]
    lm = H.DemixLM(checkpoint=str(env.demix), data=str(env.data), mode="uniform", batch_size=16)
    lls = [ll for ll, _ in lm.loglikelihood(requests)]
    picks = {"acc": 0, "acc_norm": 0}
    for r in rows:
        mine, lls = lls[: len(r["choices"])], lls[len(r["choices"]) :]
        per_char = [ll / len(c) for ll, c in zip(mine, r["choices"])]
        for metric, scores in (("acc", mine), ("acc_norm", per_char)):
            pick = scores.index(max(scores))  # the first best, as numpy's argmax (a distractor may repeat)
            others = [x for x, c in zip(scores, r["choices"]) if c != r["choices"][pick]]
            # no near-tie with another choice: rounding cannot flip the pick
            assert all(scores[pick] - x > 1e-6 for x in others), scores
            picks[metric] += pick == r["gold"]
    assert len(rows) == 3 and not lls
    assert got["acc"] == pytest.approx(picks["acc"] / 3, abs=1e-12)
    assert got["acc_norm"] == pytest.approx(picks["acc_norm"] / 3, abs=1e-12)


def test_rolling_modes_and_opt_out_agree_with_evaluate(env):
    """Modes naive / updating / average and exclude_experts (never read) through the model class directly."""
    docs = H.read_task_documents(env.tasks, ["cooking"])
    reqs = [_rolling(t, "cooking", i) for i, t in enumerate(docs["cooking"])]
    n_tokens = sum(len(env.tok.encode(t)) for t in docs["cooking"])
    ev = H.evaluate_documents(
        env.demix, env.data, docs, modes=["naive", "updating", "average"], batch_size=16
    )
    for mode in ("naive", "updating", "average"):
        lm = H.DemixLM(checkpoint=str(env.demix), data=str(env.data), mode=mode, batch_size=16)
        ppl = math.exp(-sum(lm.loglikelihood_rolling(reqs)) / n_tokens)
        assert ppl == pytest.approx(ev["domains"]["cooking"]["ppl"][mode], rel=1e-5)
    lm = H.DemixLM(
        checkpoint=str(env.demix), data=str(env.data), mode="uniform", exclude_experts="finance;sailing"
    )
    assert lm.experts == ["cooking"]
    ev = H.evaluate_documents(
        env.demix, env.data, docs, modes=["uniform"], exclude_experts=["finance", "sailing"]
    )
    ppl = math.exp(-sum(lm.loglikelihood_rolling(reqs)) / n_tokens)
    assert ppl == pytest.approx(ev["domains"]["cooking"]["ppl"]["uniform"], rel=1e-5)


def test_generate_until_is_greedy_and_stops_at_strings(env):
    from launcher.evaluation.generate import generate

    lm = H.DemixLM(checkpoint=str(env.demix), data=str(env.data), expert="sailing")
    tok = env.tok
    ref = generate(
        lm.model,
        [tok.bos_id] + tok.encode("The hull"),
        expert=lm.experts.index("sailing"),
        temperature=0.0,
        max_new_tokens=6,
        stop_id=tok.eod_id,
        vocab_limit=tok.vocab_size,
    )
    text = tok.decode([t for t in ref.new_ids if t != tok.eod_id])
    req = Instance(
        "generate_until",
        {"domain": "sailing"},
        ("The hull", {"until": [], "max_gen_toks": 6}),
        0,
        ("t", 0, 1),
    )
    assert lm.generate_until([req]) == [text]
    if len(text) > 1:
        stop = text[1:3] if text[1:3].strip() else text[-1]
        req = Instance(
            "generate_until", {}, ("The hull", {"until": [stop], "max_gen_toks": 6}), 0, ("t", 0, 1)
        )
        assert lm.generate_until([req]) == [text[: text.index(stop)]]


def test_bad_model_args_are_clear_errors(env):
    ck, data = str(env.demix), str(env.data)
    for kwargs, match in [
        ({"mode": "best"}, "mode='best': choose one of cached"),
        ({"expert": "knitting"}, "expert='knitting' is not an expert"),
        ({"expert": "sailing", "mode": "uniform"}, "not both"),
        ({"exclude_experts": "knitting"}, "not experts of"),
        ({"posterior": "suffix"}, "posterior='suffix'"),
        ({"windows": "overlap"}, "windows='overlap'"),
        ({"topk": 2, "mode": "uniform"}, "topk=2"),
        ({"colour": "red"}, "unknown colour"),
    ]:
        with pytest.raises(ValueError, match=match):
            H.DemixLM(checkpoint=ck, data=data, **kwargs)
    with pytest.raises(ValueError, match="has no experts"):
        H.DemixLM(checkpoint=str(env.dense), data=data, expert="sailing")
    with pytest.raises(ValueError, match="not a consolidated checkpoint"):
        H.DemixLM(checkpoint=str(env.root / "nowhere"))
    with pytest.raises(ValueError, match="mode='best'"):  # through lm-eval's model_args string too
        _evaluate(env, "demix", f"checkpoint={ck},mode=best", ["demix_ppl_cooking"])


@pytest.mark.slow
def test_lm_eval_cli_through_the_run_wrapper(env, tmp_path, capsys):
    """`python -m launcher.harness run ...` is lm-eval's own CLI with model demix registered (it indexes
    lm-eval's built-in tasks too, hence slow)."""
    rc = H.main(
        [
            "run",
            "--model",
            "demix",
            "--model_args",
            f"checkpoint={env.dense},data={env.data}",
            "--include_path",
            str(env.tasks),
            "--tasks",
            "demix_ppl_cooking",
            "--device",
            "cpu",
            "--output_path",
            str(tmp_path / "out"),
        ]
    )
    assert rc == 0
    assert "token_perplexity" in capsys.readouterr().out
