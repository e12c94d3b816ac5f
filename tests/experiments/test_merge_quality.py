"""experiments/merge_quality.py: a merged DEMix model (parameters sum_j w_j W_j) against the cached-prior mixture
(DEMix eq. 6). Experts that are all equal (BTX's branch of a dense model) make the merge exact: merged = mixture =
top-1 = the dense model, coherence 1. Independently initialised experts run end to end through the CLI, with the
mixture equal to evaluate_checkpoint's `cached` number and the merge weights equal to hf_export's
`merge_weights_from_data`."""

from __future__ import annotations

import json
import math

import pytest

from experiments.merge_quality import main, merge_quality
from launcher.checkpoint import CheckpointError, load_consolidated
from launcher.evaluation.evaluate import evaluate_checkpoint
from launcher.modular.hf_export import merge_weights_from_data

BLOCKS, DEV_BLOCKS = 4, 4  # tiny_tokens has more of both (32-token blocks) in every domain


def test_equal_experts_merge_exactly(branched, dense, tiny_tokens):
    res = merge_quality(branched, tiny_tokens, max_blocks=BLOCKS, cached_blocks=DEV_BLOCKS, progress=False)
    assert set(res["domains"]) == {"cooking", "sailing", "finance"}
    assert all(v == pytest.approx(1.0, abs=1e-9) for v in res["coherence"].values())
    ref = evaluate_checkpoint(dense, tiny_tokens, max_blocks=BLOCKS, unigram=False, progress=False).to_dict()
    for dom, r in res["domains"].items():
        p = r["ppl"]
        assert r["role"] == "train" and r["blocks"] == BLOCKS
        assert all(w == pytest.approx(1 / 3, abs=1e-9) for w in r["weights"].values())
        assert p["merged"] == pytest.approx(p["mixture"], rel=1e-5)
        assert p["fixed"] == pytest.approx(p["mixture"], rel=1e-5)
        assert p["top1"] == pytest.approx(p["mixture"], rel=1e-5)
        assert p["merged"] == pytest.approx(ref["domains"][dom]["ppl"]["ppl"], rel=1e-5)  # = the dense seed
    assert res["averages"]["train"]["merged_over_mixture"] == pytest.approx(1.0, abs=1e-5)


def test_independent_experts_end_to_end(random_checkpoint, tiny_tokens, tmp_path, capsys):
    ckpt = random_checkpoint(tmp_path / "demix", "demix", seed=5)
    record = tmp_path / "out" / "merge_quality.md"
    assert (
        main(
            [
                str(ckpt),
                "--data",
                str(tiny_tokens),
                "--max-blocks",
                str(BLOCKS),
                "--cached-blocks",
                str(DEV_BLOCKS),
                "--record",
                str(record),
            ]
        )
        == 0
    )
    md, rep = record.read_text(), json.loads(record.with_suffix(".json").read_text())
    assert "| domain | role | mixture ppl |" in md and "uptime" in md and "avg train" in md
    (res,) = rep["checkpoints"]
    # independent random fc1 matrices: ||mean|| / mean ||W|| ~ 1/sqrt(3)
    assert all(abs(v - 3**-0.5) < 0.05 for v in res["coherence"].values())
    c = load_consolidated(ckpt)
    ev = evaluate_checkpoint(
        c,
        tiny_tokens,
        max_blocks=BLOCKS,
        cached_blocks=DEV_BLOCKS,
        modes=["cached"],
        unigram=False,
        progress=False,
    ).to_dict()
    for dom, r in res["domains"].items():
        assert r["ppl"]["mixture"] == pytest.approx(ev["domains"][dom]["ppl"]["cached"], rel=1e-12)
        prior = merge_weights_from_data(c, dom, str(tiny_tokens), "gpt2", DEV_BLOCKS)
        assert prior.domains == c.domains
        assert [r["weights"][d] for d in c.domains] == pytest.approx(prior.probs, abs=1e-9)
        assert r["top1_expert"] == max(c.domains, key=r["weights"].__getitem__)
        assert r["ppl"]["top1"] == pytest.approx(
            ev["domains"][dom]["expert_ppl"][r["top1_expert"]], rel=1e-12
        )
        assert all(math.isfinite(v) and v > 1 for v in r["ppl"].values())


def test_refuses_a_checkpoint_without_experts(dense, tiny_tokens, capsys):
    with pytest.raises(CheckpointError, match="no domain experts"):
        merge_quality(dense, tiny_tokens, max_blocks=BLOCKS, progress=False)
    assert main([str(dense), "--data", str(tiny_tokens)]) == 2
    assert "no domain experts" in capsys.readouterr().err
