"""Expert parameters: how they are recognised (`is_expert_param`: DEMix's domain experts and DeepSpeed MoE's alike),
and DEMix's experts made distributed (`distribute_demix_experts`):

- expert parameters are tagged for DeepSpeed (`allreduce=False`, `group_name=groups.expert_group_name`) so
  the engine (ZeRO 0) or the ZeRO 1/2 optimizer reduces them only over this rank's domain group, while shared
  parameters are reduced over the whole data-parallel group (the DEMix throughput trick, DEMix §3.4);
- expert gradients are rescaled to their definition (`ExpertGradScale`): expert e's gradient is the mean over
  the step's tokens of domain e, shared parameters' the mean over all the step's tokens, whatever the layout
  (one domain on several ranks, or several domains mixed on one rank); `"global"` keeps the reference fairseq
  code's 1/N_dp;
- a parameter-free marker module switches on DeepSpeed's expert-parameter paths (`_moe_marker`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from model.gpt import GPT
from parallel.groups import ProcessGroups, register_with_deepspeed


def is_expert_param(p: torch.Tensor) -> bool:
    """DEMix domain experts and DeepSpeed MoE experts (`ep_size_N` groups) alike."""
    return getattr(p, "group_name", None) is not None and getattr(p, "allreduce", True) is False


def expert_replicas(p: torch.Tensor) -> int:
    """How many data-parallel ranks hold (and after reduction agree on) this expert parameter's gradient:
    the size of its expert-data-parallel group (DEMix registers its domain groups there too)."""
    from deepspeed.utils import groups as ds_groups

    return dist.get_world_size(ds_groups._get_expert_data_parallel_group(p.group_name))


class ExpertGradScale:
    """Per-step factors that make each DEMix expert's gradient the mean over its domain's tokens.

    DeepSpeed reduces an expert gradient over the expert's group but divides by the whole data-parallel size,
    and each rank's loss is the mean over its own N_r tokens, so the reduced gradient of expert e is

        (1/N_dp) Σ_{r ∈ group(e)} (n_{e,r} / N_r) · mean_{t ∈ e on r} ∇ℓ_t

    where n_{e,r} is the number of e's tokens on rank r this step. The definition asks for
    (1/n_e) Σ_{t ∈ e} ∇ℓ_t. The topology gives every domain either a single rank (domains per rank) or ranks
    that read only it (ranks per domain), so with equal tokens per rank a local factor

        f_e = (N_dp / R_e) · (N_r / n_{e,r}),       R_e = ranks of e's group (its data-parallel size)

    applied to the local gradient before the reduction gives exactly the domain mean. With one domain per
    rank (n_{e,r} = N_r) this is the constant N_dp / R_e; with several domains mixed on a rank the second term
    undoes each domain's share of the rank's batch, step by step (shares vary when the micro-batch does not
    divide evenly among the rank's domains). `"global"` scaling (the fairseq reference) uses f_e = 1.
    """

    def __init__(self, dp_size: int, group_size: int, scaling: str) -> None:
        self.scaling = scaling
        self.base = dp_size / group_size if scaling == "domain_mean" else 1.0
        self.factors: dict[int, float] = {}

    def set_step_tokens(self, tokens_per_expert: dict[int, float], total: float) -> None:
        """This rank's scored tokens per expert id and in all, for the coming step (host numbers)."""
        if self.scaling != "domain_mean":
            return
        self.factors = {e: self.base * total / n for e, n in tokens_per_expert.items() if n > 0}

    def factor(self, expert: int) -> float:
        return self.factors.get(expert, self.base)

    def hook(self, expert: int):
        return lambda g: g * self.factor(expert)


def tag_expert_parameters(model: GPT, groups: ProcessGroups, scaling: str) -> ExpertGradScale:
    """Mark this rank's expert parameters for domain-group reduction and hook the per-expert scaling."""
    scale = ExpertGradScale(len(groups.dp_ranks), len(groups.expert_ranks), scaling)
    for expert, params in model.expert_parameters().items():
        for p in params:
            p.allreduce = False
            p.group_name = groups.expert_group_name
            if scaling == "domain_mean":
                # Runs on the local gradient before DeepSpeed reduces it (all ZeRO stages).
                p.register_hook(scale.hook(expert))
    return scale


def _moe_marker(num_experts: int, group_name: str) -> nn.Module:
    """A parameter-free module that makes DeepSpeed switch on its expert-parameter paths.

    The engine enables expert-group reduction (and hands the expert groups to ZeRO) only when the model
    contains a `deepspeed.moe.layer.MoE`. DEMix needs those paths but not that layer (no gate, no
    all-to-all), so parallel/ attaches this marker; the model itself stays plain PyTorch.
    """
    from deepspeed.moe.layer import MoE

    class DemixExpertGroups(MoE):
        def __init__(self) -> None:
            nn.Module.__init__(self)
            self.num_experts = num_experts
            self.expert_group_name = group_name

        def set_deepspeed_parallelism(self, *args: Any, **kwargs: Any) -> None:
            pass  # groups were registered from our topology (parallel/groups.py)

        def forward(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError("the DEMix expert-group marker is not a layer")

    return DemixExpertGroups()


def distribute_demix_experts(
    model: GPT, num_experts: int, groups: ProcessGroups, scaling: str
) -> ExpertGradScale:
    """DEMix's parallel step: register the domain groups with DeepSpeed, tag this rank's experts for
    domain-group reduction with the per-expert gradient scale, and attach the marker that switches on
    DeepSpeed's expert paths. Returns the scale (its factors are set every step)."""
    register_with_deepspeed(groups)
    scale = tag_expert_parameters(model, groups, scaling)
    model.ds_expert_groups = _moe_marker(num_experts, groups.expert_group_name)
    return scale
