"""Per-domain log-likelihoods of every expert and the cached-prior mixture over a subset of them (DEMix §7:
removal at evaluation time masks experts out of the prior and the posterior, eqs. 6-8, from one all-experts pass
per domain)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from data.catalog import read_token_manifest
from launcher.checkpoint import CheckpointError
from launcher.checkpoint_data import block_inputs, data_source, load_blocks
from launcher.evaluation.scoring import stream_log_likelihoods
from launcher.expert_surgery import CkptLike, _keep_indices, _load, _require_demix
from model import mixture as mx


def domain_log_likelihoods(
    model: torch.nn.Module,
    data_root: str,
    tokenizer: str,
    domain: str,
    split: str,
    max_blocks: int | None,
    batch_size: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ll E x N x T of every expert on the first `max_blocks` blocks of a domain's split, and the mask N x T."""
    available = read_token_manifest(Path(data_root) / tokenizer / "manifest.json")["domains"]
    if domain not in available:
        raise CheckpointError(
            f"domain {domain!r} is not in {data_root}/{tokenizer} (domains: {', '.join(available)})"
        )
    blocks = load_blocks(data_root, tokenizer, domain, split, model.cfg.seq_len, max_blocks)
    if not len(blocks):
        raise CheckpointError(
            f"{domain}/{split} in {data_root}/{tokenizer} has no block of {model.cfg.seq_len}+1 tokens"
        )
    tokens, targets, mask = block_inputs(blocks)
    return stream_log_likelihoods(model, tokens, targets, None, batch_size), mask


def masked_mixture(
    ll_EBT: torch.Tensor,
    mask_BT: torch.Tensor,
    dev_ll_EBT: torch.Tensor,
    dev_mask_BT: torch.Tensor,
    names: Sequence[str],
    keep: Sequence[int],
    cached_blocks: int = mx.CACHED_PRIOR_BLOCKS,
    estimator: str = "mean",
) -> tuple[float, mx.CachedPrior]:
    """Perplexity of the cached-prior mixture (eqs. 6-8) restricted to the experts `keep`: the prior is estimated
    (`mx.estimate_cached_prior`, `estimator`) on the development blocks over those experts only, as a model holding
    only them would."""
    keep = list(keep)
    if not keep:
        raise ValueError("a mixture needs at least one expert")
    prior = mx.estimate_cached_prior(
        dev_ll_EBT[keep], [names[j] for j in keep], dev_mask_BT, cached_blocks, estimator=estimator
    )
    lp_BT = mx.posterior_mixture_log_probs(ll_EBT[keep], prior.log_prior(), mask_BT)
    return mx.perplexity(lp_BT, mask_BT), prior


@torch.no_grad()
def evaluate_experts(
    ckpt: CkptLike,
    data: str | None = None,
    tokenizer: str | None = None,
    *,
    domains: Sequence[str] | None = None,
    experts: Sequence[str] | None = None,
    without: Sequence[str] = (),
    split: str = "test",
    dev_split: str = "valid",
    max_blocks: int | None = 16,
    cached_blocks: int = 16,
    estimator: str = "mean",
) -> dict[str, Any]:
    """Evaluation-time removal: per-domain perplexity of the cached-prior mixture over a subset of experts
    (`experts`, default all, minus `without`). Returns {"experts": [kept names], "domains": {d: {"ppl", "prior"}}}."""
    c = _load(ckpt)
    _require_demix(c, "masking experts")
    data, tokenizer = data_source(c, data, tokenizer)
    keep = _keep_indices(c.domains, experts, without)
    model = c.build_model().eval()
    out: dict[str, Any] = {"experts": [c.domains[j] for j in keep], "domains": {}}
    for dom in domains or c.domains:
        ll, mask = domain_log_likelihoods(model, data, tokenizer, dom, split, max_blocks)
        dev_ll, dev_mask = domain_log_likelihoods(model, data, tokenizer, dom, dev_split, cached_blocks)
        ppl, prior = masked_mixture(ll, mask, dev_ll, dev_mask, c.domains, keep, cached_blocks, estimator)
        out["domains"][dom] = {"ppl": ppl, "prior": dict(zip(prior.domains, prior.probs))}
    return out
