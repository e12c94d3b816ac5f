"""Topology is data: a pure map from (world size, tensor parallel, domains, allocation) to rank lists.

Nothing here starts a process or touches `torch.distributed`; `parallel/` later makes process groups from
these lists, and tests check them for 1 to 1024 GPUs without a process.

Rank layout (Megatron's default): tensor-parallel ranks are contiguous,

    rank = dp_rank * tp + tp_rank,        dp_size = world_size / tp.

Domains are laid over the data-parallel ranks, in domain order, as contiguous blocks, so that a domain's
ranks share nodes. Two regimes, chosen by comparing dp_size with the number of domains G:

* ranks-per-domain (dp_size >= G, DEMix's "n/8 GPUs per domain"): each domain owns `allocation[g]`
  consecutive data-parallel ranks; default even, dp_size / G each (an error if it does not divide). An
  explicit `allocation` has G entries, each >= 1, summing to dp_size (e.g. proportional to data).
* domains-per-rank (dp_size < G): each data-parallel rank owns `allocation[p]` consecutive domains; default
  as even as possible (the first G mod dp_size ranks take one more). An explicit `allocation` then has
  dp_size entries, each >= 1, summing to G. Each domain has exactly one data-parallel rank.
  (With dp_size == G the two readings coincide: one domain per rank.)

Expert groups: the expert of domain g on tensor-parallel rank t is held by the ranks of g with tp rank t;
its gradients are reduced over exactly that group. A rank holding several domains is in several groups.
The data sampler uses `RankInfo.shard_index / num_shards`: the ranks of one domain read disjoint shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

RANKS_PER_DOMAIN = "ranks-per-domain"
DOMAINS_PER_RANK = "domains-per-rank"

Group = tuple[int, ...]


class TopologyError(ValueError):
    """An impossible layout; `problems` lists every reason (each names the numbers and a fix)."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in the parallel layout:\n{lines}")


@dataclass(frozen=True)
class RankInfo:
    """One rank's view. shard_index / num_shards locate its data-parallel rank inside its domain group."""

    rank: int
    tp_rank: int
    dp_rank: int
    domains: tuple[int, ...]
    shard_index: int
    num_shards: int


@dataclass(frozen=True)
class Topology:
    """Rank lists for every group. Build with `build_topology`; every field is derived there.

    tp_groups[i]: the i-th tensor-parallel group (contiguous ranks); dp_groups[t]: all ranks with tp rank t;
    domain_dp_ranks[g]: the data-parallel ranks of domain g; dp_domains[p]: the domains of data-parallel
    rank p; expert_groups[g][t]: the global ranks holding domain g's expert shard for tp rank t.
    """

    world_size: int
    tensor_parallel: int
    dp_size: int
    num_domains: int
    domain_names: tuple[str, ...]
    layout: str  # RANKS_PER_DOMAIN or DOMAINS_PER_RANK
    allocation: tuple[int, ...]  # resolved: ranks per domain, or domains per rank (see `layout`)
    explicit_allocation: bool
    tp_groups: tuple[Group, ...]
    dp_groups: tuple[Group, ...]
    domain_dp_ranks: tuple[Group, ...]
    dp_domains: tuple[tuple[int, ...], ...]
    expert_groups: tuple[tuple[Group, ...], ...]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")

    def _check_domain(self, domain: int) -> None:
        if not 0 <= domain < self.num_domains:
            raise ValueError(f"domain {domain} is outside 0..{self.num_domains - 1}")

    def rank_info(self, rank: int) -> RankInfo:
        self._check_rank(rank)
        dp_rank, tp_rank = divmod(rank, self.tensor_parallel)
        domains = self.dp_domains[dp_rank]
        group = self.domain_dp_ranks[domains[0]]
        return RankInfo(rank, tp_rank, dp_rank, domains, dp_rank - group[0], len(group))

    def domains_of_rank(self, rank: int) -> tuple[int, ...]:
        self._check_rank(rank)
        return self.dp_domains[rank // self.tensor_parallel]

    def ranks_of_domain(self, domain: int, tp_rank: Optional[int] = None) -> Group:
        """Global ranks of a domain (all tp ranks, or only those with `tp_rank`)."""
        self._check_domain(domain)
        if tp_rank is not None:
            return self.expert_groups[domain][tp_rank]
        tp = self.tensor_parallel
        return tuple(p * tp + t for p in self.domain_dp_ranks[domain] for t in range(tp))

    def expert_group(self, domain: int, tp_rank: int) -> Group:
        self._check_domain(domain)
        return self.expert_groups[domain][tp_rank]

    def expert_groups_of_rank(self, rank: int) -> dict[int, Group]:
        """domain -> the expert group this rank reduces that domain's expert gradients over."""
        tp_rank = rank % self.tensor_parallel
        return {g: self.expert_groups[g][tp_rank] for g in self.domains_of_rank(rank)}

    def tp_group_of_rank(self, rank: int) -> Group:
        self._check_rank(rank)
        return self.tp_groups[rank // self.tensor_parallel]

    def dp_group_of_rank(self, rank: int) -> Group:
        self._check_rank(rank)
        return self.dp_groups[rank % self.tensor_parallel]

    def describe(self) -> dict:
        """A compact, JSON-ready summary for logs (group sizes, domain blocks, rank 0's expert groups)."""
        tp = self.tensor_parallel
        domains = []
        for g, name in enumerate(self.domain_names):
            dp = self.domain_dp_ranks[g]
            domains.append(
                {
                    "domain": g,
                    "name": name,
                    "dp_ranks": _span(dp),
                    "num_dp_ranks": len(dp),
                    "global_ranks": _span(range(dp[0] * tp, (dp[-1] + 1) * tp)),
                    "shares_rank_with": [h for h in self.dp_domains[dp[0]] if h != g],
                }
            )
        return {
            "world_size": self.world_size,
            "tensor_parallel": tp,
            "data_parallel": self.dp_size,
            "num_domains": self.num_domains,
            "layout": self.layout,
            "allocation": list(self.allocation),
            "explicit_allocation": self.explicit_allocation,
            "tp_groups": {"count": len(self.tp_groups), "size": tp, "first": list(self.tp_groups[0])},
            "dp_groups": {
                "count": len(self.dp_groups),
                "size": self.dp_size,
                "first": _span(self.dp_groups[0]),
            },
            "domains": domains,
            "rank0_expert_groups": {str(g): _span(r) for g, r in self.expert_groups_of_rank(0).items()},
        }

    def describe_text(self) -> str:
        """`describe()` as a few human-readable lines."""
        d = self.describe()
        lines = [
            f"world {d['world_size']} = tp {d['tensor_parallel']} x dp {d['data_parallel']}; "
            f"{d['num_domains']} domain(s), {d['layout']} {d['allocation']}"
            f"{' (explicit)' if d['explicit_allocation'] else ''}",
            f"tp groups: {d['tp_groups']['count']} of {d['tp_groups']['size']} (first {d['tp_groups']['first']}); "
            f"dp groups: {d['dp_groups']['count']} of {d['dp_groups']['size']} (first {d['dp_groups']['first']})",
        ]
        for dom in d["domains"]:
            lines.append(
                f"  domain {dom['domain']} {dom['name']}: dp ranks {dom['dp_ranks']} ({dom['num_dp_ranks']}), "
                f"global ranks {dom['global_ranks']}"
            )
        lines.append(f"rank 0 expert groups: {d['rank0_expert_groups']}")
        return "\n".join(lines)


def domain_data_shares(topo: Topology) -> list[float]:
    """The fraction of every step's training sequences that comes from each domain (DEMix's by_domain sampler,
    equal micro-batches on every data-parallel rank).

    Ranks per domain: domain g reads on allocation[g] of the dp ranks, share = allocation[g] / dp.
    Domains per rank: a rank's k domains split its batch equally, share = 1 / (dp * k). The paper's layout
    (dp a multiple of the domain count, even allocation) gives every domain 1/G.
    """
    if topo.layout == RANKS_PER_DOMAIN:
        return [len(topo.domain_dp_ranks[g]) / topo.dp_size for g in range(topo.num_domains)]
    return [
        1.0 / (topo.dp_size * len(topo.dp_domains[topo.domain_dp_ranks[g][0]]))
        for g in range(topo.num_domains)
    ]


def unequal_data_note(topo: Topology) -> Optional[str]:
    """A line announcing unequal data per domain (allowed, but the paper gives every domain the same), or None."""
    shares = domain_data_shares(topo)
    if topo.num_domains < 2 or max(shares) - min(shares) < 1e-9:
        return None
    listed = ", ".join(f"{name} {100 * s:.1f}%" for name, s in zip(topo.domain_names, shares))
    return (
        f"domains get unequal data in this layout ({topo.layout} {list(topo.allocation)}): share of every "
        f"step's sequences: {listed}. Equal shares need a data-parallel size that is a multiple of the "
        f"{topo.num_domains} domains with an even allocation, or an equal number of domains on every rank."
    )


def _span(ranks: Sequence[int]) -> str:
    """'a-b' for a contiguous run, else the list (ranks are short to print either way)."""
    ranks = list(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    if len(ranks) > 8:
        step = ranks[1] - ranks[0]
        if ranks == list(range(ranks[0], ranks[-1] + 1, step)):
            return f"{ranks[0]}-{ranks[-1]} step {step}"
    return ",".join(map(str, ranks))


def even_split(total: int, parts: int) -> list[int]:
    """`total` split into `parts` contiguous counts differing by at most one, larger ones first."""
    base, extra = divmod(total, parts)
    return [base + 1] * extra + [base] * (parts - extra)


def _nearby_multiples(value: int, step: int) -> str:
    below, above = (value // step) * step, (value // step + 1) * step
    return " or ".join(str(v) for v in (below, above) if v > 0)


def _allocation_problems(dp: int, num_domains: int, allocation: Sequence[int]) -> list[str]:
    if dp >= num_domains:
        what, want_len, want_sum = "data-parallel ranks per domain", num_domains, dp
        why = f"one count per domain, summing to the {dp} data-parallel ranks (world / tp)"
    else:
        what, want_len, want_sum = "domains per data-parallel rank", dp, num_domains
        why = (
            f"with fewer data-parallel ranks ({dp}) than domains ({num_domains}) the allocation lists the "
            f"number of consecutive domains on each of the {dp} ranks, summing to {num_domains}"
        )
    out = []
    if len(allocation) != want_len:
        out.append(
            f"allocation={list(allocation)} has {len(allocation)} entries but needs {want_len} ({what}): {why}"
        )
    bad = [n for n in allocation if n < 1]
    if bad:
        out.append(f"allocation={list(allocation)} has counts {bad} < 1: every entry must be >= 1 ({what})")
    if sum(allocation) != want_sum:
        out.append(
            f"allocation={list(allocation)} sums to {sum(allocation)} but must sum to {want_sum}: {why}"
        )
    return out


def topology_problems(
    world_size: int,
    tensor_parallel: int,
    num_domains: int,
    allocation: Optional[Sequence[int]] = None,
    domain_names: Optional[Sequence[str]] = None,
) -> list[str]:
    """Every reason the layout is impossible (empty = fine); each names the numbers and a fix."""
    out = []
    if world_size < 1:
        out.append(f"world_size={world_size}: need at least one rank")
    if tensor_parallel < 1:
        out.append(f"tensor_parallel={tensor_parallel}: must be >= 1")
    if num_domains < 1:
        out.append(f"num_domains={num_domains}: need at least one domain")
    if domain_names is not None and len(domain_names) != num_domains:
        out.append(
            f"{len(domain_names)} domain names {list(domain_names)} for num_domains={num_domains}: "
            "give one name per domain"
        )
    if domain_names is not None and len(set(domain_names)) != len(domain_names):
        out.append(f"domain names {list(domain_names)} repeat a name: names must be unique")
    if out:
        return out
    if world_size % tensor_parallel:
        return [
            f"world_size={world_size} is not divisible by tensor_parallel={tensor_parallel}: use a world size that is "
            f"a multiple of {tensor_parallel} (e.g. {_nearby_multiples(world_size, tensor_parallel)}) "
            f"or a tensor-parallel size that divides {world_size}"
        ]
    dp = world_size // tensor_parallel
    if allocation is not None:
        return _allocation_problems(dp, num_domains, allocation)
    if dp >= num_domains and dp % num_domains:
        return [
            f"{dp} data-parallel ranks (world_size={world_size} / tensor_parallel={tensor_parallel}) cannot be split "
            f"evenly among {num_domains} domains ({dp} % {num_domains} = {dp % num_domains}): give an explicit "
            f"parallel.allocation of {num_domains} counts summing to {dp} (e.g. {even_split(dp, num_domains)}, or "
            f"proportional to each domain's data), or use a world size that is a multiple of "
            f"{num_domains} x {tensor_parallel} = {num_domains * tensor_parallel} "
            f"(e.g. {_nearby_multiples(world_size, num_domains * tensor_parallel)})"
        ]
    return []


def _blocks(counts: Sequence[int]) -> list[tuple[int, ...]]:
    """Consecutive index blocks of the given sizes: [2, 1] -> [(0, 1), (2,)]."""
    out, start = [], 0
    for n in counts:
        out.append(tuple(range(start, start + n)))
        start += n
    return out


def build_topology(
    world_size: int,
    tensor_parallel: int,
    num_domains: int,
    allocation: Optional[list[int]] = None,
    domain_names: Optional[list[str]] = None,
) -> Topology:
    """The full layout; raises TopologyError (a ValueError) listing every problem before any group exists."""
    problems = topology_problems(world_size, tensor_parallel, num_domains, allocation, domain_names)
    if problems:
        raise TopologyError(problems)
    tp, dp = tensor_parallel, world_size // tensor_parallel
    layout = RANKS_PER_DOMAIN if dp >= num_domains else DOMAINS_PER_RANK
    if layout == RANKS_PER_DOMAIN:
        counts = list(allocation) if allocation is not None else [dp // num_domains] * num_domains
        domain_dp_ranks = _blocks(counts)
        dp_domains = [(g,) for g, ranks in enumerate(domain_dp_ranks) for _ in ranks]
    else:
        counts = list(allocation) if allocation is not None else even_split(num_domains, dp)
        dp_domains = _blocks(counts)
        domain_dp_ranks = [(p,) for p, doms in enumerate(dp_domains) for _ in doms]
    names = (
        tuple(domain_names) if domain_names is not None else tuple(f"domain{g}" for g in range(num_domains))
    )
    return Topology(
        world_size=world_size,
        tensor_parallel=tp,
        dp_size=dp,
        num_domains=num_domains,
        domain_names=names,
        layout=layout,
        allocation=tuple(counts),
        explicit_allocation=allocation is not None,
        tp_groups=tuple(tuple(range(p * tp, (p + 1) * tp)) for p in range(dp)),
        dp_groups=tuple(tuple(range(t, world_size, tp)) for t in range(tp)),
        domain_dp_ranks=tuple(domain_dp_ranks),
        dp_domains=tuple(dp_domains),
        expert_groups=tuple(
            tuple(tuple(p * tp + t for p in ranks) for t in range(tp)) for ranks in domain_dp_ranks
        ),
    )


def model_sharding_problems(
    n_heads: int, d_ffn: int, tensor_parallel: int, prefix: str = "model"
) -> list[str]:
    """Tensor parallelism splits whole attention heads and the FFN width: both must divide by tp."""
    out = []
    if tensor_parallel < 1:
        return out
    if n_heads % tensor_parallel:
        divisors = [t for t in range(1, n_heads + 1) if n_heads % t == 0]
        out.append(
            f"{prefix}.n_heads={n_heads} is not divisible by tensor_parallel={tensor_parallel}: each tensor-parallel "
            f"rank holds whole heads; use tensor_parallel in {divisors}"
        )
    if d_ffn % tensor_parallel:
        out.append(
            f"ffn width {d_ffn} is not divisible by tensor_parallel={tensor_parallel}: "
            "the FFN is split by columns"
        )
    return out


# ---------------------------------------------------------------------------------------------------------
# DeepSpeed's own expert groups (deepspeed 0.19.8, deepspeed/utils/groups.py), reproduced as pure functions.
# ---------------------------------------------------------------------------------------------------------


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


def deepspeed_equivalent(topo: Topology) -> Optional[dict]:
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
    num_experts: Optional[int] = None,
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
