"""Apply the parallel layout to a plain GPT and build the DeepSpeed engine around it.

What happens here and nowhere else:
- tensor parallelism is applied (parallel/tensor_parallel.py);
- expert parameters are tagged for DeepSpeed (`allreduce=False`, `group_name=EXPERT_GROUP_NAME`) so the
  engine (ZeRO 0) or the ZeRO 1/2 optimizer reduces them only over this rank's domain group, while shared
  parameters are reduced over the whole data-parallel group (the DEMix throughput trick, DEMix §3.4);
- expert gradients are rescaled: DeepSpeed averages every gradient over the whole data-parallel world,
  so an expert's gradient would come out as (1/N_dp) Σ_{r in domain} g_r. With
  `expert_grad_scaling="domain_mean"` a hook multiplies expert gradients by N_dp / N_domain, giving the
  domain mean (1/N_domain) Σ_{r in domain} g_r; `"global"` keeps the reference fairseq code's 1/N_dp;
- the DeepSpeed JSON config is generated from the typed config (never hand-written);
- gradient clipping uses one global norm, identical on every rank:
      ||g|| = sqrt( ||g_shared||² + Σ_domains ||g_expert(d)||² )
  ZeRO 1/2 compute exactly this (every rank holds a partition of each group; the per-group squared norms
  are summed over the data-parallel group). At ZeRO 0 DeepSpeed would average the per-rank norms instead,
  so at ZeRO 0 we clip ourselves with `global_grad_norm` between backward and step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from launcher.config import RunConfig
from model.gpt import GPT
from parallel.groups import EXPERT_GROUP_NAME, DeepSpeedMPU, ProcessGroups, register_with_deepspeed


def deepspeed_config(cfg: RunConfig) -> dict[str, Any]:
    """The DeepSpeed JSON config derived from the typed run config (written into the run directory)."""
    t = cfg.train
    zero = cfg.parallel.zero_stage
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        # ZeRO 0: we clip with the true global norm ourselves (see module docstring).
        "gradient_clipping": t.clip_grad if zero > 0 else 0.0,
        "zero_optimization": {"stage": zero},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if zero > 0:
        ds["zero_optimization"].update(reduce_scatter=True, overlap_comm=False, contiguous_gradients=True)
    if t.precision == "bf16":
        if zero > 0:
            ds["bf16"] = {"enabled": True}
        else:
            ds["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    elif t.precision == "fp16":
        ds["fp16"] = {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2}
    return ds


def lr_lambda(cfg: RunConfig):
    """Polynomial (power 1) decay to min_lr after linear warm-up over `warmup_fraction` of the steps (DEMix §4.1)."""
    t = cfg.train
    warmup = int(round(t.warmup_fraction * t.steps))
    floor = t.min_lr / t.lr

    def fn(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if t.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, t.steps - warmup))
        if t.schedule == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        return floor + (1 - floor) * (1 - progress)

    return fn


def is_expert_param(p: torch.Tensor) -> bool:
    """DEMix domain experts and DeepSpeed MoE experts (`ep_size_N` groups) alike."""
    return getattr(p, "group_name", None) is not None and getattr(p, "allreduce", True) is False


def expert_replicas(p: torch.Tensor, groups: ProcessGroups) -> int:
    """How many data-parallel ranks hold (and after reduction agree on) this expert parameter's gradient."""
    if p.group_name == EXPERT_GROUP_NAME:
        return len(groups.expert_ranks)
    from deepspeed.utils import groups as ds_groups

    return dist.get_world_size(ds_groups._get_expert_data_parallel_group(p.group_name))


def tag_expert_parameters(model: GPT, groups: ProcessGroups, scaling: str) -> int:
    """Mark this rank's expert parameters for domain-group reduction; returns how many tensors were tagged."""
    factor = len(groups.dp_ranks) / len(groups.expert_ranks) if scaling == "domain_mean" else 1.0
    n = 0
    for params in model.expert_parameters().values():
        for p in params:
            p.allreduce = False
            p.group_name = EXPERT_GROUP_NAME
            if factor != 1.0:
                # Runs on the local gradient before DeepSpeed reduces it (all ZeRO stages).
                p.register_hook(lambda g, f=factor: g * f)
            n += 1
    return n


def _moe_marker(num_experts: int) -> nn.Module:
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
            self.expert_group_name = EXPERT_GROUP_NAME

        def set_deepspeed_parallelism(self, *args: Any, **kwargs: Any) -> None:
            pass  # groups were registered from our topology (parallel/groups.py)

        def forward(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError("the DEMix expert-group marker is not a layer")

    return DemixExpertGroups()


def optimizer_param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices and embeddings, not biases or norms; expert params split into their own groups."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"name": "decay", "params": decay, "weight_decay": weight_decay},
        {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
    ]
    if any(is_expert_param(p) for p in decay + no_decay):
        groups = split_params_into_different_moe_groups_for_optimizer(groups)
    # Drop empty groups (e.g. all shared parameters frozen for DEMix-DAPT): DeepSpeed drops them from the
    # optimizer, and the LR scheduler must see the same groups.
    return [g for g in groups if g["params"]]


def global_grad_norm(model: nn.Module, groups: ProcessGroups) -> torch.Tensor:
    """sqrt(||g_shared||² + Σ_d ||g_expert(d)||²) over the whole model, identical on every rank.

    Call after gradients are reduced (ZeRO 0). Shared gradients are equal on all data-parallel ranks,
    expert gradients on all ranks of a domain group: each rank contributes its squares divided by the
    number of ranks holding the same values; parameters replicated over the TP group count on tp rank 0 only
    (those that differ across it, TP shards and GShard experts, carry DeepSpeed's model-parallel flags).
    """
    from deepspeed.runtime.utils import is_model_parallel_parameter

    shared = torch.zeros((), dtype=torch.float64)
    expert = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is None or (not is_model_parallel_parameter(p) and groups.tp_rank != 0):
            continue
        sq = p.grad.detach().double().pow(2).sum()
        if is_expert_param(p):
            expert += sq / expert_replicas(p, groups)
        else:
            shared += sq
    total = shared / len(groups.dp_ranks) + expert
    dist.all_reduce(total)  # over the world: sums the tp shards, the dp replicas (/N_dp) and each domain once
    return total.sqrt().float()


def clip_grads_(model: nn.Module, max_norm: float, norm: torch.Tensor) -> None:
    """Scale gradients by min(1, max_norm / (norm + 1e-6)) (the same coefficient on every rank)."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(coef)


@dataclass
class EngineBundle:
    engine: Any  # deepspeed.DeepSpeedEngine
    groups: ProcessGroups
    model: GPT
    scheduler: torch.optim.lr_scheduler.LambdaLR


def build_engine(model: GPT, cfg: RunConfig, groups: ProcessGroups) -> EngineBundle:
    """Tensor-parallelise `model`, tag its experts, and wrap it in a DeepSpeed engine."""
    import deepspeed

    if groups.topo.tensor_parallel > 1:
        from parallel.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, groups.tp_group)
    if cfg.model.ffn.kind == "gshard":
        from parallel.gshard import apply_gshard  # swaps the plain top-k layers for DeepSpeed's MoE layer

        apply_gshard(model, cfg, groups)
    if cfg.model.ffn.kind == "demix":
        register_with_deepspeed(groups)
        tag_expert_parameters(model, groups, cfg.parallel.expert_grad_scaling)
        model.ds_expert_groups = _moe_marker(cfg.model.ffn.num_experts)
    t = cfg.train
    optimizer = torch.optim.AdamW(
        optimizer_param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=deepspeed_config(cfg), mpu=DeepSpeedMPU(groups)
    )
    return EngineBundle(engine=engine, groups=groups, model=model, scheduler=scheduler)
