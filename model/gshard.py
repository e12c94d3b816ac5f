"""GShard-style token-routed top-k mixture of experts (Lepikhin et al. 2020, Algorithm 1; DEMix §A.5), plain PyTorch.

Shape legend: B batch (sequences), T tokens per sequence, S = B*T routed tokens, D model dim, E experts,
K routes per token (top_k), C capacity (slots per expert).

This module is the single-process layer (evaluation, the reference for parity tests); parallel/gshard.py swaps
it for DeepSpeed's MoE layer (same gate, same experts, all-to-all between ranks) for training. It never
touches `torch.distributed`. The routing reproduces DeepSpeed 0.19.8's `top2gating` / `top1gating`
(deepspeed/moe/sharded_moe.py) step by step, so both compute the same thing on the same tokens:

    logits_SE = x_SD W_g^T              (W_g: E x D, no bias, computed in float32)
    p_SE      = softmax(logits_SE)
    e1_S      = argmax_e p_SE            (first expert)
    e2_S      = argmax_{e != e1} (logits_SE + n_SE)   (second expert; n = Gumbel noise for the
                                                        "sampling" policy in training, else 0)
    C         = max(ceil(S / E * K * capacity_factor), min_capacity)   (eval_capacity_factor in eval mode),
                rounded up to a multiple of `capacity_multiple` (the tensor-parallel size in distributed training,
                where each TP rank sends its 1/tp of every expert's slots through the all-to-all; 1 here)

Slots: every expert's buffer is filled by first choices in token order, then by second choices in token order
(loc1 = cumsum of e1 one-hots - 1; loc2 = cumsum of e2 one-hots - 1 + all first choices of that expert). A
route whose slot is >= C is dropped: it contributes nothing (the residual connection carries the token).
Combine weights are renormalised over the kept routes, w_k = p_{e_k} / (p_{e1} + p_{e2}) (top-2); top-1
uses w = p_{e1} unnormalised (Switch / DeepSpeed convention).

    y_S = sum_k kept_k * w_k * FFN_{e_k}(x_S)

Second-expert policies (GShard §2.2 / fairseq's `second_expert_policy`):
  * "sampling": in training, e2 is drawn by the Gumbel-max trick, i.e. sampled from the softmax over the
    other experts (DeepSpeed's `top2_2nd_expert_sampling`); in eval e2 is the argmax.
  * "all": e2 is always the argmax over the other experts.
  * "random": e2 is the argmax, but in training it is routed only with probability min(1, 2 g2) where
    g2 = p_{e2} / (p_{e1} + p_{e2}) (GShard Algorithm 1); unsampled routes take no capacity.

Load-balancing loss (GShard eq. 4 / Switch eq. 4), with f_e the fraction of tokens whose *first* choice is e
and P_e the mean gate probability of e:

    l_aux = E * sum_e P_e f_e = E * sum_e (1/S sum_s p_se) (1/S sum_s 1[e1_s = e])

It equals 1 for perfectly uniform routing; the layer returns aux_loss_weight * l_aux.
With one expert the layer is exactly the dense FFN (every token, weight 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.config import GShardConfig, ModelConfig
from model.mlp import MLP, FFNOutput


@dataclass
class Routing:
    """Where each of a token's K routes goes. Dropped or unsampled routes have kept=False and weight 0."""

    experts_KS: torch.Tensor  # long, expert of route k of token s
    slots_KS: torch.Tensor  # long, position in that expert's capacity buffer (meaningful where kept)
    kept_KS: torch.Tensor  # bool, route is routed and within capacity
    weights_KS: torch.Tensor  # float32 combine weights (0 where not kept)
    probs_SE: torch.Tensor  # float32 gate probabilities
    counts_E: torch.Tensor  # long, routed assignments per expert before dropping (DeepSpeed's exp_counts)
    capacity: int
    l_aux: torch.Tensor  # float32 scalar, E * sum_e P_e f_e (unweighted)


def expert_capacity(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    capacity_factor: float,
    min_capacity: int,
    multiple_of: int = 1,
) -> int:
    """C = max(ceil(S / E * K * capacity_factor), min_capacity), in float32 arithmetic as DeepSpeed's `_capacity`,
    then rounded up to a multiple of `multiple_of` (1 leaves DeepSpeed's value unchanged)."""
    c_t = torch.ceil((num_tokens / num_experts) * torch.tensor(capacity_factor * top_k)).to(torch.int64)
    c = max(int(c_t), min_capacity)
    return -(-c // multiple_of) * multiple_of


def gumbel_noise(like: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise shaped, placed and typed like `like` (floating point):

        n = -log(-log u),   u = tiny + r (1 - eps - tiny),   r ~ U[0, 1) (torch.rand)

    with tiny and eps of `like.dtype`. This is torch.distributions.Gumbel(0, 1).rsample (DeepSpeed's
    `gumbel_rsample`) number for number from the same RNG state, drawn on the device without building a
    distribution, whose argument validation reads a device tensor back to the host.
    """
    finfo = torch.finfo(like.dtype)
    # in the dtype, as torch rounds them
    low, high = (
        like.new_full((), finfo.tiny),
        like.new_full((), 1 - finfo.eps),
    )
    u = low + torch.rand(like.shape, dtype=like.dtype, device=like.device) * (high - low)
    return -torch.log(-torch.log(u))


def route_tokens(
    logits_SE: torch.Tensor,
    top_k: int,
    capacity_factor: float,
    min_capacity: int,
    policy: str = "all",
    training: bool = False,
    capacity_multiple: int = 1,
) -> Routing:
    """Top-k routing with capacity (see the module docstring for the maths). `logits_SE` must be float32.

    Random draws (Gumbel noise, the "random" policy's coin) use the global torch RNG in the same order as
    DeepSpeed's `top2gating`, so a seeded run reproduces DeepSpeed's choices.
    """
    S, E = logits_SE.shape
    probs_SE = F.softmax(logits_SE, dim=1)
    e1_S = torch.argmax(probs_SE, dim=1)
    mask1_SE = F.one_hot(e1_S, E)
    # l_aux written as DeepSpeed does (mean * E * E == E * sum) so that both round the same way.
    l_aux = torch.mean(probs_SE.mean(0) * mask1_SE.float().mean(0)) * E * E
    k = min(top_k, E)
    capacity = expert_capacity(S, E, top_k, capacity_factor, min_capacity, capacity_multiple)
    loc1_SE = torch.cumsum(mask1_SE, dim=0) - 1
    if k == 1:
        kept1_S = (loc1_SE * mask1_SE).sum(1) < capacity
        w1_S = probs_SE.gather(1, e1_S[:, None])[:, 0] * kept1_S
        return Routing(
            e1_S[None],
            (loc1_SE * mask1_SE).sum(1)[None],
            kept1_S[None],
            w1_S[None],
            probs_SE,
            mask1_SE.sum(0),
            capacity,
            l_aux,
        )
    noisy_SE = logits_SE
    if policy == "sampling" and training:
        noisy_SE = logits_SE + gumbel_noise(logits_SE)
    e2_S = torch.argmax(noisy_SE.masked_fill(mask1_SE.bool(), float("-inf")), dim=1)
    mask2_SE = F.one_hot(e2_S, E)
    p1_S, p2_S = probs_SE.gather(1, e1_S[:, None])[:, 0], probs_SE.gather(1, e2_S[:, None])[:, 0]
    if policy == "random" and training:
        g2_S = p2_S / (p1_S + p2_S).clamp_min(torch.finfo(p1_S.dtype).eps)
        mask2_SE = mask2_SE * (2 * g2_S > torch.rand_like(g2_S)).long()[:, None]
    loc2_SE = torch.cumsum(mask2_SE, dim=0) - 1 + mask1_SE.sum(0, keepdim=True)
    slot1_S, slot2_S = (loc1_SE * mask1_SE).sum(1), (loc2_SE * mask2_SE).sum(1)
    kept1_S = slot1_S < capacity
    kept2_S = mask2_SE.bool().any(1) & (slot2_S < capacity)
    g1_S, g2_S = p1_S * kept1_S, p2_S * kept2_S
    denom_S = (g1_S + g2_S).clamp_min(torch.finfo(g1_S.dtype).eps)
    return Routing(
        experts_KS=torch.stack([e1_S, e2_S]),
        slots_KS=torch.stack([slot1_S, slot2_S]),
        kept_KS=torch.stack([kept1_S, kept2_S]),
        weights_KS=torch.stack([g1_S / denom_S, g2_S / denom_S]),
        probs_SE=probs_SE,
        counts_E=(mask1_SE + mask2_SE).sum(0),
        capacity=capacity,
        l_aux=l_aux,
    )


@torch.no_grad()
def routing_stats(
    probs_SE: torch.Tensor, counts_E: torch.Tensor, capacity: int, batch: int
) -> dict[str, torch.Tensor]:
    """Per-layer routing statistics (detached), shared by this layer and the distributed one:

    expert_load_E     counts_e / sum counts: share of routed (token, route) assignments per expert
    dropped_fraction  sum_e max(0, counts_e - C) / sum counts: routes over capacity (slots fill in order, so
                      expert e keeps exactly min(counts_e, C))
    router_entropy    mean_s -sum_e p_se log p_se (nats; log E = uniform, 0 = one-hot)
    gate_prob_BE      mean over each sequence's tokens of p_se, for per-domain gating analysis
    """
    counts = counts_E.float()
    total = counts.sum().clamp_min(1.0)
    entropy_S = -(probs_SE * probs_SE.clamp_min(1e-12).log()).sum(1)
    return {
        "expert_load_E": counts / total,
        "dropped_fraction": (counts - capacity).clamp_min(0).sum() / total,
        "router_entropy": entropy_S.mean(),
        "gate_prob_BE": probs_SE.reshape(batch, -1, probs_SE.shape[1]).mean(1),
    }


class GShardFFN(nn.Module):
    """A GShard top-k MoE feed-forward layer (every `moe_every`-th layer of a GShard GPT).

    `gate` is a D x E linear map without bias (float32 routing); `experts` is a ModuleDict of `MLP`s keyed by
    global expert id (`experts.<id>.fc1.weight`, as DEMix). Domain ids are ignored: routing is per token.
    `expert_ids` may name a subset (a training rank's experts, before parallel/gshard.py takes over);
    forward needs all of them.
    """

    def __init__(self, cfg: ModelConfig, expert_ids: Sequence[int] | None = None) -> None:
        super().__init__()
        self.num_experts = max(1, cfg.ffn.num_experts)
        self.gcfg: GShardConfig = cfg.ffn.gshard
        ids = range(self.num_experts) if expert_ids is None else expert_ids
        self.expert_ids = sorted(int(e) for e in ids)
        if not self.expert_ids or not all(0 <= e < self.num_experts for e in self.expert_ids):
            raise ValueError(
                f"expert ids {self.expert_ids} must be a non-empty subset of 0..{self.num_experts - 1}"
            )
        self.gate = nn.Linear(cfg.d_model, self.num_experts, bias=False)
        self.experts = nn.ModuleDict(
            {str(e): MLP(cfg.d_model, cfg.d_ffn, cfg.dropout) for e in self.expert_ids}
        )
        self.capacity_multiple = 1  # set to tp to compute exactly what a tensor-parallel run's layer computes

    def route(self, x_SD: torch.Tensor) -> Routing:
        """Gate logits in float32, then `route_tokens` with this layer's capacity factor for train / eval."""
        g = self.gcfg
        logits_SE = F.linear(x_SD.float(), self.gate.weight.float())
        factor = g.capacity_factor if self.training else g.eval_capacity_factor
        return route_tokens(
            logits_SE,
            g.top_k,
            factor,
            g.min_capacity,
            g.second_expert_policy,
            self.training,
            self.capacity_multiple,
        )

    def forward(self, x_BTD: torch.Tensor, domain_ids_B: torch.Tensor | None = None) -> FFNOutput:
        if len(self.expert_ids) != self.num_experts:
            raise ValueError(
                f"this GShard layer holds experts {self.expert_ids} of {self.num_experts}: a single-process forward "
                "needs all of them (distributed training swaps the layer with parallel.gshard.apply_gshard)"
            )
        B, T, D = x_BTD.shape
        x_SD = x_BTD.reshape(B * T, D)
        r = self.route(x_SD)
        if self.num_experts == 1:  # the dense FFN, bit for bit
            y_SD = self.experts["0"](x_SD)
        else:
            y_SD = self._combine(x_SD, r)
        stats = routing_stats(r.probs_SE, r.counts_E, r.capacity, B)
        stats["l_aux"] = r.l_aux.detach()
        return FFNOutput(hidden=y_SD.view(B, T, D), aux_loss=self.gcfg.aux_loss_weight * r.l_aux, stats=stats)

    def _combine(self, x_SD: torch.Tensor, r: Routing) -> torch.Tensor:
        """y_S = sum_k kept_k w_k FFN_{e_k}(x_S); each expert runs once on all its kept rows (in slot order)."""
        y_SD = torch.zeros(x_SD.shape, dtype=torch.float32, device=x_SD.device)
        for e in self.expert_ids:
            k_N, s_N = ((r.experts_KS == e) & r.kept_KS).nonzero(as_tuple=True)
            if s_N.numel():
                order = torch.argsort(r.slots_KS[k_N, s_N])
                k_N, s_N = k_N[order], s_N[order]
                out_ND = self.experts[str(e)](x_SD[s_N]).float() * r.weights_KS[k_N, s_N][:, None]
                y_SD = y_SD.index_add(0, s_N, out_ND)
            else:  # keep every expert in the graph so gradient reduction stays uniform
                y_SD = y_SD + 0.0 * sum(p.view(-1)[0] for p in self.experts[str(e)].parameters())
        return y_SD.to(x_SD.dtype)
