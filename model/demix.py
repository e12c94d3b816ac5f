"""DEMix layers (Gururangan et al. 2022, §3): one feed-forward expert per domain, routed by the domain label.

Shape legend: B sequences, T tokens, D model dim, N sequences routed to one expert.

Several experts in one layer (a rank holding several domains: every single-device run) run as one permutation:
the B sequences are sorted by expert (a stable sort, so each expert's rows keep their batch order), each expert
runs on its contiguous slice of the sorted batch, the outputs are concatenated and scattered back once:

    s = argsort(d)  (stable)      y_s = concat_e FFN_e(x[s][start_e : start_e + n_e])      h[s] = y_s

One gather and one scatter per layer whatever the number of experts (none at all when the batch is already sorted,
e.g. one domain), instead of an out-of-place copy of the whole activation per expert. An expert that received no
row still gets an all-zero gradient (`touch_idle_experts`): gradient reduction must be uniform across ranks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from model.config import ModelConfig
from model.mlp import MLP, FFNOutput


class _ZeroGradFor(torch.autograd.Function):
    """Identity on `x`; in backward, an all-zero gradient for each of `params` (so each gets a non-None .grad)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*params)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (grad, *(torch.zeros_like(p) for p in ctx.saved_tensors))


def touch_idle_experts(out: torch.Tensor, idle: Sequence[nn.Module]) -> torch.Tensor:
    """`out`, made to give every parameter of the `idle` experts (no row this micro-batch) a zero gradient in
    backward, so that each expert's parameters take part in every backward and gradient reduction stays uniform
    across ranks whatever their batches route to. Costs no activation-sized work: the output passes through."""
    params = [p for m in idle for p in m.parameters() if p.requires_grad]
    if not params or not torch.is_grad_enabled():
        return out
    return _ZeroGradFor.apply(out, *params)


def run_grouped(
    x_BTD: torch.Tensor, experts: Sequence[nn.Module], counts: Sequence[int], order_B: torch.Tensor | None
) -> torch.Tensor:
    """h = FFN_{e(b)}(x_b) for every sequence b, given the routing as a permutation (see the module docstring).

    `order_B` (on x's device) lists the sequences sorted by expert, `counts[i]` (host ints) how many go to
    `experts[i]`, in that order; None when the batch is already in that order (no gather, no scatter). The output
    has the experts' dtype (the autocast dtype under autocast)."""
    xs_BTD = x_BTD if order_B is None else x_BTD.index_select(0, order_B)
    ys, idle, start = [], [], 0
    for expert, n in zip(experts, counts):
        if n:
            ys.append(expert(xs_BTD[start : start + n]))
            start += n
        else:
            idle.append(expert)
    ys_BTD = ys[0] if len(ys) == 1 else torch.cat(ys)
    # One scatter back: h[order[i]] = ys[i] (in place into a fresh buffer; its backward is one gather).
    out_BTD = ys_BTD if order_B is None else torch.empty_like(ys_BTD).index_copy_(0, order_B, ys_BTD)
    return touch_idle_experts(out_BTD, idle)


class DemixFFN(nn.Module):
    """A DEMix layer (DEMix eq. 5): every token of sequence b goes to the expert of its domain d_b.

        h_t = FFN_{d_b}(x_t)   for all t in sequence b

    No router, no load-balancing loss, no all-to-all. `expert_ids` are the *global* expert (= domain)
    ids this module holds: all of them for evaluation, a rank's own domains in training. Experts live
    in a ModuleDict keyed by global id, so state-dict names carry the id (`experts.3.fc1.weight`).

    Routing reads `domain_ids_B` wherever it lives. The trainer passes it on the host (it is known there from
    the sampler): the checks and the permutation are then host work, and only the small index tensor travels
    to the device (non-blocking), so a training step never waits on the device. Given on the device
    (single-process evaluation), the ids are read back once per layer (a synchronisation, harmless there).
    """

    def __init__(self, cfg: ModelConfig, expert_ids: Sequence[int]) -> None:
        super().__init__()
        if not expert_ids:
            raise ValueError("a DEMix layer needs at least one expert id")
        self.expert_ids = sorted(int(e) for e in expert_ids)
        self.experts = nn.ModuleDict(
            {str(e): MLP(cfg.d_model, cfg.d_ffn, cfg.dropout) for e in self.expert_ids}
        )

    def forward(self, x_BTD: torch.Tensor, domain_ids_B: torch.Tensor | None = None) -> FFNOutput:
        if domain_ids_B is None:
            raise ValueError("a DEMix layer routes by domain: pass domain_ids (one per sequence)")
        if len(self.expert_ids) == 1:
            only = self.expert_ids[0]
            # A rank of one domain: the whole batch is that domain (a host check when the ids are on the host).
            if not bool((domain_ids_B == only).all()):
                missing = sorted(set(domain_ids_B.tolist()) - {only})
                raise ValueError(f"domain ids {missing} have no expert here (this layer holds expert {only})")
            return FFNOutput(hidden=self.experts[str(only)](x_BTD))
        # free on the host (the trainer); one read-back when the ids are on the device
        ids = domain_ids_B.tolist()
        missing = sorted(set(ids) - set(self.expert_ids))
        if missing:
            raise ValueError(
                f"domain ids {missing} have no expert here (this layer holds experts {self.expert_ids})"
            )
        per_expert = Counter(ids)
        order = sorted(range(len(ids)), key=ids.__getitem__)  # stable: each expert's rows keep their order
        order_B = None
        if order != list(range(len(ids))):
            order_B = torch.tensor(order, dtype=torch.long).to(x_BTD.device, non_blocking=True)
        experts = [self.experts[str(e)] for e in self.expert_ids]
        return FFNOutput(
            hidden=run_grouped(x_BTD, experts, [per_expert[e] for e in self.expert_ids], order_B)
        )
