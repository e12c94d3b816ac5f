"""One evaluation of an in-memory model (all experts held): plan the work (blocks per domain, the priors, a plan
line with its estimated time), score the priors, then every domain - every mode from the same all-experts pass
per block - and the paper's tables (launcher/evaluation/evaluate.py's docstring)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from launcher.checkpoint_data import (
    block_inputs,
    check_token_ids,
    count_blocks,
    data_manifest,
    domain_token_count,
    load_blocks,
)
from launcher.evaluation.context import EvalContext
from launcher.evaluation.device import rank_and_world, say
from launcher.evaluation.prior_cache import PriorCache
from launcher.evaluation.prior_stage import prior_plan, save_priors, score_priors
from launcher.evaluation.progress import Progress, plan_line
from launcher.evaluation.report import _fmt, summary_tables, write_outputs
from launcher.evaluation.results import (
    DEMIX_MODES,
    ROUTER_MODES,
    DomainResult,
    EvalOptions,
    EvalResult,
    PriorCacheUse,
)
from launcher.evaluation.scoring import (
    _demix_domain,
    _domain_token_entry,
    stream_log_likelihoods,
    stream_scores,
    time_block_pass,
)
from launcher.evaluation.stats import block_sums
from launcher.evaluation.unigram import domain_unigram
from model import mixture as mx
from model.accounting import normalise_precision
from model.batched import demix_expert_ids


def evaluate_model(
    model: torch.nn.Module,
    cfg: Any,
    train_domains: Sequence[str],
    data_root: str | Path,
    options: EvalOptions = EvalOptions(),
    *,
    extra: dict[str, Any] | None = None,
    cached_priors: dict[str, mx.CachedPrior] | None = None,
    prior_cache: PriorCache | None = None,
    router_vectors: torch.Tensor | None = None,
) -> EvalResult:
    """Evaluate an in-memory model (all experts held) on every domain of the prepared data, on the model's device in
    `options.precision` (fp32, or bf16/fp16 autocast over fp32 weights: `forward_precision`). `cached_priors` maps a
    domain to a prior to use instead of estimating one on `dev_split`; `prior_cache` (launcher/evaluation/
    prior_cache.py) keeps the estimated ones for the next evaluation of the same checkpoint, data and settings.
    `extra` is recorded with the settings (`EvalResult.extra`). `router_vectors` (E x D, row j for
    `train_domains[j]`, launcher/router_vectors.py `router_matrix`) enable the router modes: by default (`modes`
    None) they run where given; asked for without them, ValueError before any work. With `options.progress`, a
    plan line (work, estimated time, the prior's cost) and then block counts with an ETA go to stderr
    (launcher/evaluation/progress.py). `EvalResult.to_dict()` is the dict of `EVAL_SCHEMA`."""
    o = options
    if o.posterior not in mx.POSTERIORS or o.cached_estimator not in mx.CACHED_ESTIMATORS:
        raise ValueError(
            f"posterior={o.posterior!r} / cached_estimator={o.cached_estimator!r}: choose from "
            f"{', '.join(mx.POSTERIORS)} / {', '.join(mx.CACHED_ESTIMATORS)}"
        )
    t0 = time.perf_counter()
    tell = functools.partial(say, o.progress)
    e = _context(model, cfg, train_domains, data_root, o, extra or {}, router_vectors)
    result = _empty_result(e, cfg, o, extra or {})
    plan = _blocks_plan(e, o.domains, tell)
    priors, to_score, prior_note, key = {}, {}, "", None
    if e.experts and any(m in e.modes for m in ("cached", "topk")):
        priors, to_score, prior_note, key = prior_plan(e, list(plan), cached_priors, prior_cache, tell)
        result.prior_cache = PriorCacheUse(
            file=str(prior_cache.file(key)) if key else None,
            from_cache=[d for d in priors if not priors[d].get("given")],
            scored=list(to_score),
        )
    elif e.experts:
        priors = {d: {"prior": p, "given": True} for d, p in (cached_priors or {}).items() if d in plan}
        prior_note = "prior: none (no cached/topk mode)"
    _say_plan(e, plan, to_score, prior_note, o.progress, tell)
    prog = Progress(sum(plan.values()) * e.passes_per_block + sum(to_score.values()), tell)
    t_prior = time.perf_counter()
    scored = score_priors(e, to_score, prog)
    prior_seconds = time.perf_counter() - t_prior
    priors.update(scored)
    estimated = {d: p["prior"] for d, p in priors.items() if p["prior"] is not None and not p.get("given")}
    for dom in plan:
        result.domains[dom] = _evaluate_domain(e, dom, priors.get(dom), prog, tell)
    result.tables = summary_tables(result.to_dict())
    result.seconds = round(time.perf_counter() - t0, 3)
    if o.out_dir is not None and rank_and_world()[0] == 0:  # the estimated priors are written with the report
        result.files = write_outputs(result.to_dict(), o.out_dir, estimated)
    # cached only once the evaluation has succeeded (its outputs published): a failed one leaves nothing behind
    save_priors(prior_cache, key, scored, prior_seconds, tell)
    return result


def _context(
    model: torch.nn.Module,
    cfg: Any,
    train_domains: Sequence[str],
    data_root: str | Path,
    o: EvalOptions,
    extra: dict[str, Any],
    router_vectors: torch.Tensor | None = None,
) -> EvalContext:
    """The evaluation's shared state, after checking the block length against the model's context, the data's
    tokenizer against the checkpoint's (`data_manifest`), the domain names against the experts and the modes
    against the router vectors (`_demix_modes`)."""
    tokenizer, seq_len = o.tokenizer or cfg.data.tokenizer, o.seq_len or cfg.model.seq_len
    if seq_len > cfg.model.seq_len:
        raise ValueError(f"seq_len={seq_len} is beyond the model's context ({cfg.model.seq_len} tokens)")
    manifest = data_manifest(data_root, tokenizer, extra.get("tokenizer_sha256"), extra.get("vocab_size"))
    where = str(Path(data_root) / tokenizer / "manifest.json")
    rows = model.wte.weight.shape[0] if hasattr(model, "wte") else cfg.model.padded_vocab_size(1)
    check_token_ids(manifest, rows, where, domain_token_count(cfg, list(train_domains)))
    is_demix = bool(demix_expert_ids(model))
    experts = list(train_domains) if is_demix else []
    if is_demix and len(experts) != len(demix_expert_ids(model)):
        raise ValueError(f"{len(experts)} domain names for {len(demix_expert_ids(model))} experts")
    modes = _demix_modes(o.modes, experts, router_vectors, cfg.model.d_model) if is_demix else ["ppl"]
    routed = any(m in ROUTER_MODES for m in modes)
    return EvalContext(
        model.eval(),
        data_root,
        tokenizer,
        manifest,
        list(train_domains),
        experts,
        modes,
        o.split,
        o.dev_split,
        seq_len,
        o.max_blocks,
        o.batch_size,
        normalise_precision(o.precision),
        o.cached_blocks,
        o.decay,
        o.topk,
        o.posterior,
        o.cached_estimator,
        o.unigram,
        cfg.data.mixture == "domain_token",
        router_vectors if routed else None,
        o.router_temperature if routed else None,
    )


def _demix_modes(
    asked: Sequence[str] | None, experts: list[str], router_vectors: torch.Tensor | None, d_model: int
) -> list[str]:
    """The DEMix modes to run: `asked` (unknown names dropped, as always), or by default every mode, the router
    ones only with `router_vectors`. ValueError (before any block pass) for a router mode asked for without them,
    or vectors of another shape than experts x d_model."""
    if router_vectors is not None and tuple(router_vectors.shape) != (len(experts), d_model):
        raise ValueError(
            f"router vectors of shape {tuple(router_vectors.shape)} for {len(experts)} experts of d_model {d_model}"
        )
    if asked is None:
        return [m for m in DEMIX_MODES if m not in ROUTER_MODES or router_vectors is not None]
    modes = [m for m in asked if m in DEMIX_MODES]
    routed = [m for m in modes if m in ROUTER_MODES]
    if routed and router_vectors is None:
        raise ValueError(
            f"modes {routed} need router vectors for the experts {experts}, and none were given (a checkpoint "
            "records them in meta.json 'router_vectors', launcher/router_vectors.py)"
        )
    return modes


def _empty_result(e: EvalContext, cfg: Any, o: EvalOptions, extra: dict[str, Any]) -> EvalResult:
    """The result's settings, no domain yet."""
    return EvalResult(
        kind=cfg.model.ffn.kind,
        data_mixture=cfg.data.mixture,
        experts=e.experts,
        train_domains=list(e.train_domains),
        split=o.split,
        dev_split=o.dev_split,
        seq_len=e.seq_len,
        max_blocks=o.max_blocks,
        modes=e.modes,
        decay=o.decay,
        cached_blocks=o.cached_blocks,
        topk=o.topk,
        posterior=o.posterior,
        cached_estimator=o.cached_estimator,
        device=str(e.device),
        precision=e.precision,
        router_temperature=e.router_temperature,
        extra=dict(extra),
    )


def _blocks_plan(e: EvalContext, domains: Sequence[str] | None, tell: Callable[..., None]) -> dict[str, int]:
    """{domain: test blocks to score} of the asked domains (default: the manifest's), those without a block left
    out with a note; ValueError when none has one."""
    all_domains = list(domains) if domains is not None else list(e.manifest["domains"])
    plan = {
        d: count_blocks(e.data_root, e.tokenizer, d, e.split, e.seq_len, e.max_blocks) for d in all_domains
    }
    for dom in [d for d, n in plan.items() if not n]:
        tell(f"[eval] {dom}/{e.split}: no blocks of {e.seq_len}+1 tokens, skipped")
    plan = {d: n for d, n in plan.items() if n}
    if not plan:
        raise ValueError(
            f"no domain of {all_domains} has a {e.split} block of {e.seq_len}+1 tokens in {e.data_root}/"
            f"{e.tokenizer}: the evaluation has no rows"
        )
    return plan


def _say_plan(
    e: EvalContext,
    plan: dict[str, int],
    to_score: dict[str, int],
    prior_note: str,
    progress: bool,
    tell: Callable[..., None],
) -> None:
    """The plan line: the work, and its estimated time from one timed batch (rank 0, with progress only)."""
    sec, timed = None, 0
    if progress and rank_and_world()[0] == 0:
        dom = next(iter(plan))
        n = e.batch_size if e.max_blocks is None else min(e.batch_size, e.max_blocks)
        sec, timed = time_block_pass(
            e.model, load_blocks(e.data_root, e.tokenizer, dom, e.split, e.seq_len, n), e.precision
        )
    tell(
        plan_line(
            plan,
            e.split,
            e.seq_len,
            len(e.experts),
            e.modes,
            e.passes_per_block,
            to_score,
            e.dev_split,
            prior_note,
            sec,
            timed,
            rank_and_world()[1],
        )
    )


def _evaluate_domain(
    e: EvalContext,
    dom: str,
    prior: dict[str, Any] | None,
    prog: Progress,
    tell: Callable[..., None],
) -> DomainResult:
    """One domain's entry of eval.json: every mode from the same log-likelihoods of its test blocks."""
    role = "train" if dom in e.train_domains else "novel"
    own = e.train_domains.index(dom) if role == "train" else None
    prog.start(f"{dom} ({role}, {e.split})")
    blocks = load_blocks(e.data_root, e.tokenizer, dom, e.split, e.seq_len, e.max_blocks)
    tokens, targets, mask = block_inputs(blocks)
    r = DomainResult(role=role, blocks=int(len(blocks)), tokens=int(mask.sum()))
    if e.unigram:
        r.unigram = _unigram(e, dom, targets, mask, tell)
    if e.experts:
        # the router weights of the same blocks come from the same batches (features of the same pass)
        ll, log_w = stream_scores(
            e.model,
            tokens,
            targets,
            None,
            e.batch_size,
            e.precision,
            prog.at,
            e.router_vectors,
            e.router_temperature or mx.ROUTER_TEMPERATURE,
            mask,
        )
        if prior and prior.get("variants"):
            r.cached_prior_variants = prior["variants"]
        mixed = _demix_domain(
            ll,
            mask,
            own,
            e.experts,
            e.modes,
            prior["prior"] if prior else None,
            e.topk,
            e.decay,
            e.posterior,
            log_w,
        )
        r.expert_ppl, r.naive_expert, r.ppl = mixed["expert_ppl"], mixed["naive_expert"], mixed["ppl"]
        r.posterior, r.topk, r.cached_prior = mixed["posterior"], mixed.get("topk"), mixed.get("cached_prior")
        r.router = mixed.get("router")
        r.block_nll, r.block_tokens = mixed.get("block_nll"), mixed.get("block_tokens")
    elif e.domain_token:
        base = int(e.manifest["tokenizer"]["vocab_size"])
        tok = _domain_token_entry(
            e.model, blocks, base, e.train_domains, own, e.batch_size, e.precision, prog.at
        )
        r.expert_ppl, r.naive_expert, r.ppl = tok["expert_ppl"], tok["naive_expert"], tok["ppl"]
        r.block_nll, r.block_tokens = tok["block_nll"], tok["block_tokens"]
    else:
        ll = stream_log_likelihoods(e.model, tokens, targets, None, e.batch_size, e.precision, prog.at)
        r.ppl = {"ppl": mx.perplexity(ll[0], mask)}
        nll, r.block_tokens = block_sums(ll[0], mask)
        r.block_nll = {"ppl": nll}
    prog.stage_done(
        len(blocks) * e.passes_per_block,
        "done: " + ", ".join(f"{m} {_fmt(v)}" for m, v in r.ppl.items()),
    )
    return r


def _unigram(
    e: EvalContext, dom: str, targets: torch.Tensor, mask: torch.Tensor, tell: Callable[..., None]
) -> dict[str, Any] | None:
    """The domain's own add-k unigram baseline on the same targets (launcher/evaluation/unigram.py); None, with a
    note, where it has none."""
    try:
        return domain_unigram(
            e.data_root,
            e.tokenizer,
            dom,
            e.seq_len,
            int(e.manifest["tokenizer"]["vocab_size"]),
            targets,
            mask,
            e.dev_split,
        )
    except ValueError as err:
        tell(f"[eval] {dom}: no unigram baseline ({err})")
        return None
