"""launcher/ffn_kinds.py: the strategy registry (every model kind resolvable, an unknown one a clear error, a new
one added by `register_kind`) and each strategy's answers on real configs, topologies and models: expert counts,
layout problems, which experts and data a rank gets, how many ranks hold its experts, the export's parts and the
training state's writers."""

from __future__ import annotations

import pytest
import torch

from launcher import ffn_kinds
from launcher.config import RunConfig, load_run_config
from launcher.ffn_kinds import CSE, KINDS, Demix, Dense, FFNKind, GShard, ffn_kind, register_kind
from model.config import FFN_KINDS
from model.gpt import GPT, expert_of_key
from parallel.topology import build_topology

DOMAINS = ["cooking", "sailing", "finance"]


def _cfg(kind: str, *sets: str, mixture: str | None = None) -> RunConfig:
    mixture = mixture or ("by_domain" if kind == "demix" else "natural")
    return load_run_config(
        None,
        [
            "model.preset=tiny",
            "model.n_layers=2",
            "model.d_model=32",
            "model.n_heads=2",
            "model.seq_len=16",
            "model.vocab_size=256",
            f"model.ffn.kind={kind}",
            f"data.mixture={mixture}",
            *sets,
        ],
        check=False,
    )


def test_every_model_kind_has_its_strategy_by_name_and_by_config():
    assert sorted(KINDS) == sorted(FFN_KINDS)
    for name, cls in (("dense", Dense), ("demix", Demix), ("gshard", GShard), ("cse", CSE)):
        assert type(ffn_kind(name)) is cls and ffn_kind(name).name == name
        assert ffn_kind(_cfg(name)) is ffn_kind(name) is KINDS[name]


def test_an_unknown_kind_is_a_clear_error():
    with pytest.raises(ValueError) as e:
        ffn_kind("moe")
    assert str(e.value) == (
        "feed-forward kind 'moe' has no strategy registered; known: ['cse', 'demix', 'dense', 'gshard']"
    )


def test_a_registered_kind_is_found(monkeypatch):
    monkeypatch.setattr(ffn_kinds, "KINDS", dict(KINDS))  # the registry as it was, after the test

    class Upcycled(FFNKind):
        name = "upcycled"
        has_experts = sharded_experts = True

    kind = register_kind(Upcycled())
    assert ffn_kinds.ffn_kind("upcycled") is kind and sorted(ffn_kinds.KINDS)[-1] == "upcycled"
    assert "upcycled" not in KINDS


@pytest.mark.parametrize(
    "name,has_experts,domain_experts,sharded_experts",
    [
        ("dense", False, False, False),
        ("demix", True, True, True),  # one expert per domain, each in a shard of its own
        ("gshard", True, False, True),  # routed experts, one per GPU, sharded in checkpoints
        ("cse", True, False, False),  # cluster experts live in model.pt
    ],
)
def test_each_strategys_properties(name, has_experts, domain_experts, sharded_experts):
    kind = ffn_kind(name)
    assert (kind.has_experts, kind.domain_experts, kind.sharded_experts) == (
        has_experts,
        domain_experts,
        sharded_experts,
    )


def test_expert_counts_are_resolved_per_kind():
    assert ffn_kind("dense").resolve_num_experts(_cfg("dense"), DOMAINS, 8) == 0
    assert ffn_kind("demix").resolve_num_experts(_cfg("demix"), DOMAINS, 8) == 3  # one per domain
    assert ffn_kind("gshard").resolve_num_experts(_cfg("gshard"), DOMAINS, 8) == 8  # one per GPU
    per_rank = _cfg("gshard", "model.ffn.gshard.experts_per_rank=2")
    assert ffn_kind("gshard").resolve_num_experts(per_rank, DOMAINS, 8) == 16
    assert ffn_kind("gshard").resolve_num_experts(_cfg("gshard", "model.ffn.num_experts=4"), DOMAINS, 8) == 4
    assert ffn_kind("cse").resolve_num_experts(_cfg("cse"), DOMAINS, 8) == 16  # max_clusters slots
    assert ffn_kind("cse").resolve_num_experts(_cfg("cse", "model.ffn.num_experts=5"), DOMAINS, 8) == 5
    cfg = _cfg("demix")
    resolved = ffn_kind(cfg).resolve(cfg, DOMAINS, 3)
    assert resolved.model.ffn.num_experts == 3 and cfg.model.ffn.num_experts == 0
    assert resolved.model.d_model == cfg.model.d_model and resolved.data == cfg.data
    assert ffn_kind(resolved).resolve(resolved, DOMAINS, 3) is resolved  # nothing to resolve: the same config


def test_layout_problems_name_what_each_kind_forbids():
    assert ffn_kind("dense").layout_problems(_cfg("dense"), DOMAINS, 2) == []
    assert ffn_kind("demix").layout_problems(_cfg("demix"), DOMAINS, 3) == []
    dense = _cfg("dense", "parallel.allocation=[1, 1, 1]", "train.trainable=experts", mixture="by_domain")
    assert ffn_kind("dense").layout_problems(dense, DOMAINS, 3) == [
        "data.mixture=by_domain gives each rank one domain; for kind='dense' use natural, balanced or "
        "domain_token",
        "parallel.allocation=[1, 1, 1] is only used with model.ffn.kind=demix (ranks per domain), not 'dense'",
        "train.trainable=experts needs an expert model, not 'dense'",
    ]
    assert ffn_kind("dense").layout_problems(dense, DOMAINS[:1], 3)[0].startswith("parallel.allocation")
    demix = _cfg("demix", "model.ffn.num_experts=2", mixture="natural")
    problems = ffn_kind("demix").layout_problems(demix, DOMAINS, 3)
    assert len(problems) == 2
    assert "set data.mixture=by_domain (not 'natural')" in problems[0]
    assert "num_experts=2 but there are 3 domains (cooking, sailing, finance)" in problems[1]
    gshard = _cfg("gshard", "model.ffn.num_experts=3")
    (problem,) = ffn_kind("gshard").layout_problems(gshard, DOMAINS, 4)
    assert "3 expert-parallel ranks, which does not divide the 4 ranks" in problem
    assert ffn_kind("cse").layout_problems(_cfg("cse", "train.trainable=experts"), DOMAINS, 2) == []


def test_what_the_topology_lays_out_and_the_data_note():
    assert ffn_kind("dense").topology_domains(DOMAINS) == ["all"]
    assert ffn_kind("gshard").topology_domains(DOMAINS) == ["all"]
    assert ffn_kind("demix").topology_domains(DOMAINS) == DOMAINS
    even = build_topology(3, 1, 3, None, DOMAINS)
    uneven = build_topology(2, 1, 3, None, DOMAINS)  # rank 0 reads two domains, rank 1 one
    assert ffn_kind("demix").data_note(even) is None
    note = ffn_kind("demix").data_note(uneven)
    assert "cooking 25.0%, sailing 25.0%, finance 50.0%" in note
    assert ffn_kind("dense").data_note(uneven) is None


def test_demix_ranks_get_their_domains_experts_and_data():
    topo = build_topology(4, 1, 2, None, ["a", "b"])  # ranks 0-1: domain a, 2-3: domain b
    kind, cfg = ffn_kind("demix"), _cfg("demix", "model.ffn.num_experts=2")
    assert [kind.rank_experts(cfg, topo, r, [0, 1]) for r in range(4)] == [[0], [0], [1], [1]]
    assert [kind.rank_experts(cfg, topo, r, [1, 0]) for r in range(4)] == [[1], [1], [0], [0]]
    assert [kind.rank_data(topo, r, 2) for r in range(4)] == [
        ([0], 0, 2),
        ([0], 1, 2),
        ([1], 0, 2),
        ([1], 1, 2),
    ]
    assert [kind.expert_replicas(cfg, topo, r) for r in range(4)] == [2, 2, 2, 2]
    assert kind.rank_expert_groups(cfg, topo, 3) == {"1": [2, 3]}
    shared = build_topology(2, 1, 3, None, DOMAINS)  # more domains than ranks
    assert kind.rank_experts(cfg, shared, 0, [0, 1, 2]) == [0, 1] and kind.rank_data(shared, 0, 3) == (
        [0, 1],
        0,
        1,
    )
    assert kind.expert_replicas(cfg, shared, 0) == 1


def test_dense_and_gshard_ranks_read_every_domain():
    topo = build_topology(4, 1, 1, None, ["all"])
    dense, gshard = ffn_kind("dense"), ffn_kind("gshard")
    assert [dense.rank_data(topo, r, 3) for r in range(4)] == [([0, 1, 2], r, 4) for r in range(4)]
    assert dense.rank_experts(_cfg("dense"), topo, 1, [0]) is None
    assert (
        dense.expert_replicas(_cfg("dense"), topo, 1) == 4
        and dense.rank_expert_groups(_cfg("dense"), topo, 1) == {}
    )
    cfg = _cfg("gshard", "model.ffn.num_experts=2")  # 2 expert-parallel ranks, each expert on 2 ranks
    assert [gshard.rank_experts(cfg, topo, r, [0]) for r in range(4)] == [[0], [1], [0], [1]]
    assert [gshard.expert_replicas(cfg, topo, r) for r in range(4)] == [2, 2, 2, 2]
    assert gshard.rank_expert_groups(cfg, topo, 3) == {
        "expert_parallel": [2, 3],
        "expert_data_parallel": [1, 3],
    }
    assert gshard.rank_data(topo, 2, 3) == ([0, 1, 2], 2, 4)


def test_state_names_say_which_ranks_may_write_each_parameter():
    topo = build_topology(4, 1, 2, None, ["a", "b"])
    dense_cfg = _cfg("dense")
    dense = GPT(dense_cfg.model, init_seed=0)
    names = ffn_kind("dense").state_names(dense, topo, 0)
    assert names == {n: (n, (0, 1, 2, 3)) for n, _ in dense.named_parameters()}
    demix_cfg = _cfg("demix", "model.ffn.num_experts=2")
    model = GPT(demix_cfg.model, expert_ids=[1], init_seed=0)  # rank 2 holds domain b's expert
    names = ffn_kind("demix").state_names(model, topo, 2)
    assert set(names) == {n for n, _ in model.named_parameters()}
    experts = {n for n in names if expert_of_key(n) is not None}
    assert experts and all(expert_of_key(n) == 1 for n in experts)
    for n, (plain, holders) in names.items():
        assert plain == n and holders == ((2, 3) if n in experts else (0, 1, 2, 3))


def test_export_parts_split_shared_tensors_and_experts_and_name_the_writer():
    topo = build_topology(4, 1, 2, None, ["a", "b"])
    cfg = _cfg("demix", "model.ffn.num_experts=2")
    model = GPT(cfg.model, expert_ids=[1], init_seed=0)
    state = model.state_dict()
    for rank, writes in ((2, True), (3, False)):  # the first rank of domain b's group writes its shard
        shared, experts, writer = ffn_kind("demix").export_parts(model, topo, None, rank)
        assert writer is writes and list(experts) == [1]
        assert shared.keys() == {k for k in state if expert_of_key(k) is None}
        assert experts[1].keys() == {k for k in state if expert_of_key(k) == 1}
        assert all(torch.equal(v, state[k]) for k, v in {**shared, **experts[1]}.items())
    dense = GPT(_cfg("dense").model, init_seed=0)
    full, experts, writer = ffn_kind("dense").export_parts(dense, build_topology(2, 1, 1), None, 0)
    assert experts == {} and writer is False
    assert full.keys() == dense.state_dict().keys()
    assert all(torch.equal(v, dense.state_dict()[k]) for k, v in full.items())


def test_checkpoint_domains_and_step_hooks():
    meta = {"domains": ["b", "a"]}
    assert ffn_kind("demix").checkpoint_domains(meta) == ("b", "a")
    assert (
        ffn_kind("dense").checkpoint_domains(meta) == () and ffn_kind("gshard").checkpoint_domains(meta) == ()
    )
    for name in ("dense", "demix", "gshard"):  # only CSE acts after a step (it clusters)
        assert ffn_kind(name).step_hook(None, _cfg(name), None, None, DOMAINS) is None


def test_the_models_traits_agree_with_the_strategies() -> None:
    """model/ffn.py's FFN_TRAITS (what parallel/ may ask) covers exactly the kinds of the config and of the strategy
    registry, and says the same as the strategies where both speak."""
    from model.config import FFN_KINDS as FFN_TRAITS
    from model.ffn import ffn_traits

    assert set(FFN_TRAITS) == set(FFN_KINDS) == set(KINDS)
    for name, strategy in KINDS.items():
        traits = ffn_traits(name)
        assert traits.domain_routed == strategy.domain_experts, name  # derived: the strategy reads the trait
        assert traits.deepspeed_moe == (name == "gshard"), name
    with pytest.raises(KeyError, match="no traits; known"):
        ffn_traits("mixtral")
