"""What an evaluation is asked (`EvalOptions`) and what it gives (`EvalResult`, one `DomainResult` per domain);
`EvalResult.to_dict()` is eval.json (`EVAL_SCHEMA`), key for key in the order it has always been written."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from model import mixture as mx

DEMIX_MODES: tuple[str, ...] = (
    "naive",
    "average",
    "uniform",
    "updating",
    "cached",
    "topk",
    "router",
    "router_posterior",
)
# the modes that mix with the checkpoint's router vectors (model/mixture.py router eqs. R1-R4): by default only where
# it has one for every expert present; asked for explicitly without them, refused before any block pass
ROUTER_MODES: tuple[str, ...] = ("router", "router_posterior")
EVAL_FORMAT = "demix-eval/1"
EVAL_SCHEMA = """What `EvalResult.to_dict()` gives (and eval.json holds):

    {"format": "demix-eval/1", "kind": "demix"|"dense"|..., "data_mixture": str, "experts": [names] ([] unless
         DEMix), "train_domains": [...], "split": str, "dev_split": str, "seq_len": T, "max_blocks": N|None,
         "modes": [...], "decay": λ, "cached_blocks": n, "topk": k, "posterior": "prefix"|"previous_token",
         "cached_estimator": "mean"|"ewm"|"updating", "device": "cpu"|"cuda:i", "precision": "fp32"|"bf16"|"fp16",
         with a router mode: "router_temperature": τ,
         "seconds": s, **extra (evaluate_checkpoint: "checkpoint": path|None, "step": int),
         "domains": {name: {"role": "train"|"novel", "blocks": int, "tokens": int, "ppl": {mode: float},
                            DEMix/domain-token only: "expert_ppl": {expert: float}, "naive_expert": name,
                            DEMix only: "posterior": {"updating_mean_end_of_block": {expert: p},
                                                      "updating_final_prior": {expert: p}},
                                        "cached_prior": {"probs": {expert: p}, "blocks": n, "estimator",
                                                         "posterior"},
                                        "cached_prior_variants": {"<estimator>/<posterior>": {expert: p}},
                                        "topk": {"k", "experts", "experts_evaluated", "of"},
                                        with a router mode: "router": {"mean_weight": {expert: w averaged over
                                                                       the scored tokens}}}},
         every domain also: "block_nll": {mode: [NLL sum per block, nats]}, "block_tokens": [scored tokens per block],
         and with `unigram`: "unigram": {"ppl", "k", "train_tokens", "block_nll"} (launcher/evaluation/unigram.py: the
         domain's own add-k unigram on the same test targets),
         "tables": {"in_domain_average": {mode: ppl}, "novel_average": {mode: ppl},
                    "per_domain": {domain: {mode: ppl}}, "in_domain_average_ci" / "novel_average_ci": {mode: [lo, hi]},
                    "per_domain_ci": {domain: {mode: [lo, hi]}}}  (95 % bootstrap over blocks, stats.py),
         "prior_cache": {"file": path|None, "from_cache": [domains], "scored": [domains]}  (DEMix with cached/topk),
         "files": {"json", "markdown", "posteriors", "specialisation"}  (when out_dir is given)}
"""


@dataclass(frozen=True)
class EvalOptions:
    """How to evaluate (launcher/evaluation/evaluate.py's docstring): which data (`tokenizer`, default the run
    config's; `split`; `domains`, default every domain of the manifest; at most `max_blocks` blocks of `seq_len`,
    default the model's context), which `modes`, the priors (`cached_blocks` of `dev_split`, `decay` λ of eq. 9,
    `topk`, `posterior`, `cached_estimator`), the batched pass (`batch_size` blocks, `precision`), the report
    (`out_dir`, `unigram` baselines) and `progress` lines on stderr. `modes` None: every DEMix mode, the router
    modes (`ROUTER_MODES`, τ = `router_temperature`) only where the model has router vectors for all its experts."""

    tokenizer: str | None = None
    split: str = "test"
    dev_split: str = "valid"
    max_blocks: int | None = None
    modes: Sequence[str] | None = None
    domains: Sequence[str] | None = None
    batch_size: int = 4
    cached_blocks: int = mx.CACHED_PRIOR_BLOCKS
    decay: float = mx.UPDATING_DECAY
    topk: int = 2
    seq_len: int | None = None
    out_dir: str | Path | None = None
    progress: bool = True
    posterior: str = "prefix"
    cached_estimator: str = "mean"
    unigram: bool = True
    precision: str = "fp32"
    router_temperature: float = mx.ROUTER_TEMPERATURE


@dataclass
class DomainResult:
    """One domain's entry of eval.json (`EVAL_SCHEMA`). DEMix entries have `posterior` (and `expert_ppl`,
    `naive_expert`, maybe `topk`, `cached_prior`, `cached_prior_variants`); +Domain-Token ones `expert_ppl` and
    `naive_expert` only; dense ones neither."""

    role: str
    blocks: int
    tokens: int
    ppl: dict[str, float] = field(default_factory=dict)
    block_nll: dict[str, list[float]] | None = None
    block_tokens: list[int] | None = None
    unigram: dict[str, Any] | None = None
    cached_prior_variants: dict[str, dict[str, float]] | None = None
    expert_ppl: dict[str, float] | None = None
    naive_expert: str | None = None
    posterior: dict[str, dict[str, float]] | None = None
    topk: dict[str, Any] | None = None
    cached_prior: dict[str, Any] | None = None
    router: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The entry as eval.json holds it (the keys in the order the three kinds of entry always had)."""
        out: dict[str, Any] = {"role": self.role, "blocks": self.blocks, "tokens": self.tokens}
        if self.unigram is not None:
            out["unigram"] = self.unigram
        if self.cached_prior_variants is not None:
            out["cached_prior_variants"] = self.cached_prior_variants
        if self.posterior is not None:  # DEMix
            out.update(
                expert_ppl=self.expert_ppl,
                naive_expert=self.naive_expert,
                ppl=self.ppl,
                posterior=self.posterior,
            )
            topk_first = self.topk is not None and next(iter(self.ppl), None) == "topk"
            if topk_first:  # the first mode mixed was topk: its entry came before the block sums
                out["topk"] = self.topk
            if self.block_nll is not None:
                out.update(block_nll=self.block_nll, block_tokens=self.block_tokens)
            if self.topk is not None and not topk_first:
                out["topk"] = self.topk
            if self.cached_prior is not None:
                out["cached_prior"] = self.cached_prior
            if self.router is not None:
                out["router"] = self.router
        elif self.expert_ppl is not None:  # +Domain-Token
            out.update(
                expert_ppl=self.expert_ppl,
                naive_expert=self.naive_expert,
                ppl=self.ppl,
                block_nll=self.block_nll,
                block_tokens=self.block_tokens,
            )
        else:  # one model
            out.update(ppl=self.ppl, block_tokens=self.block_tokens, block_nll=self.block_nll)
        return out


@dataclass
class PriorCacheUse:
    """Where the cached priors of a DEMix evaluation came from: the cache `file`, the domains read from it, and
    those scored here."""

    file: str | None
    from_cache: list[str]
    scored: list[str]


@dataclass
class EvalResult:
    """An evaluation: its settings, every domain's `DomainResult`, the paper's `tables` (`summary_tables`),
    `seconds`, and the report's `files` when one was written. `extra` holds what the caller adds (evaluate_checkpoint:
    checkpoint, step, tokenizer_sha256, vocab_size, excluded_experts)."""

    kind: str
    data_mixture: str
    experts: list[str]
    train_domains: list[str]
    split: str
    dev_split: str
    seq_len: int
    max_blocks: int | None
    modes: list[str]
    decay: float
    cached_blocks: int
    topk: int
    posterior: str
    cached_estimator: str
    device: str
    precision: str
    router_temperature: float | None = None  # with a router mode only
    extra: dict[str, Any] = field(default_factory=dict)
    domains: dict[str, DomainResult] = field(default_factory=dict)
    prior_cache: PriorCacheUse | None = None
    tables: dict[str, Any] | None = None
    seconds: float | None = None
    files: dict[str, str] | None = None
    format: str = EVAL_FORMAT

    def to_dict(self) -> dict[str, Any]:
        """The result as eval.json holds it (`EVAL_SCHEMA`)."""
        out: dict[str, Any] = {
            "format": self.format,
            "kind": self.kind,
            "data_mixture": self.data_mixture,
            "experts": self.experts,
            "train_domains": self.train_domains,
            "split": self.split,
            "dev_split": self.dev_split,
            "seq_len": self.seq_len,
            "max_blocks": self.max_blocks,
            "modes": self.modes,
            "decay": self.decay,
            "cached_blocks": self.cached_blocks,
            "topk": self.topk,
            "posterior": self.posterior,
            "cached_estimator": self.cached_estimator,
            "device": self.device,
            "precision": self.precision,
            **({} if self.router_temperature is None else {"router_temperature": self.router_temperature}),
            **self.extra,
            "domains": {d: r.to_dict() for d, r in self.domains.items()},
        }
        if self.prior_cache is not None:
            out["prior_cache"] = asdict(self.prior_cache)
        for name in ("tables", "seconds", "files"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out
