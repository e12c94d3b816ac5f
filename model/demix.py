"""DEMix layers (Gururangan et al. 2022, §3): one feed-forward expert per domain, routed by the domain label."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn

from model.config import ModelConfig
from model.mlp import MLP, FFNOutput, expert_output_like


class DemixFFN(nn.Module):
    """A DEMix layer (DEMix eq. 5): every token of sequence b goes to the expert of its domain d_b.

        h_t = FFN_{d_b}(x_t)   for all t in sequence b

    No router, no load-balancing loss, no all-to-all. `expert_ids` are the *global* expert (= domain)
    ids this module holds: all of them for evaluation, a rank's own domains in training. Experts live
    in a ModuleDict keyed by global id, so state-dict names carry the id (`experts.3.fc1.weight`).

    Routing reads `domain_ids_B` wherever it lives. The trainer passes it on the host (it is known there from
    the sampler): the checks and each expert's row indices are then host work, and only the small index
    tensor travels to the device (non-blocking), so a training step never waits on the device. Given on the
    device (single-process evaluation), the same code reads it back (a synchronisation, harmless there).
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
            # A rank of one domain: the whole batch is that domain (a host check when the ids are on the host).
            if not bool((domain_ids_B == only).all()):
                missing = sorted(set(domain_ids_B.tolist()) - {only})
                raise ValueError(f"domain ids {missing} have no expert here (this layer holds expert {only})")
            return FFNOutput(hidden=self.experts[str(only)](x_BTD))
        out_BTD = expert_output_like(x_BTD)  # bf16 under autocast, as the experts' outputs
        seen = torch.zeros_like(domain_ids_B, dtype=torch.bool)
        for e in self.expert_ids:
            rows_N = (domain_ids_B == e).nonzero(as_tuple=True)[0]
            seen[rows_N] = True
            if rows_N.numel():
                rows_N = rows_N.to(x_BTD.device, non_blocking=True)
                out_BTD = out_BTD.index_put((rows_N,), self.experts[str(e)](x_BTD[rows_N]))
        if not bool(seen.all()):
            missing = sorted(set(domain_ids_B[~seen].tolist()))
            raise ValueError(f"domain ids {missing} have no expert here (this layer holds experts {self.expert_ids})")
        # Touch every expert so that each one's parameters take part in the graph even when a batch has
        # none of its sequences (keeps gradient reduction uniform across ranks).
        for e in self.expert_ids:
            out_BTD = out_BTD + 0.0 * sum(p.view(-1)[0] for p in self.experts[str(e)].parameters())
        return FFNOutput(hidden=out_BTD)
