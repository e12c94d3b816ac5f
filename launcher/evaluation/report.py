"""An evaluation's report: the paper's tables (`summary_tables`: Tables 3, 4 and 5 with bootstrap intervals),
their markdown (`markdown_report`), and the files of --out (`write_outputs`: eval.json, eval.md, the figures, the
estimated cached priors), all from the result dict (`EvalResult.to_dict()`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from data.atomic import staged_dir, write_json_atomic
from launcher.evaluation.stats import bootstrap_mean_ppl, bootstrap_ppl
from launcher.tables import markdown_table

# What `write_outputs` writes into --out (figures by launcher/evaluation/figures.py).
EVAL_FILES = ("eval.json", "eval.md", "posteriors.png", "specialisation.png")


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def summary_tables(results: dict[str, Any]) -> dict[str, Any]:
    """Table 3 (mean over training domains), Table 4 (per domain), Table 5 (mean over novel domains), each with
    95 % bootstrap intervals over blocks (launcher/evaluation/stats.py) where the per-block NLLs were recorded."""
    doms = results["domains"]
    per_domain = {d: r["ppl"] for d, r in doms.items()}
    avg, avg_ci = {}, {}
    for role in ("train", "novel"):
        avg[role] = {
            m: _mean([r["ppl"][m] for r in doms.values() if r["role"] == role and m in r["ppl"]])
            for m in results["modes"]
        }
        avg_ci[role] = {}
        for m in results["modes"]:
            blocks = [
                (r["block_nll"][m], r["block_tokens"])
                for r in doms.values()
                if r["role"] == role and m in r.get("block_nll", {})
            ]
            if blocks:
                avg_ci[role][m] = list(bootstrap_mean_ppl(blocks)[1:])
    per_domain_ci = {
        d: {m: list(bootstrap_ppl(nll, r["block_tokens"])[1:]) for m, nll in r.get("block_nll", {}).items()}
        for d, r in doms.items()
    }
    unigram = {
        role: _mean([r["unigram"]["ppl"] for r in doms.values() if r["role"] == role and "unigram" in r])
        for role in ("train", "novel")
    }
    return {
        "in_domain_average": avg["train"],
        "novel_average": avg["novel"],
        "per_domain": per_domain,
        "unigram_in_domain_average": unigram["train"],
        "unigram_novel_average": unigram["novel"],
        "in_domain_average_ci": avg_ci["train"],
        "novel_average_ci": avg_ci["novel"],
        "per_domain_ci": per_domain_ci,
    }


def _fmt(v: float | None) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:.2f}"


def markdown_report(results: dict[str, Any]) -> str:
    """The paper's tables as markdown (modes as rows)."""
    label = _model_label(results)
    lines = _header(results) + _in_domain_table(results, label)
    for role, title in (("train", "Training domains (cf. Table 4)"), ("novel", "Novel domains")):
        lines += _domain_table(results, label, role, title)
    t = results["tables"]
    lines += ["", "## Novel-domain average perplexity (cf. Table 5)", ""]
    lines += markdown_table(
        ["model", "avg ppl"], [[label(m), _fmt(t["novel_average"][m])] for m in results["modes"]]
    )
    return "\n".join(lines + _expert_notes(results["domains"])) + "\n"


def _model_label(results: dict[str, Any]) -> Callable[[str], str]:
    """A mode's row label: `DEMix (<mode>)`, or the kind of a model without experts."""
    if results["experts"]:
        return lambda m: f"DEMix ({m})"
    name = results["kind"] + (" +Domain-Token" if results["data_mixture"] == "domain_token" else "")
    return lambda m: name


def _header(results: dict[str, Any]) -> list[str]:
    """Title, checkpoint, device and precision (when not the CPU in fp32), and the priors' settings (DEMix)."""
    lines = [
        f"# Evaluation ({results['split']} split, {results['seq_len']}-token blocks"
        + (f", at most {results['max_blocks']} blocks per domain" if results["max_blocks"] else "")
        + ")",
        "",
    ]
    if results.get("checkpoint"):
        lines += [f"checkpoint: `{results['checkpoint']}` (step {results.get('step')})", ""]
    if results.get("precision", "fp32") != "fp32" or results.get("device", "cpu") != "cpu":
        lines += [
            f"device: {results.get('device', 'cpu')}; precision: {results.get('precision', 'fp32')}"
            + (
                " (autocast: matmuls in half precision, log-likelihoods and sums in fp32)"
                if results.get("precision", "fp32") != "fp32"
                else ""
            ),
            "",
        ]
    if results["experts"]:
        lines += [
            f"posterior: {results.get('posterior', 'prefix')} (evidence of every posterior); cached prior: "
            f"{results.get('cached_estimator', 'updating')} over {results['cached_blocks']} "
            f"{results['dev_split']} blocks; updating prior λ = {results['decay']}",
            "",
        ]
    if results.get("router_temperature") is not None:
        lines += [
            f"router: the experts' router vectors, centred cosine to the prefix mean, τ = "
            f"{results['router_temperature']} (no dev data)",
            "",
        ]
    return lines


def _in_domain_table(results: dict[str, Any], label: Callable[[str], str]) -> list[str]:
    """Table 3: the average over the training domains, with its 95 % interval."""
    t = results["tables"]
    ci = t.get("in_domain_average_ci", {})
    return ["## In-domain average perplexity (cf. Table 3)", ""] + markdown_table(
        ["model", "avg ppl", "95% interval (blocks)"],
        [
            [
                label(m),
                _fmt(t["in_domain_average"][m]),
                f"{_fmt(ci[m][0])} – {_fmt(ci[m][1])}" if m in ci else "–",
            ]
            for m in results["modes"]
        ],
    )


def _domain_table(results: dict[str, Any], label: Callable[[str], str], role: str, title: str) -> list[str]:
    """Per-domain perplexities of the domains of one role (Table 4 for the training ones), their average, and the
    unigram baseline's row where there is one; nothing without such domains."""
    doms, t = results["domains"], results["tables"]
    names = [d for d, r in doms.items() if r["role"] == role]
    if not names:
        return []
    avg = "in_domain_average" if role == "train" else "novel_average"
    rows = [
        [label(m), *(_fmt(doms[d]["ppl"].get(m)) for d in names), _fmt(t[avg][m])] for m in results["modes"]
    ]
    if any("unigram" in doms[d] for d in names):
        uni = t.get("unigram_in_domain_average" if role == "train" else "unigram_novel_average")
        rows.append(
            [
                "unigram (own train split)",
                *(_fmt(doms[d]["unigram"]["ppl"]) if "unigram" in doms[d] else "–" for d in names),
                _fmt(uni),
            ]
        )
    return ["", f"## {title}", ""] + markdown_table(["model", *names, "avg"], rows)


def _expert_notes(doms: dict[str, Any]) -> list[str]:
    """The naive expert of each domain and the top-k experts chosen, where the evaluation has them."""
    lines = []
    naive = {d: r["naive_expert"] for d, r in doms.items() if "naive_expert" in r}
    if naive:
        lines += [
            "",
            "naive expert per domain (own expert in-domain, best single expert on novel domains): "
            + ", ".join(f"{d} -> {e}" for d, e in naive.items()),
        ]
    tk = {d: r["topk"] for d, r in doms.items() if "topk" in r}
    if tk:
        k = next(iter(tk.values()))
        lines += [
            f"top-k: k = {k['k']} of {k['of']} experts evaluated per token (chosen by the cached prior): "
            + ", ".join(f"{d} -> {'+'.join(v['experts'])}" for d, v in tk.items())
        ]
    return lines


def write_outputs(
    results: dict[str, Any], out_dir: str | Path, cached_priors: dict[str, Any] | None = None
) -> dict[str, str]:
    """Write the report into `out_dir` (eval.json, eval.md, the figures, `cached_priors/<domain>.json` for each
    estimated prior); returns {name: path}. Staged and published together (data/atomic.py `staged_dir`): a failure
    (a full disk included) leaves no report without its eval.json."""
    from launcher.evaluation.figures import write_figures

    out_dir = Path(out_dir)
    with staged_dir(out_dir, manifest="eval.json") as tmp:
        for dom, prior in (cached_priors or {}).items():
            prior.save(tmp / "cached_priors" / f"{dom}.json")
        files = {"json": str(out_dir / "eval.json"), "markdown": str(out_dir / "eval.md")}
        files.update(
            {k: str(out_dir / Path(v).relative_to(tmp)) for k, v in write_figures(results, tmp).items()}
        )
        results["files"] = files
        (tmp / "eval.md").write_text(markdown_report(results))
        write_json_atomic(tmp / "eval.json", results)
    return files
