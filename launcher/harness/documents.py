"""evaluate's side of the comparison: the same per-document windows scored by `launcher.evaluation.evaluate`'s own
functions (`stream_log_likelihoods`, `_cached_prior`, `_demix_domain`, the dense path), which the harness's token
perplexity must equal (`check`: 1e-4 relative)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from launcher.checkpoint import Consolidated, load_consolidated
from launcher.checkpoint_data import check_checkpoint_data, load_blocks, load_export_tokenizer
from launcher.evaluation.results import DEMIX_MODES, ROUTER_MODES
from launcher.evaluation.scoring import _cached_prior, _demix_domain, stream_log_likelihoods
from launcher.expert_surgery import load_without
from launcher.harness.windows import document_windows, pack_windows
from model import mixture as mx
from model.batched import demix_expert_ids


def evaluate_documents(
    ckpt: str | Path | Consolidated,
    data_root: str | Path,
    texts: Mapping[str, Sequence[str]],
    *,
    modes: Sequence[str] = tuple(m for m in DEMIX_MODES if m not in ROUTER_MODES),
    posterior: str = "prefix",
    cached_estimator: str = "mean",
    cached_blocks: int = mx.CACHED_PRIOR_BLOCKS,
    decay: float = mx.UPDATING_DECAY,
    topk: int = 2,
    batch_size: int = 4,
    dev_split: str = "valid",
    exclude_experts: Sequence[str] = (),
) -> dict[str, Any]:
    """Per-domain perplexity of `texts` ({domain: documents}) by `launcher.evaluation.evaluate`'s own functions:
    each domain's documents, one stream of per-document windows (`document_windows`, blocks) in order, scored by
    `stream_log_likelihoods`, mixed by `_demix_domain` with the cached prior of `_cached_prior` on the domain's
    `dev_split` blocks (DEMix) or `mx.perplexity` of the one model (dense). Returns

        {"kind", "experts", "seq_len", "domains": {domain: {"documents", "windows", "tokens", "ppl": {mode: ppl},
         DEMix: "expert_ppl": {expert: ppl}, "naive_expert": name, "cached_prior": {expert: p} | None}}}

    (dense: the one mode "ppl")."""
    if exclude_experts:
        c = load_without(ckpt, list(exclude_experts))
    else:
        c = ckpt if isinstance(ckpt, Consolidated) else load_consolidated(ckpt)
    tok = load_export_tokenizer(c, data_root)
    tokenizer = str(c.meta.get("tokenizer", c.cfg.data.tokenizer))
    model = c.build_model().eval()
    T = int(c.cfg.model.seq_len)
    experts = list(c.domains) if demix_expert_ids(model) else []
    manifest = check_checkpoint_data(c, data_root, tokenizer) if experts else None
    out: dict[str, Any] = {"kind": c.cfg.model.ffn.kind, "experts": experts, "seq_len": T, "domains": {}}
    for domain, docs in texts.items():
        wins = [w for text in docs for w in document_windows(tok.encode(text), T, tok.bos_id, "blocks")]
        if not wins:
            continue
        W = pack_windows(wins, range(len(wins)), tok.eod_id)
        ll = stream_log_likelihoods(model, W.tokens_NT, W.targets_NT, None, batch_size)
        entry: dict[str, Any] = {
            "documents": len(docs),
            "windows": len(wins),
            "tokens": int(W.score_NT.sum()),
        }
        if experts:
            cached = None
            if any(m in modes for m in ("cached", "topk")) and domain in manifest["domains"]:
                dev = load_blocks(data_root, tokenizer, domain, dev_split, T, cached_blocks)
                cached, _ = _cached_prior(
                    model, dev, experts, cached_blocks, decay, batch_size, cached_estimator, posterior
                )
            own = experts.index(domain) if domain in experts else None
            res = _demix_domain(ll, W.score_NT, own, experts, list(modes), cached, topk, decay, posterior)
            entry.update(
                ppl=res["ppl"],
                expert_ppl=res["expert_ppl"],
                naive_expert=res["naive_expert"],
                cached_prior=None if cached is None else dict(zip(cached.domains, cached.probs)),
            )
        else:
            entry["ppl"] = {"ppl": mx.perplexity(ll[0], W.score_NT)}
        out["domains"][domain] = entry
    return out
