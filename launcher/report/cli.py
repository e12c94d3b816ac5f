"""A summary of your own runs: loss curves, throughput, perplexities side by side, and the exact commands.

    python -m launcher.report RUN_DIR [RUN_DIR ...] [--eval EVAL_JSON_OR_DIR|auto|none ...] --out REPORT_DIR

`write_report` reads the runs (launcher/report/runs.py), refusing bad input before anything is written, then writes
the report folder staged (all files or none); `main` is the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from data.atomic import staged_dir
from data.cli import check_output_dir, cli_main
from launcher.report.document import to_html, to_markdown
from launcher.report.figures import loss_figures
from launcher.report.runs import EVAL_DEFAULTS, read_inputs
from launcher.report.sections import REPORT_FORMAT, build_report

REPORT_FILES = ("report.md", "report.html", "report.json", "loss.png", "loss_domains.png")


def write_report(
    run_dirs: Sequence[str | Path],
    out: str | Path,
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
def main(argv: Sequence[str] | None = None) -> int:
    """The command line: write the report and print its files' paths (status 2 and one `error:` line on bad input)."""
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
