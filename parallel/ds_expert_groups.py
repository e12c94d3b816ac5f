"""DeepSpeed's own MoE expert groups (deepspeed 0.19.8, deepspeed/utils/groups.py), reproduced as pure functions,
and their comparison with our topology.

`deepspeed_moe_groups` gives the rank lists `deepspeed.moe.layer.MoE` would pass to `new_group` (GShard's layout,
parallel/gshard.py, follows them); `deepspeed_equivalent` and `deepspeed_mismatches` say whether DeepSpeed's groups
could stand for a DEMix topology (the dry run reports it). Like parallel/topology.py, nothing here starts a process
or touches `torch.distributed`: the groups are data, checked in tests for any world size.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel.topology import Group, Topology


@dataclass(frozen=True)
class DeepSpeedExpertGroups:
    """The rank lists DeepSpeed would pass to `new_group`, in its creation order.

    expert_parallel[i]: ranks exchanging tokens (an all-to-all group; a rank's position in the *sorted* list
    is its expert-parallel rank, which holds global experts [pos * n_local, (pos + 1) * n_local)).
    expert_data_parallel[j]: ranks holding the same expert shard; expert gradients are reduced over it.
    """

    expert_parallel: tuple[Group, ...]
    expert_data_parallel: tuple[Group, ...]


def _divides(what: str, value: int, by_what: str, by: int) -> None:
    # DeepSpeed asserts (_ensure_divisibility); a user-facing ValueError says the same with the numbers.
    if by < 1 or value % by:
        raise ValueError(f"DeepSpeed needs {what}={value} divisible by {by_what}={by}")


def ds_create_expert_and_data_parallel(
    world_size: int,
    ep_size: int,
    *,
    use_data_before_expert_parallelism: bool = False,
    mp_size: int = 1,
    pp_size: int = 1,
    mp_mode: str = "tp",
) -> DeepSpeedExpertGroups:
    """`groups._create_expert_and_data_parallel` (no AutoEP folding spec).

    mp_size <= 1 (the legacy path, which `deepspeed.moe.layer.MoE` takes when there is no mpu or expert
    tensor parallelism is off): per pipeline stage of S = world / pp ranks,
      E+D (default): expert-data-parallel groups are strided, range(i, S, ep); expert-parallel groups are
        consecutive blocks of ep over the whole world;
      D+E (use_data_before_expert_parallelism): expert-data-parallel groups are consecutive blocks of S / ep;
        expert-parallel groups are strided by S / ep.
    mp_size > 1 (the AutoEP engine path): ranks of a stage are reordered TP-strided when mp_mode == "tp"
    (all tp-rank-0 ranks, then tp-rank-1 ...), cut into expert-parallel blocks of ep, and
    expert-data-parallel groups take the same position of each block; D+E raises NotImplementedError there.
    """
    _divides("world_size", world_size, "pipeline_parallel", pp_size)
    stride = world_size // pp_size
    _divides("world_size / pipeline_parallel", stride, "ep_size", ep_size)
    ep_groups, edp_groups = [], []
    if mp_size <= 1:
        ep_stride = stride // ep_size
        for start in range(0, world_size, stride):
            for i in range(ep_size):
                if use_data_before_expert_parallelism:
                    edp_groups.append(tuple(range(start + i * ep_stride, start + (i + 1) * ep_stride)))
                else:
                    edp_groups.append(tuple(range(start + i, start + stride, ep_size)))
        if use_data_before_expert_parallelism:
            for start in range(0, world_size, stride):
                ep_groups += [tuple(range(start + i, start + stride, ep_stride)) for i in range(ep_stride)]
        else:
            ep_groups = [tuple(range(i * ep_size, (i + 1) * ep_size)) for i in range(world_size // ep_size)]
        return DeepSpeedExpertGroups(tuple(ep_groups), tuple(edp_groups))
    if use_data_before_expert_parallelism:
        raise NotImplementedError(
            "DeepSpeed: use_data_before_expert_parallel_ is not supported with mp_size > 1"
        )
    for start in range(0, world_size, stride):
        stage = list(range(start, start + stride))
        if mp_mode == "tp":
            stage = [
                stage[g * mp_size + lane] for lane in range(mp_size) for g in range(len(stage) // mp_size)
            ]
        blocks = [tuple(stage[g * ep_size : (g + 1) * ep_size]) for g in range(len(stage) // ep_size)]
        ep_groups += blocks
        edp_groups += [tuple(b[pos] for b in blocks) for pos in range(ep_size)]
    return DeepSpeedExpertGroups(tuple(ep_groups), tuple(edp_groups))


def ds_get_expert_parallel_ranks(
    world_size: int,
    tensor_parallel: int,
    ep_size: int,
    pipeline_parallel: int = 1,
    use_data_before_expert_parallelism: bool = False,
) -> DeepSpeedExpertGroups:
    """`groups._get_expert_parallel_ranks`, the rank lists of `_create_expert_data_and_model_parallel`
    (the MoE layer's path with an mpu and expert tensor parallelism on).

    Per tp lane i (data-parallel group: ranks i, i + tp, ...; with D+E reordered so that each run of
    dp / ep consecutive data-parallel ranks lands in one position), expert-parallel groups are consecutive
    slices of ep, and expert-data-parallel groups zip those slices (same position in each).
    """
    _divides(
        "world_size", world_size, "tensor_parallel x pipeline_parallel", tensor_parallel * pipeline_parallel
    )
    dp = world_size // (tensor_parallel * pipeline_parallel)
    _divides("data-parallel size", dp, "ep_size", ep_size)
    stride = world_size // pipeline_parallel
    dp_groups: list[list[int]] = []
    for start in range(0, world_size, stride):
        for i in range(tensor_parallel):
            if use_data_before_expert_parallelism:
                dp_stride = dp // ep_size
                step = dp_stride * tensor_parallel
                dp_groups.append(
                    [
                        r
                        for ds in range(dp_stride)
                        for r in range(start + i + ds * tensor_parallel, start + stride, step)
                    ]
                )
            else:
                dp_groups.append(list(range(start + i, start + stride, tensor_parallel)))
    ep_groups, edp_groups = [], []
    for ranks in dp_groups:
        parts = [tuple(ranks[i : i + ep_size]) for i in range(0, dp, ep_size)]
        ep_groups += parts
        edp_groups += [tuple(z) for z in zip(*parts)]
    return DeepSpeedExpertGroups(tuple(ep_groups), tuple(edp_groups))


def deepspeed_moe_groups(
    world_size: int,
    ep_size: int,
    *,
    use_data_before_expert_parallelism: bool = False,
    model_parallel: int = 1,
    expert_tensor_parallelism: bool = True,
) -> DeepSpeedExpertGroups:
    """The groups `deepspeed.moe.layer.MoE._create_process_groups` makes: with an mpu of size > 1 and
    expert tensor parallelism on, `_create_expert_data_and_model_parallel`; else the legacy
    `_create_expert_and_data_parallel(ep_size)` over the whole world (tensor parallelism ignored)."""
    if model_parallel > 1 and expert_tensor_parallelism:
        return ds_get_expert_parallel_ranks(
            world_size, model_parallel, ep_size, 1, use_data_before_expert_parallelism
        )
    return ds_create_expert_and_data_parallel(
        world_size, ep_size, use_data_before_expert_parallelism=use_data_before_expert_parallelism
    )


def deepspeed_equivalent(topo: Topology) -> dict | None:
    """DeepSpeed MoE settings whose groups should reproduce `topo`, or None when none can (uneven allocation:
    register custom groups per domain instead). Check with `deepspeed_mismatches`."""
    if len(set(topo.allocation)) != 1:
        return None
    ep_size = min(topo.dp_size, topo.num_domains)
    return {
        "ep_size": ep_size,
        "num_experts": topo.num_domains,
        "use_data_before_expert_parallelism": True,
        "model_parallel": topo.tensor_parallel,
        "expert_tensor_parallelism": True,
    }


def deepspeed_mismatches(
    topo: Topology,
    ds: DeepSpeedExpertGroups,
    num_experts: int | None = None,
) -> list[str]:
    """Where DeepSpeed's groups `ds` disagree with `topo` (empty = identical): for every rank, the experts it
    holds (its position in its sorted expert-parallel group) must be its domains, and its expert-data-parallel
    group must be its expert group for each of them."""
    num_experts = topo.num_domains if num_experts is None else num_experts
    ep_size = len(ds.expert_parallel[0])
    if num_experts % ep_size:
        return [f"{num_experts} experts cannot be spread over expert-parallel groups of {ep_size}"]
    n_local = num_experts // ep_size
    held: dict[int, tuple[int, ...]] = {}
    for group in ds.expert_parallel:
        for pos, r in enumerate(sorted(group)):
            held[r] = tuple(range(pos * n_local, (pos + 1) * n_local))
    edp_of = {r: tuple(sorted(g)) for g in ds.expert_data_parallel for r in g}
    out = []
    for rank in range(topo.world_size):
        if held.get(rank) != topo.domains_of_rank(rank):
            out.append(
                f"rank {rank}: DeepSpeed gives experts {held.get(rank)}, "
                f"topology domains {topo.domains_of_rank(rank)}"
            )
            continue
        for g, group in topo.expert_groups_of_rank(rank).items():
            if edp_of.get(rank) != group:
                out.append(
                    f"rank {rank}, domain {g}: DeepSpeed reduces over {edp_of.get(rank)}, topology over {group}"
                )
    return out
