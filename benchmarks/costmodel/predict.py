"""One configuration's predicted update: t_step = t_compute + t_allreduce_exposed + t_alltoall + t_gshard
(docs/costmodel.md), and the CostOptions of a run of this trainer."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from benchmarks.costmodel.cluster import ClusterSpec
from benchmarks.costmodel.collectives import (
    allreduce_internode_bytes,
    allreduce_seconds,
    alltoall_internode_bytes,
    alltoall_seconds,
)
from benchmarks.costmodel.gshard import gshard_terms
from benchmarks.costmodel.layout import allreduce_plan, alltoall_volume, params_per_gpu, plan_from_measured
from benchmarks.costmodel.memory import memory_bytes
from benchmarks.costmodel.options import DTYPE_BYTES, CostOptions, Efficiency
from launcher.typed import ConfigError
from model import accounting as acc
from model.config import ModelConfig
from parallel.config import ParallelConfig, TrainConfig


@dataclass(frozen=True)
class Prediction:
    """One configuration's predicted update: times in seconds, bytes per GPU per update."""

    arch: str
    gpus: int
    d_model: int
    tflops_per_update: float  # recompute convention (the paper's), whatever is executed
    efficiency: float
    compute_s: float
    allreduce_s: float
    alltoall_s: float
    step_s: float
    dispatch_combine_s: float  # GShard one-hot dispatch/combine matmuls (t_gshard terms: 0 for Dense/DEMix)
    gating_s: float  # GShard routing: memory-bound (s,e,c) and (s,e) tensors + the gate projection
    capacity_padding_s: float  # expert FLOPs on capacity rows beyond the k·S tokens F counts
    expert_roofline_s: float  # expert GEMMs' memory time beyond their compute time
    fp32_master_s: float  # FP16Optimizer's extra optimizer traffic over memory-efficient fp16
    gshard_s: float  # the sum of the five terms above
    memory_gib: float  # estimated peak memory per GPU (model states + activations), GiB
    recompute: str  # what was predicted: 'full' or 'none' ('full' also when forced by memory)
    tflops_per_gpu: float  # recompute convention (the paper's Tables 2/9)
    tflops_per_gpu_no_recompute: float  # forward + backward only (3 forwards)
    comm_share: float  # exposed communication / step time
    allreduce_bytes: float  # gradient bytes each rank all-reduces (over groups of > 1 rank)
    alltoall_bytes: float  # bytes each GPU hands to all-to-all per update (its own slice included)
    internode_bytes: float  # bytes each node sends through its NICs per update (all-reduce + all-to-all)
    bytes_from: str = (
        "formulas"  # 'measured' when priced on a run's measured bytes (`predict(measured_bytes=)`)
    )


def predict(
    cfg: ModelConfig,
    gpus: int,
    cluster: ClusterSpec,
    eff: Efficiency,
    opts: CostOptions = CostOptions(),
    measured_bytes: dict[str, float] | None = None,
) -> Prediction:
    """Predicted step time and TFLOPs/GPU of one update of `cfg` data-parallel over `gpus` GPUs. With
    `measured_bytes` (a run's bytes per update and group, `plan_from_measured`) the communication is priced on
    the bytes the trainer handed to its collectives instead of the byte formulas."""
    problems = opts.problems()
    if problems:
        raise ConfigError(problems, "cost options")
    recompute = opts.recompute == "full"
    memory = memory_bytes(cfg, gpus, opts, recompute)
    limit = cluster.gpu_memory_bytes
    if not recompute and opts.on_oom == "recompute" and limit is not None and memory > limit:
        recompute, opts = True, replace(opts, recompute="full")  # --checkpoint-activations keeps micro-batch
        memory = memory_bytes(cfg, gpus, opts, recompute)
    flops = acc.flops_per_update(cfg, gpus * opts.micro_batch * opts.grad_accum)
    executed = flops.get("recompute" if recompute else "no_recompute")
    e = eff.at(cfg.d_model)
    compute = executed / (gpus * cluster.peak * 1e12 * e)
    bucket = trainer_bucket_bytes(cfg, gpus, opts) if opts.grad_reduce != "fixed" else opts.bucket_mb * 2**20
    if measured_bytes is None:
        plan = allreduce_plan(cfg, gpus, DTYPE_BYTES[opts.grad_dtype])
        volume, count = alltoall_volume(cfg, opts)
    else:
        plan, volume, count = plan_from_measured(cfg, gpus, opts, measured_bytes)
    allreduce = sum(allreduce_seconds(nbytes, p, cluster, bucket) for nbytes, p in plan)
    ep_group = min(gpus, acc.resolved_num_experts(cfg)) if count else 1
    alltoall = count * alltoall_seconds(volume, ep_group, cluster)
    last_bucket = max(
        (allreduce_seconds(min(nbytes, bucket), p, cluster, bucket) for nbytes, p in plan), default=0.0
    )
    backward = compute / opts.grad_accum * (3 / 4 if recompute else 2 / 3)  # the last micro-batch's backward
    exposed = exposed_allreduce_seconds(allreduce, last_bucket, backward, opts) + alltoall
    terms = gshard_terms(cfg, gpus, cluster, eff, opts, recompute)
    step = compute + exposed + terms.total
    g = cluster.gpus_per_node
    internode = sum(allreduce_internode_bytes(nbytes, p, g) for nbytes, p in plan)
    internode += count * alltoall_internode_bytes(volume, ep_group, g)
    return Prediction(
        arch=cfg.ffn.kind,
        gpus=gpus,
        d_model=cfg.d_model,
        tflops_per_update=flops.recompute / 1e12,
        efficiency=e,
        compute_s=compute,
        allreduce_s=allreduce,
        alltoall_s=alltoall,
        step_s=step,
        dispatch_combine_s=terms.dispatch_combine_s,
        gating_s=terms.gating_s,
        capacity_padding_s=terms.capacity_padding_s,
        expert_roofline_s=terms.expert_roofline_s,
        fp32_master_s=terms.fp32_master_s,
        gshard_s=terms.total,
        memory_gib=memory / 2**30,
        recompute="full" if recompute else "none",
        tflops_per_gpu=flops.recompute / (gpus * step) / 1e12,
        tflops_per_gpu_no_recompute=flops.no_recompute / (gpus * step) / 1e12,
        comm_share=exposed / step,
        allreduce_bytes=sum(nbytes for nbytes, p in plan if p > 1),
        alltoall_bytes=volume * count,
        internode_bytes=internode,
        bytes_from="formulas" if measured_bytes is None else "measured",
    )


def exposed_allreduce_seconds(
    allreduce_s: float, last_bucket_s: float, backward_s: float, opts: CostOptions
) -> float:
    """The gradient all-reduce time left on the critical path of an update:

        fixed           (1 - overlap) · t_allreduce                   a what-if fraction (the paper fit: 0)
        after_backward  t_allreduce                                   reduced once the backward has finished
        overlap         max(t_last, t_allreduce - t_backward)         bucket by bucket during the backward

    With `parallel.grad_reduce: overlap` (ZeRO 0's hooks, ZeRO 1/2's overlap_comm) a bucket is issued as soon as the
    backward of the accumulation boundary has finished its gradients; earlier micro-batches only accumulate, so only
    that one backward (t_backward: 2/3 of a micro-batch's compute, 3/4 with the recomputed forward) can hide the
    all-reduce, and the last bucket, whose gradients (the embeddings and first layers) the backward finishes last, runs
    after it (t_last). A single bucket (a model smaller than the bucket rule's size) is all last bucket: nothing hides.
    Optimistic by the backward's time to fill the first bucket."""
    if opts.grad_reduce == "fixed":
        return (1 - opts.overlap) * allreduce_s
    if opts.grad_reduce == "after_backward":
        return allreduce_s
    return min(allreduce_s, max(last_bucket_s, allreduce_s - backward_s))


def trainer_bucket_bytes(cfg: ModelConfig, gpus: int, opts: CostOptions) -> float:
    """The trainer's gradient bucket in bytes: parallel/grad_reduce.py's `bucket_elements` for the parameters a GPU
    holds (or `opts.bucket_elements`), in the gradient dtype."""
    from parallel.grad_reduce import bucket_elements

    return (
        bucket_elements(params_per_gpu(cfg, gpus), gpus, opts.bucket_elements) * DTYPE_BYTES[opts.grad_dtype]
    )


def trainer_cost_options(train: TrainConfig, parallel: ParallelConfig, **changes: Any) -> CostOptions:
    """CostOptions for a run of this trainer: its micro-batch, accumulation, recompute, the dtype it reduces gradients
    in (bf16 at ZeRO 0 trains by autocast over fp32 weights; `train.grad_reduce_dtype: fp32` reduces bf16 in fp32)
    and how it reduces them (`parallel.grad_reduce`, `parallel.bucket_elements`); `changes` override any field."""
    grad = train.precision
    if train.precision == "bf16" and (parallel.zero_stage == 0 or train.grad_reduce_dtype == "fp32"):
        grad = "fp32"
    base = dict(
        micro_batch=train.micro_batch,
        grad_accum=train.grad_accum,
        grad_dtype=grad,
        act_dtype=train.precision,
        recompute="full" if train.activation_checkpointing == "full" else "none",
        grad_reduce=parallel.grad_reduce,
        bucket_elements=parallel.bucket_elements,
    )
    return CostOptions(**{**base, **changes})
