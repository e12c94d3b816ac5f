"""GShard on DeepSpeed: swap each plain `model.gshard.GShardFFN` for DeepSpeed's MoE layer (all-to-all).

Shape legend: B batch, T tokens, S = B*T, D model dim, E experts, C capacity.

Layout (pure, `gshard_layout`): E = model.ffn.num_experts (0 = dp_size x experts_per_rank, see
`resolve_num_experts`); each rank holds `experts_per_rank` experts and the expert-parallel size is

    ep_size = E / experts_per_rank        (must divide the data-parallel size dp)

so the paper's setting (one expert per GPU, E = #GPUs) has ep_size = dp: one all-to-all group of all ranks and
expert-data-parallel groups of one rank. With fewer experts than dp x experts_per_rank (an explicit
num_experts), dp / ep_size expert-parallel groups each hold all E experts and every expert is replicated on
dp / ep_size ranks (its expert-data-parallel group), whose gradients DeepSpeed all-reduces.

Groups: DeepSpeed builds them itself, in `deepspeed.initialize`, from ep_size and the config key
`use_data_before_expert_parallelism` (parallel/engine.deepspeed_config; default False = DeepSpeed's E+D:
expert-parallel groups are consecutive ranks, so the all-to-all stays inside a node when ep_size <= GPUs per
node, and expert-data-parallel groups are strided). `gshard_layout` reproduces them with the pure
`parallel.topology.deepspeed_moe_groups`, which decides which experts this rank copies from the plain layer;
the first forward checks that DeepSpeed made the same groups. A rank's expert-parallel position p (its index in
its sorted group) holds global experts [p n_local, (p + 1) n_local).

Gradients: DeepSpeed averages every gradient over the whole data-parallel world, expert gradients summed over
their expert-data-parallel group only. For GShard that is the gradient of the mean loss: an expert replica
receives, through the all-to-all, the tokens of its whole expert-parallel group, and its expert-data-parallel
group covers the remaining groups, so sum over replicas / dp = d(mean_r loss_r) / d(expert).

Tensor parallelism is not supported (see `gshard_layout_problems`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from model.config import ModelConfig
from model.ffn import MLP, FFNOutput
from model.gshard import GShardFFN, expert_capacity, route_tokens, routing_stats
from parallel.topology import deepspeed_moe_groups

TP_UNSUPPORTED = (
    "gshard with tensor_parallel>1 is not supported because DeepSpeed 0.19.8's MoE layer would either keep "
    "whole (unsharded) experts on every tensor-parallel rank and build its expert groups over the whole world, "
    "across tensor-parallel lanes (enable_expert_tensor_parallelism=False), or expect Megatron-sharded experts "
    "with its own drop/gather of tokens along the capacity dimension (True), neither of which matches our "
    "megatron-core tensor parallelism; use parallel.tensor_parallel=1 (a GShard expert is FFN-sized, so the "
    "memory per GPU is close to the dense model's)"
)


def resolve_num_experts(model: ModelConfig, dp_size: int) -> int:
    """E for GShard: `num_experts` if set, else data-parallel ranks x experts_per_rank (one expert per GPU)."""
    return model.ffn.num_experts or dp_size * model.ffn.gshard.experts_per_rank


def gshard_layout_problems(model: ModelConfig, world_size: int, tensor_parallel: int = 1) -> list[str]:
    """Every reason the GShard layout is impossible (empty = fine); for the run-level validator."""
    if model.ffn.kind != "gshard":
        return []
    out = []
    if tensor_parallel > 1:
        out.append(f"parallel.tensor_parallel={tensor_parallel}: {TP_UNSUPPORTED}")
        return out
    dp = world_size // max(1, tensor_parallel)
    per_rank = model.ffn.gshard.experts_per_rank
    n = resolve_num_experts(model, dp)
    if n % per_rank:
        out.append(f"model.ffn.num_experts={n} is not a multiple of model.ffn.gshard.experts_per_rank={per_rank}: "
                   "each rank holds the same number of experts")
    elif dp % (n // per_rank):
        ep = n // per_rank
        out.append(
            f"model.ffn.num_experts={n} / experts_per_rank={per_rank} = {ep} expert-parallel ranks, which does not "
            f"divide the {dp} data-parallel ranks: use num_experts = {per_rank} x a divisor of {dp} "
            f"(0 = {dp * per_rank}, one set of experts per rank)"
        )
    return out


@dataclass(frozen=True)
class GShardLayout:
    """This rank's place: the expert-parallel size, its expert-parallel group and its experts."""

    num_experts: int
    ep_size: int
    experts_per_rank: int
    ep_ranks: tuple[int, ...]  # this rank's all-to-all group (sorted)
    edp_ranks: tuple[int, ...]  # the ranks holding the same experts
    local_experts: tuple[int, ...]  # global expert ids held here

    @property
    def group_name(self) -> str:
        return f"ep_size_{self.ep_size}"  # DeepSpeed's name for the groups of this ep_size


def gshard_layout(model: ModelConfig, world_size: int, rank: int, use_data_before_expert_parallelism: bool = False) -> GShardLayout:
    """The layout DeepSpeed will build for this rank (pure; raises ValueError listing every problem)."""
    problems = gshard_layout_problems(model, world_size)
    if problems:
        raise ValueError("GShard layout: " + "; ".join(problems))
    per_rank = model.ffn.gshard.experts_per_rank
    n = resolve_num_experts(model, world_size)
    ep = n // per_rank
    ds = deepspeed_moe_groups(world_size, ep, use_data_before_expert_parallelism=use_data_before_expert_parallelism)
    ep_ranks = next(tuple(sorted(g)) for g in ds.expert_parallel if rank in g)
    edp_ranks = next(tuple(sorted(g)) for g in ds.expert_data_parallel if rank in g)
    pos = ep_ranks.index(rank)
    return GShardLayout(n, ep, per_rank, ep_ranks, edp_ranks, tuple(range(pos * per_rank, (pos + 1) * per_rank)))


class _PlainPolicyGate(nn.Module):
    """Stands in for DeepSpeed's TopKGate where DeepSpeed has no such policy ("random"): the same `wg`
    weight, the routing of model/gshard.py, returned in DeepSpeed's sparse-route format."""

    def __init__(self, ds_gate: nn.Module, policy: str) -> None:
        super().__init__()
        self.wg, self.k, self.policy = ds_gate.wg, ds_gate.k, policy
        self.capacity_factor, self.eval_capacity_factor = ds_gate.capacity_factor, ds_gate.eval_capacity_factor
        self.min_capacity, self.ep_group = ds_gate.min_capacity, None

    def _set_ep_group(self, ep_group: Any) -> None:
        self.ep_group = ep_group

    def forward(self, x_SD: torch.Tensor, used_token: Any = None, sparse_routes: bool = True, use_tutel: bool = False):
        logits_SE = F.linear(x_SD.float(), self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        r = route_tokens(logits_SE, self.k, factor, self.min_capacity, self.policy, self.training)
        idx_KS = torch.where(r.kept_KS, r.experts_KS, -1).to(torch.int32)
        loc_KS = (r.slots_KS * r.kept_KS).to(torch.int32)
        return r.l_aux, torch.tensor(r.capacity), logits_SE.shape[1], idx_KS, loc_KS, r.weights_KS, r.counts_E


class DistributedGShardFFN(nn.Module):
    """The training layer: `deepspeed.moe.layer.MoE` (gate, this rank's experts, all-to-all), returning an
    FFNOutput with aux_loss = aux_loss_weight * l_aux and the same statistics as the plain layer (local to this
    rank's tokens; expert_load_E from DeepSpeed's exp_counts)."""

    def __init__(self, plain: GShardFFN, cfg: ModelConfig, layout: GShardLayout) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        g = cfg.ffn.gshard
        self.gcfg, self.layout = g, layout
        self.moe = MoE(
            hidden_size=cfg.d_model, expert=MLP(cfg.d_model, cfg.d_ffn, cfg.dropout), num_experts=layout.num_experts,
            ep_size=layout.ep_size, k=g.top_k, capacity_factor=g.capacity_factor,
            eval_capacity_factor=g.eval_capacity_factor, min_capacity=g.min_capacity, drop_tokens=True,
            use_rts=True,  # top-1 only: DeepSpeed's random token selection when an expert overflows
            top2_2nd_expert_sampling=g.second_expert_policy == "sampling",
        )
        inner = self.moe.deepspeed_moe
        if g.top_k == 2 and g.second_expert_policy == "random":
            inner.gate = _PlainPolicyGate(inner.gate, "random")
        with torch.no_grad():
            inner.gate.wg.weight.copy_(plain.gate.weight)
            for j, e in enumerate(layout.local_experts):
                inner.experts.deepspeed_experts[j].load_state_dict(plain.experts[str(e)].state_dict())
        self._groups_checked = False

    def _check_groups(self) -> None:
        from deepspeed.utils import groups as ds_groups

        got = tuple(sorted(ds_groups._get_expert_parallel_group_ranks(self.layout.group_name)))
        if got != self.layout.ep_ranks:
            raise RuntimeError(
                f"DeepSpeed's expert-parallel group {got} differs from the layout's {self.layout.ep_ranks}: the "
                "DeepSpeed config's use_data_before_expert_parallelism must be the one apply_gshard was given"
            )
        self._groups_checked = True

    def forward(self, x_BTD: torch.Tensor, domain_ids_B: Optional[torch.Tensor] = None) -> FFNOutput:
        if not self._groups_checked and self.layout.ep_size > 1:
            self._check_groups()
        inner = self.moe.deepspeed_moe
        if hasattr(inner.gate, "top2_2nd_expert_sampling"):
            # DeepSpeed samples the second expert in eval too; sample in training only, as the plain layer does.
            inner.gate.top2_2nd_expert_sampling = self.training and self.gcfg.second_expert_policy == "sampling"
        y_BTD, l_aux, counts_E = self.moe(x_BTD)
        B, T, D = x_BTD.shape
        with torch.no_grad():
            probs_SE = F.softmax(F.linear(x_BTD.reshape(B * T, D).float(), inner.gate.wg.weight.float()), dim=1)
        g = self.gcfg
        factor = g.capacity_factor if self.training else g.eval_capacity_factor
        cap = expert_capacity(B * T, self.layout.num_experts, g.top_k, factor, g.min_capacity)
        stats = routing_stats(probs_SE, counts_E, cap, B)
        stats["l_aux"] = l_aux.detach()
        return FFNOutput(hidden=y_BTD, aux_loss=g.aux_loss_weight * l_aux, stats=stats)


def apply_gshard(model: nn.Module, cfg: Any, groups: Any) -> list[int]:
    """Replace every plain GShard layer of `model` (a GPT) by a DistributedGShardFFN, in place, before the
    DeepSpeed engine and its optimizer are built. The plain layers must hold this rank's experts (a GPT built
    with all experts, or with `expert_ids=gshard_layout(...).local_experts`); the distributed model then
    computes what the plain one does. `cfg` is the RunConfig, `groups` our ProcessGroups.
    Returns the global expert ids this rank holds."""
    from parallel.engine import deepspeed_config

    problems = gshard_layout_problems(cfg.model, groups.topo.world_size, groups.topo.tensor_parallel)
    if problems:
        raise ValueError("; ".join(problems))
    d_before_e = bool(deepspeed_config(cfg).get("use_data_before_expert_parallelism", False))
    layout = gshard_layout(cfg.model, groups.topo.world_size, groups.rank, d_before_e)
    for i, block in enumerate(model.blocks):
        ffn = block.ffn
        if not isinstance(ffn, GShardFFN):
            continue
        if ffn.num_experts != layout.num_experts:
            raise ValueError(
                f"layer {i} was built with {ffn.num_experts} experts but the layout needs {layout.num_experts}: "
                "resolve model.ffn.num_experts before building the model (parallel.gshard.resolve_num_experts)"
            )
        missing = sorted(set(layout.local_experts) - set(ffn.expert_ids))
        if missing:
            raise ValueError(f"layer {i} lacks experts {missing} that rank {groups.rank} holds")
        block.ffn = DistributedGShardFFN(ffn, cfg.model, layout)
    return list(layout.local_experts)


@torch.no_grad()
def gather_gshard_state_dict(model: nn.Module, groups: Any = None) -> dict[str, torch.Tensor]:
    """The plain GPT's state dict with every expert (`blocks.<i>.ffn.gate.weight`,
    `blocks.<i>.ffn.experts.<id>.fc1.weight`, ...), gathered over each layer's expert-parallel group.
    Collective: every rank calls it (after the engine is built); every rank gets the full dict."""
    sd: dict[str, torch.Tensor] = {}
    moe_prefixes = []
    for name, module in model.named_modules():
        if isinstance(module, DistributedGShardFFN):
            moe_prefixes.append(name + ".")
            sd.update(_gather_layer(module, name + "."))
    for k, v in model.state_dict().items():
        if not any(k.startswith(p) for p in moe_prefixes):
            sd[k] = v.detach().clone()
    return sd


def _gather_layer(layer: DistributedGShardFFN, prefix: str) -> dict[str, torch.Tensor]:
    inner, lay = layer.moe.deepspeed_moe, layer.layout
    out = {prefix + "gate.weight": inner.gate.wg.weight.detach().clone()}
    local = [dict(m.state_dict()) for m in inner.experts.deepspeed_experts]
    for pname in local[0]:
        mine = torch.stack([sdict[pname].detach() for sdict in local]).contiguous()  # n_local x ...
        if lay.ep_size > 1:
            parts = [torch.empty_like(mine) for _ in range(lay.ep_size)]
            dist.all_gather(parts, mine, group=inner.ep_group)
        else:
            parts = [mine]
        for pos, block in enumerate(parts):
            for j in range(lay.experts_per_rank):
                out[f"{prefix}experts.{pos * lay.experts_per_rank + j}.{pname}"] = block[j].clone()
    return out
