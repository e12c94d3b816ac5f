"""Modular experts (DEMix §6-7): adding an expert copies its source and leaves everything else bit-identical,
removing one renumbers the rest untouched, evaluation-time masking equals the smaller checkpoint, and a DAPT run
through the launcher trains only the new expert (DEMix) or everything (Dense)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from data.config import DataConfig
from launcher.checkpoint import Consolidated, load_consolidated, save_consolidated
from launcher.config import RunConfig
from launcher.expert_surgery import remove_experts_state
from launcher.modular.experts import (
    adaptation_markdown,
    adaptation_report,
    add_expert,
    add_expert_state,
    dapt_overrides,
    evaluate_experts,
    main,
    removal_markdown,
    removal_report,
    remove_experts,
    run_dapt,
)
from model.config import FFNConfig, ModelConfig
from model.gpt import GPT
from parallel.config import TrainConfig

OLD = ["cooking", "sailing"]  # the base model's training domains; "finance" is the new one


def tiny_cfg(tokens: Path, kind: str = "demix", domains: list[str] = OLD) -> RunConfig:
    model = ModelConfig(
        name="tiny",
        n_layers=2,
        d_model=32,
        n_heads=2,
        seq_len=32,
        vocab_size=50264,
        ffn=FFNConfig(kind=kind, num_experts=len(domains) if kind == "demix" else 0),
    )
    data = DataConfig(
        path=str(tokens),
        tokenizer="gpt2",
        mixture="by_domain" if kind == "demix" else "natural",
        domains=list(domains) if kind == "demix" else None,
    )
    train = TrainConfig(steps=4, micro_batch=2, grad_accum=1, lr=3e-3, eval_batches=1)
    return RunConfig(model=model, data=data, train=train)


def train_tiny(tokens: Path, kind: str, out: Path, steps: int = 16) -> Path:
    """A few plain-PyTorch steps on each old domain (its own expert for DEMix), saved as a consolidated checkpoint."""
    from launcher.checkpoint_data import load_blocks

    cfg = tiny_cfg(tokens, kind)
    torch.manual_seed(0)
    model = GPT(cfg.model, init_seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    blocks = [torch.from_numpy(load_blocks(tokens, "gpt2", d, "train", 32, 64)).long() for d in OLD]
    for step in range(steps):
        for d, b in enumerate(blocks):
            x = b[(step * 4) % (len(b) - 4) :][:4]
            dom = torch.full((x.shape[0],), d) if kind == "demix" else None
            loss = model(x[:, :-1], dom, targets_BT=x[:, 1:]).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    domains = OLD if kind == "demix" else ["all"]
    return save_consolidated(out, model.state_dict(), cfg, domains, steps, extra={"tokenizer": "gpt2"})


@pytest.fixture(scope="module")
def demix_ckpt(tiny_tokens, tmp_path_factory) -> Path:
    return train_tiny(tiny_tokens, "demix", tmp_path_factory.mktemp("experts") / "demix")


@pytest.fixture(scope="module")
def dense_ckpt(tiny_tokens, tmp_path_factory) -> Path:
    return train_tiny(tiny_tokens, "dense", tmp_path_factory.mktemp("experts") / "dense")


def _logits(c: Consolidated, expert: int, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return c.build_model().eval()(tokens, torch.full((tokens.shape[0],), expert)).logits


def test_add_expert_copies_source_and_keeps_everything_else(demix_ckpt, tiny_tokens, tmp_path):
    before = load_consolidated(demix_ckpt)
    _, rec = add_expert(demix_ckpt, "finance", tmp_path / "added", dev_blocks=4)
    after = load_consolidated(tmp_path / "added")
    assert after.domains == OLD + ["finance"] and after.cfg.model.ffn.num_experts == 3
    assert (
        after.meta["experts"]["2"] == "finance" and after.meta["added_experts"][0]["source"] == rec["source"]
    )
    assert math.isclose(sum(rec["posterior"].values()), 1.0, rel_tol=1e-9)
    assert rec["posterior"][rec["source"]] == max(rec["posterior"].values())  # the most probable expert
    src = rec["source_id"]
    for k, v in before.state_dict.items():
        assert torch.equal(after.state_dict[k], v), k
    new = {k: v for k, v in after.state_dict.items() if k not in before.state_dict}
    assert new and all(".experts.2." in k for k in new)
    for k, v in new.items():
        assert torch.equal(v, before.state_dict[k.replace(".experts.2.", f".experts.{src}.")]), k
    tokens = torch.randint(0, 50000, (2, 16))
    assert torch.equal(_logits(after, 2, tokens), _logits(before, src, tokens))


def test_add_several_domains_in_turn_and_reject_duplicates(demix_ckpt, tmp_path):
    c = add_expert_state(load_consolidated(demix_ckpt), "finance", 0)
    c = add_expert_state(c, "tides", 2)
    assert c.domains == OLD + ["finance", "tides"] and c.cfg.model.ffn.num_experts == 4
    assert torch.equal(
        c.state_dict["blocks.1.ffn.experts.3.fc2.weight"], c.state_dict["blocks.1.ffn.experts.0.fc2.weight"]
    )
    with pytest.raises(ValueError, match="already has an expert"):
        add_expert_state(c, "cooking", 0)
    assert (
        main(
            [
                "add",
                str(demix_ckpt),
                "--domain",
                "finance",
                "--source",
                "sailing",
                "--dev-blocks",
                "2",
                "--out",
                str(tmp_path / "cli"),
            ]
        )
        == 0
    )
    assert load_consolidated(tmp_path / "cli").meta["added_experts"][0]["source"] == "sailing"


def test_remove_expert_renumbers_and_leaves_the_others_untouched(demix_ckpt, tmp_path):
    full = add_expert_state(load_consolidated(demix_ckpt), "finance", 1)  # cooking, sailing, finance
    save_consolidated(tmp_path / "full", full.state_dict, full.cfg, full.domains)
    remove_experts(tmp_path / "full", ["sailing"], tmp_path / "small")
    small = load_consolidated(tmp_path / "small")
    assert small.domains == ["cooking", "finance"] and small.meta["experts"] == {
        "0": "cooking",
        "1": "finance",
    }
    for k, v in small.state_dict.items():
        old = k.replace(".experts.1.", ".experts.2.") if ".experts.1." in k else k
        assert torch.equal(v, full.state_dict[old]), k
    assert not any(".experts.2." in k for k in small.state_dict)
    tokens = torch.randint(0, 50000, (2, 16))
    assert torch.equal(_logits(small, 1, tokens), _logits(full, 2, tokens))
    with pytest.raises(ValueError, match="no expert named"):
        remove_experts_state(small, ["tides"])
    with pytest.raises(ValueError, match="leave no expert"):
        remove_experts_state(small, ["cooking", "finance"])


def test_masking_an_expert_equals_the_checkpoint_without_it(demix_ckpt, tiny_tokens, tmp_path):
    remove_experts(demix_ckpt, ["sailing"], tmp_path / "minus")
    kw = dict(domains=["cooking", "finance"], max_blocks=3, cached_blocks=3)
    masked = evaluate_experts(demix_ckpt, without=["sailing"], **kw)
    smaller = evaluate_experts(tmp_path / "minus", **kw)
    assert masked["experts"] == smaller["experts"] == ["cooking"]
    for d in kw["domains"]:
        assert masked["domains"][d]["ppl"] == pytest.approx(smaller["domains"][d]["ppl"], rel=1e-5)
    every = evaluate_experts(demix_ckpt, **kw)
    assert every["domains"]["cooking"]["ppl"] != masked["domains"]["cooking"]["ppl"]
    rep = removal_report(demix_ckpt, domains=["cooking"], max_blocks=3, cached_blocks=3)  # Table 7's row
    row = rep["per_domain"]["cooking"]
    assert row["plus_expert"] == pytest.approx(every["domains"]["cooking"]["ppl"], rel=1e-6)
    # -Expert: the domain's own expert masked
    no_own = evaluate_experts(demix_ckpt, without=["cooking"], **kw)
    assert row["minus_expert"] == pytest.approx(no_own["domains"]["cooking"]["ppl"], rel=1e-6)
    assert "| cooking |" in removal_markdown(rep)
    # the full matrix: every expert removed, the change on every evaluated domain, each cell a masked mixture
    full = removal_report(demix_ckpt, domains=kw["domains"], max_blocks=3, cached_blocks=3)
    experts = full["experts"]
    for e in experts:
        for d in kw["domains"]:
            masked_e = evaluate_experts(demix_ckpt, without=[e], **kw)["domains"][d]["ppl"]
            assert full["matrix_ppl"][e][d] == pytest.approx(masked_e, rel=1e-6)
            assert full["matrix"][e][d] == pytest.approx(
                100 * (masked_e / full["plus_expert"][d] - 1), rel=1e-6
            )
    diag = [full["matrix"][d][d] for d in kw["domains"] if d in experts]
    assert full["own_change_mean"] == pytest.approx(sum(diag) / len(diag))
    md = removal_markdown(full)
    assert "rows: expert removed" in md and all(f"| -{e} |" in md for e in experts)


def test_dapt_overrides_follow_the_paper(demix_ckpt, dense_ckpt, tmp_path):
    added = add_expert_state(load_consolidated(demix_ckpt), "finance", 0)
    sets = dict(s.split("=", 1) for s in dapt_overrides(added, "demix", "X", "finance", 7))
    assert sets["train.trainable"] == "experts" and sets["data.domains"] == "[finance]"
    assert float(sets["train.lr"]) == pytest.approx(3e-4) and sets["train.steps"] == "7"  # 10x smaller
    dense = dict(
        s.split("=", 1) for s in dapt_overrides(load_consolidated(dense_ckpt), "dense", "X", "finance", 7)
    )
    assert dense["train.trainable"] == "all" and dense["data.mixture"] == "natural"
    with pytest.raises(ValueError, match="add"):
        dapt_overrides(load_consolidated(demix_ckpt), "demix", "X", "finance", 7)
    save_consolidated(tmp_path / "added", added.state_dict, added.cfg, added.domains)
    run_dapt(tmp_path / "added", "demix", "finance", 3, tmp_path / "run", nproc=1, dry_run=True)  # plans it
    assert (tmp_path / "run" / "deepspeed_config.json").is_file()


@pytest.mark.slow
@pytest.mark.long  # two launched DAPT runs: make test-long
def test_demix_dapt_trains_only_the_new_expert_and_dense_dapt_forgets(
    demix_ckpt, dense_ckpt, tiny_tokens, tmp_path
):
    """Through the launcher (1 rank each): DEMix-DAPT changes nothing but expert 2, so the old domains' perplexity
    with their own experts is unchanged; Dense-DAPT changes the shared weights."""
    add_expert(demix_ckpt, "finance", tmp_path / "added", dev_blocks=4)
    extra = ["logging.wandb_mode=disabled", "logging.progress_bar=false"]
    demix_after = run_dapt(
        tmp_path / "added", "demix", "finance", 4, tmp_path / "demix-dapt", nproc=1, extra_sets=extra
    )
    dense_after = run_dapt(
        dense_ckpt, "dense", "finance", 4, tmp_path / "dense-dapt", nproc=1, extra_sets=extra
    )
    a, b = load_consolidated(tmp_path / "added"), load_consolidated(demix_after)
    assert b.domains == OLD + ["finance"] and set(a.state_dict) == set(b.state_dict)
    changed = [k for k in a.state_dict if not torch.equal(a.state_dict[k], b.state_dict[k])]
    assert changed and all(".experts.2." in k for k in changed), changed
    d0, d1 = load_consolidated(dense_ckpt), load_consolidated(dense_after)
    assert not torch.equal(
        d0.state_dict["blocks.0.attn.qkv.weight"], d1.state_dict["blocks.0.attn.qkv.weight"]
    )
    rep = adaptation_report(
        demix_ckpt, demix_after, dense_ckpt, dense_after, ["finance"], max_blocks=3, cached_blocks=3
    )
    assert rep["own_expert_max_abs_change"] == 0.0  # no forgetting, by construction
    assert rep["summary"]["demix"]["experts_after"] == 3
    assert "Dense-DAPT" in adaptation_markdown(rep)
