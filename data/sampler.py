"""Domain-aware batch sampling: which blocks this rank reads, in which order, for every (step, micro-step).

Shape legend: B micro-batch (sequences), T tokens per sequence (seq_len).

Everything is a pure function of (seed, shard, num_shards, the rank's domains, block counts) and the global
sample index on this rank,

    g = (step * grad_accum + micro_step) * B + b,        b in [0, B)

so `batch(step, micro_step)` is computed directly, and resuming from any step (`load_state_dict`) yields exactly
the batches an uninterrupted run would. Three layers:

1. Shards (static). Shard s of n owns blocks {i : i % n == s} of each domain it reads. Ranks of one domain
   group therefore never share a block, in any epoch (the paper's "each of these n/8 GPUs is assigned to
   different shards of their domain's training data").
2. Per-domain streams. Draw k of domain d on shard s is block owned[perm_e[k % m]] with m = |owned|,
   e = k // m and perm_e a permutation seeded by (seed, d, s, n, e): each epoch visits every owned block once, and
   a new epoch reshuffles deterministically when the domain is exhausted.
3. Schedules: which domain sample g comes from, and which draw of that domain it is.
   - "by_domain" (DEMix): the rank's domains in round robin, sample g -> (domains[g % k], draw g // k). A rank
     serving one domain reads only it; a rank serving k domains alone (fewer data-parallel ranks than domains)
     gives each the same share of its batch, mixed inside every micro-batch (slot b of the micro-batch cycles
     through the domains). Ranks of different domains never read each other's data. What each layout gives a
     domain g, as a share of every step's sequences (parallel/topology.py:domain_data_shares, announced at plan
     time when unequal):
       ranks per domain (dp >= G): allocation[g] / dp, i.e. 1/G with the paper's even split (dp a multiple of G);
       domains per rank (dp < G): 1 / (dp * k_g), k_g the number of domains on g's rank: equal when every rank
       holds the same number of domains (e.g. 4 domains on 2 ranks), unequal otherwise (3 domains on 2 ranks:
       25 %, 25 %, 50 %).
     Whatever the shares, each expert's gradient is the mean over its own domain's tokens of the step
     (parallel/demix_sync.py:ExpertGradScale); the shares decide how much data each expert sees.
   - "natural" / "domain_token" (Dense, +Domain-Token): every rank reads every domain on shard = its
     data-parallel rank. A mixture epoch has one slot per owned block of every domain (quota q_d = m_d), shuffled
     by (seed, shard, epoch): blocks come in their natural proportions, one pass over the shard per epoch.
   - "balanced" (Dense-Balanced): quota q_d = min_d m_d for every domain: equal blocks per domain in every mixture
     epoch; small domains repeat (their stream wraps) and large ones continue where they stopped.
   In a mixture epoch e with P = sum q_d slots, slot j maps to unshuffled slot s = perm_e[j] of domain d(s) at
   position r(s) among that domain's slots, and to draw e * q_d + r(s) of domain d: each draw is used once.

Targets and the loss mask. Default: tokens_BT = block[:-1], targets_BT = block[1:], loss_mask 1 everywhere
(a target that is the beginning-of-document token is scored: it predicts the end of a document).
"domain_token": the domain token t_d = domain_token_base + d is an input only, never a target:
tokens_BT = [t_d] + x[0:T-1], targets_BT = x[0:T] with x = block[:T] (T text tokens per block, so the scored
tokens per sequence equal the other mixtures'); loss_mask is 1 everywhere because no target is a domain token.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from data.blocks import BlockDataset
from data.config import MIXTURES, DataConfig

_STREAM_TAG, _MIX_TAG = 0x5EED, 0x3A1C


def _permutation(entropy: Sequence[int], n: int) -> np.ndarray:
    return np.random.default_rng(np.random.SeedSequence(list(entropy))).permutation(n)


class _Lru(OrderedDict):
    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def get_or(self, key: Any, make) -> Any:
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = self[key] = make()
        if len(self) > self.size:
            self.popitem(last=False)
        return value


class DomainStream:
    """The blocks shard `shard` of `num_shards` owns in one domain, reshuffled each epoch (layers 1 and 2)."""

    def __init__(self, num_blocks: int, domain: int, shard: int, num_shards: int, seed: int):
        self.owned = np.arange(shard, num_blocks, num_shards, dtype=np.int64)
        self.key = (seed, _STREAM_TAG, domain, shard, num_shards)
        self._perms = _Lru(2)
        if len(self.owned) == 0:
            raise ValueError(f"domain {domain}: shard {shard} of {num_shards} owns no block of {num_blocks}")

    def __len__(self) -> int:
        return len(self.owned)

    def block(self, draw: int) -> int:
        epoch, pos = divmod(draw, len(self.owned))
        perm = self._perms.get_or(epoch, lambda: _permutation((*self.key, epoch), len(self.owned)))
        return int(self.owned[perm[pos]])


class RoundRobin:
    """by_domain: sample g -> (domains[g % k], g // k)."""

    def __init__(self, domains: Sequence[int]):
        self.domains = list(domains)

    def __call__(self, g: int) -> tuple[int, int]:
        k = len(self.domains)
        return self.domains[g % k], g // k


class QuotaMixture:
    """natural / balanced / domain_token: shuffled mixture epochs with `quotas[i]` slots for `domains[i]`."""

    def __init__(self, domains: Sequence[int], quotas: Sequence[int], seed: int, shard: int):
        self.domains = list(domains)
        self.quotas = np.asarray(quotas, dtype=np.int64)
        self.period = int(self.quotas.sum())
        starts = np.concatenate([[0], np.cumsum(self.quotas)[:-1]])
        # unshuffled slot -> domain pos
        self._slot_domain = np.repeat(np.arange(len(self.domains)), self.quotas)
        self._slot_rank = np.arange(self.period) - np.repeat(starts, self.quotas)  # position among its domain
        self.key = (seed, _MIX_TAG, shard)
        self._perms = _Lru(2)

    def __call__(self, g: int) -> tuple[int, int]:
        epoch, j = divmod(g, self.period)
        perm = self._perms.get_or(epoch, lambda: _permutation((*self.key, epoch), self.period))
        s = perm[j]
        i = int(self._slot_domain[s])
        return self.domains[i], epoch * int(self.quotas[i]) + int(self._slot_rank[s])


class DomainSampler:
    """Batches {tokens_BT, targets_BT, loss_mask_BT, domain_ids_B, block_ids_B} for this rank; iterate, or ask
    `batch(step, micro_step)` directly. Build it with `build_sampler`."""

    def __init__(
        self,
        datasets: Mapping[int, BlockDataset],
        schedule: Any,
        streams: Mapping[int, DomainStream],
        micro_batch: int,
        grad_accum: int,
        identity: dict,
        domain_token_base: int | None = None,
    ):
        self.datasets, self.schedule, self.streams = datasets, schedule, streams
        self.micro_batch, self.grad_accum = micro_batch, grad_accum
        self.identity = identity  # what a checkpoint must match to resume exactly
        self.domain_token_base = domain_token_base
        self.seq_len = next(iter(datasets.values())).seq_len
        self.step, self.micro_step = 0, 0

    def sample_ref(self, g: int) -> tuple[int, int]:
        """(domain id, block index in that domain's dataset) of this rank's global sample g."""
        domain, draw = self.schedule(g)
        return domain, self.streams[domain].block(draw)

    def batch(self, step: int, micro_step: int = 0) -> dict[str, torch.Tensor]:
        if step < 0 or not 0 <= micro_step < self.grad_accum:
            raise IndexError(
                f"(step={step}, micro_step={micro_step}): need step >= 0, 0 <= micro_step < {self.grad_accum}"
            )
        B, T = self.micro_batch, self.seq_len
        base = (step * self.grad_accum + micro_step) * B
        tokens_BT = np.empty((B, T), dtype=np.int64)
        targets_BT = np.empty((B, T), dtype=np.int64)
        domain_ids_B = np.empty(B, dtype=np.int64)
        block_ids_B = np.empty(B, dtype=np.int64)
        for b in range(B):
            domain, block = self.sample_ref(base + b)
            x = self.datasets[domain][block]  # T + 1 tokens
            if self.domain_token_base is None:
                tokens_BT[b], targets_BT[b] = x[:-1], x[1:]
            else:
                tokens_BT[b, 0] = self.domain_token_base + domain
                tokens_BT[b, 1:], targets_BT[b] = x[: T - 1], x[:T]
            domain_ids_B[b], block_ids_B[b] = domain, block
        return {
            "tokens_BT": torch.from_numpy(tokens_BT),
            "targets_BT": torch.from_numpy(targets_BT),
            "loss_mask_BT": torch.ones((B, T), dtype=torch.float32),
            "domain_ids_B": torch.from_numpy(domain_ids_B),
            "block_ids_B": torch.from_numpy(block_ids_B),
        }

    def __iter__(self) -> DomainSampler:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        out = self.batch(self.step, self.micro_step)
        self.micro_step += 1
        if self.micro_step == self.grad_accum:
            self.step, self.micro_step = self.step + 1, 0
        return out

    def state_dict(self) -> dict:
        return {"step": self.step, "micro_step": self.micro_step, **self.identity}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        diff = {k: (state.get(k), v) for k, v in self.identity.items() if state.get(k) != v}
        if diff:
            raise ValueError(f"sampler state from another configuration (saved, now): {diff}")
        self.step, self.micro_step = int(state["step"]), int(state["micro_step"])

    def describe(self) -> dict:
        """Per domain: blocks this rank owns (one epoch of its stream) and the dataset size."""
        return {
            d: {"owned_blocks": len(s), "dataset_blocks": len(self.datasets[d])}
            for d, s in self.streams.items()
        }


def build_sampler(
    data_cfg: DataConfig,
    datasets: Mapping[int, BlockDataset],
    rank_domains: Sequence[int],
    shard: int,
    num_shards: int,
    micro_batch: int,
    seed: int | None = None,
    grad_accum: int = 1,
    domain_token_base: int | None = None,
) -> DomainSampler:
    """The one entry point. `datasets` maps global domain id -> that domain's BlockDataset (only the domains this
    rank reads are needed). by_domain: `rank_domains` are the domains this rank serves and (shard, num_shards)
    its place in that domain group (from the topology). natural / balanced / domain_token: `rank_domains` are all
    domains and (shard, num_shards) = (data-parallel rank, data-parallel size). domain_token needs
    `domain_token_base` (= `tokenizer.vocab_size`). `seed` defaults to `data_cfg.seed`. Raises one ValueError
    naming every problem."""
    seed = data_cfg.seed if seed is None else seed
    mixture = data_cfg.mixture
    problems = []
    if mixture not in MIXTURES:
        problems.append(f"mixture={mixture!r}: choose one of {', '.join(MIXTURES)}")
    if not rank_domains or len(set(rank_domains)) != len(rank_domains):
        problems.append(f"rank_domains={list(rank_domains)}: need at least one domain, no duplicates")
    if not 0 <= shard < num_shards:
        problems.append(f"shard={shard}, num_shards={num_shards}: need 0 <= shard < num_shards")
    if micro_batch < 1 or grad_accum < 1:
        problems.append(f"micro_batch={micro_batch}, grad_accum={grad_accum}: both must be >= 1")
    if mixture == "domain_token" and domain_token_base is None:
        problems.append("mixture='domain_token' needs domain_token_base (the tokenizer's vocab_size)")
    for d in rank_domains:
        if d not in datasets:
            problems.append(f"domain {d}: no dataset given (have {sorted(datasets)})")
        elif len(datasets[d]) < max(num_shards, 1):
            problems.append(
                f"domain {d} ({datasets[d].name}): {len(datasets[d])} blocks of {datasets[d].seq_len}+1 tokens, "
                f"fewer than num_shards={num_shards}; add data or shorten seq_len"
            )
    if len({datasets[d].seq_len for d in rank_domains if d in datasets}) > 1:
        problems.append("datasets have different seq_len")
    if problems:
        raise ValueError("cannot build the sampler:\n  " + "\n  ".join(problems))
    streams = {d: DomainStream(len(datasets[d]), d, shard, num_shards, seed) for d in rank_domains}
    if mixture == "by_domain":
        schedule: Any = RoundRobin(rank_domains)
    else:
        owned = [len(streams[d]) for d in rank_domains]
        quotas = [min(owned)] * len(owned) if mixture == "balanced" else owned
        schedule = QuotaMixture(rank_domains, quotas, seed, shard)
    identity = {
        "seed": seed,
        "mixture": mixture,
        "domains": list(rank_domains),
        "shard": shard,
        "num_shards": num_shards,
        "micro_batch": micro_batch,
        "grad_accum": grad_accum,
        "blocks": [len(datasets[d]) for d in rank_domains],
    }
    return DomainSampler(
        {d: datasets[d] for d in rank_domains},
        schedule,
        streams,
        micro_batch,
        grad_accum,
        identity,
        domain_token_base if mixture == "domain_token" else None,
    )
