"""Apply the parallel layout to a plain GPT and build the DeepSpeed engine around it.

What happens here and nowhere else:
- tensor parallelism is applied (parallel/tensor_parallel.py);
- expert parameters are tagged for DeepSpeed (`allreduce=False`, `group_name=groups.expert_group_name`) so
  the engine (ZeRO 0) or the ZeRO 1/2 optimizer reduces them only over this rank's domain group, while shared
  parameters are reduced over the whole data-parallel group (the DEMix throughput trick, DEMix §3.4);
- expert gradients are rescaled to their definition (`ExpertGradScale`): expert e's gradient is the mean over
  the step's tokens of domain e, shared parameters' the mean over all the step's tokens, whatever the layout
  (one domain on several ranks, or several domains mixed on one rank); `"global"` keeps the reference fairseq
  code's 1/N_dp;
- every rank gets the same optimizer param-group structure (`optimizer_param_groups`): ZeRO 1/2 run one
  collective over the whole data-parallel group per group, so ranks holding different numbers of experts
  must still split them into the same number of groups;
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
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel.config import ParallelConfig, TrainConfig
from model.gpt import GPT
from parallel.groups import DeepSpeedMPU, ProcessGroups, register_with_deepspeed


def deepspeed_config(t: TrainConfig, parallel: ParallelConfig, extra: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The DeepSpeed JSON config derived from the typed training recipe and layout (written into the run
    directory by the launcher), with `extra` (the run config's `extra_deepspeed`: comms logger, flops profiler,
    offload, ...) merged in. A key of `extra` that the framework sets itself is refused
    (`extra_deepspeed_problems`), so the typed config stays the one place those are decided."""
    zero = parallel.zero_stage
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        # ZeRO 0: we clip with the true global norm ourselves (see module docstring).
        "gradient_clipping": t.clip_grad if zero > 0 else 0.0,
        "zero_optimization": {"stage": zero},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer (on by default) calls the accelerator's synchronize() in every
        # engine.forward and engine.step: two full device waits per micro-batch, which make a GPU step
        # host-bound. The trainer measures its own throughput over log intervals (launcher/train.py).
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
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
    return _merge_dicts(ds, extra or {})


# Keys of the DeepSpeed config the framework decides, and the typed setting to change instead.
OWNED_DEEPSPEED_KEYS: dict[str, str] = {
    "train_batch_size": "train.micro_batch x train.grad_accum x data-parallel size",
    "train_micro_batch_size_per_gpu": "train.micro_batch",
    "gradient_accumulation_steps": "train.grad_accum",
    "gradient_clipping": "train.clip_grad",
    "zero_optimization.stage": "parallel.zero_stage",
    "fp16": "train.precision", "bf16": "train.precision", "torch_autocast": "train.precision",
    "optimizer": "train (lr, betas, eps, weight_decay: the trainer builds AdamW)",
    "scheduler": "train.schedule / warmup_fraction",
    "timers": "the trainer's own tokens_per_s / step_time_s (DeepSpeed's throughput timer synchronises the device "
              "twice per micro-batch)",
}


def extra_deepspeed_problems(extra: dict[str, Any], prefix: str = "extra_deepspeed") -> list[str]:
    """Every key of `extra` that the framework owns (each with the typed setting to use instead)."""
    out = []

    def walk(node: dict[str, Any], path: str) -> None:
        for key, value in node.items():
            dotted = f"{path}.{key}" if path else key
            if dotted in OWNED_DEEPSPEED_KEYS:
                out.append(f"{prefix}.{dotted} is set by the framework: use {OWNED_DEEPSPEED_KEYS[dotted]}")
            elif isinstance(value, dict):
                walk(value, dotted)

    walk(extra, "")
    return out


def _merge_dicts(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`extra` on top of `base`, recursively for mappings (new keys inside an owned section, e.g. offload
    options under zero_optimization, are added)."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge_dicts(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def lr_lambda(t: TrainConfig) -> Callable[[int], float]:
    """Polynomial (power 1) decay to min_lr after linear warm-up over `warmup_fraction` of the steps (DEMix §4.1)."""
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


def _split_max_numel() -> Optional[int]:
    """DeepSpeed's threshold for splitting expert parameters into optimizer groups (its default argument)."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

    return split.__defaults__[0] if split.__defaults__ else None


def _greedy_chunks(params: list[nn.Parameter], max_numel: Optional[int]) -> list[list[nn.Parameter]]:
    """DeepSpeed's split: consecutive parameters while the running size stays <= max_numel."""
    chunks: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        if chunks and (max_numel is None or size + p.numel() <= max_numel):
            chunks[-1].append(p)
            size += p.numel()
        else:
            chunks.append([p])
            size = p.numel()
    return chunks


def _refine(chunks: list[list[nn.Parameter]], count: int) -> list[list[nn.Parameter]]:
    """Split the largest chunks in two (by size, keeping order) until there are `count` of them."""
    chunks = [list(c) for c in chunks]
    while len(chunks) < count:
        splittable = [i for i, c in enumerate(chunks) if len(c) > 1]
        if not splittable:
            raise ValueError(f"cannot split {sum(map(len, chunks))} expert tensors into {count} optimizer groups")
        i = max(splittable, key=lambda j: sum(p.numel() for p in chunks[j]))
        c, half, acc, cut = chunks[i], sum(p.numel() for p in chunks[i]) / 2, 0, 1
        for k, p in enumerate(c[:-1]):
            acc += p.numel()
            if acc >= half:
                cut = k + 1
                break
        else:
            cut = len(c) - 1
        chunks[i:i + 1] = [c[:cut], c[cut:]]
    return chunks


def _merge(chunks: list[list[nn.Parameter]], count: int) -> list[list[nn.Parameter]]:
    """Merge the smallest adjacent pair of chunks until there are `count` of them (order kept)."""
    chunks = [list(c) for c in chunks]
    size = [sum(p.numel() for p in c) for c in chunks]
    while len(chunks) > count:
        i = min(range(len(chunks) - 1), key=lambda j: size[j] + size[j + 1])
        chunks[i:i + 2] = [chunks[i] + chunks[i + 1]]
        size[i:i + 2] = [size[i] + size[i + 1]]
    return chunks


def _agree_on_chunks(chunked: list[list[list[nn.Parameter]]]) -> list[int]:
    """How many optimizer groups each base group's expert parameters get, the same on every rank: the most
    chunks any rank's DeepSpeed split makes, but never more than the fewest tensors any rank holds (each
    group needs one). One small all-reduce, on the training device."""
    counts = [len(c) for c in chunked]
    tensors = [sum(map(len, c)) for c in chunked]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from deepspeed.accelerator import get_accelerator

        t = torch.tensor(counts + [-n for n in tensors], dtype=torch.int64,
                         device=get_accelerator().current_device_name())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        values = t.tolist()
        counts, tensors = values[:len(counts)], [-v for v in values[len(counts):]]
    return [min(c, n) for c, n in zip(counts, tensors)]


def _exactly(chunks: list[list[nn.Parameter]], count: int) -> list[list[nn.Parameter]]:
    """`chunks` made into `count` chunks: split further (sizes stay under DeepSpeed's threshold) or merged."""
    return _refine(chunks, count) if len(chunks) <= count else _merge(chunks, count)


def optimizer_param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices and embeddings, not biases or norms; expert parameters in their own groups, split by size
    as DeepSpeed does, into the *same number of groups on every rank*.

    DeepSpeed splits a rank's expert parameters into groups of at most ~179M elements
    (`split_params_into_different_moe_groups_for_optimizer`). A rank holding two experts would get more
    groups than a rank holding one, and ZeRO 1/2 run one norm all-reduce over the whole data-parallel group
    per group: unequal counts deadlock. So each base group's expert chunks are counted with DeepSpeed's rule,
    the ranks agree on the largest count (a collective: every rank calls this), and ranks with fewer chunks
    split theirs further. (Should a rank hold fewer tensors than that, the count drops to its tensor count
    and larger ranks merge chunks past the threshold: only with a threshold far below a layer's size.) Group
    order is the same everywhere: shared decay, shared no-decay, then the expert chunks of each.
    """
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"name": "decay", "params": decay, "weight_decay": weight_decay},
        {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
    ]
    if any(is_expert_param(p) for p in decay + no_decay):
        shared = split_params_into_different_moe_groups_for_optimizer(groups, max_group_size=None)
        expert_groups = [g for g in shared if g.get("moe")]
        shared = [g for g in shared if not g.get("moe")]
        limit = _split_max_numel()
        chunked = [_greedy_chunks(g["params"], limit) for g in expert_groups]
        counts = _agree_on_chunks(chunked)
        groups = shared + [{**g, "params": part} for g, c, n in zip(expert_groups, chunked, counts)
                           for part in _exactly(c, n)]
    # Drop empty groups (e.g. all shared parameters frozen for DEMix-DAPT): DeepSpeed drops them from the
    # optimizer, and the LR scheduler must see the same groups.
    return [g for g in groups if g["params"]]


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
    expert: dict[int, list[torch.Tensor]] = {}  # by replica count: weight 1/R, a Python scalar (no host->device copy)
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
        total += torch.stack(torch._foreach_norm(shared, 2, dtype=torch.float32)).double().pow(2).sum() / len(groups.dp_ranks)
    for replicas, grads in sorted(expert.items()):
        total += torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).double().pow(2).sum() / replicas
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


@dataclass
class EngineBundle:
    engine: Any  # deepspeed.DeepSpeedEngine
    groups: ProcessGroups
    model: GPT
    scheduler: torch.optim.lr_scheduler.LambdaLR
    expert_scale: Optional[ExpertGradScale] = None  # DEMix: per-step expert gradient factors


def distribute_demix_experts(model: GPT, num_experts: int, groups: ProcessGroups, scaling: str) -> ExpertGradScale:
    """DEMix's parallel step: register the domain groups with DeepSpeed, tag this rank's experts for
    domain-group reduction with the per-expert gradient scale, and attach the marker that switches on
    DeepSpeed's expert paths. Returns the scale (its factors are set every step)."""
    register_with_deepspeed(groups)
    scale = tag_expert_parameters(model, groups, scaling)
    model.ds_expert_groups = _moe_marker(num_experts, groups.expert_group_name)
    return scale


def adamw_options(t: TrainConfig, device_type: str) -> dict[str, Any]:
    """AdamW's settings: the recipe's, and on CUDA torch's fused implementation (one kernel for every parameter's
    update instead of several per tensor; the same update rule). Elsewhere the default (foreach) implementation,
    so CPU results stay as they were."""
    return dict(lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, **({"fused": True} if device_type == "cuda" else {}))


PrepareFn = Callable[[nn.Module], Optional[ExpertGradScale]]


def build_engine(model: GPT, t: TrainConfig, parallel: ParallelConfig, groups: ProcessGroups,
                 prepare: Optional[PrepareFn] = None, extra_deepspeed: Optional[dict[str, Any]] = None) -> EngineBundle:
    """Tensor-parallelise `model`, let `prepare` make its experts distributed (the FFN kind's step, e.g.
    `distribute_demix_experts` or `parallel.gshard.apply_gshard`), and wrap it in a DeepSpeed engine."""
    import deepspeed

    if groups.topo.tensor_parallel > 1:
        from parallel.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, groups.tp_group)
    expert_scale = prepare(model) if prepare is not None else None
    optimizer = torch.optim.AdamW(optimizer_param_groups(model, t.weight_decay), **adamw_options(t, "cuda" if torch.cuda.is_available() else "cpu"))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t))
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=deepspeed_config(t, parallel, extra_deepspeed),
        mpu=DeepSpeedMPU(groups)
    )
    return EngineBundle(engine=engine, groups=groups, model=model, scheduler=scheduler, expert_scale=expert_scale)
