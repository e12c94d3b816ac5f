"""The feed-forward seam: the only place where Dense, DEMix, GShard and CSE differ inside the model.

The layers live one per file (`mlp.py`: the shared MLP and the dense layer; `demix.py`, `gshard.py`,
`cse.py`: the expert layers); this module registers them and builds the one a layer needs.

Shape legend: B batch (sequences), T tokens per sequence, D model dim, F ffn dim,
E experts, G domains, N routed rows.

Every FFN kind is an `nn.Module` with `forward(x_BTD, domain_ids_B) -> FFNOutput`. New kinds register
a builder with `register_ffn(kind)` (the kind itself, and its traits, are declared once in model/config.py
`FFN_KINDS`); `build_ffn` is the only constructor the model calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.nn as nn

from model.config import FFN_KINDS, FFNTraits, ModelConfig
from model.cse import build_cse
from model.demix import DemixFFN
from model.gshard import GShardFFN
from model.mlp import MLP, DenseFFN, FFNOutput

__all__ = [
    "FFNOutput",
    "MLP",
    "DenseFFN",
    "DemixFFN",
    "GShardFFN",
    "FFNTraits",
    "register_ffn",
    "build_ffn",
    "ffn_traits",
]


def ffn_traits(kind: str) -> FFNTraits:
    """The traits of FFN kind `kind` (model/config.py `FFN_KINDS`; a KeyError names the known kinds)."""
    try:
        return FFN_KINDS[kind]
    except KeyError:
        raise KeyError(f"feed-forward kind {kind!r} has no traits; known: {sorted(FFN_KINDS)}") from None


FFNBuilder = Callable[[ModelConfig, int, Sequence[int]], nn.Module]
_FFN_BUILDERS: dict[str, FFNBuilder] = {}


def register_ffn(kind: str) -> Callable[[FFNBuilder], FFNBuilder]:
    """Register a builder `(cfg, layer_idx, expert_ids) -> module` for a declared FFN kind's expert layers (a kind
    without one has dense layers only)."""
    if kind not in FFN_KINDS:
        raise ValueError(
            f"feed-forward kind {kind!r} is not declared: model/config.py declare_ffn_kind first"
        )

    def deco(fn: FFNBuilder) -> FFNBuilder:
        _FFN_BUILDERS[kind] = fn
        return fn

    return deco


@register_ffn("demix")
def _build_demix(cfg: ModelConfig, layer_idx: int, expert_ids: Sequence[int]) -> nn.Module:
    return DemixFFN(cfg, expert_ids)


@register_ffn("gshard")
def _build_gshard(cfg: ModelConfig, layer_idx: int, expert_ids: Sequence[int]) -> nn.Module:
    return GShardFFN(cfg, expert_ids)


@register_ffn("cse")
def _build_cse(cfg: ModelConfig, layer_idx: int, expert_ids: Sequence[int]) -> nn.Module:
    return build_cse(cfg, layer_idx, expert_ids)


def build_ffn(cfg: ModelConfig, layer_idx: int, expert_ids: Sequence[int]) -> nn.Module:
    """The FFN of layer `layer_idx`: the kind's expert layer where the kind puts one, else dense."""
    if layer_idx not in cfg.moe_layer_ids():
        return DenseFFN(cfg)
    if cfg.ffn.kind not in FFN_KINDS:
        raise ValueError(f"feed-forward kind {cfg.ffn.kind!r} is not declared; known: {sorted(FFN_KINDS)}")
    builder = _FFN_BUILDERS.get(cfg.ffn.kind)
    return DenseFFN(cfg) if builder is None else builder(cfg, layer_idx, expert_ids)
