"""A summary of your own runs: loss curves, throughput, perplexities side by side, and the exact commands.

    python -m launcher.report RUN_DIR [RUN_DIR ...] [--eval EVAL_JSON_OR_DIR|auto|none ...] --out REPORT_DIR

Writes REPORT_DIR/report.md and report.html (the same content; the HTML needs only the PNGs beside it),
loss.png (training loss vs step, one line per run) and loss_domains.png (per training domain), and report.json
(every number shown, format `demix-run-report/1`; a later report may replace the folder). Without matplotlib the
PNGs are left out and the report says so. Bad input is refused before anything is written.

The package, in reading order: runs.py (reading run directories and evaluations), numbers.py (throughput,
summaries, the perplexity table's data), figures.py (the loss plots), sections.py (the report's sections and
report.json), document.py (Markdown and HTML), cli.py (`write_report` and the command line).
"""

from launcher.report.cli import REPORT_FILES, main, write_report
from launcher.report.numbers import perplexities, run_summary, throughput
from launcher.report.runs import Run, load_eval, load_run, read_inputs
from launcher.report.sections import REPORT_FORMAT, build_report

__all__ = [
    "REPORT_FILES",
    "REPORT_FORMAT",
    "Run",
    "build_report",
    "load_eval",
    "load_run",
    "main",
    "perplexities",
    "read_inputs",
    "run_summary",
    "throughput",
    "write_report",
]
