"""A run directory is one the launcher made: recognised by its marker, so a launch never replaces a user's files.

`launch --run-dir DIR` writes config.yaml, command.sh and deepspeed_config.json into DIR, and the ranks write
metrics.jsonl, checkpoints/ and model/. `check_run_dir` applies the project's one output rule
(data/cli.py `check_output_dir`) to it before any work: DIR is new or empty, or carries the marker
`demix_run.json` that `mark_run_dir` writes, or is a run directory of a version before the marker (a training
state in checkpoints/, or a metrics.jsonl that starts with the trainer's start record); otherwise any of those names already there is someone
else's file, and the launch is refused. The tokens it reads are never inside it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterable

from data.atomic import write_json_atomic
from data.cli import check_output_dir

RUN_MARKER = "demix_run.json"
RUN_FORMAT = "demix-run/1"
# What a launch and its ranks write into a run directory.
RUN_FILES = ("config.yaml", "command.sh", "deepspeed_config.json", "metrics.jsonl", "checkpoints", "model", "wandb",
             "wandb_run_id")


def _older_run_dir(run_dir: Path) -> bool:
    """A run directory written before the marker existed (or by ranks started without the launcher): it holds a
    training state (`checkpoints/latest`, or `checkpoints/step_<n>/meta.json`), or its metrics.jsonl opens with the
    trainer's start record."""
    ckdir = run_dir / "checkpoints"
    if (ckdir / "latest").is_file() or any(ckdir.glob("step_*/meta.json")):
        return True
    try:
        with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
            first = json.loads(f.readline())
    except (OSError, ValueError):
        return False
    return isinstance(first, dict) and first.get("kind") == "start"


def check_run_dir(run_dir: Path, inputs: Iterable[Path] = (), what: str = "--run-dir") -> None:
    """OutputError unless `run_dir` may be written by a launch (see the module); `inputs` (the tokens) may not be
    it or hold it."""
    run_dir = Path(run_dir)
    if not (run_dir / RUN_MARKER).exists() and _older_run_dir(run_dir):
        return
    check_output_dir(run_dir, [RUN_FORMAT], RUN_FILES, inputs=inputs, manifest=RUN_MARKER, what=what)


def mark_run_dir(run_dir: Path) -> None:
    """Write the marker (once) that makes `run_dir` a run directory for later launches and resumes."""
    if not (Path(run_dir) / RUN_MARKER).is_file():
        write_json_atomic(Path(run_dir) / RUN_MARKER, {"format": RUN_FORMAT, "created_unix": int(time.time())})
