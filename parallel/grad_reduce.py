"""How gradients are bucketed: the bucket size the ranks agree on and whether reduction overlaps the backward.

Gradients are reduced while the accumulation boundary's backward still runs (`parallel.grad_reduce: overlap`): at
ZeRO 0 by parallel/demix_sync.py `OverlappedGradReduce` (bucketed async all-reduces from gradient hooks, DeepSpeed's
numbers), at ZeRO 1/2 by DeepSpeed's `overlap_comm`, in buckets of `bucket_elements` agreed by the ranks
(`plan_grad_reduce`). Which collective reduces which gradients over which group: parallel/demix_sync.py.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel.config import ParallelConfig
from parallel.demix_sync import is_expert_param
from parallel.groups import ProcessGroups

# The gradient bucket rule (`bucket_elements`): Megatron-core's default DDP bucket, max(4e7, 1e6 x data-parallel
# ranks) elements ("larger DP sizes need larger buckets to ensure collectives do not become latency-bound": each rank's
# share of a ring all-reduce, bucket / ranks, stays >= 1e6 elements), never above DeepSpeed's own default
# reduce_bucket_size of 5e8 elements.
BUCKET_FLOOR_ELEMENTS = 40_000_000
BUCKET_PER_RANK_ELEMENTS = 1_000_000
DEEPSPEED_BUCKET_ELEMENTS = 500_000_000


def bucket_elements(rank_params: int, dp_size: int, override: int | None = None) -> int:
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
    and DeepSpeed allocates one bucket instead of two. ZeRO 0 (demix_sync.py `OverlappedGradReduce`) keeps shared and
    expert buckets apart, each the same on every rank of its group: any layout overlaps."""
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
