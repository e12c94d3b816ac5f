"""The cached prior of each domain of a DEMix evaluation (DEMix §5.1): given by the caller, read from the
checkpoint's prior cache (launcher/evaluation/prior_cache.py), or scored on the domain's development blocks -
planned before any work (the plan line's "prior: ..." clause) and cached once the evaluation has succeeded."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from launcher.checkpoint_data import count_blocks, load_blocks
from launcher.evaluation.context import EvalContext
from launcher.evaluation.device import rank_and_world
from launcher.evaluation.prior_cache import PriorCache, PriorEntries, data_fingerprint
from launcher.evaluation.progress import Progress
from launcher.evaluation.scoring import _cached_prior
from model import mixture as mx


def _agree_over_ranks(hits: list[str], need: list[str], device: torch.device) -> list[str]:
    """The cache hits every rank has (all ranks must score the same priors: the passes are collective)."""
    if rank_and_world()[1] == 1 or not need:
        return hits
    flags = torch.tensor([1.0 if d in hits else 0.0 for d in need], device=device)
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN)
    return [d for d, f in zip(need, flags.tolist()) if f > 0]


def prior_plan(
    e: EvalContext,
    domains: list[str],
    given: dict[str, mx.CachedPrior] | None,
    cache: PriorCache | None,
    say: Callable[[str], None],
) -> tuple[PriorEntries, dict[str, int], str, dict[str, Any] | None]:
    """The priors given or cached, the development blocks to score for the other domains, the plan line's
    "prior: ..." clause, and the cache key (None without a cache)."""
    entries: PriorEntries = {d: {"prior": given[d], "given": True} for d in domains if given and d in given}
    need = [d for d in domains if d not in entries]
    key, cached = None, {}
    if cache is not None and need:
        key = cache.fingerprint(
            data_fingerprint(e.data_root, e.tokenizer, e.dev_split),
            {
                "dev_split": e.dev_split,
                "cached_blocks": e.cached_blocks,
                "seq_len": e.seq_len,
                "decay": e.decay,
                "estimator": e.cached_estimator,
                "posterior": e.posterior,
                "precision": e.precision,
                "device": e.device.type,
                "experts": e.experts,
            },
        )
        cached, why = cache.read(key)
        if why:
            say(f"[eval] prior cache not used: {why}")
    hits = _agree_over_ranks([d for d in need if d in cached], need, e.device)
    entries.update({d: cached[d] for d in hits})
    to_score = {
        d: count_blocks(e.data_root, e.tokenizer, d, e.dev_split, e.seq_len, e.cached_blocks)
        for d in need
        if d not in hits
    }
    parts = []
    if hits:
        parts.append(
            f"prior: cached from {cache.file(key)}"
            + (f" for {', '.join(hits)}" if to_score else "")
            + f" (its {e.cached_blocks} {e.dev_split} blocks per domain are not scored again)"
        )
    if to_score:
        n = sorted(set(to_score.values()))
        where = (
            f"once per checkpoint: cached in {cache.file(key)}"
            if cache is not None
            else "not cached: evaluate_checkpoint(prior_cache=True) or the command caches it"
        )
        parts.append(
            f"prior: scoring {n[0] if len(n) == 1 else f'{n[0]}-{n[-1]}'} {e.dev_split} blocks per domain"
            + (f" for {', '.join(to_score)}" if hits else f" ({len(to_score)} domains)")
            + f", {where}"
        )
    if len(entries) > len(hits):
        parts.append("prior: given for " + ", ".join(d for d in entries if entries[d].get("given")))
    return entries, to_score, "; ".join(parts), key


def score_priors(e: EvalContext, to_score: dict[str, int], prog: Progress) -> PriorEntries:
    """The cached prior (and its variants) of each domain of `to_score`, from its development blocks."""
    out: PriorEntries = {}
    for dom in to_score:
        prog.start(f"prior {dom} ({e.dev_split})")
        dev = load_blocks(e.data_root, e.tokenizer, dom, e.dev_split, e.seq_len, e.cached_blocks)
        prior, variants = _cached_prior(
            e.model,
            dev,
            e.experts,
            e.cached_blocks,
            e.decay,
            e.batch_size,
            e.cached_estimator,
            e.posterior,
            e.precision,
            prog.at,
        )
        out[dom] = {"prior": prior, "variants": variants}
        prog.stage_done(len(dev))
    return out


def save_priors(
    cache: PriorCache | None,
    key: dict[str, Any] | None,
    scored: PriorEntries,
    seconds: float,
    say: Callable[[str], None],
) -> None:
    """Write the priors scored here into the checkpoint's cache (rank 0; a read-only place is only noted)."""
    if cache is None or key is None or not scored or rank_and_world()[0] != 0:
        return
    try:
        say(f"[eval] prior: cached in {cache.write(key, scored, seconds)} for the next evaluation")
    except OSError as err:
        say(f"[eval] prior: not cached ({err})")
