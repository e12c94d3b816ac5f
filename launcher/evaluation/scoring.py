"""Scoring blocks and mixing experts: every expert's token log-likelihoods of a stream of blocks in one batched
pass (`stream_log_likelihoods`, sharded over ranks), a domain's cached prior from its development blocks, and
every mode's perplexity of one domain from the same log-likelihoods (`_demix_domain`; model/mixture.py's maths,
DEMix eqs. 6-9). +Domain-Token models: the domain token plays the expert's part."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from launcher.checkpoint_data import block_inputs
from launcher.evaluation.device import rank_and_world
from launcher.evaluation.results import DEMIX_MODES
from launcher.evaluation.stats import block_sums
from model import mixture as mx
from model.batched import demix_expert_ids, expert_log_likelihoods
from parallel.precision import forward_precision


@torch.no_grad()
def stream_log_likelihoods(
    model: torch.nn.Module,
    tokens_NT: torch.Tensor,
    targets_NT: torch.Tensor,
    expert_ids: Sequence[int] | None = None,
    batch_size: int = 4,
    precision: str = "fp32",
    on_blocks: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """ll E x N x T (fp32, on the host) over a stream of N blocks, scored on the model's device in `precision`
    (`forward_precision`); blocks are sharded over ranks and summed back (all_reduce). `on_blocks(k)` after each
    batch: about k of the N blocks are done over all ranks (progress)."""
    rank, world = rank_and_world()
    N, T = tokens_NT.shape
    mine = list(range(rank, N, world))
    device = next(
        model.parameters()
    ).device  # the blocks are scored and summed over ranks there (NCCL: no CPU)
    parts = {}
    for s in range(0, len(mine), batch_size):
        idx = mine[s : s + batch_size]
        with forward_precision(model, precision, device.type):
            parts[tuple(idx)] = expert_log_likelihoods(
                model, tokens_NT[idx].to(device), targets_NT[idx].to(device), expert_ids
            )
        if on_blocks is not None:
            on_blocks(min(N, (s + len(idx)) * world))
    E = next(iter(parts.values())).shape[0] if parts else max(1, len(expert_ids or demix_expert_ids(model)))
    full = torch.zeros(E, N, T, dtype=torch.float32, device=device)
    for idx, ll in parts.items():
        full[:, list(idx)] = ll.float()
    if world > 1:
        torch.distributed.all_reduce(full)
    return full.cpu()


def time_block_pass(model: torch.nn.Module, blocks_NT1: np.ndarray, precision: str) -> tuple[float, int]:
    """Seconds per block pass from one timed batch of blocks (the plan line's estimate), and how many blocks it
    timed. On a GPU one block is passed first (CUDA start-up is not timed)."""
    device = next(model.parameters()).device
    tokens, targets, _ = block_inputs(blocks_NT1)
    tokens, targets = tokens.to(device), targets.to(device)
    with torch.no_grad(), forward_precision(model, precision, device.type):
        if device.type == "cuda":
            expert_log_likelihoods(model, tokens[:1], targets[:1])
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        expert_log_likelihoods(model, tokens, targets)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return (time.perf_counter() - t) / len(tokens), len(tokens)


def _domain_token_ll(
    model,
    blocks,
    base: int,
    num_domains: int,
    batch_size: int,
    precision: str = "fp32",
    on_blocks: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """+Domain-Token: ll under each domain token d (the token plays the expert's part), G x N x T."""
    out = []
    for d in range(num_domains):
        tokens, targets, _ = block_inputs(blocks, base + d)
        tick = None if on_blocks is None else (lambda k, d=d: on_blocks(d * len(blocks) + k))
        out.append(stream_log_likelihoods(model, tokens, targets, None, batch_size, precision, tick)[0])
    return torch.stack(out)


def _cached_prior(
    model,
    dev_blocks,
    experts,
    cached_blocks,
    decay,
    batch_size,
    estimator: str = "mean",
    posterior: str = "prefix",
    precision: str = "fp32",
    on_blocks: Callable[[int], None] | None = None,
) -> tuple[mx.CachedPrior | None, dict[str, dict[str, float]]]:
    """The cached prior of one domain from its development blocks (None without any), and every estimator x
    posterior variant of it on the same log-likelihoods ({"<estimator>/<posterior>": {expert: p}}, Figure 4 for
    each choice)."""
    if not len(dev_blocks):
        return None, {}
    tokens, targets, mask = block_inputs(dev_blocks)
    ll = stream_log_likelihoods(model, tokens, targets, None, batch_size, precision, on_blocks)
    variants = {}
    for est in mx.CACHED_ESTIMATORS:
        for post in mx.POSTERIORS:
            v = mx.estimate_cached_prior(
                ll, experts, mask, cached_blocks, decay if est == "updating" else None, est, post
            )
            variants[f"{est}/{post}"] = dict(zip(v.domains, v.probs))
    prior = mx.estimate_cached_prior(
        ll, experts, mask, cached_blocks, decay if estimator == "updating" else None, estimator, posterior
    )
    return prior, variants


def _domain_token_entry(
    model,
    blocks,
    base: int,
    train_domains: list[str],
    own: int | None,
    batch_size: int,
    precision: str = "fp32",
    on_blocks: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """+Domain-Token: own token in-domain, the best token on a novel domain (DEMix §5.3)."""
    ll = _domain_token_ll(model, blocks, base, len(train_domains), batch_size, precision, on_blocks)
    mask = torch.ones(ll.shape[1:])
    exp_ppl = mx.expert_perplexities(ll, mask)
    best = mx.naive_expert(ll, own, mask)
    nll, tokens = block_sums(ll[best], mask)
    return {
        "expert_ppl": dict(zip(train_domains, exp_ppl)),
        "naive_expert": train_domains[best],
        "ppl": {"ppl": exp_ppl[best]},
        "block_nll": {"ppl": nll},
        "block_tokens": tokens,
    }


def _demix_domain(
    ll_EBT, mask_BT, own, experts, modes, cached_prior, topk, decay, posterior: str = "prefix"
) -> dict[str, Any]:
    """Every mode's perplexity and the posterior statistics of one test domain."""
    E = ll_EBT.shape[0]
    uniform = mx.uniform_log_prior(E)
    exp_ppl = mx.expert_perplexities(ll_EBT, mask_BT)
    naive = mx.naive_expert(ll_EBT, own, mask_BT)
    upd = mx.updating_priors(ll_EBT, mask_BT, decay, posterior=posterior)
    res: dict[str, Any] = {
        "expert_ppl": dict(zip(experts, exp_ppl)),
        "naive_expert": experts[naive],
        "ppl": {},
        "posterior": {
            "updating_mean_end_of_block": dict(zip(experts, upd.log_posterior_EB.exp().mean(dim=1).tolist())),
            "updating_final_prior": dict(zip(experts, upd.final_log_prior_E.exp().tolist())),
        },
    }
    for mode in modes:
        if mode == "naive":
            lp = ll_EBT[naive]
        elif mode == "average":
            lp = mx.average_log_probs(ll_EBT)
        elif mode == "uniform":
            lp = mx.posterior_mixture_log_probs(ll_EBT, uniform, mask_BT, posterior)
        elif mode == "updating":
            lp = mx.posterior_mixture_log_probs(ll_EBT, upd.log_prior_EB, mask_BT, posterior)
        elif mode in ("cached", "topk"):
            if cached_prior is None:
                continue
            lp_E = cached_prior.log_prior(experts)
            if mode == "cached":
                lp = mx.posterior_mixture_log_probs(ll_EBT, lp_E, mask_BT, posterior)
            else:
                top = mx.topk_mixture_log_probs(ll_EBT, lp_E, min(topk, E), mask_BT, posterior=posterior)
                lp = top.log_probs_BT
                res["topk"] = {
                    "k": min(topk, E),
                    "experts": [experts[j] for j in top.experts],
                    "experts_evaluated": top.experts_evaluated,
                    "of": E,
                }
        else:
            raise ValueError(f"mode {mode!r}: choose from {', '.join(DEMIX_MODES)}")
        res["ppl"][mode] = mx.perplexity(lp, mask_BT)
        res.setdefault("block_nll", {})[mode], res["block_tokens"] = block_sums(lp, mask_BT)
    if cached_prior is not None:
        res["cached_prior"] = {
            "probs": dict(zip(cached_prior.domains, cached_prior.probs)),
            "blocks": cached_prior.blocks,
            "estimator": cached_prior.estimator,
            "posterior": cached_prior.posterior,
        }
    return res
