"""The numbers a report shows, from the runs as read (launcher/report/runs.py): throughput, a summary per run, the
perplexity table's data and each evaluation's command.

Throughput is the median over a run's `train` records after the first one of each start (its interval includes
start-up), with the count used; `tokens_per_s` in metrics.jsonl is global (all ranks), per GPU is global / the
world size of the run's `start` record ("per GPU" = per rank).
"""

from __future__ import annotations

import json
import math
import re
import shlex
import statistics
from typing import Any

from launcher.report.runs import Run

# the metrics.jsonl keys the throughput table gives medians of (launcher/metrics.py)
SPEED_KEYS: tuple[str, ...] = (
    "tokens_per_s",
    "tokens_per_s_per_gpu",
    "tflops_per_gpu",
    "tflops_per_gpu_no_recompute",
    "mfu",
    "hfu",
    "step_time_s",
)


def is_number(v: Any) -> bool:
    """A finite int or float (not a bool): a value a table or a figure can show."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def world_size_of(run: Run) -> int | None:
    """The run's world size: its latest `start` record's, else the `# world size N` line of command.sh."""
    starts = [
        r["world_size"] for r in run.records if r.get("kind") == "start" and is_number(r.get("world_size"))
    ]
    if starts:
        return int(starts[-1])
    m = re.search(r"^# world size (\d+)", run.command or "", re.M)
    return int(m.group(1)) if m else None


def throughput(run: Run) -> dict[str, Any]:
    """Medians of the speed keys over the `train` records after the first of each start, with the counts used;
    per GPU = the record's global tokens/s / the world size of the start it follows."""
    world, fallback, fresh = None, world_size_of(run), True
    used, warm = [], []
    for r in run.records:
        if r.get("kind") == "start":
            world, fresh = (int(r["world_size"]) if is_number(r.get("world_size")) else world), True
            continue
        if r.get("kind") != "train":
            continue
        rec, w = dict(r), world or fallback
        if not is_number(rec.get("tokens_per_s_per_gpu")) and is_number(rec.get("tokens_per_s")) and w:
            rec["tokens_per_s_per_gpu"] = rec["tokens_per_s"] / w
        (warm if fresh else used).append(rec)
        fresh = False
    out: dict[str, Any] = {
        "records": len(used),
        "warmup_records_left_out": len(warm),
        "warmup_included": not used,
    }
    sample = used or warm  # a single interval per start: nothing else to take
    if not used:
        out["records"] = len(warm)
    counts = {}
    for key in SPEED_KEYS:
        vals = [r[key] for r in sample if is_number(r.get(key))]
        out[key], counts[key] = (statistics.median(vals) if vals else None), len(vals)
    peaks = [r["peak_mem_gb"] for r in sample if is_number(r.get("peak_mem_gb"))]
    out["peak_mem_gb"] = max(peaks) if peaks else None
    out["counts"], out["world_size"] = counts, fallback
    return out


def run_summary(run: Run) -> dict[str, Any]:
    """FFN kind, data mixture, world size, steps, final train loss and the final validation losses."""
    train = [r for r in run.records if r.get("kind") == "train"]
    evals = [r for r in run.records if r.get("kind") == "eval"]
    model, data, tr = run.config.get("model", {}), run.config.get("data", {}), run.config.get("train", {})
    val = {
        k.split("/", 1)[1]: v
        for k, v in (evals[-1] if evals else {}).items()
        if k.startswith("val_loss/") and is_number(v)
    }
    return {
        "ffn_kind": model.get("ffn", {}).get("kind"),
        "data_mixture": data.get("mixture"),
        "model": model.get("name"),
        "world_size": world_size_of(run),
        "steps": train[-1].get("step"),
        "configured_steps": tr.get("steps"),
        "final_loss": train[-1].get("loss"),
        "final_val_loss": statistics.mean(val.values()) if val else None,
        "final_val_loss_per_domain": val,
        "device": next((r.get("device") for r in reversed(run.records) if r.get("kind") == "start"), None),
    }


def perplexities(runs: list[Run]) -> dict[str, Any]:
    """Columns (run, mode) and rows (domains: training then novel) of every evaluated run, with the intervals,
    averages and the unigram baseline; notes where the runs' evaluations are not comparable."""
    evaluated = [r for r in runs if r.evaluation is not None]
    columns = [{"run": r.label, "mode": m} for r in evaluated for m in r.evaluation["modes"]]
    roles: dict[str, str] = {}
    for r in evaluated:
        for d, e in r.evaluation["domains"].items():
            roles.setdefault(d, e["role"])
    order = [d for d in roles if roles[d] == "train"] + [d for d in roles if roles[d] != "train"]
    rows, notes = {}, []
    for d in order:
        cells, unigram, shapes = {}, None, set()
        for r in evaluated:
            e, ci = (
                r.evaluation["domains"].get(d),
                r.evaluation.get("tables", {}).get("per_domain_ci", {}).get(d, {}),
            )
            if e is None:
                continue
            shapes.add((e.get("blocks"), e.get("tokens")))
            if e["role"] != roles[d]:
                notes.append(
                    f"{d} is a {e['role']} domain of {r.label} but a {roles[d]} domain of another run"
                )
            if unigram is None and is_number(e.get("unigram", {}).get("ppl")):
                unigram = e["unigram"]["ppl"]
            for m in r.evaluation["modes"]:
                cells[f"{r.label}|{m}"] = {"ppl": e["ppl"].get(m), "ci": ci.get(m)}
        if len(shapes) > 1:
            notes.append(
                f"{d}: the runs were scored on different blocks/tokens {sorted(shapes, key=str)}: "
                "not directly comparable"
            )
        rows[d] = {"role": roles[d], "cells": cells, "unigram": unigram}
    averages = {}
    for role, key in (("train", "in_domain_average"), ("novel", "novel_average")):
        averages[role] = {
            f"{r.label}|{m}": {
                "ppl": r.evaluation.get("tables", {}).get(key, {}).get(m),
                "ci": r.evaluation.get("tables", {}).get(f"{key}_ci", {}).get(m),
            }
            for r in evaluated
            for m in r.evaluation["modes"]
        }
        averages[f"unigram_{role}"] = next(
            (
                r.evaluation.get("tables", {}).get(f"unigram_{key}")
                for r in evaluated
                if r.evaluation.get("tables", {}).get(f"unigram_{key}") is not None
            ),
            None,
        )
    for key in ("split", "seq_len", "max_blocks"):
        if len({json.dumps(r.evaluation.get(key)) for r in evaluated}) > 1:
            notes.append(
                f"the evaluations differ in {key}: "
                + ", ".join(f"{r.label}: {r.evaluation.get(key)}" for r in evaluated)
            )
    return {"columns": columns, "domains": rows, "averages": averages, "notes": notes}


def eval_command(run: Run) -> str:
    """The evaluation's command if eval.json records one, else its recorded settings."""
    e = run.evaluation or {}
    if isinstance(e.get("command"), str):
        return e["command"]
    if isinstance(e.get("argv"), list):
        return shlex.join(str(a) for a in e["argv"])
    # the mixing settings only where there are experts to mix
    keys = ("checkpoint", "step", "split", "seq_len", "max_blocks", "modes", "device", "precision") + (
        ("dev_split", "posterior", "cached_estimator", "cached_blocks", "decay", "topk", "excluded_experts")
        if e.get("experts")
        else ()
    )
    return (
        "# not recorded in eval.json (launcher.evaluation.evaluate keeps its settings, not its command line):\n"
        + "\n".join(f"# {k}: {json.dumps(e.get(k))}" for k in keys if k in e)
    )
