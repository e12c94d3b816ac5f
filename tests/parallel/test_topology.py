"""The pure topology: rank lists for 1 to 1024 GPUs, checked without starting a process."""

from __future__ import annotations

import pytest

from parallel.ds_expert_groups import (
    deepspeed_equivalent,
    deepspeed_mismatches,
    deepspeed_moe_groups,
    ds_create_expert_and_data_parallel,
    ds_get_expert_parallel_ranks,
)
from parallel.topology import (
    DOMAINS_PER_RANK,
    RANKS_PER_DOMAIN,
    Topology,
    TopologyError,
    build_topology,
    model_sharding_problems,
)

# (world, tp, domains, allocation)
LAYOUTS = [
    (1, 1, 1, None),
    (1, 1, 8, None),  # one GPU holds every domain
    (4, 1, 8, None),  # 2 domains per rank
    (4, 2, 8, None),
    (4, 4, 1, None),
    (8, 1, 8, None),
    (8, 2, 8, None),  # 4 dp ranks, 2 domains each
    (8, 1, 3, [4, 2, 2]),
    (8, 8, 8, None),  # dp 1: all 8 domains on one tp group
    (6, 2, 8, None),  # dp 3 < 8 domains: 3, 3, 2
    (6, 1, 8, [1, 2, 1, 1, 2, 1]),  # dp 6 < 8 domains, explicit domains per rank
    (128, 1, 8, None),
    (128, 2, 8, None),
    (128, 4, 8, None),
    (128, 8, 8, None),
    (128, 2, 8, [16, 12, 8, 8, 4, 4, 4, 8]),  # uneven, e.g. proportional to data (sums to 64)
    (128, 4, 8, [2, 2, 2, 2, 2, 2, 2, 18]),
    (1024, 1, 8, None),
    (1024, 2, 8, None),
    (1024, 8, 8, None),
    (1024, 8, 16, [8] * 8 + [4] * 4 + [12] * 4),
    (16, 2, 16, None),  # dp 8 < 16 domains, 2 each
    (16, 4, 8, [1, 1, 3, 3]),  # dp 4 < 8: explicit domains per rank
]


def _ids(layout):
    w, tp, g, alloc = layout
    return f"w{w}-tp{tp}-g{g}" + ("-alloc" if alloc else "")


@pytest.fixture(params=LAYOUTS, ids=_ids)
def topo(request) -> Topology:
    return build_topology(*request.param)


def test_every_rank_in_exactly_one_tp_and_one_dp_group(topo):
    w, tp = topo.world_size, topo.tensor_parallel
    for groups, size in ((topo.tp_groups, tp), (topo.dp_groups, w // tp)):
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(w)) and all(len(g) == size for g in groups)
    for r in range(w):
        info = topo.rank_info(r)
        assert r == info.dp_rank * tp + info.tp_rank  # Megatron's default order: tp ranks contiguous
        assert topo.tp_group_of_rank(r) == tuple(range(info.dp_rank * tp, (info.dp_rank + 1) * tp))
        assert topo.dp_group_of_rank(r) == tuple(range(info.tp_rank, w, tp))


def test_domains_partition_dp_ranks_contiguously(topo):
    dp, G = topo.dp_size, topo.num_domains
    assert topo.layout == (RANKS_PER_DOMAIN if dp >= G else DOMAINS_PER_RANK)
    # every domain has >= 1 dp rank, blocks are contiguous, and in domain order
    for g in range(G):
        ranks = topo.domain_dp_ranks[g]
        assert ranks and list(ranks) == list(range(ranks[0], ranks[-1] + 1))
        glob = topo.ranks_of_domain(g)
        assert list(glob) == list(range(glob[0], glob[-1] + 1))  # a domain's global ranks share nodes
    # every dp rank has >= 1 domain, consecutive, in order; the two maps are inverse
    assert [g for doms in topo.dp_domains for g in doms] == list(range(G)) or topo.layout == RANKS_PER_DOMAIN
    for p, doms in enumerate(topo.dp_domains):
        assert doms and list(doms) == list(range(doms[0], doms[-1] + 1))
        assert all(p in topo.domain_dp_ranks[g] for g in doms)
    firsts = [topo.domain_dp_ranks[g][0] for g in range(G)]
    assert firsts == sorted(firsts)
    assert sorted({p for g in range(G) for p in topo.domain_dp_ranks[g]}) == list(range(dp))
    if topo.layout == RANKS_PER_DOMAIN:
        assert all(len(d) == 1 for d in topo.dp_domains)
        assert [len(topo.domain_dp_ranks[g]) for g in range(G)] == list(topo.allocation)
    else:
        assert all(len(r) == 1 for r in topo.domain_dp_ranks)
        assert [len(d) for d in topo.dp_domains] == list(topo.allocation)
        if not topo.explicit_allocation:
            assert max(topo.allocation) - min(topo.allocation) <= 1


def test_expert_groups_are_the_domains_ranks_with_that_tp_rank(topo):
    tp = topo.tensor_parallel
    memberships = {r: 0 for r in range(topo.world_size)}
    for g in range(topo.num_domains):
        for t in range(tp):
            want = tuple(r for r in topo.ranks_of_domain(g) if r % tp == t)
            assert topo.expert_group(g, t) == want == topo.ranks_of_domain(g, tp_rank=t)
            for r in want:
                memberships[r] += 1
    for r, n in memberships.items():
        assert n == len(topo.domains_of_rank(r))  # several domains per rank -> several expert groups
        assert set(topo.expert_groups_of_rank(r)) == set(topo.domains_of_rank(r))


def test_shard_indices_cover_each_domain(topo):
    for g in range(topo.num_domains):
        for t in range(topo.tensor_parallel):
            infos = [topo.rank_info(r) for r in topo.expert_group(g, t)]
            assert [i.shard_index for i in infos] == list(range(len(infos)))
            assert all(i.num_shards == len(infos) and g in i.domains and i.tp_rank == t for i in infos)


def test_describe_is_compact_and_json_ready(topo):
    import json

    d = topo.describe()
    text = json.dumps(d)
    assert len(text) < 2500 + 200 * topo.num_domains  # one line per domain, never per rank
    assert d["data_parallel"] * d["tensor_parallel"] == d["world_size"]
    assert str(topo.world_size) in topo.describe_text()


def test_even_128_gpus_tp2_eight_domains():
    t = build_topology(128, 2, 8, domain_names=[f"d{i}" for i in range(8)])
    assert t.dp_size == 64 and t.allocation == (8,) * 8
    assert t.expert_group(0, 0) == tuple(range(0, 16, 2)) and t.expert_group(7, 1) == tuple(
        range(113, 128, 2)
    )
    assert t.rank_info(127) == t.rank_info(127).__class__(127, 1, 63, (7,), 7, 8)
    assert t.domains_of_rank(0) == (0,) and t.ranks_of_domain(3) == tuple(range(48, 64))
    assert t.describe()["domains"][3]["global_ranks"] == "48-63"


def test_more_domains_than_ranks_splits_domains_contiguously():
    t = build_topology(6, 2, 8)
    assert t.allocation == (3, 3, 2) and t.dp_domains == ((0, 1, 2), (3, 4, 5), (6, 7))
    assert t.expert_groups_of_rank(5) == {6: (5,), 7: (5,)}
    assert t.rank_info(3) == t.rank_info(3).__class__(3, 1, 1, (3, 4, 5), 0, 1)
    assert build_topology(4, 1, 8, allocation=[1, 1, 3, 3]).dp_domains == ((0,), (1,), (2, 3, 4), (5, 6, 7))
    one = build_topology(1, 1, 8)
    assert one.domains_of_rank(0) == tuple(range(8)) and one.rank_info(0).num_shards == 1


@pytest.mark.parametrize(
    "args, needles",
    [
        ((100, 1, 8), ["100 data-parallel ranks", "8 domains", "100 % 8 = 4", "allocation", "96 or 104"]),
        ((128, 3, 8), ["world_size=128", "tensor_parallel=3", "126 or 129"]),
        ((96, 2, 5), ["48 data-parallel ranks", "5 domains", "[10, 10, 10, 9, 9]", "multiple of 5 x 2 = 10"]),
        ((16, 1, 8, [2, 2]), ["has 2 entries but needs 8", "sums to 4 but must sum to 16"]),
        ((16, 2, 8, [1, 1, 1, 1, 1, 1, 1, 0]), ["counts [0] < 1", "sums to 7 but must sum to 8"]),
        ((16, 1, 4, [8, 4, 4, -1]), ["counts [-1] < 1", "sums to 15 but must sum to 16"]),
        (
            (4, 1, 8, [2, 2, 2, 2, 0, 0, 0, 0]),
            ["needs 4 (domains per data-parallel rank)", "fewer data-parallel ranks (4)"],
        ),
        ((8, 0, 8), ["tensor_parallel=0"]),
        ((8, 1, 0), ["num_domains=0"]),
        ((8, 1, 2, None, ["a"]), ["1 domain names"]),
    ],
)
def test_bad_layouts_name_the_numbers(args, needles):
    with pytest.raises(TopologyError) as e:
        build_topology(*args)
    assert isinstance(e.value, ValueError)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_several_problems_are_reported_together():
    with pytest.raises(TopologyError) as e:
        build_topology(16, 1, 3, allocation=[0, 2])
    assert len(e.value.problems) == 3  # length, non-positive, sum


def test_model_sharding_problems():
    assert model_sharding_problems(16, 4096, 2) == []
    heads, width = model_sharding_problems(16, 4096, 3)
    assert "n_heads=16" in heads and "tensor_parallel=3" in heads and "[1, 2, 4, 8, 16]" in heads
    assert "4096" in width


# --- DeepSpeed's expert groups ------------------------------------------------------------------------------


def test_deepspeed_layouts_for_world_8_ep_4():
    """The exact groups deepspeed 0.19.8 makes (read from deepspeed/utils/groups.py)."""
    ed = deepspeed_moe_groups(8, 4)  # E + D (default): strided expert-data-parallel groups
    assert ed.expert_parallel == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert ed.expert_data_parallel == ((0, 4), (1, 5), (2, 6), (3, 7))
    de = deepspeed_moe_groups(8, 4, use_data_before_expert_parallelism=True)  # D + E: contiguous
    assert de.expert_parallel == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert de.expert_data_parallel == ((0, 1), (2, 3), (4, 5), (6, 7))
    for flag in (False, True):  # mpu with tp 2 and expert tensor parallelism: one lane per tp rank
        mp = deepspeed_moe_groups(8, 4, use_data_before_expert_parallelism=flag, model_parallel=2)
        assert mp.expert_parallel == ((0, 2, 4, 6), (1, 3, 5, 7))
        assert mp.expert_data_parallel == ((0,), (2,), (4,), (6,), (1,), (3,), (5,), (7,))
    # without expert tensor parallelism the MoE layer takes the legacy path over the whole world
    assert deepspeed_moe_groups(8, 4, model_parallel=2, expert_tensor_parallelism=False) == ed
    # the engine's AutoEP path with mp_size 2: TP-strided order, and D + E is refused
    auto = ds_create_expert_and_data_parallel(8, 4, mp_size=2)
    assert auto.expert_parallel == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert auto.expert_data_parallel == ((0, 1), (2, 3), (4, 5), (6, 7))
    with pytest.raises(NotImplementedError):
        ds_create_expert_and_data_parallel(8, 4, mp_size=2, use_data_before_expert_parallelism=True)
    # the docstring example of _get_expert_parallel_ranks (world 16, tp 2, ep 4)
    doc = ds_get_expert_parallel_ranks(16, 2, 4)
    assert doc.expert_parallel == ((0, 2, 4, 6), (8, 10, 12, 14), (1, 3, 5, 7), (9, 11, 13, 15))
    assert doc.expert_data_parallel[:4] == ((0, 8), (2, 10), (4, 12), (6, 14))


EVEN = [
    (w, tp, g)
    for w in (1, 4, 8, 128, 1024)
    for tp in (1, 2, 4, 8)
    for g in (1, 2, 4, 8)
    if w % tp == 0 and (w // tp < g and g % (w // tp) == 0 or w // tp >= g and (w // tp) % g == 0)
]


@pytest.mark.parametrize("world, tp, domains", EVEN)
def test_even_topology_equals_deepspeed_data_before_expert(world, tp, domains):
    topo = build_topology(world, tp, domains)
    eq = deepspeed_equivalent(topo)
    assert eq is not None and eq["use_data_before_expert_parallelism"]
    ds = deepspeed_moe_groups(
        world, eq["ep_size"], use_data_before_expert_parallelism=True, model_parallel=tp
    )
    assert deepspeed_mismatches(topo, ds, eq["num_experts"]) == []
    # every DeepSpeed expert-data-parallel group is exactly one of ours
    ours = {topo.expert_group(g, t) for g in range(domains) for t in range(tp)}
    assert {tuple(sorted(g)) for g in ds.expert_data_parallel} == ours


def test_deepspeed_default_order_does_not_match():
    topo = build_topology(128, 2, 8)
    ds = deepspeed_moe_groups(128, 8, model_parallel=2)  # E + D: strided expert-data-parallel groups
    assert deepspeed_mismatches(topo, ds)
    # ignores tp: groups mix tp ranks
    legacy = deepspeed_moe_groups(
        128, 8, use_data_before_expert_parallelism=True, model_parallel=2, expert_tensor_parallelism=False
    )
    assert deepspeed_mismatches(topo, legacy)
    no_tp = deepspeed_moe_groups(16, 8, use_data_before_expert_parallelism=True)
    assert deepspeed_mismatches(build_topology(16, 1, 8), no_tp) == []


def test_uneven_allocation_has_no_deepspeed_equivalent():
    assert deepspeed_equivalent(build_topology(128, 2, 8, [16, 12, 8, 8, 4, 4, 4, 8])) is None
    assert deepspeed_equivalent(build_topology(6, 2, 8)) is None


@pytest.mark.parametrize("world, ep, pp", [(8, 4, 1), (16, 4, 1), (16, 2, 2), (32, 8, 2)])
@pytest.mark.parametrize("data_first", [False, True])
def test_reproduction_matches_deepspeed_source(monkeypatch, world, ep, pp, data_first):
    """Run DeepSpeed's own group builders with a recording stand-in for torch.distributed (no process)."""
    groups = pytest.importorskip("deepspeed.utils.groups")

    class FakeDist:
        def __init__(self) -> None:
            self.made: list[tuple[int, ...]] = []

        def is_initialized(self) -> bool:
            return True

        def get_world_size(self) -> int:
            return world

        def get_rank(self) -> int:
            return 0

        def new_group(self, ranks):
            self.made.append(tuple(ranks))
            return object()

    for mp in (1, 2):
        if mp > 1 and data_first:
            continue  # DeepSpeed raises NotImplementedError there (checked above)
        fake = FakeDist()
        monkeypatch.setattr(groups, "dist", fake)
        monkeypatch.setattr(groups, "log_dist", lambda *a, **k: None)
        for name in (
            "_EXPERT_PARALLEL_GROUP",
            "_EXPERT_DATA_PARALLEL_GROUP",
            "_EXPERT_PARALLEL_GROUP_RANKS",
            "_EXPERT_DATA_PARALLEL_GROUP_RANKS",
        ):
            monkeypatch.setattr(groups, name, {})
        groups._create_expert_and_data_parallel(
            ep, mp_size=mp, pp_size=pp, use_data_before_expert_parallel_=data_first
        )
        ours = ds_create_expert_and_data_parallel(
            world, ep, use_data_before_expert_parallelism=data_first, mp_size=mp, pp_size=pp
        )
        if mp == 1:  # exact creation order: legacy path makes data groups first
            assert fake.made == list(ours.expert_data_parallel + ours.expert_parallel)
        elif pp == 1:  # mp > 1: per stage, expert-parallel groups first
            assert fake.made == list(ours.expert_parallel + ours.expert_data_parallel)
        assert sorted(fake.made) == sorted(ours.expert_parallel + ours.expert_data_parallel)
        name = f"ep_size_{ep}"  # what rank 0 keeps
        assert tuple(groups._EXPERT_PARALLEL_GROUP_RANKS[name]) == next(
            g for g in ours.expert_parallel if 0 in g
        )
        rank0_edp = next(g for g in ours.expert_data_parallel if 0 in g)
        assert tuple(groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name]) == rank0_edp
    for tp in (1, 2, 4):
        if world % (tp * pp) or (world // (tp * pp)) % ep:
            continue
        ep_ranks, edp_ranks = groups._get_expert_parallel_ranks(world, tp, ep, pp, data_first)
        mine = ds_get_expert_parallel_ranks(world, tp, ep, pp, data_first)
        assert [tuple(g) for g in ep_ranks] == list(mine.expert_parallel)
        assert [tuple(g) for g in edp_ranks] == list(mine.expert_data_parallel)
