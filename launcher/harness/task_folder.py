"""A task folder's format and fingerprint: `file_hashes` is the sha256 of every file `write_tasks` wrote (kept in
its record), `verify_tasks_dir` checks them before lm-eval imports anything from the folder, and
`read_task_documents` gives the documents its perplexity tasks score."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from data.readers import check_shape, read_json_object

TASKS_FORMAT = (
    "demix-harness-tasks/2"  # /2: the record holds the sha256 of every file written (`verify_tasks_dir`)
)


OLD_TASKS_FORMATS = ("demix-harness-tasks/1",)  # replaced by `tasks`, refused by `check`


def file_hashes(root: str | Path) -> dict[str, str]:
    """sha256 of every file under `root` by relative POSIX path, the folder's record (demix_tasks.json) excepted;
    a symbolic link to a directory is listed as "<link>" (never followed)."""
    root, out = Path(root), {}
    for top, dirs, files in os.walk(root):
        for name in sorted(files) + sorted(d for d in dirs if os.path.islink(os.path.join(top, d))):
            path = Path(top) / name
            rel = path.relative_to(root).as_posix()
            if rel != "demix_tasks.json":
                out[rel] = "<link>" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def verify_tasks_dir(tasks_dir: str | Path) -> dict[str, Any]:
    """The record of a task folder, after checking that its files are exactly those `write_tasks` wrote, unchanged
    (the sha256 it recorded). lm-eval imports the folder's utils.py for the `!function` of its task YAMLs (and Python
    would load a `__pycache__` beside it instead), so a changed or added .py, .yaml or bytecode file would run code:
    ValueError naming them, before anything in the folder is imported."""
    root = Path(tasks_dir)
    path = root / "demix_tasks.json"
    rec = read_json_object(path, {"format": str, "domains": dict}, what="harness task folder record")
    if rec["format"] != TASKS_FORMAT:
        raise ValueError(
            f"{path}: format {rec['format']!r}, not {TASKS_FORMAT!r} (a folder written before its files "
            "were fingerprinted, or not by `harness tasks`): write it again with `python -m "
            "launcher.harness tasks`"
        )
    check_shape(rec, {"files": dict}, path, "harness task folder record")
    now, then = file_hashes(root), rec["files"]
    diff = {
        "changed": sorted(f for f in then if f in now and now[f] != then[f]),
        "added": sorted(f for f in now if f not in then),
        "missing": sorted(f for f in then if f not in now),
    }
    if any(diff.values()):
        listed = "; ".join(f"{k}: {', '.join(v[:5])}" for k, v in diff.items() if v)
        raise ValueError(
            f"{root} is not as `harness tasks` wrote it ({listed}); nothing in it was imported (lm-eval "
            "would import its utils.py and follow its YAMLs: a changed or added file could run code). "
            "Write the folder again with `python -m launcher.harness tasks`"
        )
    return rec


def read_task_documents(tasks_dir: str | Path, domains: Sequence[str] | None = None) -> dict[str, list[str]]:
    """{domain: texts} of the perplexity tasks in a folder written by `write_tasks` (the documents they score)."""
    rec = read_json_object(
        Path(tasks_dir) / "demix_tasks.json", {"domains": dict}, what="harness task folder record"
    )
    out = {}
    for d in domains or list(rec["domains"]):
        if d not in rec["domains"]:
            raise ValueError(f"domain {d!r} has no task in {tasks_dir}; domains: {', '.join(rec['domains'])}")
        path = Path(tasks_dir) / "data" / f"ppl_{d}.jsonl"
        try:
            out[d] = [
                json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines() if line
            ]
        except (OSError, ValueError, LookupError, TypeError) as e:
            raise ValueError(
                f"{path} is not a task data file of `harness tasks` ({type(e).__name__}: {e})"
            ) from None
    return out
