"""Typed configs: every shipped YAML loads; bad configs list every problem at once."""

from pathlib import Path

import pytest

from launcher.config import CONFIG_DIR, ConfigError, load_run_config, model_presets
from model.config import FFN_KINDS

# Run configs: every YAML under configs/ except model presets (tested below), cluster descriptions and
# sweeps (tests/benchmarks/test_costmodel.py and tests/benchmarks/test_sweep.py load those), reproduce budgets
# (tests/benchmarks/test_reproduce.py).
NOT_RUN_CONFIGS = ("model", "clusters", "sweeps", "reproduce")
RUN_CONFIGS = sorted(p for p in CONFIG_DIR.rglob("*.yaml") if p.parent.name not in NOT_RUN_CONFIGS)


def test_presets_are_shipped():
    assert {"tiny", "gpt3-small", "gpt3-medium", "gpt3-large", "gpt3-xl"} <= set(model_presets())


@pytest.mark.parametrize("preset", ["tiny", "gpt3-small", "gpt3-medium", "gpt3-large", "gpt3-xl"])
@pytest.mark.parametrize("kind", ["dense", "demix", "gshard"])
def test_every_preset_loads_as_every_kind(preset, kind):
    cfg = load_run_config(None, [f"model.preset={preset}", f"model.ffn.kind={kind}"])
    assert cfg.model.name == preset and cfg.model.ffn.kind == kind


def test_paper_shapes():
    shapes = {
        p: load_run_config(None, [f"model.preset={p}"]).model
        for p in ("gpt3-small", "gpt3-medium", "gpt3-large", "gpt3-xl")
    }
    assert [(m.n_layers, m.d_model, m.seq_len) for m in shapes.values()] == [
        (12, 768, 1024),
        (24, 1024, 1024),
        (24, 1536, 1024),
        (24, 2048, 1024),
    ]


# Every shipped run config by name, with the fields that make it the run it is named for; its output folder is
# runs/<the config's path without .yaml>.
_DEMO = {  # the demo's tiny CPU runs on the demo corpus
    "preset": "tiny",
    "vocab_size": 8200,
    "tokenizer": "sentencepiece",
    "path": "artifacts/demo/tokens",
    "num_experts": 0,  # derived from the domains (DEMix) or the layout (GShard)
    "steps": 60,
    "micro_batch": 4,
    "grad_accum": 1,
    "lr": 2e-3,
    "precision": "fp32",
    "zero_stage": 0,
}
_PAPER = {  # GPT-3 Small (DEMix 125M) with the paper's recipe
    **_DEMO,
    "preset": "gpt3-small",
    "vocab_size": 50264,
    "tokenizer": "gpt2",
    "steps": 10000,
    "micro_batch": 2,
    "grad_accum": 8,
    "lr": 5e-4,
    "precision": "fp16",
    "zero_stage": 1,
}
SHIPPED_RUN_CONFIGS = {
    "demo/dense.yaml": {**_DEMO, "kind": "dense", "mixture": "natural"},
    "demo/dense-balanced.yaml": {**_DEMO, "kind": "dense", "mixture": "balanced"},
    "demo/domain-token.yaml": {**_DEMO, "kind": "dense", "mixture": "domain_token"},
    "demo/demix.yaml": {**_DEMO, "kind": "demix", "mixture": "by_domain"},
    "demo/gshard.yaml": {**_DEMO, "kind": "gshard", "mixture": "natural"},
    "cse/cse.yaml": {**_DEMO, "kind": "cse", "mixture": "natural", "num_experts": 8},
    "cse/dense.yaml": {**_DEMO, "kind": "dense", "mixture": "natural"},
    "cse/demix-true.yaml": {**_DEMO, "kind": "demix", "mixture": "by_domain"},
    "cse/demix-clustered.yaml": {
        **_DEMO,
        "kind": "demix",
        "mixture": "by_domain",
        "path": "artifacts/cse/clustered",
    },
    "btx/finetune.yaml": {
        **_DEMO,
        "kind": "gshard",
        "mixture": "natural",
        "num_experts": 8,
        "steps": 200,
        "lr": 6e-4,
    },
    "gpt3-small-dense.yaml": {**_PAPER, "kind": "dense", "mixture": "natural"},
    "gpt3-small-demix.yaml": {**_PAPER, "kind": "demix", "mixture": "by_domain"},
    "gpt3-small-gshard.yaml": {**_PAPER, "kind": "gshard", "mixture": "natural"},
}


def test_run_configs_are_shipped():
    """Exactly the run configs listed above are shipped: a new one is added to the table, a removed one taken out."""
    assert sorted(str(p.relative_to(CONFIG_DIR)) for p in RUN_CONFIGS) == sorted(SHIPPED_RUN_CONFIGS)


@pytest.mark.parametrize("name", sorted(SHIPPED_RUN_CONFIGS))
def test_each_shipped_run_config_is_the_run_it_is_named_for(name: str):
    """The config loads and validates (`load_run_config` raises on any problem) and holds its run's key fields."""
    cfg = load_run_config(CONFIG_DIR / name)
    m, d, t = cfg.model, cfg.data, cfg.train
    assert {
        "preset": m.name,
        "vocab_size": m.vocab_size,
        "kind": m.ffn.kind,
        "num_experts": m.ffn.num_experts,
        "mixture": d.mixture,
        "tokenizer": d.tokenizer,
        "path": d.path,
        "steps": t.steps,
        "micro_batch": t.micro_batch,
        "grad_accum": t.grad_accum,
        "lr": t.lr,
        "precision": t.precision,
        "zero_stage": cfg.parallel.zero_stage,
    } == SHIPPED_RUN_CONFIGS[name]
    assert cfg.logging.out_dir == "runs/" + name.removesuffix(".yaml")
    assert cfg.problems() == []
    # DEMix trains each expert on its own domain; every other kind reads the domains mixed
    assert (m.ffn.kind == "demix") == (d.mixture == "by_domain")


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: str(p.relative_to(CONFIG_DIR)))
def test_every_shipped_run_config_loads(path: Path):
    cfg = load_run_config(path)
    assert cfg.model.ffn.kind in FFN_KINDS


def test_bad_config_lists_every_problem(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "model: {preset: tiny, n_heads: 5, bogus: 1, ffn: {kind: moe}}\n"
        "train: {lr: fast, precision: fp8}\n"
        "parallel: {zero_stage: 3}\n"
        "nonsense: 1\n"
    )
    with pytest.raises(ConfigError) as e:
        load_run_config(bad)
    text = str(e.value)
    for needle in (
        "n_heads=5",
        "bogus",
        "kind='moe'",
        "lr='fast'",
        "precision='fp8'",
        "zero_stage=3",
        "nonsense",
    ):
        assert needle in text, (needle, text)
    assert len(e.value.problems) == 7


def test_unknown_preset_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no such preset"):
        load_run_config(None, ["model.preset=gpt5"])
    with pytest.raises(ConfigError, match="no such file"):
        load_run_config(tmp_path / "missing.yaml")


def test_overrides_parse_yaml_scalars():
    cfg = load_run_config(
        None, ["model.preset=tiny", "train.lr=3e-4", "train.steps=7", "parallel.allocation=[1, 3]"]
    )
    assert cfg.train.lr == 3e-4 and cfg.train.steps == 7 and cfg.parallel.allocation == [1, 3]
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_run_config(None, ["train.steps"])


@pytest.mark.parametrize("value", ["nan", ".nan", "inf", "-.inf"])
def test_non_finite_numbers_are_refused_before_any_rank_starts(value):
    """`train.lr=nan` used to pass validation and fail in every rank minutes later."""
    from launcher.config import load_run_config

    with pytest.raises(ConfigError) as err:
        load_run_config(None, ["model.preset=tiny", f"train.lr={value}", "model.dropout=.inf"])
    msg = str(err.value)
    assert (
        "train.lr=" in msg and "model.dropout=inf: expected a finite number" in msg and "2 problem(s)" in msg
    )
