"""The feed-forward seam: the only place where Dense, DEMix, GShard and CSE differ.

Shape legend: B batch (sequences), T tokens per sequence, D model dim, F ffn dim,
E experts, G domains, N routed rows.

Every FFN kind is an `nn.Module` with `forward(x_BTD, domain_ids_B) -> FFNOutput`. New kinds register
a builder with `register_ffn(kind)`; `build_ffn` is the only constructor the model calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.config import ModelConfig


@dataclass
class FFNOutput:
    """What a feed-forward layer returns: hidden states, an auxiliary loss, routing statistics."""

    hidden: torch.Tensor
    aux_loss: Optional[torch.Tensor] = None
    stats: dict[str, torch.Tensor] = field(default_factory=dict)


class MLP(nn.Module):
    """The dense FFN of GPT-3: D -> F -> D with GELU. One DEMix expert has exactly this shape."""

    def __init__(self, d_model: int, d_ffn: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ffn)
        self.fc2 = nn.Linear(d_ffn, d_model)
        self.fc2.is_residual_projection = True  # scaled init (GPT-2), see GPT._init_weights
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc2(F.gelu(self.fc1(x))))


class DenseFFN(nn.Module):
    """The degenerate case: one expert, every token."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.mlp = MLP(cfg.d_model, cfg.d_ffn, cfg.dropout)

    def forward(self, x_BTD: torch.Tensor, domain_ids_B: Optional[torch.Tensor] = None) -> FFNOutput:
        return FFNOutput(hidden=self.mlp(x_BTD))


class DemixFFN(nn.Module):
    """A DEMix layer (DEMix eq. 5): every token of sequence b goes to the expert of its domain d_b.

        h_t = FFN_{d_b}(x_t)   for all t in sequence b

    No router, no load-balancing loss, no all-to-all. `expert_ids` are the *global* expert (= domain)
    ids this module holds: all of them for evaluation, a rank's own domains in training. Experts live
    in a ModuleDict keyed by global id, so state-dict names carry the id (`experts.3.fc1.weight`).
    """

    def __init__(self, cfg: ModelConfig, expert_ids: Sequence[int]) -> None:
        super().__init__()
        if not expert_ids:
            raise ValueError("a DEMix layer needs at least one expert id")
        self.expert_ids = sorted(int(e) for e in expert_ids)
        self.experts = nn.ModuleDict({str(e): MLP(cfg.d_model, cfg.d_ffn, cfg.dropout) for e in self.expert_ids})

    def forward(self, x_BTD: torch.Tensor, domain_ids_B: Optional[torch.Tensor] = None) -> FFNOutput:
        if domain_ids_B is None:
            raise ValueError("a DEMix layer routes by domain: pass domain_ids (one per sequence)")
        if len(self.expert_ids) == 1:
            only = self.expert_ids[0]
            # A rank of one domain: the whole batch is that domain (checked cheaply, no host sync in the hot path
            # beyond one comparison).
            if not bool((domain_ids_B == only).all()):
                missing = sorted(set(domain_ids_B.tolist()) - {only})
                raise ValueError(f"domain ids {missing} have no expert here (this layer holds expert {only})")
            return FFNOutput(hidden=self.experts[str(only)](x_BTD))
        out_BTD = torch.zeros_like(x_BTD)
        seen = torch.zeros_like(domain_ids_B, dtype=torch.bool)
        for e in self.expert_ids:
            rows_N = (domain_ids_B == e).nonzero(as_tuple=True)[0]
            seen[rows_N] = True
            if rows_N.numel():
                out_BTD = out_BTD.index_put((rows_N,), self.experts[str(e)](x_BTD[rows_N]))
        if not bool(seen.all()):
            missing = sorted(set(domain_ids_B[~seen].tolist()))
            raise ValueError(f"domain ids {missing} have no expert here (this layer holds experts {self.expert_ids})")
        # Touch every expert so that each one's parameters take part in the graph even when a batch has
        # none of its sequences (keeps gradient reduction uniform across ranks).
        for e in self.expert_ids:
            out_BTD = out_BTD + 0.0 * sum(p.view(-1)[0] for p in self.experts[str(e)].parameters())
        return FFNOutput(hidden=out_BTD)


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
    from model.gshard import GShardFFN  # imported here: model/gshard.py builds on this module's MLP

    return GShardFFN(cfg, expert_ids)


@register_ffn("cse")
def _build_cse(cfg: ModelConfig, layer_idx: int, expert_ids: Sequence[int]) -> nn.Module:
    from model.cse import build_cse  # imported here: model/cse.py builds on this module's MLP

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
