"""A distributed model's state at full size, for the tests that compare it with a plain model: tensor-parallel
gradients gathered and a consolidated state dict sharded back (parallel/tensor_parallel.py), every GShard expert
gathered (parallel/gshard.py), a ZeRO-partitioned fp32 master or optimizer state made whole (parallel/cse.py).

The training code never needs these (its exports write each rank's own part); they are collectives, so every rank
of the group must call them, in the same order. They read the modules' private helpers on purpose: a test of the
sharding compares against the same layout the module writes."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

from parallel import ds_private
from parallel.cse import _full_state, _torch_optimizer
from parallel.gshard import DistributedGShardFFN, _non_expert_state
from parallel.tensor_parallel import _gather_named, _shard, is_tensor_parallel


def replicated_parameter_names(model: nn.Module) -> list[str]:
    """Names of the parameters every TP rank holds whole (their gradients must agree across the group)."""
    return [n for n, p in model.named_parameters() if not is_tensor_parallel(p)]


def gather_full_grads(model: nn.Module, tp_group: ProcessGroup) -> dict[str, torch.Tensor | None]:
    """Each parameter's gradient at full (TP=1) shape, by parameter name (None where there is none).
    A collective: every rank of the group must call it."""
    return _gather_named(list(model.named_parameters()), lambda p: p.grad, tp_group)


def shard_full_state_dict(
    model: nn.Module, full_state: dict[str, torch.Tensor], tp_group: ProcessGroup
) -> dict[str, torch.Tensor]:
    """This rank's shards of a consolidated (plain GPT) state dict, ready for `model.load_state_dict`
    on a tensor-parallel `model`. No communication."""
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state"):
            continue
        if name not in full_state:
            raise KeyError(f"consolidated state dict has no {name!r}")
        full = full_state[name]
        out[name] = _shard(full, t.partition_dim, tp_group) if is_tensor_parallel(t) else full
    return out


@torch.no_grad()
def gather_gshard_state_dict(model: nn.Module, groups: Any = None) -> dict[str, torch.Tensor]:
    """The plain GPT's state dict with every expert (`blocks.<i>.ffn.gate.weight`,
    `blocks.<i>.ffn.experts.<id>.fc1.weight`, ...) at full (TP=1) shapes: experts gathered over each layer's
    expert-parallel group, tensor-parallel shards over the TP group. Collective: every rank calls it (after the
    engine is built); every rank gets the full dict, so it is for tests and small models: the export writes
    each rank's own experts instead (`parallel.gshard.gshard_export_parts`). `groups` (our ProcessGroups) is
    needed only when tp > 1."""
    sd: dict[str, torch.Tensor] = {}
    moe_prefixes = []
    for name, module in model.named_modules():
        if isinstance(module, DistributedGShardFFN):
            moe_prefixes.append(name + ".")
            sd.update(_gather_layer(module, name + "."))
    sd.update(_non_expert_state(model, moe_prefixes, groups))
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


def partitioned_state(p: torch.Tensor, optimizer: Any, key: str | None = None) -> torch.Tensor | None:
    """Full fp32 master weight (key None) or optimizer state of a parameter of a ZeRO 1/2 / bf16 optimizer
    (collective over its data-parallel group); None for parameters such an optimizer does not partition."""
    if not ds_private.has_hp_mapping(p):
        return None
    return _full_state(p, _torch_optimizer(optimizer), key).view_as(p)
