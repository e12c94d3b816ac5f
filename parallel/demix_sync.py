"""DEMix's gradient synchronisation in one module: which collective reduces which gradients, over which group,
where in the code, with which scale, for every ZeRO stage and FFN kind.

DEMix §3.4: shared parameters are all-reduced over all ranks, expert e's only over the ranks of its domain. Here
expert parameters are tagged (`tag_expert_parameters`: `allreduce=False`, `group_name`), DeepSpeed's
expert-data-parallel group of that name is bound to this rank's domain group (`register_with_deepspeed`), a
parameter-free marker switches DeepSpeed's expert paths on (ds_private.py `moe_marker`), expert gradients are
rescaled to their domain's mean (`ExpertGradScale`), and ZeRO 0's reduction runs here (`OverlappedGradReduce`);
at ZeRO 1/2 DeepSpeed's optimizer reduces by the same tags and groups. One training step (`SYNC_TABLE`, which
tests/parallel/test_demix_sync.py renders into this table; tests/multirank/test_sync_table.py counts the
collectives of a real step on 4 gloo ranks, 2 domains x 2 ranks, and checks the gradient rows):

| ZeRO | kinds  | gradients     | collective | group            | per step   | where                       | scale    |
|------|--------|---------------|------------|------------------|------------|-----------------------------|----------|
| 0    | all    | shared        | all_reduce | data-parallel    | 1          | OverlappedGradReduce (here) | 1/N_dp   |
| 0    | demix  | expert e      | all_reduce | e's domain       | 1          | OverlappedGradReduce (here) | f_e/N_dp |
| 1    | all    | shared        | all_reduce | data-parallel    | 1          | DeepSpeed ZeRO optimizer    | 1/N_dp   |
| 1    | demix  | expert e      | all_reduce | e's domain       | 1          | DeepSpeed ZeRO optimizer    | f_e/N_dp |
| 2    | all    | shared        | all_reduce | data-parallel    | grad_accum | DeepSpeed ZeRO optimizer    | 1/N_dp   |
| 2    | demix  | expert e      | all_reduce | e's domain       | grad_accum | DeepSpeed ZeRO optimizer    | f_e/N_dp |
| 0    | all    | norm          | all_reduce | world            | 1          | engine.py global_grad_norm  | -        |
| 1, 2 | all    | norm partials | all_reduce | data-parallel    | 1          | DeepSpeed ZeRO optimizer    | -        |
| 1, 2 | demix  | norm partials | all_reduce | e's domain       | 1          | DeepSpeed ZeRO optimizer    | -        |
| 1, 2 | all    | parameters    | all_gather | data-parallel    | 1          | DeepSpeed ZeRO optimizer    | -        |
| 1, 2 | demix  | parameters    | all_gather | e's domain       | 1          | DeepSpeed ZeRO optimizer    | -        |
| all  | gshard | expert        | all_reduce | expert-data-par. | 1          | DeepSpeed MoE (gshard.py)   | 1/N_dp   |

- gradients: `shared` every parameter that is not an expert's (all of dense's and CSE's), `expert e` DEMix's
  expert of domain e (`is_expert_param`), `norm` the one global clipping norm, `parameters` ZeRO's all-gather of
  the updated partitions (DeepSpeed binds torch's all-gather when it starts: `parallel.comm_stats` does not see
  it, the test does not check it).
- per step: ZeRO 0 and 1 reduce on the accumulation boundary's backward only; ZeRO 2 reduces every micro-batch's
  backward into the partitioned gradients (`train.grad_accum` times the gradient bytes).
- where: `OverlappedGradReduce` issues bucketed asynchronous all-reduces while the backward runs
  (`parallel.grad_reduce: overlap`, the default); with `grad_reduce: after_backward` DeepSpeed's
  `engine.allreduce_gradients` runs the same collectives after the backward. DeepSpeed's ZeRO 1/2 optimizer
  (`stage_1_and_2.py`) reads each parameter's tags and reduces over `register_with_deepspeed`'s groups; the bucket
  size and overlap it is handed come from parallel/grad_reduce.py.
- scale: the reduced gradient is the sum over the group divided by N_dp (DeepSpeed divides expert sums by the
  whole data-parallel size too), so shared gradients are the mean over all the step's tokens. Expert e's local
  gradient is first multiplied by f_e = (N_dp / R_e) · (N_r / n_{e,r}) (`ExpertGradScale`, R_e the ranks of e's
  group, N_r this rank's tokens, n_{e,r} those of domain e), making it the mean over domain e's tokens; with
  `parallel.expert_grad_scaling: global` (the fairseq reference code) f_e = 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from model.gpt import GPT
from parallel import ds_private
from parallel.groups import ProcessGroups


@dataclass(frozen=True)
class SyncRow:
    """One row of the module docstring's table: what one step reduces (or gathers), how, over which group."""

    zero: tuple[int, ...]  # the ZeRO stages it holds for
    kinds: tuple[str, ...]  # FFN kinds ("all": every kind)
    gradients: str  # "shared", "expert e", "norm", "norm partials", "parameters", "expert" (GShard's)
    collective: str  # the torch.distributed function
    group: str  # "data-parallel", "e's domain" (the rank's expert group), "world", "expert-data-par."
    per_step: str  # how many times per optimizer step: "1" or "grad_accum"
    where: str
    scale: str


_ALL = ("all",)
SYNC_TABLE: tuple[SyncRow, ...] = (
    SyncRow(
        (0,), _ALL, "shared", "all_reduce", "data-parallel", "1", "OverlappedGradReduce (here)", "1/N_dp"
    ),
    SyncRow(
        (0,),
        ("demix",),
        "expert e",
        "all_reduce",
        "e's domain",
        "1",
        "OverlappedGradReduce (here)",
        "f_e/N_dp",
    ),
    SyncRow((1,), _ALL, "shared", "all_reduce", "data-parallel", "1", "DeepSpeed ZeRO optimizer", "1/N_dp"),
    SyncRow(
        (1,), ("demix",), "expert e", "all_reduce", "e's domain", "1", "DeepSpeed ZeRO optimizer", "f_e/N_dp"
    ),
    SyncRow(
        (2,),
        _ALL,
        "shared",
        "all_reduce",
        "data-parallel",
        "grad_accum",
        "DeepSpeed ZeRO optimizer",
        "1/N_dp",
    ),
    SyncRow(
        (2,),
        ("demix",),
        "expert e",
        "all_reduce",
        "e's domain",
        "grad_accum",
        "DeepSpeed ZeRO optimizer",
        "f_e/N_dp",
    ),
    SyncRow((0,), _ALL, "norm", "all_reduce", "world", "1", "engine.py global_grad_norm", "-"),
    SyncRow(
        (1, 2), _ALL, "norm partials", "all_reduce", "data-parallel", "1", "DeepSpeed ZeRO optimizer", "-"
    ),
    SyncRow(
        (1, 2), ("demix",), "norm partials", "all_reduce", "e's domain", "1", "DeepSpeed ZeRO optimizer", "-"
    ),
    SyncRow((1, 2), _ALL, "parameters", "all_gather", "data-parallel", "1", "DeepSpeed ZeRO optimizer", "-"),
    SyncRow(
        (1, 2), ("demix",), "parameters", "all_gather", "e's domain", "1", "DeepSpeed ZeRO optimizer", "-"
    ),
    SyncRow(
        (0, 1, 2),
        ("gshard",),
        "expert",
        "all_reduce",
        "expert-data-par.",
        "1",
        "DeepSpeed MoE (gshard.py)",
        "1/N_dp",
    ),
)


def is_expert_param(p: torch.Tensor) -> bool:
    """DEMix domain experts and DeepSpeed MoE experts (`ep_size_N` groups) alike."""
    return getattr(p, "group_name", None) is not None and getattr(p, "allreduce", True) is False


def expert_replicas(p: torch.Tensor) -> int:
    """How many data-parallel ranks hold (and after reduction agree on) this expert parameter's gradient:
    the size of its expert-data-parallel group (DEMix registers its domain groups there too)."""
    return ds_private.expert_group_size(p.group_name)  # type: ignore[attr-defined]  # DeepSpeed's MoE attribute


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


def register_with_deepspeed(groups: ProcessGroups) -> None:
    """Bind DeepSpeed's expert-data-parallel group name to this rank's domain group.

    DeepSpeed reduces a parameter tagged `allreduce=False, group_name=N` over its expert-data-parallel group N, at
    ZeRO 0 (engine) and 1/2 (optimizer). ZeRO only checks that an expert-parallel group exists, and the fp16
    overflow check reduces over it; DEMix has no all-to-all, the closest meaning is the data-parallel group (the
    ranks that hold the other domains' experts), which also makes an overflow in any expert skip the step everywhere.
    """
    ds_private.bind_expert_groups(
        groups.expert_group_name,
        groups.expert_group,
        list(groups.expert_ranks),
        groups.dp_group,
        list(groups.dp_ranks),
    )


def tag_expert_parameters(model: GPT, groups: ProcessGroups, scaling: str) -> ExpertGradScale:
    """Mark this rank's expert parameters for domain-group reduction and hook the per-expert scaling."""
    scale = ExpertGradScale(len(groups.dp_ranks), len(groups.expert_ranks), scaling)
    for expert, params in model.expert_parameters().items():
        for p in params:
            # DeepSpeed's MoE parameter attributes (what its engine and ZeRO read to reduce over the expert group)
            p.allreduce = False  # type: ignore[attr-defined]
            p.group_name = groups.expert_group_name  # type: ignore[attr-defined]
            if scaling == "domain_mean":
                # Runs on the local gradient before DeepSpeed reduces it (all ZeRO stages).
                p.register_hook(scale.hook(expert))
    return scale


def distribute_demix_experts(
    model: GPT, num_experts: int, groups: ProcessGroups, scaling: str
) -> ExpertGradScale:
    """DEMix's parallel step: register the domain groups with DeepSpeed, tag this rank's experts for
    domain-group reduction with the per-expert gradient scale, and attach the marker that switches on
    DeepSpeed's expert paths. Returns the scale (its factors are set every step)."""
    register_with_deepspeed(groups)
    scale = tag_expert_parameters(model, groups, scaling)
    model.ds_expert_groups = ds_private.moe_marker(num_experts, groups.expert_group_name)
    return scale


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
        self.engine = engine
        shared_group = ds_private.sequence_data_parallel_group()
        # engine._reduce_non_expert_gradients / _reduce_expert_gradients: the same divisors, float and int
        shared_world = dist.get_world_size(shared_group) / float(engine.sequence_parallel_size)
        expert_world = dist.get_world_size(ds_private.data_parallel_group())
        self.buckets: list[_Bucket] = []
        self.bucket_of: dict[int, _Bucket] = {}
        open_buckets: dict[tuple, _Bucket] = {}
        params = [p for p in engine.module.parameters() if p.requires_grad and p.numel() > 0]
        for p in reversed(params):
            expert = is_expert_param(p)
            key = ("expert", p.group_name, p.dtype) if expert else ("shared", p.dtype)
            b = open_buckets.get(key)
            if b is None or sum(q.numel() for q in b.params) + p.numel() > elements:
                group = ds_private.expert_data_parallel_group(p.group_name) if expert else shared_group
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
        self._task: int | None = None  # the autograd graph task of the current backward
        self._boundary = False

    def install(self) -> OverlappedGradReduce:
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
        grads = []
        for p in b.params:
            assert p.grad is not None  # accumulated (or zero-filled) before its bucket is issued
            grads.append(p.grad.data)
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

    @property
    def collective(self) -> tuple[str, Any]:
        """(op, group) of the collective this waits on, for a timeout's message (parallel/comm_timeout.py)."""
        return "all_reduce", self.bucket.group

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
