"""Blocks and the domain-aware sampler: windows, disjoint shards, determinism, resume, mixtures, 4 real ranks."""

from collections import Counter

import numpy as np
import pytest
import torch.distributed as dist

from data.blocks import BlockDataset, InMemoryDocuments
from data.config import DataConfig
from data.sampler import build_sampler
from tests.harness.multirank import run_ranks

T = 8


def _domain(d: int, n_docs: int = 12, seed: int = 0) -> BlockDataset:
    """Documents of varied length whose tokens are unique across domains: [bos=1] + d*100000 + counter."""
    rng = np.random.default_rng([seed, d])
    docs, counter = [], d * 100_000 + 10
    for _ in range(n_docs):
        n = int(rng.integers(1, 25))
        docs.append([1] + list(range(counter, counter + n)))
        counter += n
    return BlockDataset(InMemoryDocuments(docs), seq_len=T, name=f"dom{d}")


def _cfg(mixture: str = "by_domain", seed: int = 7) -> DataConfig:
    return DataConfig(mixture=mixture, seed=seed)


def test_blocks_are_windows_over_the_concatenated_stream():
    docs = [[1, 5, 6], [1, 7], [1, 8, 9, 10, 11, 12], [1, 13, 14, 15]]
    ds = BlockDataset(InMemoryDocuments(docs), seq_len=4)
    stream = np.concatenate(docs)
    assert len(ds) == (len(stream) - 1) // 4 == 3
    for i in range(len(ds)):
        assert ds[i].tolist() == stream[i * 4 : i * 4 + 5].tolist()
    assert ds[-1].tolist() == ds[2].tolist()
    with pytest.raises(IndexError):
        ds[3]


def _seen(sampler, steps):
    return [
        (d, b)
        for s in range(steps)
        for m in range(sampler.grad_accum)
        for d, b in zip(
            sampler.batch(s, m)["domain_ids_B"].tolist(), sampler.batch(s, m)["block_ids_B"].tolist()
        )
    ]


def test_same_domain_shards_are_disjoint_and_cover_each_epoch():
    ds = {0: _domain(0)}
    n = len(ds[0])
    samplers = [build_sampler(_cfg(), ds, [0], s, 3, micro_batch=2, grad_accum=2) for s in range(3)]
    seen = [_seen(s, 10) for s in samplers]  # 40 samples per shard: several epochs of ~n/3 blocks
    sets = [set(b for _, b in x) for x in seen]
    assert sets[0].isdisjoint(sets[1]) and sets[0].isdisjoint(sets[2]) and sets[1].isdisjoint(sets[2])
    assert set().union(*sets) == set(range(n))
    owned = len(samplers[0].streams[0])
    first, second = [b for _, b in seen[0][:owned]], [b for _, b in seen[0][owned : 2 * owned]]
    assert sorted(first) == sorted(second) == sorted(sets[0])  # each epoch visits every owned block once
    assert first != second  # and reshuffles


def test_deterministic_random_access_and_exact_resume():
    ds = {0: _domain(0), 1: _domain(1)}
    a = build_sampler(_cfg(), ds, [0], 1, 2, micro_batch=2, grad_accum=3)
    b = build_sampler(_cfg(), ds, [0], 1, 2, micro_batch=2, grad_accum=3)
    run = [next(a) for _ in range(3 * 7)]
    for i, batch in enumerate(run):
        direct = b.batch(i // 3, i % 3)
        assert all((batch[k] == direct[k]).all() for k in batch)
    a2 = build_sampler(_cfg(), ds, [0], 1, 2, micro_batch=2, grad_accum=3)
    for _ in range(4 * 3):
        next(a2)
    state = a2.state_dict()
    resumed = build_sampler(_cfg(), ds, [0], 1, 2, micro_batch=2, grad_accum=3)
    resumed.load_state_dict(state)
    for batch in run[12:]:
        assert (next(resumed)["tokens_BT"] == batch["tokens_BT"]).all()
    other = build_sampler(_cfg(seed=8), ds, [0], 1, 2, micro_batch=2, grad_accum=3)
    assert not all((other.batch(s)["block_ids_B"] == a.batch(s)["block_ids_B"]).all() for s in range(5))
    with pytest.raises(ValueError, match="another configuration"):
        other.load_state_dict(state)


def test_inputs_targets_shift_and_rank_serving_two_domains_mixes_them():
    ds = {0: _domain(0), 3: _domain(3)}
    s = build_sampler(_cfg(), ds, [0, 3], 0, 1, micro_batch=4)
    for step in range(6):
        batch = s.batch(step)
        assert batch["domain_ids_B"].tolist() == [0, 3, 0, 3]
        for b in range(4):
            d, blk = int(batch["domain_ids_B"][b]), int(batch["block_ids_B"][b])
            x = ds[d][blk]
            assert (
                batch["tokens_BT"][b].tolist() == x[:-1].tolist()
                and batch["targets_BT"][b].tolist() == x[1:].tolist()
            )
            assert all(t == 1 or t // 100_000 == d for t in x.tolist())  # only that domain's tokens
        assert batch["loss_mask_BT"].shape == (4, T) and float(batch["loss_mask_BT"].min()) == 1.0


def test_natural_balanced_and_domain_token_mixtures():
    ds = {0: _domain(0, n_docs=40), 1: _domain(1, n_docs=10), 2: _domain(2, n_docs=20)}
    nat = build_sampler(_cfg("natural"), ds, [0, 1, 2], 1, 2, micro_batch=1)
    owned = {d: len(st) for d, st in nat.streams.items()}
    epoch = [nat.sample_ref(g) for g in range(sum(owned.values()))]
    assert Counter(d for d, _ in epoch) == owned  # natural proportions, one pass over the shard
    assert len(set(epoch)) == len(epoch) and all(b % 2 == 1 for _, b in epoch)  # shard 1 of 2 only
    bal = build_sampler(_cfg("balanced"), ds, [0, 1, 2], 0, 2, micro_batch=1)
    q = min(len(st) for st in bal.streams.values())
    counts = Counter(bal.sample_ref(g)[0] for g in range(3 * q * 4))
    assert counts == {0: 4 * q, 1: 4 * q, 2: 4 * q}
    base = 10_000_000
    dt = build_sampler(_cfg("domain_token"), ds, [0, 1, 2], 0, 2, micro_batch=3, domain_token_base=base)
    for step in range(5):
        batch = dt.batch(step)
        for b in range(3):
            d, blk = int(batch["domain_ids_B"][b]), int(batch["block_ids_B"][b])
            x = ds[d][blk]
            assert int(batch["tokens_BT"][b, 0]) == base + d  # input only
            assert batch["tokens_BT"][b, 1:].tolist() == x[: T - 1].tolist()
            assert batch["targets_BT"][b].tolist() == x[:T].tolist()
            assert int(batch["targets_BT"].max()) < base  # the domain token is never a target


def test_problems_are_reported_together():
    ds = {0: _domain(0, n_docs=1)}
    with pytest.raises(ValueError) as e:
        build_sampler(_cfg("domain_token"), ds, [0, 5], 4, 4, micro_batch=0)
    msg = str(e.value)
    assert "shard=4" in msg and "micro_batch=0" in msg and "domain_token_base" in msg and "domain 5" in msg


def _rank_view(rank: int, world: int, steps: int, resume_at: int) -> dict:
    """2 domains x 2 ranks: rank r serves domain r // 2 as shard r % 2 (contiguous ranks per domain)."""
    ds = {d: _domain(d, n_docs=30) for d in (0, 1)}  # each rank builds every dataset; uses only its own
    domain, shard = rank // 2, rank % 2
    cfg = _cfg()
    s = build_sampler(cfg, ds, [domain], shard, 2, micro_batch=2, grad_accum=2)
    seen, hashes = [], []
    for _ in range(steps * 2):
        batch = next(s)
        seen += [(int(d), int(b)) for d, b in zip(batch["domain_ids_B"], batch["block_ids_B"])]
        hashes += [hash(tuple(row)) for row in batch["tokens_BT"].tolist()]
    resumed = build_sampler(cfg, ds, [domain], shard, 2, micro_batch=2, grad_accum=2)
    resumed.load_state_dict({**resumed.state_dict(), "step": resume_at, "micro_step": 0})
    tail = [
        hash(tuple(row))
        for _ in range((steps - resume_at) * 2)
        for row in next(resumed)["tokens_BT"].tolist()
    ]
    gathered = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "domain": domain, "seen": seen, "hashes": hashes})
    by_rank = {g["rank"]: g for g in gathered}
    for r, g in by_rank.items():
        for r2, g2 in by_rank.items():
            if r < r2:
                # no block content shared, any domain
                assert set(g["hashes"]).isdisjoint(g2["hashes"]), (
                    r,
                    r2,
                )
                if g["domain"] == g2["domain"]:
                    assert {b for _, b in g["seen"]}.isdisjoint(b for _, b in g2["seen"])
        assert {d for d, _ in g["seen"]} == {g["domain"]}
    return {
        "tail_matches": tail == hashes[resume_at * 2 * 2 :],
        "blocks_seen": len(set(seen)),
        "owned": len(s.streams[domain]),
    }


@pytest.mark.slow
def test_four_ranks_two_domains_disjoint_and_resumable():
    out = run_ranks(_rank_view, 4, args=(12, 5), timeout=120)
    assert all(o["tail_matches"] for o in out)
    assert all(o["blocks_seen"] == o["owned"] for o in out)  # 48 samples > one epoch: every owned block seen
