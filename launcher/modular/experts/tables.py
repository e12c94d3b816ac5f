"""The paper's modularity tables as numbers: adaptation (Tables 6 and 13: perplexity on the training and the new
domains before and after DAPT) and removal (Table 7, as a full matrix over removed experts x domains)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from launcher.checkpoint import Consolidated
from launcher.checkpoint_data import data_source
from launcher.evaluation.evaluate import evaluate_checkpoint
from launcher.expert_surgery import CkptLike, _load, _require_demix
from launcher.ffn_kinds import ffn_kind
from launcher.modular.experts.scoring import domain_log_likelihoods, masked_mixture

ADAPT_REPORT_FORMAT = "demix-adapt-report/1"
REMOVAL_REPORT_FORMAT = "demix-removal-report/2"


def pct_change(after: float, before: float) -> float:
    """The change from `before` to `after` in percent."""
    return 100.0 * (after / before - 1.0)


def _ppl_of(res: dict[str, Any], domain: str, mode: str) -> float:
    return float(res["domains"][domain]["ppl"][mode])


def adaptation_report(
    demix_before: CkptLike,
    demix_after: CkptLike,
    dense_before: CkptLike,
    dense_after: CkptLike,
    new_domains: Sequence[str],
    data: str | None = None,
    tokenizer: str | None = None,
    max_blocks: int | None = 16,
    cached_blocks: int = 16,
) -> dict[str, Any]:
    """Tables 6 and 13: perplexity on the training domains (T) and the new domains (N) before and after adaptation.
    DEMix: the cached-prior mixture over all experts the checkpoint holds (§6: "mix with a cached prior"), and each
    training domain's own expert (naive; unchanged by DEMix-DAPT by construction). Dense: the model itself."""
    cks = {
        k: _load(v)
        for k, v in (
            ("demix_before", demix_before),
            ("demix_after", demix_after),
            ("dense_before", dense_before),
            ("dense_after", dense_after),
        )
    }
    train = [d for d in cks["demix_before"].domains if d not in new_domains]
    data, tokenizer = data_source(cks["demix_before"], data, tokenizer)
    doms = train + list(new_domains)
    res = {}
    for name, c in cks.items():
        modes = ("naive", "cached") if ffn_kind(c.cfg).domain_experts else ("ppl",)
        res[name] = evaluate_checkpoint(
            c,
            data,
            tokenizer=tokenizer,
            split="test",
            max_blocks=max_blocks,
            modes=modes,
            domains=doms,
            cached_blocks=cached_blocks,
            progress=False,
        ).to_dict()
    rows: dict[str, dict[str, float]] = {}
    for name in cks:
        mode = "cached" if ffn_kind(cks[name].cfg).domain_experts else "ppl"
        rows[name] = {d: _ppl_of(res[name], d, mode) for d in doms}
        if mode == "cached":
            rows[name + "_own_expert"] = {d: _ppl_of(res[name], d, "naive") for d in train}
    summary = {}
    for arch in ("demix", "dense"):
        b, a = rows[f"{arch}_before"], rows[f"{arch}_after"]
        t_b, t_a = float(np.mean([b[d] for d in train])), float(np.mean([a[d] for d in train]))
        n_b, n_a = float(np.mean([b[d] for d in new_domains])), float(np.mean([a[d] for d in new_domains]))
        summary[arch] = {
            "experts_before": len(cks[f"{arch}_before"].domains) if arch == "demix" else None,
            "experts_after": len(cks[f"{arch}_after"].domains) if arch == "demix" else None,
            "train_before": t_b,
            "train_after": t_a,
            "train_change_pct": pct_change(t_a, t_b),
            "novel_before": n_b,
            "novel_after": n_a,
            "novel_change_pct": pct_change(n_a, n_b),
        }
    own_b, own_a = rows["demix_before_own_expert"], rows["demix_after_own_expert"]
    paths = dict(
        demix_before=demix_before, demix_after=demix_after, dense_before=dense_before, dense_after=dense_after
    )
    return {
        "format": ADAPT_REPORT_FORMAT,
        "train_domains": train,
        "new_domains": list(new_domains),
        "max_blocks": max_blocks,
        "cached_blocks": cached_blocks,
        "per_domain": rows,
        "summary": summary,
        "own_expert_max_abs_change": max(abs(own_a[d] - own_b[d]) for d in train),
        "checkpoints": {k: None if isinstance(v, Consolidated) else str(v) for k, v in paths.items()},
    }


def removal_report(
    ckpt: CkptLike,
    data: str | None = None,
    tokenizer: str | None = None,
    domains: Sequence[str] | None = None,
    max_blocks: int | None = 16,
    cached_blocks: int = 16,
) -> dict[str, Any]:
    """Table 7 as a full matrix: for each evaluated domain d (`domains`, default every expert's), the cached-prior
    mixture with all experts (+Expert) and with each expert r masked out, from one all-experts pass per domain.
    `per_domain[d]` is Table 7's row (r = d); `matrix[r][d]` the change on every domain when r is removed;
    `own_change_mean` / `other_change_mean` average the diagonal / the off-diagonal cells."""
    c = _load(ckpt)
    _require_demix(c, "the removal table")
    data, tokenizer = data_source(c, data, tokenizer)
    model = c.build_model().eval()
    every = list(range(len(c.domains)))
    rows, matrix, matrix_ppl = {}, {r: {} for r in c.domains}, {r: {} for r in c.domains}
    for d in domains or c.domains:
        ll, mask = domain_log_likelihoods(model, data, tokenizer, d, "test", max_blocks)
        dev_ll, dev_mask = domain_log_likelihoods(model, data, tokenizer, d, "valid", cached_blocks)
        plus, prior = masked_mixture(ll, mask, dev_ll, dev_mask, c.domains, every, cached_blocks)
        for r in c.domains:
            minus, _ = masked_mixture(
                ll, mask, dev_ll, dev_mask, c.domains, [j for j in every if c.domains[j] != r], cached_blocks
            )
            matrix[r][d], matrix_ppl[r][d] = pct_change(minus, plus), minus
        if d in c.domains:
            rows[d] = {
                "plus_expert": plus,
                "minus_expert": matrix_ppl[d][d],
                "change_pct": matrix[d][d],
                "prior_on_own_expert": dict(zip(prior.domains, prior.probs)).get(d),
            }
        else:
            rows[d] = {"plus_expert": plus}
    own = [matrix[d][d] for d in rows if d in c.domains]
    other = [matrix[r][d] for r in c.domains for d in rows if d != r]
    table7 = {d: r for d, r in rows.items() if "minus_expert" in r}
    avg = (
        {k: float(np.mean([r[k] for r in table7.values()])) for k in ("plus_expert", "minus_expert")}
        if table7
        else {}
    )
    return {
        "format": REMOVAL_REPORT_FORMAT,
        "experts": c.domains,
        "max_blocks": max_blocks,
        "cached_blocks": cached_blocks,
        "per_domain": table7,
        "average": avg,
        "evaluated_domains": list(rows),
        "plus_expert": {d: r["plus_expert"] for d, r in rows.items()},
        "matrix": matrix,
        "matrix_ppl": matrix_ppl,
        "own_change_mean": float(np.mean(own)) if own else None,
        "other_change_mean": float(np.mean(other)) if other else None,
    }
