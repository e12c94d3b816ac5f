"""The DeepSpeed JSON config and the learning-rate schedule, derived from the typed training recipe and layout.

The DeepSpeed config is generated, never hand-written (`deepspeed_config`); the keys the framework decides
(`OWNED_DEEPSPEED_KEYS`) cannot be set through a run's `extra_deepspeed`, so the typed config stays the one place
they are decided. Nothing here needs a model or a process: the launcher writes the config into the run directory
before any rank starts, and the run configuration (launcher/config.py) checks `extra_deepspeed` with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from parallel.config import ParallelConfig, TrainConfig

if TYPE_CHECKING:
    from parallel.grad_reduce import GradReducePlan


def deepspeed_config(
    t: TrainConfig,
    parallel: ParallelConfig,
    extra: dict[str, Any] | None = None,
    grad_reduce: GradReducePlan | None = None,
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
        # ZeRO 0: the trainer clips with the true global norm itself (parallel/engine.py `global_grad_norm`).
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
