"""Opt-out with a guarantee (FlexOlmo-style): evaluating or exporting a DEMix checkpoint with experts excluded never
reads their weights - the test replaces an excluded expert's shard with bytes that are no torch file, so any read
would fail - and gives bit for bit what a checkpoint saved without them gives (`experts remove`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from launcher.checkpoint import CheckpointError, load_consolidated
from launcher.evaluation.evaluate import evaluate_checkpoint
from launcher.evaluation.evaluate import main as evaluate_main
from launcher.expert_surgery import load_without
from launcher.modular.experts import remove_experts

SETTINGS = dict(max_blocks=2, cached_blocks=2, progress=False, unigram=False, batch_size=2)


def _corrupt_expert(path: Path, name: str) -> None:
    meta = json.loads((path / "meta.json").read_text())
    shard = path / meta["shards"]["experts"][str(meta["domains"].index(name))]
    shard.write_bytes(b"opted out: not a torch file")


@pytest.fixture
def opted_out(tmp_path, random_checkpoint):
    """(checkpoint with sailing's shard destroyed, the same checkpoint saved without sailing)."""
    path = random_checkpoint(tmp_path / "full", "demix")
    remove_experts(path, ["sailing"], tmp_path / "without")
    _corrupt_expert(path, "sailing")
    with pytest.raises(CheckpointError, match="does not match the sha256"):
        load_consolidated(path)  # the corruption is real: reading that expert fails (its checksum first)
    return path, tmp_path / "without"


def test_evaluation_without_an_expert_is_bit_identical_to_a_model_built_without_it(opted_out, tiny_tokens):
    path, without = opted_out
    a = evaluate_checkpoint(path, tiny_tokens, exclude_experts=["sailing"], **SETTINGS).to_dict()
    b = evaluate_checkpoint(without, tiny_tokens, **SETTINGS).to_dict()
    assert a["experts"] == b["experts"] == ["cooking", "finance"] and a["excluded_experts"] == ["sailing"]
    # its expert is gone: the mixture sees it as a new domain
    assert a["domains"]["sailing"]["role"] == "novel"
    for dom in ("cooking", "sailing", "finance"):
        ra, rb = a["domains"][dom], b["domains"][dom]
        assert ra["block_nll"] == rb["block_nll"] and ra["ppl"] == rb["ppl"]  # exact equality, every mode
        assert ra.get("cached_prior") == rb.get("cached_prior")
    assert set(a["domains"]["cooking"]["block_nll"]) >= {"naive", "uniform", "updating", "cached"}


def test_export_without_an_expert_is_bit_identical(opted_out, tmp_path):
    from safetensors.torch import load_file

    from launcher.modular.hf_export import main as export_main

    path, without = opted_out
    assert (
        export_main(
            [
                str(path),
                "--merge-weights",
                "cooking=1,sailing=5,finance=3",
                "--exclude-experts",
                "sailing",
                "--no-tokenizer",
                "--out",
                str(tmp_path / "hf_a"),
            ]
        )
        == 0
    )
    assert (
        export_main(
            [
                str(without),
                "--merge-weights",
                "cooking=1,finance=3",
                "--no-tokenizer",
                "--out",
                str(tmp_path / "hf_b"),
            ]
        )
        == 0
    )
    ta, tb = (
        load_file(tmp_path / "hf_a" / "model.safetensors"),
        load_file(tmp_path / "hf_b" / "model.safetensors"),
    )
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    rec = json.loads((tmp_path / "hf_a" / "demix_export.json").read_text())
    assert rec["excluded_experts"] == ["sailing"] and rec["merge_weights"] == {
        "cooking": 0.25,
        "finance": 0.75,
    }
    assert "opted out" in (tmp_path / "hf_a" / "README.md").read_text()
    # an excluded expert cannot be exported
    assert (
        export_main(
            [
                str(path),
                "--domain",
                "sailing",
                "--exclude-experts",
                "sailing",
                "--no-tokenizer",
                "--out",
                str(tmp_path / "hf_c"),
            ]
        )
        == 2
    )


def test_opt_out_errors_are_clear(tmp_path, random_checkpoint, tiny_tokens, capsys):
    path = random_checkpoint(tmp_path / "demix", "demix")
    with pytest.raises(CheckpointError, match="no expert named \\['salling'\\]"):
        load_without(path, ["salling"])
    with pytest.raises(CheckpointError, match="would leave no expert"):
        load_without(path, ["cooking", "sailing", "finance"])
    dense = random_checkpoint(tmp_path / "dense", "dense")
    with pytest.raises(CheckpointError, match="no domain experts to exclude"):
        load_without(dense, ["cooking"])
    assert evaluate_main([str(path), "--data", str(tiny_tokens), "--exclude-experts", "salling"]) == 2
    assert "no expert named" in capsys.readouterr().err
