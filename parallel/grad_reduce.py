"""How gradients are reduced: the bucket size, whether reduction overlaps the backward, and ZeRO 0's overlapped
all-reduce.

Gradients are reduced while the accumulation boundary's backward still runs (`parallel.grad_reduce: overlap`): at
ZeRO 0 by `OverlappedGradReduce` (bucketed async all-reduces from gradient hooks, DeepSpeed's numbers), at ZeRO 1/2
by DeepSpeed's `overlap_comm`, in buckets of `bucket_elements` agreed by the ranks (`plan_grad_reduce`).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel.config import ParallelConfig
from parallel.expert_grads import is_expert_param
from parallel.groups import ProcessGroups

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
        # frees finished buckets' flat copies early
        while self._handles and self._handles[0].handle.is_completed():
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
