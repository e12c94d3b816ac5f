"""Scoring blocks and mixing experts: every expert's token log-likelihoods of a stream of blocks in one batched
pass (`stream_log_likelihoods`, sharded over ranks; `stream_scores` also gives the router weights of the same
blocks), a domain's cached prior from its development blocks, and every mode's perplexity of one domain from the
same log-likelihoods (`_demix_domain`; model/mixture.py's maths, DEMix eqs. 6-9, router eqs. R1-R4). +Domain-Token
models: the domain token plays the expert's part."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from launcher.checkpoint_data import block_inputs
from launcher.evaluation.device import rank_and_world
from launcher.evaluation.results import DEMIX_MODES, ROUTER_MODES
from launcher.evaluation.stats import block_sums
from model import mixture as mx
from model.batched import demix_expert_ids, expert_log_likelihoods, shared_trunk_features
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
    return stream_scores(model, tokens_NT, targets_NT, expert_ids, batch_size, precision, on_blocks)[0]


@torch.no_grad()
def stream_scores(
    model: torch.nn.Module,
    tokens_NT: torch.Tensor,
    targets_NT: torch.Tensor,
    expert_ids: Sequence[int] | None = None,
    batch_size: int = 4,
    precision: str = "fp32",
    on_blocks: Callable[[int], None] | None = None,
    router_vectors_ED: torch.Tensor | None = None,
    router_temperature: float = mx.ROUTER_TEMPERATURE,
    mask_NT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(ll, log_w): `stream_log_likelihoods`'s ll, and with `router_vectors_ED` (one row per expert scored, in
    order) the router log-weights E x N x T (float64, on the host; router eqs. R1-R3 over each block's own
    features, `shared_trunk_features` of the same batch in the same precision, positions counted per `mask_NT`).
    Each rank computes the weights of its own blocks, which need nothing from any other block, and they are
    summed back over ranks like ll: every rank holds the whole stream's weights. log_w is None without vectors."""
    rank, world = rank_and_world()
    N, T = tokens_NT.shape
    if router_vectors_ED is not None:
        scored = len(expert_ids) if expert_ids is not None else len(demix_expert_ids(model))
        if router_vectors_ED.shape[0] != scored:
            raise ValueError(f"{router_vectors_ED.shape[0]} router vectors for {scored} experts")
    mine = list(range(rank, N, world))
    device = next(
        model.parameters()
    ).device  # the blocks are scored and summed over ranks there (NCCL: no CPU)
    parts, weights = {}, {}
    for s in range(0, len(mine), batch_size):
        idx = mine[s : s + batch_size]
        with forward_precision(model, precision, device.type):
            tokens = tokens_NT[idx].to(device)
            parts[tuple(idx)] = expert_log_likelihoods(model, tokens, targets_NT[idx].to(device), expert_ids)
            if router_vectors_ED is not None:
                features_BTD = shared_trunk_features(model, tokens)
        if router_vectors_ED is not None:  # the maths in float64, outside autocast
            mask = None if mask_NT is None else mask_NT[idx].to(device)
            weights[tuple(idx)] = mx.router_log_weights(
                features_BTD, router_vectors_ED, router_temperature, mask
            )
        if on_blocks is not None:
            on_blocks(min(N, (s + len(idx)) * world))
    E = next(iter(parts.values())).shape[0] if parts else max(1, len(expert_ids or demix_expert_ids(model)))
    full = torch.zeros(E, N, T, dtype=torch.float32, device=device)
    for idx, ll in parts.items():
        full[:, list(idx)] = ll.float()
    log_w = None
    if router_vectors_ED is not None:
        log_w = torch.zeros(E, N, T, dtype=torch.float64, device=device)
        for idx, w in weights.items():
            log_w[:, list(idx)] = w
    if world > 1:
        torch.distributed.all_reduce(full)
        if log_w is not None:  # each block's weights live on one rank, zeros elsewhere
            torch.distributed.all_reduce(log_w)
    return full.cpu(), None if log_w is None else log_w.cpu()


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
    ll_EBT,
    mask_BT,
    own,
    experts,
    modes,
    cached_prior,
    topk,
    decay,
    posterior: str = "prefix",
    router_log_weights_EBT: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Every mode's perplexity and the posterior statistics of one test domain. The router modes mix with
    `router_log_weights_EBT` (`stream_scores`); without them they are skipped, as cached/topk without a prior."""
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
        elif mode in ROUTER_MODES:
            if router_log_weights_EBT is None:
                continue
            if mode == "router":  # eq. 6 with g = w (router eq. R3)
                lp = mx.mixture_log_probs(ll_EBT, router_log_weights_EBT)
            else:  # eqs. 6-8 with w as the prior at each token (router eq. R4)
                lp = mx.posterior_mixture_log_probs(ll_EBT, router_log_weights_EBT, mask_BT, posterior)
        else:
            raise ValueError(f"mode {mode!r}: choose from {', '.join(DEMIX_MODES)}")
        res["ppl"][mode] = mx.perplexity(lp, mask_BT)
        res.setdefault("block_nll", {})[mode], res["block_tokens"] = block_sums(lp, mask_BT)
    if router_log_weights_EBT is not None and any(m in res["ppl"] for m in ROUTER_MODES):
        m_BT = torch.ones(ll_EBT.shape[1:]) if mask_BT is None else mask_BT
        m_BT = m_BT.to(torch.float64)
        w_E = (router_log_weights_EBT.exp() * m_BT).sum(dim=(1, 2)) / m_BT.sum().clamp(min=1.0)
        res["router"] = {"mean_weight": dict(zip(experts, w_E.tolist()))}
    if cached_prior is not None:
        res["cached_prior"] = {
            "probs": dict(zip(cached_prior.domains, cached_prior.probs)),
            "blocks": cached_prior.blocks,
            "estimator": cached_prior.estimator,
            "posterior": cached_prior.posterior,
        }
    return res
