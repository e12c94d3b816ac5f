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

from collections.abc import Sequence
from dataclasses import dataclass

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

    def ranks_of_domain(self, domain: int, tp_rank: int | None = None) -> Group:
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


def unequal_data_note(topo: Topology) -> str | None:
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
    allocation: Sequence[int] | None = None,
    domain_names: Sequence[str] | None = None,
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
    allocation: list[int] | None = None,
    domain_names: list[str] | None = None,
) -> Topology:
    """The full layout; raises TopologyError (a ValueError) listing every problem before any group exists."""
    problems = topology_problems(world_size, tensor_parallel, num_domains, allocation, domain_names)
    if problems:
        raise TopologyError(problems)
    tp, dp = tensor_parallel, world_size // tensor_parallel
    layout = RANKS_PER_DOMAIN if dp >= num_domains else DOMAINS_PER_RANK
    domain_dp_ranks: list[Group]
    dp_domains: list[Group]
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
    out: list[str] = []
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
