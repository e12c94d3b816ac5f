"""GShard on DeepSpeed: swap each plain `model.gshard.GShardFFN` for DeepSpeed's MoE layer (all-to-all).

Shape legend: B batch, T tokens, S = B*T, D model dim, E experts, C capacity.

Layout (pure, `gshard_layout`): E = model.ffn.num_experts (0 = N x experts_per_rank for N GPUs, see
`resolve_num_experts`); each rank holds `experts_per_rank` experts and the expert-parallel size is

    ep_size = E / experts_per_rank        (must divide the world size N)

so the paper's setting (one expert per GPU, E = N) has ep_size = N: one all-to-all group of all ranks and
expert-data-parallel groups of one rank. With fewer experts than N x experts_per_rank (an explicit
num_experts), N / ep_size expert-parallel groups each hold all E experts and every expert is replicated on
N / ep_size ranks (its expert-data-parallel group), whose gradients DeepSpeed all-reduces. (Without tensor
parallelism N is the data-parallel size dp.)

Groups: DeepSpeed builds them itself, in `deepspeed.initialize`, from ep_size and the config key
`use_data_before_expert_parallelism` (parallel/ds_config.deepspeed_config; default False = DeepSpeed's E+D:
expert-parallel groups are consecutive ranks, so the all-to-all stays inside a node when ep_size <= GPUs per
node, and expert-data-parallel groups are strided). `gshard_layout` reproduces them with the pure
`parallel.ds_expert_groups.deepspeed_moe_groups`, which decides which experts this rank copies from the plain layer;
the first forward checks that DeepSpeed made the same groups. A rank's expert-parallel position p (its index in
its sorted group) holds global experts [p n_local, (p + 1) n_local).

Gradients: DeepSpeed averages every gradient over the whole data-parallel world, expert gradients summed over
their expert-data-parallel group only. For GShard that is the gradient of the mean loss: an expert replica
receives, through the all-to-all, the tokens of its whole expert-parallel group, and its expert-data-parallel
group covers the remaining groups, so sum over replicas / dp = d(mean_r loss_r) / d(expert).

Tensor parallelism (tp > 1; DeepSpeed's MoE with `enable_expert_tensor_parallelism=False`): attention and the
dense FFN layers are megatron-core-sharded (parallel/tensor_parallel.py), GShard experts stay whole, and every GPU
holds its own: by default E = GPUs x experts_per_rank, one expert per GPU as in the paper, so ep_size must divide
the world size (not only dp), and expert-parallel groups may span tensor-parallel lanes. The layer's input is
replicated on the TP ranks of a group, so each computes the same routing (same gate, same tokens, the same RNG
stream for the sampled policies: every rank of a TP group consumes the default generator identically). DeepSpeed
then removes the duplicates: TP rank t sends only slots [t C/tp, (t+1) C/tp) of every expert's buffer through the
all-to-all (`drop_tokens`) and all-gathers the returned slots over the TP group (`gather_tokens`), so each expert
computes each routed token once. That needs C to be a multiple of tp: with tp > 1 the gate is ours
(`_RoutingGate`, the routing of model/gshard.py) and rounds C up to a multiple of tp; the plain layer (evaluation
of a consolidated checkpoint) keeps DeepSpeed's C, which differs by fewer than tp slots.

Gradients with tp > 1: an expert replica still receives every token routed to it from its expert-parallel group
exactly once (each TP rank's share of the slots), so the sum over its expert-data-parallel group divided by
DeepSpeed's data-parallel size (world / tp) is again d(mean loss)/d(expert). Expert parameters differ across the
TP ranks of a group, so they are flagged `model_parallel=True` (DeepSpeed's `is_model_parallel_parameter`): ZeRO's
gradient norm and ours (parallel/engine.global_grad_norm) count them on every TP rank, not only on TP rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from model.config import ModelConfig
from model.gshard import GShardFFN, expert_capacity, route_tokens, routing_stats
from model.mlp import MLP, FFNOutput
from parallel import ds_private
from parallel.ds_expert_groups import deepspeed_moe_groups

if TYPE_CHECKING:
    from model.gpt import GPT


def resolve_num_experts(model: ModelConfig, world_size: int) -> int:
    """E for GShard: `num_experts` if set, else GPUs x experts_per_rank (one expert per GPU, DEMix §A.5).
    With tensor parallelism every GPU of a TP group holds different whole experts."""
    return model.ffn.num_experts or world_size * model.ffn.gshard.experts_per_rank


def gshard_layout_problems(model: ModelConfig, world_size: int, tensor_parallel: int = 1) -> list[str]:
    """Every reason the GShard layout is impossible (empty = fine); for the run-level validator.
    Expert-parallel groups are cut from the whole world (TP lanes included), so ep_size must divide world_size."""
    out = []
    per_rank = model.ffn.gshard.experts_per_rank
    n = resolve_num_experts(model, world_size)
    if n % per_rank:
        out.append(
            f"model.ffn.num_experts={n} is not a multiple of model.ffn.gshard.experts_per_rank={per_rank}: "
            "each rank holds the same number of experts"
        )
    elif world_size % (n // per_rank):
        ep = n // per_rank
        out.append(
            f"model.ffn.num_experts={n} / experts_per_rank={per_rank} = {ep} expert-parallel ranks, which does not "
            f"divide the {world_size} ranks: use num_experts = {per_rank} x a divisor of {world_size} "
            f"(0 = {world_size * per_rank}, one set of experts per GPU)"
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
    tensor_parallel: int = 1  # C is rounded up to a multiple of it (each TP rank sends 1/tp of the slots)

    @property
    def group_name(self) -> str:
        return f"ep_size_{self.ep_size}"  # DeepSpeed's name for the groups of this ep_size


def gshard_layout(
    model: ModelConfig,
    world_size: int,
    rank: int,
    use_data_before_expert_parallelism: bool = False,
    tensor_parallel: int = 1,
) -> GShardLayout:
    """The layout DeepSpeed will build for this rank (pure; raises ValueError listing every problem)."""
    problems = gshard_layout_problems(model, world_size, tensor_parallel)
    if problems:
        raise ValueError("GShard layout: " + "; ".join(problems))
    per_rank = model.ffn.gshard.experts_per_rank
    n = resolve_num_experts(model, world_size)
    ep = n // per_rank
    ds = deepspeed_moe_groups(
        world_size, ep, use_data_before_expert_parallelism=use_data_before_expert_parallelism
    )
    ep_ranks = next(tuple(sorted(g)) for g in ds.expert_parallel if rank in g)
    edp_ranks = next(tuple(sorted(g)) for g in ds.expert_data_parallel if rank in g)
    pos = ep_ranks.index(rank)
    return GShardLayout(
        n,
        ep,
        per_rank,
        ep_ranks,
        edp_ranks,
        tuple(range(pos * per_rank, (pos + 1) * per_rank)),
        tensor_parallel,
    )


def gshard_layout_for(model: ModelConfig, topo: Any, rank: int) -> GShardLayout:
    """`gshard_layout` on a parallel.topology.Topology, in DeepSpeed's default group order (E+D: the DeepSpeed
    config from parallel.ds_config.deepspeed_config leaves `use_data_before_expert_parallelism` unset;
    DistributedGShardFFN checks the groups DeepSpeed built against this layout)."""
    return gshard_layout(model, topo.world_size, rank, False, topo.tensor_parallel)


class _RoutingGate(nn.Module):
    """Stands in for DeepSpeed's TopKGate where DeepSpeed's cannot serve: a policy it lacks ("random"), or
    tensor parallelism (C must be a multiple of tp). The same `wg` weight, the routing of model/gshard.py,
    returned in DeepSpeed's sparse-route format."""

    def __init__(self, ds_gate: Any, policy: str, capacity_multiple: int = 1, tp_group: Any = None) -> None:
        super().__init__()
        self.wg, self.k, self.policy = ds_gate.wg, ds_gate.k, policy
        self.capacity_factor, self.eval_capacity_factor = (
            ds_gate.capacity_factor,
            ds_gate.eval_capacity_factor,
        )
        self.min_capacity, self.capacity_multiple, self.ep_group = (
            ds_gate.min_capacity,
            capacity_multiple,
            None,
        )
        self.tp_group = tp_group  # checked once: every TP rank must route identically

    def _set_ep_group(self, ep_group: Any) -> None:
        self.ep_group = ep_group

    def forward(
        self, x_SD: torch.Tensor, used_token: Any = None, sparse_routes: bool = True, use_tutel: bool = False
    ):
        logits_SE = F.linear(x_SD.float(), self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        r = route_tokens(
            logits_SE, self.k, factor, self.min_capacity, self.policy, self.training, self.capacity_multiple
        )
        idx_KS = torch.where(r.kept_KS, r.experts_KS, -1).to(torch.int32)
        loc_KS = (r.slots_KS * r.kept_KS).to(torch.int32)
        if self.tp_group is not None:
            _check_same_routing(idx_KS, loc_KS, self.tp_group)
            self.tp_group = None
        return r.l_aux, torch.tensor(r.capacity), logits_SE.shape[1], idx_KS, loc_KS, r.weights_KS, r.counts_E


def _check_same_routing(idx_KS: torch.Tensor, loc_KS: torch.Tensor, tp_group: Any) -> None:
    """Raise unless every rank of `tp_group` made the same routing decisions. DeepSpeed splits the capacity slots
    over the TP ranks assuming they did; a rank whose random draws (second-expert sampling, the "random" policy)
    diverged would silently mix different tokens."""
    pos_KS = torch.arange(1, idx_KS.numel() + 1, device=idx_KS.device).view_as(idx_KS)
    digest = ((idx_KS.long() + 2) * 1_000_003 + loc_KS.long() + 1).mul(pos_KS).sum().view(1)
    lo, hi = digest.clone(), digest.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=tp_group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=tp_group)
    if int(lo) != int(hi):
        raise RuntimeError(
            "GShard routing differs across the tensor-parallel ranks of a group: they must see the same tokens and "
            "draw the same random numbers (seed every rank with train.seed; do not reseed per rank)"
        )


class DistributedGShardFFN(nn.Module):
    """The training layer: `deepspeed.moe.layer.MoE` (gate, this rank's experts, all-to-all), returning an
    FFNOutput with aux_loss = aux_loss_weight * l_aux and the same statistics as the plain layer (local to this
    rank's tokens; expert_load_E from DeepSpeed's exp_counts)."""

    def __init__(
        self, plain: GShardFFN, cfg: ModelConfig, layout: GShardLayout, tp_group: Any = None
    ) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        g = cfg.ffn.gshard
        self.gcfg, self.layout = g, layout
        self.moe = MoE(
            hidden_size=cfg.d_model,
            expert=MLP(cfg.d_model, cfg.d_ffn, cfg.dropout),
            num_experts=layout.num_experts,
            ep_size=layout.ep_size,
            k=g.top_k,
            capacity_factor=g.capacity_factor,
            eval_capacity_factor=g.eval_capacity_factor,
            min_capacity=g.min_capacity,
            drop_tokens=True,
            use_rts=True,  # top-1 only: DeepSpeed's random token selection when an expert overflows
            top2_2nd_expert_sampling=g.second_expert_policy == "sampling",
        )
        inner = self.moe.deepspeed_moe
        if layout.tensor_parallel > 1 or (g.top_k == 2 and g.second_expert_policy == "random"):
            inner.gate = _RoutingGate(
                inner.gate,
                g.second_expert_policy,
                layout.tensor_parallel,
                tp_group if layout.tensor_parallel > 1 else None,
            )
        with torch.no_grad():
            inner.gate.wg.weight.copy_(plain.gate.weight)
            for j, e in enumerate(layout.local_experts):
                inner.experts.deepspeed_experts[j].load_state_dict(plain.experts[str(e)].state_dict())
        if layout.tensor_parallel > 1:
            for p in inner.experts.parameters():
                p.model_parallel = (
                    True  # differs across TP ranks: every TP rank counts it in the gradient norm
                )
        self._groups_checked = False

    def _check_groups(self) -> None:
        got = tuple(sorted(ds_private.expert_parallel_group_ranks(self.layout.group_name)))
        if got != self.layout.ep_ranks:
            raise RuntimeError(
                f"DeepSpeed's expert-parallel group {got} differs from the layout's {self.layout.ep_ranks}: the "
                "DeepSpeed config's use_data_before_expert_parallelism must be the one apply_gshard was given"
            )
        self._groups_checked = True

    def forward(self, x_BTD: torch.Tensor, domain_ids_B: torch.Tensor | None = None) -> FFNOutput:
        if not self._groups_checked and self.layout.ep_size > 1:
            self._check_groups()
        if self.layout.tensor_parallel > 1:
            _gloo_accepts_flat_token_gather()
        inner = self.moe.deepspeed_moe
        if hasattr(inner.gate, "top2_2nd_expert_sampling"):
            # DeepSpeed samples the second expert in eval too; sample in training only, as the plain layer does.
            inner.gate.top2_2nd_expert_sampling = (
                self.training and self.gcfg.second_expert_policy == "sampling"
            )
        try:
            y_BTD, l_aux, counts_E = self.moe(x_BTD)
        finally:
            # DeepSpeed's MoE keeps `l_aux` on the module. Under activation recompute the re-run block's l_aux, kept
            # there, holds that whole re-run's graph (and its activations) alive until backward ends: about one
            # block of activations per MoE layer (tiny 8-layer model: 59.3 vs 40.9 MiB measured on real tensors).
            inner.l_aux = None
        B, T, D = x_BTD.shape
        with torch.no_grad():
            probs_SE = F.softmax(
                F.linear(x_BTD.reshape(B * T, D).float(), inner.gate.wg.weight.float()), dim=1
            )
        g = self.gcfg
        factor = g.capacity_factor if self.training else g.eval_capacity_factor
        cap = expert_capacity(
            B * T, self.layout.num_experts, g.top_k, factor, g.min_capacity, self.layout.tensor_parallel
        )
        stats = routing_stats(probs_SE, counts_E, cap, B)
        stats["l_aux"] = l_aux.detach()
        return FFNOutput(hidden=y_BTD, aux_loss=g.aux_loss_weight * l_aux, stats=stats)


def _gloo_accepts_flat_token_gather() -> None:
    """With tp > 1 DeepSpeed's MoE all-gathers each expert's slots over the TP group into a flat buffer of
    tp x numel elements (deepspeed/moe/mappings.py `_gather_tokens`). NCCL takes any output of that size; gloo
    (torch 2.13) insists on the shape (tp * d0, d1, ...). On gloo groups only, DeepSpeed's backend call is given a
    view of the same buffer in that shape (same memory, same result); NCCL calls pass through untouched.
    Idempotent; needs DeepSpeed's communication backend (set up by deepspeed.initialize)."""
    from deepspeed.comm import comm as ds_comm

    cdb = ds_comm.cdb
    if cdb is None or getattr(cdb.all_gather_into_tensor, "gloo_flat_view", False):
        return
    inner = cdb.all_gather_into_tensor

    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        if output_tensor.dim() == 1 and input_tensor.dim() > 1 and dist.get_backend(group) == "gloo":
            output_tensor = output_tensor.view(-1, *input_tensor.shape[1:])
        return inner(output_tensor=output_tensor, input_tensor=input_tensor, group=group, async_op=async_op)

    all_gather_into_tensor.gloo_flat_view = True  # type: ignore[attr-defined]  # a marker on the function
    cdb.all_gather_into_tensor = all_gather_into_tensor


def apply_gshard(model: GPT, cfg: ModelConfig, groups: Any) -> list[int]:
    """Replace every plain GShard layer of `model` (a GPT) by a DistributedGShardFFN, in place, before the
    DeepSpeed engine and its optimizer are built. The plain layers must hold this rank's experts (a GPT built
    with all experts, or with `expert_ids=gshard_layout(...).local_experts`); the distributed model then
    computes what the plain one does. `cfg` is the model's config, `groups` our ProcessGroups.
    Returns the global expert ids this rank holds."""
    layout = gshard_layout_for(cfg, groups.topo, groups.rank)
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
        block.ffn = DistributedGShardFFN(ffn, cfg, layout, groups.tp_group)
    return list(layout.local_experts)


def _non_expert_state(model: nn.Module, moe_prefixes: list[str], groups: Any) -> dict[str, torch.Tensor]:
    """Everything outside the MoE layers, TP shards gathered (a collective over the TP group when tp > 1)."""
    rest = [
        (k, v)
        for k, v in model.state_dict(keep_vars=True).items()
        if not any(k.startswith(p) for p in moe_prefixes) and not k.endswith("_extra_state")
    ]
    if groups is not None and groups.topo.tensor_parallel > 1:
        from parallel.tensor_parallel import gather_tensors

        return gather_tensors(rest, groups.tp_group)
    return {k: v.detach() for k, v in rest}


def gshard_export_parts(
    model: nn.Module, groups: Any = None
) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]], bool]:
    """(shared tensors, {global expert id: its tensors in every MoE layer}, whether this rank writes them).

    No expert leaves its rank: each rank returns only the experts it holds (plain names, global ids), and the
    first rank of each expert-data-parallel group writes them. Gathering every expert everywhere instead would
    need E x expert size per GPU (52B parameters for the paper's 1.3B GShard on 128 GPUs). Collective over the
    TP group only (for the shared tensors)."""
    shared: dict[str, torch.Tensor] = {}
    experts: dict[int, dict[str, torch.Tensor]] = {}
    moe_prefixes, writer = [], True
    for name, module in model.named_modules():
        if not isinstance(module, DistributedGShardFFN):
            continue
        prefix, inner, lay = name + ".", module.moe.deepspeed_moe, module.layout
        moe_prefixes.append(prefix)
        shared[prefix + "gate.weight"] = inner.gate.wg.weight.detach()
        for j, e in enumerate(lay.local_experts):
            for pname, t in inner.experts.deepspeed_experts[j].state_dict().items():
                experts.setdefault(e, {})[f"{prefix}experts.{e}.{pname}"] = t.detach()
        writer &= lay.edp_ranks[0] == dist.get_rank()
    shared.update(_non_expert_state(model, moe_prefixes, groups))
    return shared, experts, writer


def gshard_state_names(model: nn.Module) -> dict[str, tuple[str, tuple[int, ...] | None]]:
    """For the parameters of the distributed MoE layers: engine name -> (plain GPT name, the ranks holding it, None
    for the replicated gate: the caller's rule for shared parameters). DeepSpeed names experts by local index
    (`moe.deepspeed_moe.experts.deepspeed_experts.<j>`); the plain model by global id (`experts.<e>`), which is what
    lets another layout load them. An expert is held whole by every rank of its expert-data-parallel group (its
    training state is written by one of them)."""
    out: dict[str, tuple[str, tuple[int, ...] | None]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, DistributedGShardFFN):
            continue
        inner, lay = module.moe.deepspeed_moe, module.layout
        for pname, _ in inner.gate.wg.named_parameters():
            out[f"{name}.moe.deepspeed_moe.gate.wg.{pname}"] = (f"{name}.gate.{pname}", None)
        for j, e in enumerate(lay.local_experts):
            for pname, _ in inner.experts.deepspeed_experts[j].named_parameters():
                out[f"{name}.moe.deepspeed_moe.experts.deepspeed_experts.{j}.{pname}"] = (
                    f"{name}.experts.{e}.{pname}",
                    tuple(lay.edp_ranks),
                )
    return out
