"""The command line: `tasks` writes a task folder, `run` is lm-eval's own CLI with model `demix` registered,
`check` compares the harness with evaluate (docs/harness.md)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from data.argtypes import nonneg_float, positive_int, random_seed
from data.atomic import write_json_atomic
from data.cli import cli_main
from launcher.harness.check import check, print_check
from launcher.harness.lm_eval_runner import run_lm_eval
from launcher.harness.model_args import MODES
from launcher.harness.tasks import MC_TASK, PPL_GROUP, write_tasks

DESCRIPTION = "The DEMix mixture inside EleutherAI's lm-evaluation-harness (lm_eval 0.4), offline."


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    """`python -m launcher.harness tasks|run|check ...`; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":  # everything after `run` is lm-eval's
        return run_lm_eval(argv[1:])
    p = parser()
    a = p.parse_args(argv)
    if a.command == "tasks":
        return _tasks(a)
    return _check(a, p)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launcher.harness", description=DESCRIPTION)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tasks", help="write local lm-eval tasks (YAML + JSONL) from a prepared split")
    t.add_argument("--data", required=True, help="prepared tokens root, e.g. artifacts/demo/tokens")
    t.add_argument(
        "--tokenizer",
        default="gpt2",
        choices=("gpt2", "sentencepiece"),
        help="tokenizer of the stored n_tokens (the models' tokenizer)",
    )
    t.add_argument("--out", required=True, help="task folder (pass it to lm-eval as --include_path)")
    t.add_argument("--split", default="test", choices=("train", "valid", "test"))
    t.add_argument("--max-docs", type=positive_int, default=None, help="first N documents of each domain")
    t.add_argument("--domains", help="comma-separated subset of the domains (default: all)")
    t.add_argument("--seed", type=random_seed, default=0, help="distractors of the multiple-choice task")
    t.add_argument(
        "--docs-from",
        choices=("gpt2", "sentencepiece"),
        help="prepared dataset whose corpus and split give the documents (default: --tokenizer's)",
    )
    sub.add_parser(
        "run", help="lm-eval's CLI with model demix registered: run ARGS... (lm-eval run's arguments)"
    )
    c = sub.add_parser("check", help="harness token perplexity vs evaluate_documents (and an hf export)")
    c.add_argument("checkpoint")
    c.add_argument("--tasks-dir", required=True)
    c.add_argument("--data", required=True)
    c.add_argument("--domains", help="comma-separated (default: every task's domain)")
    c.add_argument("--modes", default="cached,naive", help=f"comma-separated subset of {','.join(MODES)}")
    c.add_argument("--hf-domain", help="also export this expert and run the stock hf model on its task")
    c.add_argument("--batch-size", type=positive_int, default=8)
    c.add_argument("--model-args", default="", help="extra demix model_args, e.g. posterior=previous_token")
    c.add_argument(
        "--tolerance", type=nonneg_float, default=1e-4, help="largest relative difference accepted"
    )
    c.add_argument("--json", help="also write the result here")
    return p


def _tasks(a: argparse.Namespace) -> int:
    rec = write_tasks(
        a.data,
        a.tokenizer,
        a.out,
        a.split,
        a.max_docs,
        [d.strip() for d in a.domains.split(",")] if a.domains else None,
        a.seed,
        a.docs_from,
    )
    for _d, r in rec["domains"].items():
        print(f"{r['task']}: {r['documents']} documents, {r['tokens']} tokens")
    print(f"{MC_TASK}: {rec['continuation']['documents']} documents")
    print(f"written: {a.out} (lm-eval --include_path {a.out} --tasks {PPL_GROUP},{MC_TASK})")
    return 0


def _check(a: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"--modes {bad}: choose from {', '.join(MODES)}")
    res = check(
        a.checkpoint,
        a.tasks_dir,
        a.data,
        [d.strip() for d in a.domains.split(",")] if a.domains else None,
        modes,
        a.hf_domain,
        a.batch_size,
        a.model_args,
    )
    print_check(res)
    if a.json:
        write_json_atomic(Path(a.json), res)
    worst = max((r["rel_diff"] for r in res["rows"]), default=0.0)
    if worst > a.tolerance:
        print(
            f"error: harness and evaluate_documents differ by {worst:.2e} relative (> {a.tolerance})",
            file=sys.stderr,
        )
        return 1
    return 0
