"""Reading run directories and their evaluations, checked, before anything is written.

Reads each run directory as the launcher and trainer write it: `config.yaml` (the resolved config; a run started
bare with `python -m launcher.train` has none, and `model/meta.json`'s copy is read instead), `command.sh` (the
exact launch command; `command.node<K>.sh` of other nodes too), `metrics.jsonl` (launcher/metrics.py: `start`,
`train` and `eval` records) and the run's evaluation, the eval.json of `launcher.evaluation.evaluate`: by default
`<run>/model/eval/eval.json` (the evaluator's default --out) or else `<run>/eval/eval.json` (the demo's). `--eval`,
given once per run in the order of the runs, overrides it: an eval.json, a folder holding one, `auto` (the
default lookup) or `none`. Bad input is refused with an InputFileError: a folder without metrics.jsonl or a
config, an eval file that is not the evaluator's JSON.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data.readers import InputFileError, check_shape, read_json, read_yaml

EVAL_FORMAT = "demix-eval/1"  # launcher/evaluation/evaluate.py (not imported: it loads torch)
EVAL_DEFAULTS = ("model/eval/eval.json", "eval/eval.json")


@dataclass
class Run:
    """One run directory as read: its config (a plain dict), commands, metrics records and evaluation."""

    path: Path
    config: dict[str, Any]
    config_source: str
    records: list[dict[str, Any]]
    skipped_lines: int = 0
    command: str | None = None
    node_commands: dict[str, str] = field(default_factory=dict)
    label: str = ""
    evaluation: dict[str, Any] | None = None
    eval_path: Path | None = None


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


def load_run(path: str | Path) -> Run:
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


def load_eval(path: str | Path) -> tuple[dict[str, Any], Path]:
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


def read_inputs(run_dirs: Sequence[str | Path], evals: Sequence[str] = ()) -> list[Run]:
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
