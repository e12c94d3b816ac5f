"""The owners' workflow end to end, through the real launcher: one public Dense anchor; three owners, each with a
prepared corpus of its own domain only, train their experts separately (`experts train-owner`, two forked ranks
each) and ship packages; the packages are merged; the merged model is evaluated in every mixing mode, one owner opts
out (`experts verify` proves it, and the opt-out evaluation equals the merge without that package), and the merged
checkpoint is what the other tools take (`experts remove`, a joint run's `train.init_from`)."""

from __future__ import annotations

import json

import pytest
import torch

from launcher.checkpoint import load_consolidated
from launcher.modular.experts import main as experts_main
from launcher.modular.owners.package import read_package
from tests.conftest import build_tiny_tokens, save_random_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.long]

OWNERS = ["cooking", "sailing", "finance"]


@pytest.fixture(scope="module")
def workflow(tiny_tokens, tmp_path_factory):
    root = tmp_path_factory.mktemp("owners-e2e")
    anchor = save_random_checkpoint(root / "anchor", tiny_tokens, "dense")
    pkgs = []
    for d in OWNERS:
        data = build_tiny_tokens(root / f"data-{d}", domains=[d])  # the owner's corpus: its domain only
        out = root / f"pkg-{d}"
        argv = [
            "train-owner",
            str(anchor),
            "--domain",
            d,
            "--data",
            str(data),
            "--steps",
            "3",
            "--out",
            str(out),
        ]
        argv += ["--nproc", "2", "--set", "train.micro_batch=2", "--dev-blocks", "2", "--router-blocks", "2"]
        assert experts_main([*argv, "--tag", f"contact={d}@example.org"]) == 0
        pkgs.append(out)
    merged = root / "merged"
    assert experts_main(["merge", str(anchor), *map(str, pkgs), "--out", str(merged)]) == 0
    return root, anchor, pkgs, merged


def test_owners_trained_apart_and_merged(workflow):
    root, anchor, pkgs, merged = workflow
    c = load_consolidated(merged)
    assert c.domains == OWNERS
    a = load_consolidated(anchor)
    for j, path in enumerate(pkgs):
        p = read_package(path)
        m = p.manifest
        assert m["training"]["config"]["data"]["path"] == str(
            root / f"data-{OWNERS[j]}" / "tokens"
        )  # its own data
        assert m["training"]["config"]["train"]["trainable"] == "experts"
        assert m["training"]["steps"] == 3 and m["training"]["tokens"] > 0
        assert m["tags"] == {"contact": f"{OWNERS[j]}@example.org"}
        # the merged expert is the owner's package, bit for bit; the trained expert moved away from the anchor's FFN
        for k, v in p.as_expert(j).items():
            assert torch.equal(c.state_dict[k].view(torch.uint8), v.view(torch.uint8)), k
        dense = a.state_dict[k.replace(f"experts.{j}.", "mlp.")]
        assert not torch.equal(v, dense)
    for k, v in c.state_dict.items():
        if ".ffn." not in k:
            assert torch.equal(v, a.state_dict[k]), k  # every shared tensor is the anchor's


def test_merged_model_evaluates_and_opts_out(workflow, tiny_tokens, tmp_path):
    from launcher.evaluation.evaluate import evaluate_checkpoint

    root, anchor, pkgs, merged = workflow
    opts = {"max_blocks": 2, "cached_blocks": 2}
    full = evaluate_checkpoint(merged, tiny_tokens, **opts).to_dict()
    assert set(full["domains"]) == set(OWNERS)
    modes = set(full["modes"])
    assert {"naive", "uniform", "updating", "cached", "router"} <= modes
    for d in OWNERS:
        assert all(v > 1 for v in full["domains"][d]["ppl"].values())
    # opt-out: the proof, then the evaluation without sailing equals the merge built without its package
    audit = tmp_path / "audit.json"
    assert experts_main(["verify", str(merged), "--without", "sailing", "--out", str(audit)]) == 0
    assert json.loads(audit.read_text())["passed"]
    kept = [p for p in pkgs if "sailing" not in p.name]
    assert experts_main(["merge", str(anchor), *map(str, kept), "--out", str(tmp_path / "without")]) == 0
    opted = evaluate_checkpoint(merged, tiny_tokens, exclude_experts=["sailing"], **opts).to_dict()
    fresh = evaluate_checkpoint(tmp_path / "without", tiny_tokens, **opts).to_dict()
    assert opted["domains"] == fresh["domains"]
    # removing one owner's expert changes only the numbers that used it: cooking's naive (own-expert) ppl is equal
    assert opted["domains"]["cooking"]["ppl"]["naive"] == full["domains"]["cooking"]["ppl"]["naive"]


def test_merged_checkpoint_feeds_the_other_tools(workflow, tmp_path):
    from launcher.launch import parse_args, prepare_run
    from launcher.modular.btx.run_sets import demix_overrides

    root, anchor, pkgs, merged = workflow
    assert experts_main(["remove", str(merged), "--experts", "finance", "--out", str(tmp_path / "rm")]) == 0
    assert load_consolidated(tmp_path / "rm").domains == ["cooking", "sailing"]
    # further joint training from the merged checkpoint: the launcher validates the whole run
    sets = [a for s in demix_overrides(merged) for a in ("--set", s)]
    argv = ["--config", "configs/demo/demix.yaml", "--nproc", "2", "--run-dir", str(tmp_path / "joint")]
    prepare_run(parse_args([*argv, *sets, "--dry-run"]))
    assert (tmp_path / "joint" / "config.yaml").is_file()
