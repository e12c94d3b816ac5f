"""Each FFN-kind question has one answer: a kind is declared once (model/config.py `FFN_KINDS`) and the config, the
model's builders and traits and the launcher's strategies derive from it; "whose expert is this parameter?" is
answered once (model/gpt.py `expert_of_key`), and `GPT.expert_parameters` and parallel/'s tags derive from it."""

from __future__ import annotations

import pytest
import torch

import model.ffn as ffn
from model.config import FFN_KINDS, FFNConfig, FFNTraits, ModelConfig
from model.gpt import GPT, expert_of_key
from model.mlp import DenseFFN


def _tiny(kind: str, experts: int = 0) -> ModelConfig:
    from launcher.config import load_run_config

    cfg = load_run_config(None, ["model.preset=tiny", "model.n_layers=2", "model.ffn.kind=demix"]).model
    return cfg.__class__(**{**cfg.__dict__, "ffn": FFNConfig(kind=kind, num_experts=experts)})


def test_a_kind_declared_in_one_place_is_seen_by_every_layer(monkeypatch):
    from launcher.ffn_kinds import Dense, ffn_kind

    monkeypatch.setitem(FFN_KINDS, "fake", FFNTraits(domain_routed=True))  # the one declaration
    assert FFNConfig(kind="fake").problems() == []  # the config accepts it
    assert ffn.ffn_traits("fake").domain_routed  # parallel/ reads its traits
    strategy = ffn_kind("fake")  # the launcher has a strategy for it (dense's, under its name)
    assert strategy.name == "fake" and isinstance(strategy, Dense)
    cfg = _tiny("fake")
    assert isinstance(ffn.build_ffn(cfg, 0, [0]), DenseFFN)  # no layer of its own yet: dense layers
    assert GPT(cfg).num_parameters() > 0
    # its layer is one registered builder away
    monkeypatch.setattr(ffn, "_FFN_BUILDERS", dict(ffn._FFN_BUILDERS))
    marker = torch.nn.Identity()
    ffn.register_ffn("fake")(lambda c, i, e: marker)
    monkeypatch.setattr(ModelConfig, "moe_layer_ids", lambda self: [0])
    assert ffn.build_ffn(cfg, 0, [0]) is marker


def test_an_undeclared_kind_is_refused_everywhere():
    from launcher.ffn_kinds import ffn_kind

    assert "unknown feed-forward kind" in FFNConfig(kind="nope").problems()[0]
    with pytest.raises(ValueError, match="not declared"):
        ffn.register_ffn("nope")
    with pytest.raises(KeyError, match="no traits"):
        ffn.ffn_traits("nope")
    with pytest.raises(ValueError, match="no strategy registered"):
        ffn_kind("nope")


def test_expert_parameters_are_the_parameters_expert_of_key_names():
    model = GPT(_tiny("demix", 3), expert_ids=[0, 2])
    by_key: dict[int, list[int]] = {}
    for name, p in model.named_parameters():
        if expert_of_key(name) is not None:
            by_key.setdefault(expert_of_key(name), []).append(id(p))
    got = {e: [id(p) for p in ps] for e, ps in model.expert_parameters().items()}
    assert got == by_key and sorted(got) == [0, 2]
