"""benchmarks/reproduce.py on a smoke budget: real training runs of two arms through the launcher, evaluation with
intervals, the removal matrix, the claims report (verdicts, "not evaluated" where arms are missing), and a rerun
that reuses every finished stage instead of training again."""

import json
from pathlib import Path

import pytest
import yaml

from benchmarks import reproduce


def test_budget_files_load_and_bad_keys_are_named(tmp_path: Path):
    full = reproduce.Budget.load(reproduce.ROOT / "configs/reproduce/full.yaml")
    assert (
        full.seeds["dense"] == [1, 2]
        and full.seeds["demix"] == [1, 2]
        and set(full.seeds) == set(reproduce.ARMS)
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: 3\nstep_count: 4\n")
    with pytest.raises(ValueError, match="unknown keys \\['step_count'\\]"):
        reproduce.Budget.load(bad)
    bad.write_text("steps: 3\nseeds: {densee: [1]}\n")
    with pytest.raises(ValueError, match="unknown arms \\['densee'\\]"):
        reproduce.Budget.load(bad)


@pytest.mark.slow
@pytest.mark.long  # every arm launched, then resumed: make test-long
def test_smoke_budget_end_to_end_and_resumed(tmp_path: Path, tiny_tokens: Path, capsys):
    budget = {
        "steps": 4,
        "nproc": 1,
        "seeds": {"dense": [1], "demix": [1]},
        "eval_blocks": 3,
        "cached_blocks": 3,
        "save_interval": 2,
        "dapt_steps": 0,
        "sets": [
            f"data.path={tiny_tokens}",
            "data.tokenizer=gpt2",
            "model.vocab_size=50264",
            "model.n_layers=2",
            "model.d_model=64",
            "model.n_heads=2",
            "model.seq_len=32",
            "train.eval_batches=1",
        ],
    }
    (tmp_path / "smoke.yaml").write_text(yaml.safe_dump(budget))
    out = tmp_path / "out"
    args = [
        "--budget",
        str(tmp_path / "smoke.yaml"),
        "--out",
        str(out),
        "--arms",
        "dense,demix",
        "--data",
        str(tiny_tokens),
        "--record",
        str(tmp_path / "record"),
    ]
    assert reproduce.main(args) == 0
    report = json.loads((out / "report.json").read_text())
    verdicts = {c["claim"]: c for c in report["claims"]}
    dvd = verdicts["DEMix beats Dense in-domain"]
    assert dvd["verdict"] in ("reproduced", "not reproduced")
    lo_hi = dvd["numbers"]["seed 1"]["ratio_demix_over_dense"]
    assert lo_hi[1] <= lo_hi[0] <= lo_hi[2]  # the ratio inside its paired interval
    assert verdicts["removing an expert hurts its domain, barely the others"]["verdict"] != "not evaluated"
    assert (
        verdicts["novel domains: cached <= updating <= uniform < average"]["reason"]
        == "not run: the data has no novel domain"
    )
    assert verdicts["GShard's gating is nearly domain-agnostic"]["verdict"] == "not evaluated"
    # 4 steps of a tiny model are nowhere near half the unigram perplexity: the report says so
    pre = verdicts["every model at most half the unigram perplexity (in-domain average)"]
    assert pre["verdict"] == "not reproduced" and set(pre["numbers"]) == {"dense-s1", "demix-s1"}
    assert (tmp_path / "record" / "report.md").read_text() == (out / "report.md").read_text()
    md = (out / "report.md").read_text()
    assert "| DEMix beats Dense in-domain | Tables 3/4 |" in md
    # rerun: every stage reused (no training, no evaluation)
    mtime = (out / "arms" / "demix-s1" / "eval" / "eval.json").stat().st_mtime
    capsys.readouterr()
    assert reproduce.main(args) == 0
    log = capsys.readouterr().out
    assert log.count("finished earlier, reused") == 2 and "[reproduce] training" not in log
    assert (out / "arms" / "demix-s1" / "eval" / "eval.json").stat().st_mtime == mtime
    # a budget that asks for other settings does not silently reuse (or resume) runs trained differently
    budget["sets"].append("train.lr=1.0e-3")
    (tmp_path / "smoke.yaml").write_text(yaml.safe_dump(budget))
    with pytest.raises(SystemExit, match="trained with other settings"):
        reproduce.main(args)
