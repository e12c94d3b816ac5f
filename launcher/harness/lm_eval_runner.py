"""lm-eval's side: the task folder's metrics through `lm_eval.simple_evaluate`, and lm-eval's own CLI with the
model `demix` registered (`python -m launcher.harness run ...`)."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from launcher.harness.task_folder import verify_tasks_dir


def harness_metrics(
    model: str,
    model_args: str,
    tasks: Sequence[str],
    tasks_dir: str | Path,
    limit: int | None = None,
) -> dict[str, dict[str, Any]]:
    """lm_eval.simple_evaluate on the task folder (its tasks only, offline); returns results per task with the
    ",none" filter suffix dropped from metric names."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    verify_tasks_dir(tasks_dir)  # lm-eval imports the folder's utils.py: only the one `write_tasks` wrote
    bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # no __pycache__ left in the folder
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = lm_eval.simple_evaluate(
                model=model,
                model_args=model_args,
                tasks=list(tasks),
                limit=limit,
                task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
                log_samples=False,
                bootstrap_iters=0,
                device="cpu",
            )
    finally:
        sys.dont_write_bytecode = bytecode
    return {t: {k.split(",")[0]: v for k, v in r.items()} for t, r in res["results"].items()}


def run_lm_eval(argv: Sequence[str]) -> int:
    """lm-eval's own CLI (`lm-eval run ...`) with the demix model registered."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    import launcher.harness.model  # noqa: F401  (registers "demix")

    argv = list(argv)
    # a folder `tasks` wrote is verified as `check` does before lm-eval imports it
    for i, arg in enumerate(argv):
        path = (
            argv[i + 1]
            if arg == "--include_path" and i + 1 < len(argv)
            else (arg.partition("=")[2] if arg.startswith("--include_path=") else None)
        )
        if path and (Path(path) / "demix_tasks.json").is_file():
            verify_tasks_dir(path)
    saved, bytecode = sys.argv, sys.dont_write_bytecode
    sys.argv = ["lm-eval"] + (argv if argv and argv[0] in ("run", "ls", "validate") else ["run"] + argv)
    sys.dont_write_bytecode = (
        True  # no __pycache__ left in a task folder (`verify_tasks_dir` would refuse it)
    )
    try:
        setup_logging()
        cli = HarnessCLI()
        cli.execute(cli.parse_args())
    finally:
        sys.argv, sys.dont_write_bytecode = saved, bytecode
    return 0
