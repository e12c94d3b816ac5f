"""A summary of your own runs: loss curves, throughput, perplexities side by side, and the exact commands.

    python -m launcher.report RUN_DIR [RUN_DIR ...] [--eval EVAL_JSON_OR_DIR|auto|none ...] --out REPORT_DIR

Reads each run directory as the launcher and trainer write it: `config.yaml` (the resolved config; a run started
bare with `python -m launcher.train` has none, and `model/meta.json`'s copy is read instead), `command.sh` (the
exact launch command; `command.node<K>.sh` of other nodes too), `metrics.jsonl` (launcher/metrics.py: `start`,
`train` and `eval` records) and the run's evaluation, the eval.json of `launcher.evaluation.evaluate`: by default
`<run>/model/eval/eval.json` (the evaluator's default --out) or else `<run>/eval/eval.json` (the demo's). `--eval`,
given once per run in the order of the runs, overrides it: an eval.json, a folder holding one, `auto` (the
default lookup) or `none`.

Writes REPORT_DIR/report.md and report.html (the same content; the HTML needs only the PNGs beside it),
loss.png (training loss vs step, one line per run) and loss_domains.png (per training domain), and report.json
(every number shown, format `demix-run-report/1`; a later report may replace the folder). Without matplotlib the
PNGs are left out and the report says so.

Throughput is the median over a run's `train` records after the first one of each start (its interval includes
start-up), with the count used; `tokens_per_s` in metrics.jsonl is global (all ranks), per GPU is global / the
world size of the run's `start` record ("per GPU" = per rank). Bad input is refused before anything is written:
a folder without metrics.jsonl or a config, an eval file that is not the evaluator's JSON.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import os
import re
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from data.atomic import staged_dir
from data.cli import check_output_dir, cli_main, exit_process
from data.readers import InputFileError, check_shape, read_json, read_yaml

REPORT_FORMAT = "demix-run-report/1"
EVAL_FORMAT = "demix-eval/1"  # launcher/evaluation/evaluate.py (not imported: it loads torch)
REPORT_FILES = ("report.md", "report.html", "report.json", "loss.png", "loss_domains.png")
EVAL_DEFAULTS = ("model/eval/eval.json", "eval/eval.json")
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


# --------------------------------------------------------------------------------------------------
# Reading run directories and evaluations
# --------------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One run directory as read: its config (a plain dict), commands, metrics records and evaluation."""

    path: Path
    config: dict[str, Any]
    config_source: str
    records: list[dict[str, Any]]
    skipped_lines: int = 0
    command: Optional[str] = None
    node_commands: dict[str, str] = field(default_factory=dict)
    label: str = ""
    evaluation: Optional[dict[str, Any]] = None
    eval_path: Optional[Path] = None


def read_records(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of a metrics.jsonl file and the count of lines that are not one (a line cut short by a
    killed run is skipped, as the trainer's resume does)."""
    records, skipped = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                skipped += 1
                continue
            if isinstance(rec, dict):
                records.append(rec)
            else:
                skipped += 1
    return records, skipped


def _run_config(path: Path) -> tuple[dict[str, Any], str]:
    """The run's resolved config: config.yaml (launch), else model/meta.json's (the trainer's export)."""
    if (path / "config.yaml").is_file():
        cfg = read_yaml(path / "config.yaml")
        check_shape(cfg, {"model": {"ffn": dict}}, path / "config.yaml", "a run config")
        return cfg, "config.yaml"
    if (path / "model" / "meta.json").is_file():
        meta = read_json(path / "model" / "meta.json", "the exported model's meta")
        check_shape(
            meta,
            {"config": {"model": {"ffn": dict}}},
            path / "model" / "meta.json",
            "the exported model's meta",
        )
        return meta["config"], "model/meta.json"
    raise InputFileError(
        f"{path} is not a run directory: config.yaml is missing (launcher.launch writes it), and "
        "there is no model/meta.json with the resolved config either"
    )


def load_run(path: Union[str, Path]) -> Run:
    """Read run directory `path`; InputFileError naming what is missing when it is not one."""
    path = Path(path)
    if not path.is_dir():
        raise InputFileError(
            f"{path} is not a run directory: " + ("it is a file" if path.exists() else "no such folder")
        )
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise InputFileError(
            f"{path} is not a run directory: metrics.jsonl is missing (the trainer's rank 0 writes "
            "it at the first log interval)"
        )
    cfg, source = _run_config(path)
    records, skipped = read_records(metrics)
    if not any(r.get("kind") == "train" for r in records):
        raise InputFileError(
            f"{metrics} holds no training record (kind: train) yet: nothing to report for this run"
        )
    command = (path / "command.sh").read_text(encoding="utf-8") if (path / "command.sh").is_file() else None
    nodes = {p.name: p.read_text(encoding="utf-8") for p in sorted(path.glob("command.node*.sh"))}
    return Run(path, cfg, source, records, skipped, command, nodes)


def load_eval(path: Union[str, Path]) -> tuple[dict[str, Any], Path]:
    """An evaluation (eval.json, or a folder holding one) of launcher.evaluation.evaluate, checked; InputFileError
    when it is missing, not JSON, or not the evaluator's."""
    path = Path(path)
    file = path / "eval.json" if path.is_dir() else path
    data = read_json(file, "an evaluation of launcher.evaluation.evaluate")
    if not isinstance(data, dict) or data.get("format") != EVAL_FORMAT:
        fmt = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise InputFileError(
            f"{file} is not an eval.json of launcher.evaluation.evaluate (format {fmt!r}, expected "
            f"{EVAL_FORMAT!r})"
        )
    check_shape(data, {"modes": list, "domains": dict, "tables?": dict}, file, "an evaluation")
    for name, entry in data["domains"].items():
        check_shape(entry, {"role": str, "ppl": dict}, file, f"the evaluation of domain {name!r}")
    return data, file


def attach_evals(runs: list[Run], evals: Sequence[str]) -> None:
    """Each run's evaluation: `evals[i]` for run i (a path, `auto` or `none`), or the default lookup."""
    if evals and len(evals) != len(runs):
        raise InputFileError(
            f"--eval given {len(evals)} time(s) for {len(runs)} run directories: give it once per run, "
            "in the same order (auto: the run's own evaluation, none: no evaluation)"
        )
    for i, run in enumerate(runs):
        choice = evals[i] if evals else "auto"
        if choice == "none":
            continue
        if choice == "auto":
            found = next((run.path / p for p in EVAL_DEFAULTS if (run.path / p).is_file()), None)
            if found is None:
                continue
            choice = str(found)
        run.evaluation, run.eval_path = load_eval(choice)


def label_runs(runs: list[Run]) -> None:
    """Short distinct labels: the folder name, with its parent's where two runs share one."""
    names = [r.path.resolve().name for r in runs]
    for i, run in enumerate(runs):
        run.label = names[i] if names.count(names[i]) == 1 else "/".join(run.path.resolve().parts[-2:])
    seen: dict[str, int] = {}
    for run in runs:
        seen[run.label] = seen.get(run.label, 0) + 1
        if seen[run.label] > 1:
            run.label = f"{run.label} #{seen[run.label]}"


# --------------------------------------------------------------------------------------------------
# Numbers
# --------------------------------------------------------------------------------------------------


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def world_size_of(run: Run) -> Optional[int]:
    """The run's world size: its latest `start` record's, else the `# world size N` line of command.sh."""
    starts = [
        r["world_size"] for r in run.records if r.get("kind") == "start" and _number(r.get("world_size"))
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
            world, fresh = (int(r["world_size"]) if _number(r.get("world_size")) else world), True
            continue
        if r.get("kind") != "train":
            continue
        rec, w = dict(r), world or fallback
        if not _number(rec.get("tokens_per_s_per_gpu")) and _number(rec.get("tokens_per_s")) and w:
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
        vals = [r[key] for r in sample if _number(r.get(key))]
        out[key], counts[key] = (statistics.median(vals) if vals else None), len(vals)
    peaks = [r["peak_mem_gb"] for r in sample if _number(r.get("peak_mem_gb"))]
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
        if k.startswith("val_loss/") and _number(v)
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
            if unigram is None and _number(e.get("unigram", {}).get("ppl")):
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
    keys = ("checkpoint", "step", "split", "seq_len", "max_blocks", "modes", "device", "precision") + (
        ("dev_split", "posterior", "cached_estimator", "cached_blocks", "decay", "topk", "excluded_experts")
        if e.get("experts")
        else ()
    )  # the mixing settings only where there are experts to mix
    return (
        "# not recorded in eval.json (launcher.evaluation.evaluate keeps its settings, not its command line):\n"
        + "\n".join(f"# {k}: {json.dumps(e.get(k))}" for k in keys if k in e)
    )


# --------------------------------------------------------------------------------------------------
# Document: one list of blocks, rendered to Markdown and to HTML
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """A heading (level > 0), a paragraph (`text`), a table (`header` + `rows`), code (`code`) or an image
    (`image`: a file beside the report)."""

    text: str = ""
    level: int = 0
    header: tuple[str, ...] = ()
    rows: tuple[tuple[str, ...], ...] = ()
    code: Optional[str] = None
    image: Optional[str] = None


def fmt(v: Any, digits: int = 3) -> str:
    """A number for a table cell: thousands separators from 1000 on, `digits` significant digits below; – if none."""
    if not _number(v):
        return "–"
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.{digits}g}"


def _pct(v: Any) -> str:
    return f"{100 * v:.1f} %" if _number(v) else "–"


def _ppl(cell: Optional[dict[str, Any]]) -> str:
    if not cell or not _number(cell.get("ppl")):
        return "–"
    ci = cell.get("ci")
    return f"{cell['ppl']:.2f}" + (
        f" [{ci[0]:.2f}–{ci[1]:.2f}]" if isinstance(ci, list) and len(ci) == 2 else ""
    )


def to_markdown(blocks: Sequence[Block]) -> str:
    """The blocks as Markdown."""
    out = []
    cell = lambda s: s.replace("|", "\\|").replace("\n", "<br>")  # noqa: E731
    for b in blocks:
        if b.level:
            out.append("#" * b.level + " " + b.text)
        elif b.header:
            out.append(
                "\n".join(
                    ["| " + " | ".join(cell(h) for h in b.header) + " |", "|---" * len(b.header) + "|"]
                    + ["| " + " | ".join(cell(c) for c in row) + " |" for row in b.rows]
                )
            )
        elif b.code is not None:
            out.append((f"{b.text}\n\n" if b.text else "") + "```bash\n" + b.code.rstrip("\n") + "\n```")
        elif b.image is not None:
            out.append(f"![{b.text}]({b.image})")
        else:
            out.append(b.text)
    return "\n\n".join(out) + "\n"


def _inline(text: str) -> str:
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


def to_html(blocks: Sequence[Block], title: str) -> str:
    """The blocks as one HTML page (inline style; images by file name, beside it)."""
    body = []
    for b in blocks:
        if b.level:
            body.append(f"<h{b.level}>{_inline(b.text)}</h{b.level}>")
        elif b.header:
            head = "".join(f"<th>{_inline(h)}</th>" for h in b.header)
            rows = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>" for r in b.rows)
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif b.code is not None:
            body.append((f"<p>{_inline(b.text)}</p>" if b.text else "") + f"<pre>{html.escape(b.code)}</pre>")
        elif b.image is not None:
            body.append(
                f'<figure><img src="{html.escape(b.image)}" alt="{html.escape(b.text)}">'
                f"<figcaption>{_inline(b.text)}</figcaption></figure>"
            )
        else:
            body.append(f"<p>{_inline(b.text)}</p>")
    style = (
        "body{font-family:sans-serif;max-width:1200px;margin:2em auto;line-height:1.4}table{border-collapse:"
        "collapse;margin:1em 0;font-size:13px}td,th{border:1px solid #bbb;padding:3px 7px;text-align:right}"
        "th{background:#eee}td:first-child{text-align:left}img{max-width:100%}pre{background:#f3f3f3;padding:"
        "8px;white-space:pre-wrap;word-break:break-all}code{background:#f3f3f3;padding:0 3px}"
    )
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


# --------------------------------------------------------------------------------------------------
# Figures (matplotlib, Agg backend; optional)
# --------------------------------------------------------------------------------------------------


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _curve(run: Run, key: str) -> tuple[list[int], list[float]]:
    pts = sorted(
        (r["step"], r[key])
        for r in run.records
        if r.get("kind") == "train" and _number(r.get("step")) and _number(r.get(key))
    )
    return [p[0] for p in pts], [p[1] for p in pts]


def loss_figures(runs: list[Run], out: Path) -> tuple[list[str], list[str]]:
    """Write loss.png (and loss_domains.png where a run logs per-domain losses) into `out`; (files, notes)."""
    plt = _pyplot()
    if plt is None:
        return [], [
            "matplotlib is not installed: loss.png and loss_domains.png were not drawn "
            "(install matplotlib and run the report again)"
        ]
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        ax.plot(*_curve(run, "loss"), label=run.label, marker=".")
    ax.set(xlabel="step", ylabel="training loss (nats/token)", title="Training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    plt.close(fig)
    files = ["loss.png"]
    domains = list(
        dict.fromkeys(
            k[5:]
            for run in runs
            for r in run.records
            if r.get("kind") == "train"
            for k in r
            if k.startswith("loss/")
        )
    )
    if domains:
        cols = min(4, len(domains))
        rows = -(-len(domains) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False, sharex=True)
        for ax, d in zip(axes.flat, domains):
            for run in runs:
                ax.plot(*_curve(run, f"loss/{d}"), label=run.label)
            ax.set_title(d, fontsize=9)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(domains) :]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=7)
        fig.suptitle("Training loss per domain (nats/token) vs step")
        fig.tight_layout()
        fig.savefig(out / "loss_domains.png", dpi=100)
        plt.close(fig)
        files.append("loss_domains.png")
    return files, []


# --------------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------------


def runs_and_speed_blocks(
    runs: list[Run], summaries: list[dict[str, Any]], speeds: list[dict[str, Any]]
) -> list[Block]:
    """The runs table and the throughput table, with the footnote on what the numbers are."""
    runs_rows = tuple(
        (
            r.label,
            str(r.path),
            str(s["ffn_kind"]),
            str(s["data_mixture"]),
            str(s["model"]),
            str(s["world_size"] or "–"),
            f"{s['steps']} / {s['configured_steps']}",
            fmt(s["final_loss"], 4),
            fmt(s["final_val_loss"], 4),
            str(s["device"] or "–"),
        )
        for r, s in zip(runs, summaries)
    )
    speed_rows = tuple(
        (
            r.label,
            str(s["ffn_kind"]),
            str(s["world_size"] or "–"),
            str(s["steps"]),
            f"{t['records']}" + (" (warm-up incl.)" if t["warmup_included"] else ""),
            fmt(t["tokens_per_s"]),
            fmt(t["tokens_per_s_per_gpu"]),
            fmt(t["tflops_per_gpu"]),
            fmt(t["tflops_per_gpu_no_recompute"]),
            _pct(t["mfu"]),
            _pct(t["hfu"]),
            fmt(t["step_time_s"]),
            fmt(t["peak_mem_gb"]),
        )
        for r, s, t in zip(runs, summaries, speeds)
    )
    return [
        Block("Runs", level=2),
        Block(
            header=(
                "run",
                "path",
                "FFN kind",
                "data mixture",
                "model",
                "world size",
                "steps (logged / configured)",
                "final train loss",
                "final val loss (mean over domains)",
                "device",
            ),
            rows=runs_rows,
        ),
        Block("Throughput", level=2),
        Block(
            header=(
                "run",
                "FFN kind",
                "world size",
                "steps",
                "records used",
                "tokens/s (global)",
                "tokens/s per GPU",
                "TFLOP/s per GPU (executed)",
                "TFLOP/s per GPU (model)",
                "MFU",
                "HFU",
                "s/update",
                "peak memory GB",
            ),
            rows=speed_rows,
        ),
        Block(
            "Medians over the `train` records of metrics.jsonl after the first record of each start (its interval "
            "includes start-up); 'records used' is how many. `tokens_per_s` in metrics.jsonl is GLOBAL: the tokens of "
            "the whole global batch per second, all ranks together; tokens/s per GPU = global / world size (ranks, "
            "from the run's `start` record), as the trainer's `tokens_per_s_per_gpu`. TFLOP/s per GPU (executed) is "
            "`tflops_per_gpu`: the FLOPs the hardware runs, activation recompute included, the basis of HFU; "
            "(model) is `tflops_per_gpu_no_recompute`, the basis of MFU. MFU/HFU are – where the device's peak is "
            "unknown (the CPU). Peak memory is the largest over the records and ranks."
        ),
    ]


def ppl_blocks(ppl: dict[str, Any]) -> list[Block]:
    """Per-domain perplexity tables (training domains, then novel ones), one column per run and mode."""
    if not ppl["columns"]:
        return [
            Block("Perplexity", level=2),
            Block(
                "No run has an evaluation (eval.json): run `python -m "
                "launcher.evaluation.evaluate RUN/model --data TOKENS`, or pass "
                "--eval."
            ),
        ]
    keys = [f"{c['run']}|{c['mode']}" for c in ppl["columns"]]
    heads = tuple(c["run"] if c["mode"] == "ppl" else f"{c['run']} ({c['mode']})" for c in ppl["columns"])
    has_unigram = any(row["unigram"] is not None for row in ppl["domains"].values())
    out = [Block("Perplexity", level=2)]
    for role, title in (("train", "Training domains"), ("novel", "Novel domains")):
        names = [d for d, row in ppl["domains"].items() if (row["role"] == "train") == (role == "train")]
        if not names:
            continue
        rows = [
            (d, *(_ppl(ppl["domains"][d]["cells"].get(k)) for k in keys))
            + ((_ppl({"ppl": ppl["domains"][d]["unigram"]}),) if has_unigram else ())
            for d in names
        ]
        avg = ppl["averages"][role]
        rows.append(
            ("average", *(_ppl(avg.get(k)) for k in keys))
            + ((_ppl({"ppl": ppl["averages"][f"unigram_{role}"]}),) if has_unigram else ())
        )
        out += [
            Block(title, level=3),
            Block(header=("domain", *heads) + (("unigram",) if has_unigram else ()), rows=tuple(rows)),
        ]
    out.append(
        Block(
            "Test perplexity per domain, each cell `ppl [low–high]`: the 95 % bootstrap interval over "
            "evaluation blocks that eval.json records (launcher/evaluation/stats.py); `average` is the plain mean "
            "of the per-domain perplexities (the paper's Tables 3 and 5) with its interval. DEMix columns are the "
            "evaluation's mixing modes (naive, average, uniform, updating, cached, topk); other runs have one "
            "(ppl). unigram: each domain's own add-k unigram on the same test tokens, where recorded."
        )
    )
    out += [Block("Note: " + n) for n in ppl["notes"]]
    return out


def command_blocks(runs: list[Run], own: str) -> list[Block]:
    """Each run's command.sh (and other nodes'), its evaluation's command or settings, and this report's."""
    out = [Block("Commands", level=2)]
    for r in runs:
        out.append(Block(r.label, level=3))
        out.append(
            Block(f"`{r.path}/command.sh`:", code=r.command)
            if r.command is not None
            else Block(
                "command.sh: not recorded (the run was not started by `python -m launcher.launch`; the "
                f"resolved config was read from {r.config_source})."
            )
        )
        out += [Block(f"`{name}`:", code=text) for name, text in r.node_commands.items()]
        if r.evaluation is not None:
            out.append(Block(f"evaluation `{r.eval_path}`:", code=eval_command(r)))
    out.append(Block("This report:", code=own))
    return out


def build_report(
    runs: list[Run], own_command: str, figures: list[str], figure_notes: list[str], title: str
) -> tuple[list[Block], dict[str, Any]]:
    """The document's blocks and report.json's content."""
    summaries, speeds, ppl = [run_summary(r) for r in runs], [throughput(r) for r in runs], perplexities(runs)
    blocks = [
        Block(title, level=1),
        Block(
            f"{len(runs)} run(s): "
            + ", ".join(f"{r.label} ({s['ffn_kind']})" for r, s in zip(runs, summaries))
            + f". Written by `python -m launcher.report` at {time.strftime('%Y-%m-%d %H:%M:%S')}."
        ),
    ]
    blocks += runs_and_speed_blocks(runs, summaries, speeds)
    blocks.append(Block("Loss curves", level=2))
    captions = {
        "loss.png": "Training loss vs step, one line per run",
        "loss_domains.png": "Training loss per domain vs step",
    }
    blocks += [Block(captions[f], image=f) for f in figures] + [Block("Note: " + n) for n in figure_notes]
    skipped = [
        f"{r.label}: {r.skipped_lines} line(s) of metrics.jsonl are not JSON records and were skipped"
        for r in runs
        if r.skipped_lines
    ]
    blocks += [Block("Note: " + s) for s in skipped]
    blocks += ppl_blocks(ppl) + command_blocks(runs, own_command)
    data = {
        "format": REPORT_FORMAT,
        "command": own_command,
        "created_unix": int(time.time()),
        "files": figures,
        "notes": figure_notes + skipped + ppl["notes"],
        "perplexity": ppl,
        "runs": [
            {
                "label": r.label,
                "path": str(r.path),
                "config_source": r.config_source,
                **s,
                "throughput": t,
                "command_sh": r.command,
                "node_commands": r.node_commands,
                "eval": None
                if r.evaluation is None
                else {"path": str(r.eval_path), "command": eval_command(r)},
            }
            for r, s, t in zip(runs, summaries, speeds)
        ],
    }
    return blocks, data


def read_inputs(run_dirs: Sequence[Union[str, Path]], evals: Sequence[str] = ()) -> list[Run]:
    """Every run directory and evaluation, checked (InputFileError on the first bad one), labelled."""
    seen = set()
    for p in run_dirs:
        if Path(p).resolve() in seen:
            raise InputFileError(f"{p} is given twice: name each run directory once")
        seen.add(Path(p).resolve())
    runs = [load_run(p) for p in run_dirs]
    attach_evals(runs, evals)
    label_runs(runs)
    return runs


def write_report(
    run_dirs: Sequence[Union[str, Path]],
    out: Union[str, Path],
    evals: Sequence[str] = (),
    own_command: str = "",
    title: str = "Run report",
) -> dict[str, Any]:
    """Read the runs (refusing bad input before anything is written), then write the report folder `out` staged
    (data/atomic.py `staged_dir`: all files or none). Returns report.json's content."""
    runs = read_inputs(run_dirs, evals)
    out = Path(out)
    inputs = [r.path for r in runs] + [r.eval_path for r in runs if r.eval_path is not None]
    check_output_dir(out, [REPORT_FORMAT], REPORT_FILES, inputs=inputs, manifest="report.json", what="--out")
    # a folder holding other things too (e.g. the runs themselves): only the report's files are replaced in it
    shared = out.is_dir() and any(p.name not in REPORT_FILES for p in out.iterdir())
    with staged_dir(out, manifest="report.json", shared=shared) as tmp:
        figures, notes = loss_figures(runs, tmp)
        blocks, data = build_report(runs, own_command, figures, notes, title)
        (tmp / "report.md").write_text(to_markdown(blocks), encoding="utf-8")
        (tmp / "report.html").write_text(to_html(blocks, title), encoding="utf-8")
        (tmp / "report.json").write_text(
            json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )
    for stale in set(REPORT_FILES) - set(figures) - {"report.md", "report.html", "report.json"}:
        (out / stale).unlink(missing_ok=True)  # an earlier report's figure this one did not draw
    return data


@cli_main
def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launcher.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (launcher.launch --run-dir)")
    ap.add_argument(
        "--eval",
        action="append",
        default=[],
        metavar="EVAL_JSON_OR_DIR",
        help="once per run, in order: its eval.json (or the folder), auto (default: "
        f"{' or '.join('RUN/' + p for p in EVAL_DEFAULTS)}) or none",
    )
    ap.add_argument("--out", required=True, help="report folder (report.md, report.html, report.json, PNGs)")
    ap.add_argument("--title", default="Run report")
    args = ap.parse_args(argv)
    own = f"cd {shlex.quote(os.getcwd())}\n" + shlex.join(
        [sys.executable, "-m", "launcher.report", *(argv or [])]
    )
    write_report(args.runs, args.out, args.eval, own, args.title)
    out = Path(args.out)
    print("\n".join(str(out / n) for n in REPORT_FILES if (out / n).is_file()))
    return 0


if __name__ == "__main__":
    exit_process(main())
