"""How far a merged DEMix model (experts' parameters averaged, launcher/modular/hf_export/) is from the DEMix
expert mixture it stands for, per domain, on the same test blocks.

    python -m experiments.merge_quality CKPT [CKPT ...] [--data artifacts/demo/tokens] [--tokenizer TOK]
        [--max-blocks 64] [--cached-blocks 100] [--batch-size 4] [--record experiments/results/merge_quality.md]

Shape legend: E experts (= training domains), L layers, N test blocks, T tokens per block.

For every domain d of the prepared data (training and novel roles, from its manifest) and every checkpoint:

* weights  w = the cached prior of d (DEMix §5.1): the mean over the first `cached_blocks` blocks of d's `valid`
  split of the end-of-block posteriors under the uniform prior (eqs. 7-8, whole-prefix evidence), estimated by
  launcher.evaluation.evaluate's `_cached_prior` (mean estimator, prefix posterior: the evaluator's defaults). It is
  also the prior `merge_weights_from_data` (hf_export `--merge-domain-data`) gives an export: the same estimator on
  the same blocks (tests/benchmarks/test_merge_quality.py checks they agree). Mixture, fixed, merged and top-1 all
  use this w.
* mixture  the DEMix cached-prior mixture (eq. 6, posterior eqs. 7-8 under prior w): evaluate's `_demix_domain` in
  mode `cached` on the experts' log-likelihoods of the test blocks (`stream_log_likelihoods`), i.e. exactly
  `evaluate_checkpoint`'s number:  log p(x_t | x_<t) = logsumexp_j [ ll_j(t) + log p(D = j | x_<t) ],
  ll_j = the model with every layer routed to expert j.
* fixed    eq. 6 with the weights held at w (no posterior update within the block):
  log p(x_t | x_<t) = logsumexp_j [ ll_j(t) + log w_j ]. The output mixture the merged model approximates most
  directly; the gap mixture -> fixed is what the per-token posterior buys, fixed -> merged what averaging parameters
  instead of outputs costs.
* merged   one dense model whose FFN in layer l has the parameters sum_j w_j theta_j^l
  (hf_export.dense_model(c, w)); attention, norms and embeddings are shared, so they are unchanged.
* top-1    the single expert j* = argmax_j w_j alone (its test perplexity from the same evaluation).

Perplexity is exp(mean NLL over the scored tokens of the domain's first `max_blocks` test blocks); averages over
domains are plain means of the per-domain perplexities (the paper's Tables 3 and 5); the ratio of an average row is
the ratio of the two averages.

Expert coherence per layer (launcher/modular/btx/ `average_coherence`, what `upcycle` records for averaged layers):
||mean_j W_j|| / mean_j ||W_j|| over the experts' fc1 weights: 1 when the experts are equal, about 1/sqrt(E) when
they are independent matrices. Parameter averaging is exact only in the first case (hf_export's docstring).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from data.argtypes import positive_int
from data.cli import cli_main, usage_error
from launcher.checkpoint import CheckpointError, Consolidated, load_consolidated, write_json_atomic
from launcher.checkpoint_data import block_inputs, check_checkpoint_data, load_blocks
from launcher.evaluation.scoring import _cached_prior, _demix_domain, stream_log_likelihoods
from launcher.ffn_kinds import ffn_kind
from launcher.modular.btx import average_coherence
from launcher.modular.hf_export import dense_model
from model import mixture as mx

MERGE_QUALITY_FORMAT = "demix-merge-quality/1"


def expert_coherence(c: Consolidated) -> dict[int, float]:
    """{layer: ||mean_j W_j|| / mean_j ||W_j||} over the fc1 weights of every layer's experts
    (btx.average_coherence)."""
    return {l: average_coherence(c.state_dict, len(c.domains), l) for l in range(c.cfg.model.n_layers)}


def fixed_weight_log_probs(ll_ENT: torch.Tensor, weights_E: Sequence[float]) -> torch.Tensor:
    """Eq. 6 with fixed weights g_j = w_j at every token: log p(x_t) = logsumexp_j [ll_j(t) + log w_j], N T."""
    log_w_E = torch.log(torch.tensor(list(weights_E), dtype=torch.float64))
    return mx.mixture_log_probs(ll_ENT, log_w_E[:, None, None].expand(ll_ENT.shape))


@torch.no_grad()
def merged_log_likelihoods(
    c: Consolidated,
    weights_E: Sequence[float],
    tokens_NT: torch.Tensor,
    targets_NT: torch.Tensor,
    batch_size: int = 4,
) -> torch.Tensor:
    """Token log-likelihoods N T of the merged model, every DEMix FFN W = sum_j w_j W_j (hf_export.dense_model)."""
    return stream_log_likelihoods(dense_model(c, weights_E), tokens_NT, targets_NT, None, batch_size)[0]


def _require_mergeable(c: Consolidated, source: str) -> None:
    kind = ffn_kind(c.cfg)
    if not kind.domain_experts:
        raise CheckpointError(
            f"{source}: a {c.cfg.model.ffn.kind!r} checkpoint has no domain experts to merge; "
            "give a DEMix checkpoint (RUN_DIR/model of a model.ffn.kind=demix run)"
        )
    if c.cfg.data.mixture == "domain_token":
        raise CheckpointError(
            f"{source}: a +Domain-Token model reads a domain token the merged model has no use for"
        )


@torch.no_grad()
def domain_merge_quality(
    c: Consolidated,
    model: torch.nn.Module,
    data: str | Path,
    tokenizer: str,
    domain: str,
    *,
    split: str = "test",
    dev_split: str = "valid",
    max_blocks: int | None = 64,
    cached_blocks: int = mx.CACHED_PRIOR_BLOCKS,
    batch_size: int = 4,
) -> dict[str, Any] | None:
    """One domain's row (`merge_quality`'s "domains" entry), or None without test or development blocks. The
    experts' log-likelihoods, the cached prior and the mixture come from launcher.evaluation.evaluate's building
    blocks (the calls `evaluate_model` makes in mode `cached`), so the mixture is its number."""
    T, experts = c.cfg.model.seq_len, list(c.domains)
    blocks = load_blocks(data, tokenizer, domain, split, T, max_blocks)
    dev = load_blocks(data, tokenizer, domain, dev_split, T, cached_blocks)
    if not len(blocks) or not len(dev):
        return None
    tokens_NT, targets_NT, mask_NT = block_inputs(blocks)
    ll_ENT = stream_log_likelihoods(model, tokens_NT, targets_NT, None, batch_size)
    prior, _ = _cached_prior(
        model, dev, experts, cached_blocks, mx.UPDATING_DECAY, batch_size, "mean", "prefix"
    )
    own = experts.index(domain) if domain in experts else None
    ev = _demix_domain(ll_ENT, mask_NT, own, experts, ["cached"], prior, 2, mx.UPDATING_DECAY, "prefix")
    w = dict(zip(prior.domains, prior.probs))
    w_E = [w[d] for d in experts]
    top = max(experts, key=w.__getitem__)
    ppl = {
        "mixture": ev["ppl"]["cached"],
        "fixed": mx.perplexity(fixed_weight_log_probs(ll_ENT, w_E), mask_NT),
        "merged": mx.perplexity(merged_log_likelihoods(c, w_E, tokens_NT, targets_NT, batch_size), mask_NT),
        "top1": ev["expert_ppl"][top],
    }
    return {
        "role": "train" if own is not None else "novel",
        "blocks": len(blocks),
        "tokens": int(mask_NT.sum()),
        "dev_blocks": prior.blocks,
        "weights": w,
        "max_weight": w[top],
        "top1_expert": top,
        "ppl": ppl,
        "merged_over_mixture": ppl["merged"] / ppl["mixture"],
    }


def merge_quality(
    ckpt: str | Path | Consolidated,
    data: str | Path,
    *,
    tokenizer: str | None = None,
    max_blocks: int | None = 64,
    cached_blocks: int = mx.CACHED_PRIOR_BLOCKS,
    batch_size: int = 4,
    domains: Sequence[str] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Mixture vs fixed-weight mixture vs merged vs top-1 perplexity of every domain of the data (default: all in
    its manifest) for one DEMix checkpoint (module docstring). Returns {"format", "checkpoint", "step", "experts",
    "max_blocks", "cached_blocks", "coherence": {layer: c}, "domains": {d: {"role", "blocks", "tokens",
    "dev_blocks", "weights": {expert: w}, "max_weight", "top1_expert", "ppl": {"mixture", "fixed", "merged",
    "top1"}, "merged_over_mixture"}}, "averages": {"train"|"novel": {"domains", "ppl", "merged_over_mixture",
    "max_weight"}}, "seconds"}."""
    t0 = time.perf_counter()
    source = "checkpoint" if isinstance(ckpt, Consolidated) else str(ckpt)
    c = ckpt if isinstance(ckpt, Consolidated) else load_consolidated(ckpt)
    _require_mergeable(c, source)
    tokenizer = tokenizer or c.meta.get("tokenizer", c.cfg.data.tokenizer)
    manifest = check_checkpoint_data(c, data, tokenizer)  # refuses tokens of another tokenizer
    unknown = [d for d in (domains or []) if d not in manifest["domains"]]
    if unknown:
        raise ValueError(
            f"domains {unknown} are not in {data}/{tokenizer} (domains: {', '.join(manifest['domains'])})"
        )
    model = c.build_model().eval()
    out: dict[str, Any] = {
        "format": MERGE_QUALITY_FORMAT,
        "checkpoint": None if source == "checkpoint" else source,
        "step": c.step,
        "experts": list(c.domains),
        "max_blocks": max_blocks,
        "cached_blocks": cached_blocks,
        "coherence": expert_coherence(c),
        "domains": {},
    }
    for dom in domains or manifest["domains"]:
        row = domain_merge_quality(
            c,
            model,
            data,
            tokenizer,
            dom,
            max_blocks=max_blocks,
            cached_blocks=cached_blocks,
            batch_size=batch_size,
        )
        if row is None:
            _say(
                progress, f"[merge] {dom}: no test or valid blocks of {c.cfg.model.seq_len}+1 tokens, skipped"
            )
            continue
        out["domains"][dom] = row
        p = row["ppl"]
        _say(
            progress,
            f"[merge] {dom} ({row['role']}): mixture {p['mixture']:.2f} fixed {p['fixed']:.2f} "
            f"merged {p['merged']:.2f} top-1 {p['top1']:.2f}",
        )
    out["averages"] = _averages(out["domains"])
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


def _averages(doms: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Plain means of the per-domain perplexities per role; the ratio of the means."""
    avg: dict[str, dict[str, Any]] = {}
    for role in ("train", "novel"):
        rows = [r for r in doms.values() if r["role"] == role]
        if not rows:
            continue
        ppl = {k: sum(r["ppl"][k] for r in rows) / len(rows) for k in rows[0]["ppl"]}
        avg[role] = {
            "domains": len(rows),
            "ppl": ppl,
            "merged_over_mixture": ppl["merged"] / ppl["mixture"],
            "max_weight": sum(r["max_weight"] for r in rows) / len(rows),
        }
    return avg


# ----------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------


def _table(res: dict[str, Any]) -> list[str]:
    lines = [
        "| domain | role | mixture ppl | fixed-w mixture ppl | merged ppl | merged / mixture | top-1 expert "
        "| top-1 ppl | max merge weight |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for dom, r in res["domains"].items():
        p = r["ppl"]
        lines.append(
            f"| {dom} | {r['role']} | {p['mixture']:.2f} | {p['fixed']:.2f} | {p['merged']:.2f} | "
            f"{r['merged_over_mixture']:.3f} | {r['top1_expert']} | {p['top1']:.2f} | {r['max_weight']:.3f} |"
        )
    for role, a in res["averages"].items():
        p = a["ppl"]
        lines.append(
            f"| **avg {role}** ({a['domains']}) | {role} | {p['mixture']:.2f} | {p['fixed']:.2f} | "
            f"{p['merged']:.2f} | {a['merged_over_mixture']:.3f} | | {p['top1']:.2f} | {a['max_weight']:.3f} |"
        )
    return lines


def markdown(rep: dict[str, Any]) -> str:
    """The results file: command, date, machine, load, then per checkpoint its coherence and table."""
    m = rep["machine"]
    lines = [
        "# Merged model vs DEMix mixture (parameter averaging vs output mixture, eq. 6)",
        "",
        f"Command: `{rep['command']}`  ",
        f"Date: {rep['date']}; {rep['seconds']:.0f} s in all.  ",
        f"Machine: {m['cores']} cores ({m['cpu'] or 'unknown CPU'}), torch {m['torch']}, "
        f"{'GPU ' + m['gpu'] if m['gpu'] else 'no GPU used'}.  ",
        f"`uptime` before: `{rep['uptime_before']}`  ",
        f"`uptime` after: `{rep['uptime_after']}`  ",
        "(a shared machine; perplexities do not depend on its load, only the time does)",
        "",
        f"Test split, the first {rep['max_blocks']} blocks per domain; merge weights = each domain's cached prior "
        f"(mean of the end-of-block posteriors of its first {rep['cached_blocks']} `valid` blocks, eqs. 7-8), the "
        "same weights for the mixture (its prior), the fixed-weight mixture, the merged model and the top-1 "
        "choice. mixture = DEMix cached-prior mixture (eq. 6, per-token posterior); fixed-w = eq. 6 with the "
        "weights held at the cached prior; merged = one FFN per layer with parameters sum_j w_j W_j "
        "(hf_export.dense_model); top-1 = the expert of the largest weight alone. Averages are plain means of "
        "the per-domain perplexities; their ratio is the ratio of the means.",
        "",
    ]
    for res in rep["checkpoints"]:
        E = len(res["experts"])
        coh = ", ".join(f"layer {l}: {v:.3f}" for l, v in res["coherence"].items())
        lines += (
            [
                f"## `{res['checkpoint']}` (step {res['step']}, {E} experts; {res['seconds']:.0f} s)",
                "",
                f"Expert coherence ||mean W|| / mean ||W|| (fc1, per layer; 1 = equal experts, 1/sqrt({E}) = "
                f"{E**-0.5:.3f} = unrelated): {coh}",
                "",
            ]
            + _table(res)
            + [""]
        )
    if rep.get("interpretation"):
        lines += ["## Interpretation", "", rep["interpretation"], ""]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "checkpoints", nargs="+", metavar="CKPT", help="consolidated DEMix checkpoints (RUN_DIR/model)"
    )
    p.add_argument("--data", default="artifacts/demo/tokens", help="prepared tokens root")
    p.add_argument("--tokenizer", help="tokenizer directory name (default: each checkpoint's)")
    p.add_argument("--max-blocks", type=positive_int, default=64, help="test blocks per domain")
    p.add_argument(
        "--cached-blocks",
        type=positive_int,
        default=mx.CACHED_PRIOR_BLOCKS,
        help="valid blocks per domain the cached prior (= merge weights) is estimated on",
    )
    p.add_argument(
        "--batch-size", type=positive_int, default=4, help="blocks per batched pass (x E sequences)"
    )
    p.add_argument("--domains", help="comma-separated domains (default: all in the data manifest)")
    p.add_argument("--record", help="write the markdown report here and the JSON beside it (.json)")
    p.add_argument(
        "--interpretation", metavar="FILE", help="a paragraph (text file) to close the markdown report"
    )
    return p.parse_args(argv)


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks.machine import machine_info, uptime

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    t0 = time.perf_counter()
    rep: dict[str, Any] = {
        "format": MERGE_QUALITY_FORMAT,
        "command": "python -m experiments.merge_quality " + shlex.join(argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine_info(),
        "max_blocks": args.max_blocks,
        "cached_blocks": args.cached_blocks,
        "uptime_before": uptime(),
    }
    domains = [d.strip() for d in args.domains.split(",") if d.strip()] if args.domains else None
    try:
        rep["checkpoints"] = [
            merge_quality(
                ck,
                args.data,
                tokenizer=args.tokenizer,
                max_blocks=args.max_blocks,
                cached_blocks=args.cached_blocks,
                batch_size=args.batch_size,
                domains=domains,
            )
            for ck in args.checkpoints
        ]
    except (CheckpointError, ValueError) as e:
        return usage_error(e)
    rep["uptime_after"] = uptime()
    rep["seconds"] = time.perf_counter() - t0
    if args.interpretation:
        rep["interpretation"] = Path(args.interpretation).read_text().strip()
    text = markdown(rep)
    if args.record:
        Path(args.record).parent.mkdir(parents=True, exist_ok=True)
        Path(args.record).write_text(text)
        write_json_atomic(Path(args.record).with_suffix(".json"), rep)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
