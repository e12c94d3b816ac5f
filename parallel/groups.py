"""Process groups, made once from the pure topology and passed in (never looked up from inside the model).

`ProcessGroups.create(topo)` calls `torch.distributed.new_group` for every tensor-parallel group, every
data-parallel group and every domain's expert group, on every rank and in the same order (a requirement of
`new_group`), and keeps the ones this rank belongs to. parallel/demix_sync.py `register_with_deepspeed` then makes
DeepSpeed's expert-data-parallel machinery use *our* domain groups: all of a rank's expert parameters carry one group
name (`ProcessGroups.expert_group_name`, the same string on every rank), bound on each rank to that rank's
own domain group. Every rank therefore has the same optimizer param-group names (which ZeRO's collective
norm computation needs), whatever the allocation (even, uneven, or several domains per rank).

The name follows DeepSpeed's convention `ep_size_<N>`: DeepSpeed's fp16 overflow check
(`deepspeed/utils/groups.py:_get_max_expert_size`) parses N out of every expert group name and all-reduces
the overflow flag over the largest one. N is the data-parallel size, the group registered as DEMix's
"expert-parallel" group, so an fp16 overflow in any domain's expert skips the step on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from parallel.comm_timeout import name_group
from parallel.topology import Group, Topology

# How a message names each kind of group (parallel/comm_timeout.py `failed_collective`)
GROUP_NAMES = {
    "tp": "the tensor-parallel group",
    "dp": "the data-parallel group",
    "expert": "the expert group (the ranks of this rank's domain)",
}


def expert_group_name(dp_size: int) -> str:
    """DeepSpeed's expert group naming convention, `ep_size_<N>` (see the module docstring)."""
    return f"ep_size_{dp_size}"


@dataclass
class ProcessGroups:
    """This rank's groups and their rank lists."""

    topo: Topology
    rank: int
    tp_group: dist.ProcessGroup | None
    tp_ranks: Group
    dp_group: dist.ProcessGroup | None
    dp_ranks: Group
    # the ranks that share this rank's experts (same domain(s), same tp rank)
    expert_group: dist.ProcessGroup | None
    expert_ranks: Group

    @property
    def tp_rank(self) -> int:
        return self.tp_ranks.index(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.dp_ranks.index(self.rank)

    @property
    def expert_group_name(self) -> str:
        """The group name every DEMix expert parameter carries (identical on all ranks)."""
        return expert_group_name(len(self.dp_ranks))

    @classmethod
    def create(
        cls, topo: Topology, rank: int | None = None, timeout: timedelta | None = None
    ) -> ProcessGroups:
        """Make every group (collective: all ranks must call this with the same topology). `timeout`: how long each
        group's collectives wait for the other ranks (None: torch's default, 30 minutes; parallel/comm_timeout.py)."""
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call deepspeed.init_distributed() first"
            )
        rank = dist.get_rank() if rank is None else rank
        if dist.get_world_size() != topo.world_size:
            raise ValueError(
                f"the topology is for {topo.world_size} ranks but {dist.get_world_size()} processes were started"
            )
        mine: dict[str, tuple[dist.ProcessGroup | None, Group]] = {}

        def make(kind: str, groups: list[Group]) -> None:
            for ranks in groups:
                pg = dist.new_group(list(ranks), timeout=timeout)
                if rank in ranks:
                    mine[kind] = (pg, ranks)
                    name_group(pg, GROUP_NAMES[kind])

        make("tp", list(topo.tp_groups))
        make("dp", list(topo.dp_groups))
        # One expert group per distinct rank set (several domains on one rank share one group).
        expert_sets = sorted({grp for per_domain in topo.expert_groups for grp in per_domain})
        make("expert", expert_sets)
        return cls(topo, rank, *mine["tp"], *mine["dp"], *mine["expert"])


class DeepSpeedMPU:
    """The `mpu` object DeepSpeed asks for: model(=tensor)-parallel and data-parallel groups."""

    def __init__(self, groups: ProcessGroups) -> None:
        self.g = groups

    def get_model_parallel_rank(self) -> int:
        return self.g.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return len(self.g.tp_ranks)

    # None (a one-rank world's groups as data): torch's default group
    def get_model_parallel_group(self) -> dist.ProcessGroup | None:
        return self.g.tp_group

    def get_data_parallel_rank(self) -> int:
        return self.g.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return len(self.g.dp_ranks)

    def get_data_parallel_group(self) -> dist.ProcessGroup | None:
        return self.g.dp_group

    # DeepSpeed also asks under the tensor-parallel names.
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1
