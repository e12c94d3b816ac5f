"""What an evaluation says before and while it runs (plan line, block counts, ETA), the modes sharing one
all-experts pass per block, the cached prior's per-checkpoint cache, and evaluate/generate following the data and
tokenizer the checkpoint recorded. Tiny fixtures: tests/conftest.py `tiny_tokens` / `random_checkpoint`."""

import json
import re
import shutil

import numpy as np
import pytest

KW = dict(max_blocks=3, cached_blocks=2)


@pytest.fixture(scope="module")
def ckpt(random_checkpoint, tmp_path_factory):
    return random_checkpoint(tmp_path_factory.mktemp("eval_progress") / "demix", "demix")


def _plan_counts(data, ckpt_path, max_blocks, cached_blocks):
    """(test block passes, prior block passes) the evaluation of `ckpt_path` on `data` should do."""
    from launcher.checkpoint import read_meta
    from launcher.checkpoint_data import count_blocks

    seq = read_meta(ckpt_path)["config"]["model"]["seq_len"]
    doms = json.loads((data / "gpt2" / "manifest.json").read_text())["domains"]
    return (
        sum(count_blocks(data, "gpt2", d, "test", seq, max_blocks) for d in doms),
        sum(count_blocks(data, "gpt2", d, "valid", seq, cached_blocks) for d in doms),
    )


def test_plan_line_first_then_block_counts_with_an_eta(ckpt, tiny_tokens, capsys):
    from launcher.evaluation.evaluate import evaluate_checkpoint

    test, prior = _plan_counts(tiny_tokens, ckpt, **KW)
    assert test > 0 and prior > 0
    evaluate_checkpoint(ckpt, tiny_tokens, progress=True, **KW)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("[eval]")]
    first = lines[0]
    assert first.startswith("[eval] plan: 3 domains x 3 test blocks"), first
    for part in (
        "3 experts",
        "6 modes (naive,average,uniform,updating,cached,topk) mixed from one all-experts pass",
        f"= {test} block passes ({3 * test} block-expert evaluations)",
        "prior: scoring 2 valid blocks per domain (3 domains), not cached",
        f"total {test + prior} block",
        "estimated ",
        "(an estimate:",
        "--max-blocks N",
        "--modes",
        "--cached-blocks N",
    ):
        assert part in first, part
    counts = [
        tuple(map(int, m.groups()))
        for m in (re.search(r"\] (\d+)/(\d+) block passes", x) for x in lines[1:])
        if m
    ]
    assert counts and all(total == test + prior for _, total in counts)
    assert [d for d, _ in counts] == sorted(d for d, _ in counts) and counts[-1][0] == test + prior
    assert all("ETA " in x and "elapsed" in x for x in lines[1:] if re.search(r"block passes \(", x))
    assert "done: naive " in lines[-1] and lines[-1].endswith("ETA 0s")
    evaluate_checkpoint(ckpt, tiny_tokens, progress=False, **KW)  # quiet: nothing on stderr
    assert capsys.readouterr().err == ""


def test_progress_eta_and_durations():
    from launcher.evaluation.progress import Progress, fmt_seconds

    assert (fmt_seconds(41), fmt_seconds(125), fmt_seconds(3720)) == ("41s", "2m05s", "1h02m")
    said = []
    p = Progress(10, said.append, every=0.0)
    assert p.eta() is None
    p.start("prior a (valid)")
    p.at(2)
    p.t0 -= 8.0  # 2 blocks in 8 s: 8 blocks left take 32 s
    assert p.eta() == pytest.approx(32.0, abs=0.5)
    p.stage_done(4)
    p.start("a (train, test)")
    p.stage_done(6, "done: naive 3.00")
    assert said[-1].startswith("[eval] 10/10 block passes (100%) - a (train, test) done: naive 3.00 - ")
    assert said[-1].endswith("ETA 0s") and said[0].startswith(
        "[eval] 2/10 block passes (20%) - prior a (valid)"
    )


def test_every_mode_is_mixed_from_one_all_experts_pass_per_block(ckpt, tiny_tokens, monkeypatch):
    """Six modes cost the forward passes of one: each test block goes through the model once (all experts
    batched), and the numbers of a mode do not depend on which other modes are asked for."""
    import launcher.evaluation.evaluate as ev
    import launcher.evaluation.scoring as scoring
    from launcher.checkpoint import load_consolidated
    from model import mixture as mx

    calls = []
    real = scoring.expert_log_likelihoods
    monkeypatch.setattr(
        scoring,
        "expert_log_likelihoods",
        lambda m, x, y, ids=None, **k: calls.append((x.shape[0], ids)) or real(m, x, y, ids, **k),
    )
    names = load_consolidated(ckpt).domains
    given = {d: mx.CachedPrior(names, [1 / len(names)] * len(names)) for d in names}  # no development pass
    kw = dict(max_blocks=3, batch_size=2, progress=False, cached_priors=given)
    every = ev.evaluate_checkpoint(ckpt, tiny_tokens, **kw).to_dict()
    n_every, calls[:] = list(calls), []
    naive = ev.evaluate_checkpoint(ckpt, tiny_tokens, modes=["naive"], **kw).to_dict()
    test, _ = _plan_counts(tiny_tokens, ckpt, 3, 0)
    assert n_every == calls and sum(b for b, _ in calls) == test and all(ids is None for _, ids in calls)
    for d, r in naive["domains"].items():
        assert r["ppl"]["naive"] == every["domains"][d]["ppl"]["naive"]
        assert r["block_nll"]["naive"] == every["domains"][d]["block_nll"]["naive"]


def _counting(monkeypatch):
    import launcher.evaluation.scoring as ev

    blocks = []
    real = ev.expert_log_likelihoods
    monkeypatch.setattr(
        ev,
        "expert_log_likelihoods",
        lambda m, x, y, ids=None, **k: blocks.append(x.shape[0]) or real(m, x, y, ids, **k),
    )
    return blocks


def _numbers(res):
    return {
        d: (r["ppl"], r["block_nll"], r.get("cached_prior"), r.get("cached_prior_variants"))
        for d, r in res["domains"].items()
    }


def test_prior_cache_hit_reuses_the_prior_and_changes_no_number(
    ckpt, tiny_tokens, tmp_path, monkeypatch, capsys
):
    from launcher.evaluation.evaluate import evaluate_checkpoint
    from launcher.evaluation.prior_cache import PRIOR_CACHE_DIR

    test, prior = _plan_counts(tiny_tokens, ckpt, **KW)
    blocks = _counting(monkeypatch)
    first = evaluate_checkpoint(ckpt, tiny_tokens, prior_cache=True, out_dir=tmp_path / "a", **KW).to_dict()
    err = capsys.readouterr().err
    assert "prior: scoring 2 valid blocks per domain (3 domains), once per checkpoint: cached in " in err
    files = list((ckpt / PRIOR_CACHE_DIR).glob("*.json"))
    assert len(files) == 1 and first["prior_cache"] == {
        "file": str(files[0]),
        "from_cache": [],
        "scored": ["cooking", "finance", "sailing"],
    }
    assert sum(blocks) == test + prior + min(4, 3)  # + the plan's one timed batch
    blocks[:] = []
    second = evaluate_checkpoint(ckpt, tiny_tokens, prior_cache=True, out_dir=tmp_path / "b", **KW).to_dict()
    err = capsys.readouterr().err
    plan = next(x for x in err.splitlines() if x.startswith("[eval] plan:"))
    assert f"prior: cached from {files[0]} (its 2 valid blocks per domain are not scored again)" in plan
    assert sum(blocks) == test + 3 and second["prior_cache"]["scored"] == []  # no development block scored
    assert _numbers(first) == _numbers(second)  # bit for bit
    assert (tmp_path / "b" / "cached_priors" / "sailing.json").read_text() == (
        tmp_path / "a" / "cached_priors" / "sailing.json"
    ).read_text()
    other = evaluate_checkpoint(
        ckpt, tiny_tokens, prior_cache=True, progress=False, max_blocks=3, cached_blocks=1
    ).to_dict()
    assert (
        other["prior_cache"]["from_cache"] == [] and len(list((ckpt / PRIOR_CACHE_DIR).glob("*.json"))) == 2
    )
    only = evaluate_checkpoint(
        ckpt, tiny_tokens, prior_cache=True, progress=False, domains=["sailing"], **KW
    ).to_dict()
    assert only["prior_cache"]["from_cache"] == ["sailing"]  # a subset of the domains is served too


def test_prior_cache_is_not_reused_for_a_changed_checkpoint_or_data(
    random_checkpoint, tiny_tokens, tmp_path, capsys
):
    from launcher.evaluation.evaluate import evaluate_checkpoint

    cache = tmp_path / "cache"  # outside the checkpoint: replacing the checkpoint leaves it there
    path = random_checkpoint(tmp_path / "ckpt", "demix", seed=3)
    kw = dict(prior_cache=cache, progress=False, **KW)
    a = evaluate_checkpoint(path, tiny_tokens, **kw).to_dict()
    assert evaluate_checkpoint(path, tiny_tokens, **kw).to_dict()["prior_cache"]["scored"] == []
    shutil.rmtree(path)
    random_checkpoint(tmp_path / "ckpt", "demix", seed=4)  # other weights at the same path
    b = evaluate_checkpoint(path, tiny_tokens, **kw).to_dict()
    assert b["prior_cache"]["from_cache"] == [] and len(b["prior_cache"]["scored"]) == 3
    assert b["domains"]["sailing"]["cached_prior"] != a["domains"]["sailing"]["cached_prior"]
    data = tmp_path / "data"
    shutil.copytree(tiny_tokens, data)
    # a copy of the same data: served
    assert evaluate_checkpoint(path, data, **kw).to_dict()["prior_cache"]["scored"] == []
    dev = data / "gpt2" / "sailing" / "valid.bin"
    dtype = json.loads((data / "gpt2" / "manifest.json").read_text())["dtype"]
    tokens = np.fromfile(dev, dtype=dtype)
    tokens[1:-1] = tokens[1:-1][::-1].copy()  # other development text, same size
    tokens.tofile(dev)
    changed = evaluate_checkpoint(path, data, **kw).to_dict()
    assert changed["prior_cache"]["from_cache"] == [] and len(changed["prior_cache"]["scored"]) == 3
    (cache_file,) = [f for f in cache.glob("*.json") if f.name in changed["prior_cache"]["file"]]
    cache_file.write_text("{not json")  # a damaged cache file is said and scored again, never trusted
    capsys.readouterr()
    again = evaluate_checkpoint(path, data, prior_cache=cache, progress=True, **KW).to_dict()
    assert "prior cache not used" in capsys.readouterr().err and len(again["prior_cache"]["scored"]) == 3
    assert _numbers(again) == _numbers(changed)


def test_evaluate_command_defaults_to_the_checkpoints_own_data(
    random_checkpoint, tiny_tokens, tmp_path, capsys
):
    from launcher.evaluation.evaluate import main

    data = tmp_path / "data"
    shutil.copytree(tiny_tokens, data)
    path = random_checkpoint(tmp_path / "ckpt", "demix")  # records tiny_tokens
    assert main([str(path), "--max-blocks", "2", "--cached-blocks", "2", "--out", str(tmp_path / "o1")]) == 0
    err = capsys.readouterr().err
    assert f"on {tiny_tokens}/gpt2 (the checkpoint's recorded data.path" in err and "prior: scoring" in err
    assert json.loads((tmp_path / "o1" / "eval.json").read_text())["prior_cache"]["scored"]
    assert main([str(path), "--max-blocks", "2", "--cached-blocks", "2", "--out", str(tmp_path / "o2")]) == 0
    assert "prior: cached from " + str(path / "eval_prior_cache") in capsys.readouterr().err
    moved = random_checkpoint(tmp_path / "ckpt2", "demix")
    meta = json.loads((moved / "meta.json").read_text())
    meta["config"]["data"]["path"] = str(tmp_path / "gone")  # trained on data that is no longer there
    (moved / "meta.json").write_text(json.dumps(meta))
    assert main([str(moved), "--max-blocks", "2", "--out", str(tmp_path / "o4")]) == 2
    err = capsys.readouterr().err
    assert (
        f"data.path={tmp_path / 'gone'}" in err and "pass --data DIR" in err and "artifacts/demo" not in err
    )
    assert not (tmp_path / "o4").exists()
    assert (
        main(
            [
                str(moved),
                "--data",
                str(data),
                "--max-blocks",
                "2",
                "--cached-blocks",
                "2",
                "--quiet",
                "--no-prior-cache",
                "--out",
                str(tmp_path / "o5"),
            ]
        )
        == 0
    )
    assert "[eval]" not in capsys.readouterr().err and not (moved / "eval_prior_cache").exists()
    assert json.loads((tmp_path / "o5" / "eval.json").read_text())["prior_cache"]["file"] is None


def test_generate_uses_the_checkpoints_tokenizer_and_data(random_checkpoint, tmp_path, capsys, monkeypatch):
    import launcher.evaluation.generate as gen

    path = random_checkpoint(tmp_path / "ckpt", "demix")
    seen = []
    real = gen.checkpoint_data
    monkeypatch.setattr(gen, "checkpoint_data", lambda *a: seen.append(a) or real(*a))
    assert gen.main([str(path), "--prompt", "bake", "--expert", "cooking", "--max-new-tokens", "2"]) == 0
    # the recorded data
    assert capsys.readouterr().out.startswith("bake") and seen == [(str(path), None, None)]
    meta = json.loads((path / "meta.json").read_text())
    meta["config"]["data"]["path"] = str(tmp_path / "gone")
    (path / "meta.json").write_text(json.dumps(meta))
    # GPT-2
    assert gen.main([str(path), "--prompt", "bake", "--expert", "cooking", "--max-new-tokens", "2"]) == 0
    assert gen.main([str(path), "--prompt", "x", "--mixture", "--tokenizer", "sentencepiece"]) == 2
    err = capsys.readouterr().err
    assert f"data.path={tmp_path / 'gone'} (tokenizer sentencepiece)" in err and "pass --data DIR" in err
