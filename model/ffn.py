"""The feed-forward seam: the only place where Dense, DEMix, GShard and CSE differ inside the model.

The layers live one per file (`mlp.py`: the shared MLP and the dense layer; `demix.py`, `gshard.py`,
`cse.py`: the expert layers); this module registers them and builds the one a layer needs.

Shape legend: B batch (sequences), T tokens per sequence, D model dim, F ffn dim,
E experts, G domains, N routed rows.

Every FFN kind is an `nn.Module` with `forward(x_BTD, domain_ids_B) -> FFNOutput`. New kinds register
a builder with `register_ffn(kind)`; `build_ffn` is the only constructor the model calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch.nn as nn

from model.config import ModelConfig
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


@dataclass(frozen=True)
class FFNTraits:
    """What code below launcher/ (parallel/'s memory model and tracing) needs to know of an FFN kind, so that it
    asks this table instead of comparing kind names; launcher/ffn_kinds.py holds the rest, one strategy per kind."""

    domain_routed: bool = False  # routed by the batch's domain ids (DEMix): the trainer passes domain_ids_B
    deepspeed_moe: bool = False  # a learned top-k gate that training swaps for DeepSpeed's MoE layer (GShard)


FFN_TRAITS: dict[str, FFNTraits] = {
    "dense": FFNTraits(),
    "demix": FFNTraits(domain_routed=True),
    "gshard": FFNTraits(deepspeed_moe=True),
    "cse": FFNTraits(),
}


def ffn_traits(kind: str) -> FFNTraits:
    """The traits of FFN kind `kind` (a KeyError names the known kinds)."""
    try:
        return FFN_TRAITS[kind]
    except KeyError:
        raise KeyError(f"feed-forward kind {kind!r} has no traits; known: {sorted(FFN_TRAITS)}") from None


FFNBuilder = Callable[[ModelConfig, int, Sequence[int]], nn.Module]
_FFN_BUILDERS: dict[str, FFNBuilder] = {}


def register_ffn(kind: str) -> Callable[[FFNBuilder], FFNBuilder]:
    """Register a builder `(cfg, layer_idx, expert_ids) -> module` for an FFN kind's expert layers."""

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
    try:
        builder = _FFN_BUILDERS[cfg.ffn.kind]
    except KeyError:
        raise ValueError(
            f"feed-forward kind {cfg.ffn.kind!r} has no builder registered; known: {sorted(_FFN_BUILDERS) + ['dense']}"
        ) from None
    return builder(cfg, layer_idx, expert_ids)
