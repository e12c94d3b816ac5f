"""Apply the parallel layout to a plain GPT and build the DeepSpeed engine around it; the gradient arithmetic
the trainer does around the engine's step (global norm, clipping, fp16 loss scale).

`build_engine` applies tensor parallelism (parallel/tensor_parallel.py), lets the FFN kind make its experts
distributed (e.g. parallel/demix_sync.py `distribute_demix_experts`), builds AdamW over the same parameter-group
structure on every rank (parallel/optim_groups.py), generates the DeepSpeed config (parallel/ds_config.py) with the
bucket size and overlap the ranks agreed on (parallel/grad_reduce.py), and wraps the model in a DeepSpeed engine.

- gradient clipping uses one global norm, identical on every rank:
      ||g|| = sqrt( ||g_shared||² + Σ_domains ||g_expert(d)||² )
  ZeRO 1/2 compute exactly this (every rank holds a partition of each group; the per-group squared norms
  are summed over the data-parallel group). At ZeRO 0 DeepSpeed would average the per-rank norms instead,
  so at ZeRO 0 we clip ourselves with `global_grad_norm` between backward and step;
- DeepSpeed's backward prologue runs for our dataclass outputs (`attach_backward_prologue`): without it ZeRO's
  gradient hooks read a stale accumulation-boundary flag, which made `overlap_comm` at ZeRO 1 wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from model.gpt import GPT
from parallel import ds_private
from parallel.config import ParallelConfig, TrainConfig
from parallel.demix_sync import ExpertGradScale, OverlappedGradReduce, expert_replicas, is_expert_param
from parallel.ds_config import deepspeed_config, lr_lambda
from parallel.grad_reduce import GradReducePlan, plan_grad_reduce
from parallel.groups import DeepSpeedMPU, ProcessGroups
from parallel.optim_groups import optimizer_param_groups


def global_grad_norm(model: nn.Module, groups: ProcessGroups) -> torch.Tensor:
    """sqrt(||g_shared||² + Σ_d ||g_expert(d)||²) over the whole model, identical on every rank.

    Call after gradients are reduced (ZeRO 0). Shared gradients are equal on all data-parallel ranks,
    expert gradients on all ranks of a domain group: each rank contributes its squares divided by the
    number of ranks holding the same values; parameters replicated over the TP group count on tp rank 0 only
    (those that differ across it, TP shards and GShard experts, carry DeepSpeed's model-parallel flags).
    The sums live on the gradients' device (NCCL reduces nothing else); with fp16 the result is the norm of
    the loss-scaled gradients: divide by the loss scale.
    """
    from deepspeed.runtime.utils import is_model_parallel_parameter

    device = next(model.parameters()).device
    shared: list[torch.Tensor] = []
    expert: dict[
        int, list[torch.Tensor]
    ] = {}  # by replica count: weight 1/R, a Python scalar (no host->device copy)
    for p in model.parameters():
        if p.grad is None or (not is_model_parallel_parameter(p) and groups.tp_rank != 0):
            continue
        if is_expert_param(p):
            expert.setdefault(expert_replicas(p), []).append(p.grad.detach())
        else:
            shared.append(p.grad.detach())
    # One fused norm per tensor (torch._foreach_norm, as clip_grad_norm_ does), squared and summed in float64.
    total = torch.zeros((), dtype=torch.float64, device=device)
    if shared:
        total += torch.stack(torch._foreach_norm(shared, 2, dtype=torch.float32)).double().pow(2).sum() / len(
            groups.dp_ranks
        )
    for replicas, grads in sorted(expert.items()):
        total += (
            torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).double().pow(2).sum() / replicas
        )
    dist.all_reduce(total)  # over the world: sums the tp shards, the dp replicas (/N_dp) and each domain once
    return total.sqrt().float()


def loss_scale(engine: Any) -> float:
    """The fp16 dynamic loss scale the gradients currently carry (1.0 without fp16)."""
    if not engine.fp16_enabled():
        return 1.0
    return float(getattr(engine.optimizer, "loss_scale", getattr(engine.optimizer, "cur_scale", 1.0)))


def backward_loss_factor(engine: Any) -> float:
    """What to multiply the loss by before `engine.backward` so the gradients carry the fp16 loss scale.

    DeepSpeed 0.19.8's `engine.backward` scales the loss only for ZeRO optimizers (and torch-autocast's
    scaler). At ZeRO 0 its fp16 wrappers (FP16_Optimizer, FP16_UnfusedOptimizer around our AdamW) are not
    ZeRO optimizers, yet their `step` still divides the gradients by the current scale: unscaled fp16
    gradients would underflow, and be divided by 2^16 and more at every step. So at ZeRO 0 with fp16 we apply
    the scale the optimizer will remove; elsewhere DeepSpeed does it.
    """
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    if engine.fp16_enabled() and not isinstance(engine.optimizer, ZeROOptimizer):
        return loss_scale(engine)
    return 1.0


def clip_grads_(model: nn.Module, max_norm: float, norm: torch.Tensor) -> None:
    """Scale gradients by min(1, max_norm / (norm + 1e-6)) (the same coefficient on every rank)."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():  # fused, as clip_grad_norm_ does
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))


def attach_backward_prologue(engine: Any) -> None:
    """Run DeepSpeed's backward prologue for our model's outputs.

    `engine.forward` hooks the module's output tensors so that their first gradient calls `engine._backward_prologue`,
    which (among other things) tells the ZeRO optimizer whether this backward is the accumulation boundary. DeepSpeed
    looks for tensors in tensors, tuples, lists and dicts only; GPT returns a dataclass (`GPTOutput`), so the prologue
    never ran and ZeRO's gradient hooks saw the previous micro-batch's boundary flag. With `overlap_comm` at ZeRO 1
    and several buckets that reduced partial gradients on the first micro-batch (measured: a 15 % larger gradient
    norm at 2 ranks, grad_accum 2). This forward hook gives DeepSpeed the dataclass's fields, the same hooks it puts on
    a tuple output."""
    from deepspeed.runtime.utils import register_output_backward_hooks

    def hook(module: nn.Module, args: Any, out: Any) -> None:
        if is_dataclass(out) and torch.is_grad_enabled():
            register_output_backward_hooks(
                [getattr(out, f.name) for f in fields(out)], **ds_private.backward_prologue_hooks(engine)
            )

    engine.module.register_forward_hook(hook)


@dataclass
class EngineBundle:
    engine: Any  # deepspeed.DeepSpeedEngine
    groups: ProcessGroups
    model: GPT
    scheduler: torch.optim.lr_scheduler.LambdaLR
    expert_scale: ExpertGradScale | None = None  # DEMix: per-step expert gradient factors
    grad_reduce: GradReducePlan | None = None  # bucket size and overlap (`plan_grad_reduce`)
    reducer: OverlappedGradReduce | None = None  # ZeRO 0 with parallel.grad_reduce: overlap
    deepspeed_config: dict[str, Any] = field(default_factory=dict)  # the config the engine was built with


def adamw_options(t: TrainConfig, device_type: str) -> dict[str, Any]:
    """AdamW's settings: the recipe's, and on CUDA torch's fused implementation (one kernel for every parameter's
    update instead of several per tensor; the same update rule). Elsewhere the default (foreach) implementation,
    so CPU results stay as they were."""
    return dict(
        lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, **({"fused": True} if device_type == "cuda" else {})
    )


PrepareFn = Callable[[nn.Module], ExpertGradScale | None]


def build_engine(
    model: GPT,
    t: TrainConfig,
    parallel: ParallelConfig,
    groups: ProcessGroups,
    prepare: PrepareFn | None = None,
    extra_deepspeed: dict[str, Any] | None = None,
) -> EngineBundle:
    """Tensor-parallelise `model`, let `prepare` make its experts distributed (the FFN kind's step, e.g.
    `distribute_demix_experts` or `parallel.gshard.apply_gshard`), and wrap it in a DeepSpeed engine."""
    import deepspeed

    if groups.topo.tensor_parallel > 1:
        from parallel.tensor_parallel import apply_tensor_parallel

        assert groups.tp_group is not None  # ProcessGroups.create makes it whenever tensor_parallel > 1
        apply_tensor_parallel(model, groups.tp_group)
    expert_scale = prepare(model) if prepare is not None else None
    optimizer = torch.optim.AdamW(
        optimizer_param_groups(model, t.weight_decay),
        **adamw_options(t, "cuda" if torch.cuda.is_available() else "cpu"),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t))
    plan = plan_grad_reduce(model, parallel, groups)
    config = deepspeed_config(t, parallel, extra_deepspeed, plan)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config, mpu=DeepSpeedMPU(groups)
    )
    attach_backward_prologue(engine)
    reducer = None
    # BF16_Optimizer (never configured here) reduces its own fp32 buffers: DeepSpeed's path stays for it.
    if parallel.zero_stage == 0 and plan.overlap and not hasattr(engine.optimizer, "get_grads_for_reduction"):
        reducer = OverlappedGradReduce(engine, plan.elements).install()
    return EngineBundle(
        engine=engine,
        groups=groups,
        model=model,
        scheduler=scheduler,
        expert_scale=expert_scale,
        grad_reduce=plan,
        reducer=reducer,
        deepspeed_config=config,
    )
