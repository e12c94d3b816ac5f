"""Communication as it happens: bytes, calls and host time of every collective, per process group.

`CommStats.install()` wraps torch.distributed's collectives (the functions DeepSpeed's comm layer and our own
code call) so every call adds to a counter keyed by (collective, group): the group is named from the run's
`ProcessGroups` (`world`, `data_parallel`, `tensor_parallel`, `expert`) or, for another group, by its ranks.

    bytes   the payload handed to the collective on this rank: all_reduce / broadcast / reduce: the tensor;
            reduce_scatter: the input (the whole buffer being reduced); all_gather: the output (the whole
            gathered buffer); all_to_all: the input. This is the "message size" of the NCCL tests, which the
            cost model's formulas are written in (benchmarks/costmodel/: `allreduce_plan`, `alltoall_volume`);
            bytes on the wire follow from it (a ring all-reduce sends 2(p-1)/p of it per rank).
    calls   how many collectives.
    seconds host time spent inside the call. With gloo (and NCCL's blocking calls) this is the time in the
            collective; NCCL's asynchronous calls return at once, so on a GPU it is the launch time only.

The trainer takes the counters at each log interval (`take`, per update) and records them in metrics.jsonl
(`comm/<group>/<collective>/{bytes,calls,seconds}`, rank 0's view: its data-parallel and expert groups);
what logging, evaluation and checkpoints communicate is not counted (`paused`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

COLLECTIVES: dict[str, str] = {  # function name -> the parameter whose size is the payload (module docstring)
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "reduce": "tensor",
    "reduce_scatter_tensor": "input",
    "_reduce_scatter_base": "input",
    "reduce_scatter": "input_list",
    "all_gather_into_tensor": "output_tensor",
    "_all_gather_base": "output_tensor",
    "all_gather": "tensor_list",
    "all_to_all_single": "input",
    "all_to_all": "input_tensor_list",
}


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class CommStats:
    """Counters of every collective since the last `take`, per (group name, collective)."""

    def __init__(self, names: dict[tuple[int, ...], str] | None = None) -> None:
        self.names = dict(names or {})
        self._ranks: dict[int, tuple[int, ...]] = {}
        self.counts: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])
        self._originals: dict[str, Callable] = {}
        self.counting = True

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Collectives inside are not counted (logging, evaluation, checkpoints: not the steps' communication)."""
        was, self.counting = self.counting, False
        try:
            yield
        finally:
            self.counting = was

    @classmethod
    def for_groups(cls, groups: Any) -> CommStats:
        """Names from a `parallel.groups.ProcessGroups`. Groups with the same ranks get one name, by priority
        data_parallel > expert > tensor_parallel > world: one rank alone is data_parallel (its gradient
        all-reduces); a one-rank expert group beside it (several domains per rank) is expert. Any other group of
        one rank (TP = 1, DeepSpeed's expert-data-parallel group with one expert per rank) is `local`: collectives
        called on it move nothing."""
        world = tuple(range(dist.get_world_size()))
        names = {world: "world"}
        if len(groups.tp_ranks) > 1:
            names[tuple(groups.tp_ranks)] = "tensor_parallel"
        if groups.expert_group is not None:
            names[tuple(groups.expert_ranks)] = "expert"
        names[tuple(groups.dp_ranks)] = "data_parallel"
        return cls(names)

    def _group_name(self, group: dist.ProcessGroup | None) -> str:
        key = id(group)
        if key not in self._ranks:
            self._ranks[key] = (
                tuple(dist.get_process_group_ranks(group))
                if group is not None
                else tuple(range(dist.get_world_size()))
            )
        ranks = self._ranks[key]
        return self.names.get(ranks, "local" if len(ranks) == 1 else "ranks_" + "_".join(map(str, ranks)))

    def install(self) -> CommStats:
        """Wrap torch.distributed's collectives (idempotent); returns self."""
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None or name in self._originals:
                continue
            # another CommStats (an earlier trainer in this
            while getattr(fn, "__wrapped_comm_stats__", False):
                fn = fn.__wrapped__  # process): replaced, never stacked
            self._originals[name] = fn
            setattr(dist, name, self._wrap(name, fn))
        return self

    def uninstall(self) -> None:
        """Put torch.distributed's own collectives back (a later `install` would otherwise wrap these wrappers)."""
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals.clear()

    def _wrap(self, name: str, fn: Callable) -> Callable:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if not self.counting:
                return out
            bound = signature.bind_partial(*args, **kwargs).arguments
            c = self.counts[(self._group_name(bound.get("group")), name)]
            c[0] += _nbytes(bound.get(COLLECTIVES[name]))
            c[1] += 1
            c[2] += time.perf_counter() - t0
            return out

        wrapper.__wrapped_comm_stats__ = True  # type: ignore[attr-defined]  # a marker on the wrapper function
        return wrapper

    def take(self, per: int = 1) -> dict[str, float]:
        """The counters since the last take, divided by `per` (e.g. updates), as flat metrics; then reset."""
        out: dict[str, float] = {}
        for (group, op), (nbytes, calls, seconds) in sorted(self.counts.items()):
            out[f"comm/{group}/{op}/bytes"] = nbytes / per
            out[f"comm/{group}/{op}/calls"] = calls / per
            out[f"comm/{group}/{op}/seconds"] = seconds / per
        self.counts.clear()
        return out
