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
  so at ZeRO 0 we clip ourselves with `global_grad_norm` between backward and step;
- gradients are reduced while the accumulation boundary's backward still runs (`parallel.grad_reduce: overlap`):
  at ZeRO 0 by `OverlappedGradReduce` (bucketed async all-reduces from gradient hooks, DeepSpeed's numbers), at
  ZeRO 1/2 by DeepSpeed's `overlap_comm`, in buckets of `bucket_elements` agreed by the ranks (`plan_grad_reduce`);
- DeepSpeed's backward prologue runs for our dataclass outputs (`attach_backward_prologue`): without it ZeRO's
  gradient hooks read a stale accumulation-boundary flag, which made `overlap_comm` at ZeRO 1 wrong.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from model.gpt import GPT
from parallel.config import ParallelConfig, TrainConfig
from parallel.groups import DeepSpeedMPU, ProcessGroups, register_with_deepspeed

# The gradient bucket rule (`bucket_elements`): Megatron-core's default DDP bucket, max(4e7, 1e6 x data-parallel
# ranks) elements ("larger DP sizes need larger buckets to ensure collectives do not become latency-bound": each rank's
# share of a ring all-reduce, bucket / ranks, stays >= 1e6 elements), never above DeepSpeed's own default
# reduce_bucket_size of 5e8 elements.
BUCKET_FLOOR_ELEMENTS = 40_000_000
BUCKET_PER_RANK_ELEMENTS = 1_000_000
DEEPSPEED_BUCKET_ELEMENTS = 500_000_000


def bucket_elements(rank_params: int, dp_size: int, override: Optional[int] = None) -> int:
    """Gradient elements per reduction bucket (ZeRO 0's `OverlappedGradReduce`, ZeRO 1/2's `reduce_bucket_size` and
    `allgather_bucket_size`):

        n = min(P, max(4e7, 1e6 N_dp), 5e8)        P: the most trainable parameters any data-parallel rank holds

    The floor keeps a bucket bandwidth-bound (Megatron-core's rule, see BUCKET_FLOOR_ELEMENTS); the bound by P keeps a
    small model from allocating DeepSpeed's default 2 x 5e8-element reduce buckets (4 GB in fp32) for a few million
    gradients; a model larger than n gets several buckets, the first reduced while the backward still computes the
    others. `override` (`parallel.bucket_elements`) replaces the rule. Rounded up to even: DeepSpeed wants the
    all-gather bucket a multiple of 2."""
    n = (
        override
        if override is not None
        else min(
            rank_params,
            max(BUCKET_FLOOR_ELEMENTS, BUCKET_PER_RANK_ELEMENTS * dp_size),
            DEEPSPEED_BUCKET_ELEMENTS,
        )
    )
    n = max(1, int(n))
    return n + n % 2


@dataclass(frozen=True)
class GradReducePlan:
    """How this run reduces gradients (`plan_grad_reduce`): bucket size and whether reduction overlaps the backward."""

    elements: int  # gradient elements per bucket
    overlap: (
        bool  # buckets issued during the backward of the accumulation boundary (ZeRO 0 hooks / overlap_comm)
    )
    max_rank_params: int  # the most trainable parameters a data-parallel rank holds (the bucket rule's P)
    uniform: bool  # every data-parallel rank holds trainable parameters of the same shapes, in the same order


def deepspeed_config(
    t: TrainConfig,
    parallel: ParallelConfig,
    extra: Optional[dict[str, Any]] = None,
    grad_reduce: Optional[GradReducePlan] = None,
) -> dict[str, Any]:
    """The DeepSpeed JSON config derived from the typed training recipe and layout (written into the run
    directory by the launcher), with `extra` (the run config's `extra_deepspeed`: comms logger, flops profiler,
    offload, ...) merged in. A key of `extra` that the framework sets itself is refused
    (`extra_deepspeed_problems`), so the typed config stays the one place those are decided.

    `grad_reduce` (`plan_grad_reduce`, which needs the model) sets ZeRO 1/2's bucket sizes and overlap; without it
    (the launcher, before any model exists) `parallel.grad_reduce` and `parallel.bucket_elements` alone decide, and the
    size keys are left out unless `bucket_elements` is set.

    bf16 with `train.grad_reduce_dtype: fp32`: at ZeRO 2 `data_types.grad_accum_dtype` and `communication_data_type`
    fp32 (each micro-batch's bf16 gradients are reduced in fp32 and summed into an fp32 partition); at ZeRO 1 only
    `communication_data_type` fp32 (the sum over ranks in fp32, the micro-batches still accumulate in bf16 `.grad`):
    DeepSpeed 0.19.8 trains ZeRO 1 with an fp32 `grad_accum_dtype` through its BF16_Optimizer instead, which
    all-reduces whole gradients without overlap and sums each expert's squared norm over the expert-parallel group,
    which parallel/groups.py binds to the whole data-parallel group: a DEMix domain held by R ranks would count R
    times in the clipping norm. At ZeRO 0 bf16 runs as autocast over fp32 weights: the gradients are fp32 already.
    """
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
        overlap = grad_reduce.overlap if grad_reduce is not None else parallel.grad_reduce == "overlap"
        ds["zero_optimization"].update(reduce_scatter=True, overlap_comm=overlap, contiguous_gradients=True)
        n = grad_reduce.elements if grad_reduce is not None else parallel.bucket_elements
        if n is not None:
            n += n % 2
            ds["zero_optimization"].update(reduce_bucket_size=n, allgather_bucket_size=n)
    if t.precision == "bf16":
        if zero > 0:
            ds["bf16"] = {"enabled": True}
            if t.grad_reduce_dtype == "fp32":
                ds["communication_data_type"] = "fp32"
                if zero == 2:
                    ds["data_types"] = {"grad_accum_dtype": "fp32"}
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
    "zero_optimization.overlap_comm": "parallel.grad_reduce (overlap | after_backward)",
    "zero_optimization.reduce_bucket_size": "parallel.bucket_elements",
    "zero_optimization.allgather_bucket_size": "parallel.bucket_elements",
    "communication_data_type": "train.grad_reduce_dtype (bf16 | fp32, with train.precision=bf16)",
    "data_types.grad_accum_dtype": "train.grad_reduce_dtype (bf16 | fp32, with train.precision=bf16)",
    "fp16": "train.precision",
    "bf16": "train.precision",
    "torch_autocast": "train.precision",
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
        out[key] = (
            _merge_dicts(out[key], value)
            if isinstance(value, dict) and isinstance(out.get(key), dict)
            else value
        )
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
            raise ValueError(
                f"cannot split {sum(map(len, chunks))} expert tensors into {count} optimizer groups"
            )
        i = max(splittable, key=lambda j: sum(p.numel() for p in chunks[j]))
        c, half, acc, cut = chunks[i], sum(p.numel() for p in chunks[i]) / 2, 0, 1
        for k, p in enumerate(c[:-1]):
            acc += p.numel()
            if acc >= half:
                cut = k + 1
                break
        else:
            cut = len(c) - 1
        chunks[i : i + 1] = [c[:cut], c[cut:]]
    return chunks


def _merge(chunks: list[list[nn.Parameter]], count: int) -> list[list[nn.Parameter]]:
    """Merge the smallest adjacent pair of chunks until there are `count` of them (order kept)."""
    chunks = [list(c) for c in chunks]
    size = [sum(p.numel() for p in c) for c in chunks]
    while len(chunks) > count:
        i = min(range(len(chunks) - 1), key=lambda j: size[j] + size[j + 1])
        chunks[i : i + 2] = [chunks[i] + chunks[i + 1]]
        size[i : i + 2] = [size[i] + size[i + 1]]
    return chunks


def _agree_on_chunks(chunked: list[list[list[nn.Parameter]]]) -> list[int]:
    """How many optimizer groups each base group's expert parameters get, the same on every rank: the most
    chunks any rank's DeepSpeed split makes, but never more than the fewest tensors any rank holds (each
    group needs one). One small all-reduce, on the training device."""
    counts = [len(c) for c in chunked]
    tensors = [sum(map(len, c)) for c in chunked]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from deepspeed.accelerator import get_accelerator

        t = torch.tensor(
            counts + [-n for n in tensors], dtype=torch.int64, device=get_accelerator().current_device_name()
        )
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        values = t.tolist()
        counts, tensors = values[: len(counts)], [-v for v in values[len(counts) :]]
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
        groups = shared + [
            {**g, "params": part}
            for g, c, n in zip(expert_groups, chunked, counts)
            for part in _exactly(c, n)
        ]
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


def _structure_signature(params: list[nn.Parameter]) -> int:
    """A 31-bit digest of the trainable parameters' shapes and expert tags, in order (equal on ranks laid out alike)."""
    return zlib.crc32(repr([(tuple(p.shape), is_expert_param(p)) for p in params]).encode()) & 0x7FFFFFFF


def plan_grad_reduce(model: nn.Module, parallel: ParallelConfig, groups: ProcessGroups) -> GradReducePlan:
    """The bucket size (`bucket_elements`, with P the largest rank's trainable parameters) and the overlap, agreed by
    the data-parallel group (one small all-reduce on the training device: every rank calls this).

    ZeRO 1/2 fill one bucket with shared and expert gradients in backward order and reduce it when the next gradient
    would not fit; each reduction runs one collective per process group in the bucket. Ranks whose trainable
    parameters differ (DEMix with unequal numbers of domains per rank) would therefore cut their shared gradients
    into different collectives: then the bucket holds the whole rank (one reduction, the same everywhere). With a
    single bucket there is nothing to overlap (it fills when the backward ends), so ZeRO 1/2 keep `overlap_comm` off
    and DeepSpeed allocates one bucket instead of two. ZeRO 0 (`OverlappedGradReduce`) keeps shared and expert
    buckets apart, each the same on every rank of its group: any layout overlaps."""
    params = [p for p in model.parameters() if p.requires_grad]
    count, sig = sum(p.numel() for p in params), _structure_signature(params)
    most, sig_max, sig_min = count, sig, sig
    if dist.is_available() and dist.is_initialized() and len(groups.dp_ranks) > 1:
        from deepspeed.accelerator import get_accelerator

        t = torch.tensor(
            [count, sig, -sig], dtype=torch.int64, device=get_accelerator().current_device_name()
        )
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=groups.dp_group)
        most, sig_max, sig_min = (int(v) for v in t.tolist())
        sig_min = -sig_min
    uniform = sig_max == sig_min
    n = bucket_elements(most, len(groups.dp_ranks), parallel.bucket_elements)
    overlap = parallel.grad_reduce == "overlap"
    if parallel.zero_stage > 0:
        if not uniform:
            n = bucket_elements(most, 1, max(n, most))
        overlap = overlap and n < most
    return GradReducePlan(elements=n, overlap=overlap, max_rank_params=most, uniform=uniform)


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
                [getattr(out, f.name) for f in fields(out)],
                preprocess_once_fn=engine._backward_prologue,
                preprocess_per_tensor_fn=engine._backward_prologue_per_tensor,
            )

    engine.module.register_forward_hook(hook)


@dataclass
class _Bucket:
    """Gradients reduced together over one process group (`OverlappedGradReduce`)."""

    params: list[nn.Parameter]
    group: Any  # the process group
    world: float  # what DeepSpeed divides the sum by (the data-parallel size, also for experts)
    ready: int = 0  # parameters whose gradient is final in this backward


class OverlappedGradReduce:
    """ZeRO 0's gradient all-reduce, issued bucket by bucket while the accumulation boundary's backward still runs.

    DeepSpeed's ZeRO-0 engine all-reduces every gradient after `loss.backward()` returns
    (`engine.allreduce_gradients` -> `buffered_allreduce_fallback`), so no communication overlaps the backward.
    Here, as PyTorch DDP does, the trainable parameters are cut at build time into buckets of at most `elements`
    gradients in reverse parameter order (roughly the order the backward finishes them): shared parameters apart,
    reduced over DeepSpeed's data-parallel group, expert parameters (DEMix domain experts, DeepSpeed MoE experts) by
    expert group name, reduced over their expert-data-parallel group, and by dtype. On the boundary micro-batch a
    post-accumulate-grad hook counts each bucket's finished gradients; a complete bucket is flattened and all-reduced
    asynchronously as soon as every earlier bucket has been issued, so every rank of a group issues the same
    collectives in the same order. Each bucket's numbers are DeepSpeed's own (`engine.allreduce_bucket`): the flat
    gradients cast to `communication_data_type`, the predivide/postscale factors, the sum, then division by the
    data-parallel size (experts too, whose sum runs over their group only), copied back into `.grad`. When the
    backward ends (an autograd engine callback) the remaining buckets are issued - parameters the backward never
    reached get zero gradients, as DeepSpeed gives them - and every handle is waited for, so the gradients are reduced
    before the trainer's `global_grad_norm`, the clip and the step. The engine's own after-backward all-reduce is
    switched off (`engine.enable_backward_allreduce`).

    Memory: a bucket's flat copy lives until its all-reduce is waited for. Finished ones are collected as the backward
    goes on; at most 2 x `elements` copied gradients are in flight (before issuing more, the oldest is waited for),
    the double buffer DeepSpeed's `overlap_comm` allocates at ZeRO 1/2 (parallel/memory.py `buffer_bytes`); a
    parameter larger than a bucket is reduced in its own `.grad`, uncopied. A rank only ever waits for buckets it
    issued, in the one order every rank of the group issues them.
    """

    def __init__(self, engine: Any, elements: int) -> None:
        from deepspeed.moe.utils import is_moe_param
        from deepspeed.utils import groups as ds_groups

        self.engine = engine
        shared_group = ds_groups._get_sequence_data_parallel_group()
        # engine._reduce_non_expert_gradients / _reduce_expert_gradients: the same divisors, float and int
        shared_world = dist.get_world_size(shared_group) / float(engine.sequence_parallel_size)
        expert_world = dist.get_world_size(ds_groups._get_data_parallel_group())
        self.buckets: list[_Bucket] = []
        self.bucket_of: dict[int, _Bucket] = {}
        open_buckets: dict[tuple, _Bucket] = {}
        params = [p for p in engine.module.parameters() if p.requires_grad and p.numel() > 0]
        for p in reversed(params):
            expert = is_moe_param(p)
            key = ("expert", p.group_name, p.dtype) if expert else ("shared", p.dtype)
            b = open_buckets.get(key)
            if b is None or sum(q.numel() for q in b.params) + p.numel() > elements:
                group = ds_groups._get_expert_data_parallel_group(p.group_name) if expert else shared_group
                b = _Bucket([], group, expert_world if expert else shared_world)
                open_buckets[key] = b
                self.buckets.append(b)
            b.params.append(p)
            self.bucket_of[id(p)] = b
        self._handles: list[_Pending] = []
        self._in_flight = 0  # gradient elements issued and not yet waited for
        self.peak_in_flight = 0  # the most there ever were (parallel/memory.py buffer_bytes bounds it)
        self._cap = 2 * elements
        self._next = 0  # the first bucket not yet issued in this backward
        self._task: Optional[int] = None  # the autograd graph task of the current backward
        self._boundary = False

    def install(self) -> "OverlappedGradReduce":
        """Hook every bucketed parameter and switch the engine's after-backward all-reduce off."""
        for b in self.buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(self._grad_ready)
        self.engine.enable_backward_allreduce = False
        return self

    def _grad_ready(self, p: nn.Parameter) -> None:
        task = torch._C._current_graph_task_id()
        if task != self._task:  # the first finished gradient of a new backward
            self._begin(task)
        if not self._boundary:
            return
        b = self.bucket_of[id(p)]
        b.ready += 1
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(
            self.buckets[self._next].params
        ):
            self._issue(self.buckets[self._next])
            self._next += 1
        while (
            self._handles and self._handles[0].handle.is_completed()
        ):  # frees finished buckets' flat copies early
            self._wait_oldest()

    def _begin(self, task: int) -> None:
        self.finish()  # anything a failed backward left (normally nothing)
        self._task = task
        self._boundary = (
            self.engine.is_gradient_accumulation_boundary() and not self.engine.inside_no_sync_ctxt
        )
        if self._boundary:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        for b in self.buckets[self._next :]:
            for p in b.params:
                if p.grad is None:  # DeepSpeed reduces zeros for them, so every rank reduces the same sizes
                    p.grad = torch.zeros_like(p)
            self._issue(b)
        self.finish()
        self._task = None

    def _issue(self, b: _Bucket) -> None:
        from deepspeed import comm as ds_dist
        from torch._utils import _flatten_dense_tensors

        e = self.engine
        grads = [p.grad.data for p in b.params]
        # A bucket of one gradient (a parameter larger than a bucket, e.g. the embedding) is reduced in place, as
        # ZeRO 1/2 reduce their oversized gradients: no copy. Otherwise the flat copy counts against the cap.
        alone = len(grads) == 1 and grads[0].is_contiguous() and e.communication_data_type == grads[0].dtype
        copied = 0 if alone else sum(g.numel() for g in grads)
        while self._handles and self._in_flight + copied > self._cap:
            self._wait_oldest()
        self._in_flight += copied
        self.peak_in_flight = max(self.peak_in_flight, self._in_flight)
        flat = grads[0].view(-1) if alone else _flatten_dense_tensors(grads)
        comm = flat if e.communication_data_type == flat.dtype else flat.to(e.communication_data_type)
        if e.gradient_average and e.postscale_gradients():
            if e.gradient_predivide_factor() != 1.0:
                comm.mul_(1.0 / e.gradient_predivide_factor())
        elif e.gradient_average:
            comm.mul_(1.0 / b.world)
        handle = ds_dist.all_reduce(comm, group=b.group, async_op=True)
        self._handles.append(_Pending(self, b, grads, flat, comm, handle, copied))

    def _wait_oldest(self) -> None:
        pending = self._handles.pop(0)
        pending.finish()
        self._in_flight -= pending.copied

    def finish(self) -> None:
        """Wait for every issued bucket and copy its reduced gradients back; reset for the next backward."""
        while self._handles:
            self._wait_oldest()
        for b in self.buckets:
            b.ready = 0
        self._next = 0


@dataclass
class _Pending:
    """An issued bucket: its gradients, their flat copy, the tensor being all-reduced and its work handle."""

    owner: OverlappedGradReduce
    bucket: _Bucket
    grads: list[torch.Tensor]
    flat: torch.Tensor
    comm: torch.Tensor
    handle: Any
    copied: int  # elements of the flat copy (0: reduced in place)

    def finish(self) -> None:
        from torch._utils import _unflatten_dense_tensors

        e = self.owner.engine
        self.handle.wait()
        if (
            e.gradient_average
            and e.postscale_gradients()
            and e.gradient_predivide_factor() != self.bucket.world
        ):
            self.comm.mul_(e.gradient_predivide_factor() / self.bucket.world)
        if self.comm is not self.flat:
            self.flat.copy_(self.comm)
        if self.copied:
            for g, reduced in zip(self.grads, _unflatten_dense_tensors(self.flat, self.grads)):
                g.copy_(reduced)


@dataclass
class EngineBundle:
    engine: Any  # deepspeed.DeepSpeedEngine
    groups: ProcessGroups
    model: GPT
    scheduler: torch.optim.lr_scheduler.LambdaLR
    expert_scale: Optional[ExpertGradScale] = None  # DEMix: per-step expert gradient factors
    grad_reduce: Optional[GradReducePlan] = None  # bucket size and overlap (`plan_grad_reduce`)
    reducer: Optional[OverlappedGradReduce] = None  # ZeRO 0 with parallel.grad_reduce: overlap
    deepspeed_config: dict[str, Any] = field(default_factory=dict)  # the config the engine was built with


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


def adamw_options(t: TrainConfig, device_type: str) -> dict[str, Any]:
    """AdamW's settings: the recipe's, and on CUDA torch's fused implementation (one kernel for every parameter's
    update instead of several per tensor; the same update rule). Elsewhere the default (foreach) implementation,
    so CPU results stay as they were."""
    return dict(
        lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, **({"fused": True} if device_type == "cuda" else {})
    )


PrepareFn = Callable[[nn.Module], Optional[ExpertGradScale]]


def build_engine(
    model: GPT,
    t: TrainConfig,
    parallel: ParallelConfig,
    groups: ProcessGroups,
    prepare: Optional[PrepareFn] = None,
    extra_deepspeed: Optional[dict[str, Any]] = None,
) -> EngineBundle:
    """Tensor-parallelise `model`, let `prepare` make its experts distributed (the FFN kind's step, e.g.
    `distribute_demix_experts` or `parallel.gshard.apply_gshard`), and wrap it in a DeepSpeed engine."""
    import deepspeed

    if groups.topo.tensor_parallel > 1:
        from parallel.tensor_parallel import apply_tensor_parallel

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
