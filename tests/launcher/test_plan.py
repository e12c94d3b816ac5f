"""launcher/plan.py on the tiny prepared corpus (tests/conftest.py `tiny_tokens`: cooking, sailing, finance; GPT-2
tokens) and on hand-made catalogs: the resolved config, catalog and topology of a run; the data-free layout the
dry run uses is the same; `train.init_from` maps the checkpoint's experts onto the data's domains; every problem
(config, data, vocabulary, layout, checkpoint) is reported at once with its fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from data.catalog import Catalog
from launcher.config import ConfigError, RunConfig, load_run_config
from launcher.plan import data_problems, init_checkpoint_problems, make_plan, plan_layout, vocab_problems

CORPUS = ("cooking", "finance", "sailing")  # the catalog's order: sorted


def _cfg(tokens: Path, kind: str = "demix", *sets: str, mixture: str | None = None) -> RunConfig:
    """The shape of conftest's `random_checkpoint` (2 layers, d 32, 2 heads, 32 tokens, GPT-2's vocabulary)."""
    mixture = mixture or ("by_domain" if kind == "demix" else "natural")
    return load_run_config(
        None,
        [
            "model.preset=tiny",
            "model.n_layers=2",
            "model.d_model=32",
            "model.n_heads=2",
            "model.seq_len=32",
            "model.vocab_size=50257",
            f"model.ffn.kind={kind}",
            f"data.path={tokens}",
            "data.tokenizer=gpt2",
            f"data.mixture={mixture}",
            "train.steps=4",
            *sets,
        ],
        check=False,
    )


def _problems(cfg: RunConfig, world: int) -> list[str]:
    with pytest.raises(ConfigError) as e:
        make_plan(cfg, world)
    return e.value.problems


def _catalog(vocab: int, domains: tuple[str, ...], tokens: dict | None = None) -> Catalog:
    counts = tokens or {d: {"train": {"tokens": 1000}, "valid": {"tokens": 1000}} for d in domains}
    return Catalog(Path("tokens/gpt2"), "gpt2", vocab, 50256, domains, (), counts)


def test_a_demix_run_on_the_tiny_corpus(tiny_tokens):
    cfg = _cfg(tiny_tokens)
    plan = make_plan(cfg, 3)
    manifest = json.loads((tiny_tokens / "gpt2" / "manifest.json").read_text())
    cat = plan.catalog
    assert cat.root == tiny_tokens / "gpt2" and cat.tokenizer == "gpt2"
    assert cat.train_domains == CORPUS and cat.novel_domains == ()
    assert (cat.vocab_size, cat.bos_id, cat.eod_id) == (50257, manifest["tokenizer"]["bos_id"], 50256)
    for d in CORPUS:
        for split in ("train", "valid", "test"):
            assert cat.tokens(d, split) == manifest["counts"][d][split]["tokens"] > 0
    # resolved: one expert per domain; nothing else changed
    assert plan.cfg.model.ffn.num_experts == 3 and cfg.model.ffn.num_experts == 0
    assert plan.cfg.model.d_model == 32 and plan.cfg.data == cfg.data and plan.cfg.train == cfg.train
    topo = plan.topo
    assert (topo.world_size, topo.tensor_parallel, topo.num_domains) == (3, 1, 3)
    assert topo.domain_names == CORPUS and [topo.rank_info(r).domains for r in range(3)] == [(0,), (1,), (2,)]
    assert plan.expert_domains == () and plan.expert_of_domain == [0, 1, 2] and plan.notes == ()
    # the dry run's data-free planning gives the same config and layout
    layout = plan_layout(cfg, 3, CORPUS)
    assert layout.problems == [] and layout.cfg == plan.cfg and layout.topo == plan.topo


def test_data_domains_pick_and_order_the_training_domains(tiny_tokens):
    plan = make_plan(_cfg(tiny_tokens, "demix", "data.domains=[sailing, cooking]"), 2)
    assert plan.catalog.train_domains == ("sailing", "cooking") and plan.catalog.novel_domains == ("finance",)
    assert plan.cfg.model.ffn.num_experts == 2 and plan.topo.domain_names == ("sailing", "cooking")


def test_dense_and_gshard_lay_out_one_group_of_everything(tiny_tokens):
    dense = make_plan(_cfg(tiny_tokens, "dense"), 2)
    assert dense.topo.domain_names == ("all",) and dense.topo.dp_size == 2
    assert dense.cfg.model.ffn.num_experts == 0 and dense.catalog.train_domains == CORPUS
    gshard = make_plan(_cfg(tiny_tokens, "gshard"), 2)
    # one expert per GPU
    assert gshard.cfg.model.ffn.num_experts == 2 and gshard.topo.domain_names == ("all",)


def test_unequal_data_per_domain_is_a_note_and_an_uneven_split_a_problem(tiny_tokens):
    plan = make_plan(_cfg(tiny_tokens), 2)  # rank 0: cooking and finance, rank 1: sailing
    (note,) = plan.notes
    assert "cooking 25.0%, finance 25.0%, sailing 50.0%" in note
    (problem,) = _problems(_cfg(tiny_tokens), 4)
    assert (
        problem.startswith("parallel: 4 data-parallel ranks")
        and "allocation of 3 counts summing to 4" in problem
    )
    assert "e.g. [2, 1, 1]" in problem
    plan = make_plan(_cfg(tiny_tokens, "demix", "parallel.allocation=[2, 1, 1]"), 4)
    assert plan.topo.ranks_of_domain(0) == (0, 1) and plan.topo.ranks_of_domain(2) == (3,)


def test_every_problem_of_config_data_and_layout_at_once(tiny_tokens):
    cfg = _cfg(
        tiny_tokens,
        "demix",
        "model.ffn.num_experts=2",
        "model.vocab_size=1000",
        "parallel.tensor_parallel=3",
        mixture="natural",
    )
    problems = _problems(cfg, 6)
    assert len(problems) == 5, problems
    assert "set data.mixture=by_domain (not 'natural')" in problems[0]
    assert "num_experts=2 but there are 3 domains (cooking, finance, sailing)" in problems[1]
    assert problems[2].startswith("model.n_heads=2 is not divisible by tensor_parallel=3")
    assert problems[3].startswith("ffn width 128 is not divisible by tensor_parallel=3")
    assert "model.vocab_size=1000 (padded 1152) is smaller than the 50257 token ids" in problems[4]


def test_config_problems_are_listed_with_missing_data(tmp_path):
    cfg = _cfg(tmp_path / "nowhere", "dense", "train.steps=0", "parallel.tensor_parallel=4")
    problems = _problems(cfg, 4)
    assert any(p.startswith("train.steps=0") for p in problems)
    assert any("manifest.json not found: prepare the data first" in p for p in problems)
    assert any(p.startswith("model.n_heads=2 is not divisible by tensor_parallel=4") for p in problems)


def test_an_unknown_domain_is_named(tiny_tokens):
    (problem,) = _problems(_cfg(tiny_tokens, "demix", "data.domains=[cooking, knitting]"), 2)
    manifest = tiny_tokens / "gpt2" / "manifest.json"
    assert problem == f"data.domains ['knitting'] are not in {manifest}; available: cooking, finance, sailing"


def test_vocab_problems_give_the_size_to_set():
    cfg = _cfg(Path("x"), "dense")
    assert vocab_problems(cfg, _catalog(50257, ("a", "b"))) == []  # 50,257 ids fit the padded 50,304
    small = _cfg(Path("x"), "dense", "model.vocab_size=1000")
    (p,) = vocab_problems(small, _catalog(50257, ("a", "b")))
    assert p.startswith(
        "model.vocab_size=1000 (padded 1024) is smaller than the 50257 token ids the gpt2 data uses; "
        "fix: `--set model.vocab_size=50304`"
    )
    assert p.endswith("use data prepared with a tokenizer of at most 1024 tokens")
    # with domain tokens: 50,300 + 8 ids do not fit 50,304; the fix rounds 50,308 up to a multiple of 128
    tokens = _cfg(Path("x"), "dense", "model.vocab_size=50304", mixture="domain_token")
    (p,) = vocab_problems(tokens, _catalog(50300, tuple("abcdefgh")))
    assert "smaller than the 50308 token ids the gpt2 data uses with domain tokens" in p
    assert "`--set model.vocab_size=50432`" in p and "50300 tokenizer tokens + 8 domain tokens" in p
    assert p.endswith("of at most 50296 tokens")  # 50,304 less the 8 domain tokens


def test_data_problems_need_one_block_per_domain_and_split():
    cfg = _cfg(Path("x"), "dense")  # seq_len 32: a block is 33 tokens
    counts = {
        "a": {"train": {"tokens": 33}, "valid": {"tokens": 32}},
        "b": {"train": {"tokens": 10}, "valid": {"tokens": 100}},
    }
    assert data_problems(cfg, _catalog(50257, ("a", "b"), counts)) == [
        "domain 'a' has 32 valid tokens, fewer than one block of 33",
        "domain 'b' has 10 train tokens, fewer than one block of 33",
    ]


def test_init_from_maps_the_checkpoints_experts_onto_the_datas_domains(
    tiny_tokens, random_checkpoint, tmp_path
):
    ckpt = random_checkpoint(tmp_path / "demix", "demix")  # experts: cooking, sailing, finance
    plan = make_plan(_cfg(tiny_tokens, "demix", f"train.init_from={ckpt}"), 3)
    assert plan.expert_domains == ("cooking", "sailing", "finance")
    assert plan.expert_of_domain == [0, 2, 1]  # data domains cooking, finance, sailing -> their experts
    problems, domains = init_checkpoint_problems(plan.cfg, plan.catalog)
    assert problems == [] and domains == ("cooking", "sailing", "finance")


def test_init_from_problems(tiny_tokens, random_checkpoint, tmp_path):
    ckpt = random_checkpoint(tmp_path / "demix", "demix")
    problems = _problems(_cfg(tiny_tokens, "demix", f"train.init_from={ckpt}", "model.d_model=64"), 3)
    assert "train.init_from: model.d_model is 32 in the checkpoint, 64 here" in problems
    dense = random_checkpoint(tmp_path / "dense", "dense")
    problems = _problems(_cfg(tiny_tokens, "demix", f"train.init_from={dense}"), 3)
    assert "train.init_from: a 'dense' checkpoint cannot start a 'demix' run" in problems
    (problem,) = _problems(_cfg(tiny_tokens, "demix", f"train.init_from={tmp_path}"), 3)
    assert problem == f"train.init_from={str(tmp_path)!r}: not a consolidated checkpoint (no meta.json)"
    other = tmp_path / "other"
    shutil.copytree(ckpt, other)
    meta = json.loads((other / "meta.json").read_text())
    meta.update(tokenizer_sha256="0" * 64, domains=["cooking", "sailing", "knitting"])
    (other / "meta.json").write_text(json.dumps(meta))
    problems = _problems(_cfg(tiny_tokens, "demix", f"train.init_from={other}"), 3)
    assert len(problems) == 2, problems
    assert "trained on tokens of another tokenizer (fingerprint 000000000000)" in problems[0]
    assert problems[1].startswith(
        "train.init_from has no expert for ['finance'] (experts: cooking, sailing, knitting); add one first"
    )
