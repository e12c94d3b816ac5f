"""The report's content: its sections as document blocks (runs, throughput, loss curves, perplexity, commands)
and report.json's data (every number shown, format `demix-run-report/1`)."""

from __future__ import annotations

import time
from typing import Any

from launcher.report.document import Block
from launcher.report.numbers import eval_command, is_number, perplexities, run_summary, throughput
from launcher.report.runs import Run

REPORT_FORMAT = "demix-run-report/1"


def fmt(v: Any, digits: int = 3) -> str:
    """A number for a table cell: thousands separators from 1000 on, `digits` significant digits below; – if none."""
    if not is_number(v):
        return "–"
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.{digits}g}"


def _pct(v: Any) -> str:
    return f"{100 * v:.1f} %" if is_number(v) else "–"


def _ppl(cell: dict[str, Any] | None) -> str:
    if not cell or not is_number(cell.get("ppl")):
        return "–"
    ci = cell.get("ci")
    return f"{cell['ppl']:.2f}" + (
        f" [{ci[0]:.2f}–{ci[1]:.2f}]" if isinstance(ci, list) and len(ci) == 2 else ""
    )


SPEED_NOTE = (
    "Medians over the `train` records of metrics.jsonl after the first record of each start (its interval "
    "includes start-up); 'records used' is how many. `tokens_per_s` in metrics.jsonl is GLOBAL: the tokens of "
    "the whole global batch per second, all ranks together; tokens/s per GPU = global / world size (ranks, "
    "from the run's `start` record), as the trainer's `tokens_per_s_per_gpu`. TFLOP/s per GPU (executed) is "
    "`tflops_per_gpu`: the FLOPs the hardware runs, activation recompute included, the basis of HFU; "
    "(model) is `tflops_per_gpu_no_recompute`, the basis of MFU. MFU/HFU are – where the device's peak is "
    "unknown (the CPU). Peak memory is the largest over the records and ranks."
)


def _runs_table(runs: list[Run], summaries: list[dict[str, Any]]) -> Block:
    """One row per run: where it is, what it trained, how far, and its final losses."""
    rows = tuple(
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
    return Block(
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
        rows=rows,
    )


def _speed_table(runs: list[Run], summaries: list[dict[str, Any]], speeds: list[dict[str, Any]]) -> Block:
    """One row per run: the medians of its throughput, FLOPs, utilisation, step time and peak memory."""
    rows = tuple(
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
    return Block(
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
        rows=rows,
    )


def runs_and_speed_blocks(
    runs: list[Run], summaries: list[dict[str, Any]], speeds: list[dict[str, Any]]
) -> list[Block]:
    """The runs table and the throughput table, with the footnote on what the numbers are."""
    return [
        Block("Runs", level=2),
        _runs_table(runs, summaries),
        Block("Throughput", level=2),
        _speed_table(runs, summaries, speeds),
        Block(SPEED_NOTE),
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
