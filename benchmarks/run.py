"""`make bench`: the CPU throughput sweep, the cost model's paper table, and the report.

    python -m benchmarks.run [--record] [--reuse] [--data PATH [--tokenizer NAME]]
                             [--config configs/sweeps/cpu.yaml] [--sweep-dir runs/sweeps/<name>] [--out DIR]

1. with --data, checks the prepared corpus first (PATH/<tokenizer>/manifest.json, read with data/catalog.py's
   loader; the tokenizer: --tokenizer, else the only one prepared there) and refuses before any work if it is not
   usable; every point then trains on it (data.path, data.tokenizer and model.vocab_size set for every point).
   Without --data, makes sure the demo data exists (builds it with `python -m data.build_demo --tokenizers
   sentencepiece` if artifacts/demo/tokens/sentencepiece is missing, and says so);
2. regenerates the cost model's table for the paper's 12 configurations (`python -m benchmarks.costmodel
   --paper --out-dir <costmodel dir>` -> costmodel_paper.{md,json});
3. runs the sweep (configs/sweeps/cpu.yaml: the tiny demo GPT as Dense, DEMix and GShard on 1, 2 and 4 local
   CPU ranks, one after another, each on a reserved rendezvous port); point run directories go to --sweep-dir
   (ignored by git). Every point is run and timed again: a rerun re-times what it reports. --reuse keeps points
   that finished earlier with the same launch instead; the results and the report mark each "reused from <date>"
   with its own timings and load;
4. renders report.md, report.html, the PNGs and results.json into the report directory, plus bench.json
   (command, machine, timings), and prints where the report is.

Outputs go to runs/bench/ (ignored by git): the report to runs/bench/sweep_<name>/, the cost model's table to
runs/bench/. --record (`make bench RECORD=1`) writes them where the recorded, tracked copies are instead:
benchmarks/results/sweep_<name>/ and benchmarks/results/costmodel_paper.{md,json}. --out names another report
directory.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import costmodel, report, sweep
from data.catalog import DataError
from data.cli import usage_error
from data.config import TOKENIZERS

ROOT = Path(__file__).resolve().parents[1]
DEMO_TOKENS = ROOT / "artifacts" / "demo" / "tokens" / "sentencepiece"
RUNS_DIR = ROOT / "runs"  # ignored by git: every run's default
RECORD_DIR = ROOT / "benchmarks" / "results"  # tracked: only with --record


def ensure_demo_data() -> None:
    """Build the demo corpus's sentencepiece tokens if they are missing (saying so)."""
    if (DEMO_TOKENS / "manifest.json").is_file():
        return
    cmd = [sys.executable, "-m", "data.build_demo", "--tokenizers", "sentencepiece"]
    print(f"[bench] demo data missing ({DEMO_TOKENS}); building it first: {shlex.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


@dataclass(frozen=True)
class BenchPaths:
    """Where one `make bench` writes: point run directories, the report, the cost model's paper table."""

    sweep_dir: Path
    out: Path
    costmodel_dir: Path

    @property
    def costmodel_json(self) -> Path:
        return self.costmodel_dir / "costmodel_paper.json"


def bench_paths(
    name: str, record: bool = False, sweep_dir: str | None = None, out: str | None = None
) -> BenchPaths:
    """The outputs of a bench of sweep `name`: under runs/bench/ (ignored by git), or with `record` under
    benchmarks/results/ (the tracked copies); `sweep_dir` and `out` override theirs."""
    base = RECORD_DIR if record else RUNS_DIR / "bench"
    return BenchPaths(
        Path(sweep_dir) if sweep_dir else RUNS_DIR / "sweeps" / name,
        Path(out) if out else base / f"sweep_{name}",
        base,
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/sweeps/cpu.yaml", help="the sweep YAML")
    p.add_argument("--sweep-dir", help="point run directories and results.json (default runs/sweeps/<name>)")
    p.add_argument(
        "--out",
        help="the report directory (default runs/bench/sweep_<name>; with --record "
        "benchmarks/results/sweep_<name>)",
    )
    p.add_argument(
        "--record",
        action="store_true",
        help="write the report and the cost model's table to benchmarks/results/ (the tracked copies)",
    )
    p.add_argument(
        "--data",
        metavar="PATH",
        help="a prepared token directory (python -m data.prepare --out PATH) to "
        "run every point on, instead of the demo corpus",
    )
    p.add_argument(
        "--tokenizer",
        choices=TOKENIZERS,
        help="with --data: the tokenizer whose tokens to use (default: the only one prepared there)",
    )
    sweep.add_reuse_args(p)
    args = p.parse_args(argv)
    if args.tokenizer and not args.data:
        p.error("--tokenizer chooses the tokens of --data PATH: give --data too")
    return args


def costmodel_args(out_dir: Path) -> list[str]:
    """`benchmarks.costmodel` arguments writing its paper table into `out_dir` (its own default, the tracked
    benchmarks/results/, with nothing added: the command recorded there stays the same)."""
    if out_dir.resolve() == costmodel.RESULTS_DIR.resolve():
        return ["--paper"]
    return ["--paper", "--out-dir", str(out_dir.resolve())]


def load_bench_sweep(args: argparse.Namespace) -> sweep.SweepConfig:
    """The sweep config, pointed at --data when given (checked there: ConfigError or DataError before any work)."""
    cfg = sweep.load_sweep(ROOT / args.config)
    return sweep.with_data(cfg, args.data, args.tokenizer) if args.data else cfg


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    command = "make bench  # = python -m benchmarks.run" + (" " + shlex.join(argv) if argv else "")
    try:
        cfg = load_bench_sweep(args)
    except sweep.ConfigError as e:
        return usage_error(e)
    except DataError as e:
        return usage_error(f"--data {args.data}: {e}")
    paths = bench_paths(cfg.name, args.record, args.sweep_dir, args.out)
    timings: dict[str, float] = {}
    t = time.perf_counter()
    if not args.data:
        ensure_demo_data()
    timings["demo_data_s"] = time.perf_counter() - t

    t = time.perf_counter()
    if costmodel.main(costmodel_args(paths.costmodel_dir)) != 0:
        return 1
    timings["costmodel_s"] = time.perf_counter() - t

    t = time.perf_counter()
    results = sweep.run_sweep(
        cfg, paths.sweep_dir, reuse=args.reuse, command=command, config_path=args.config
    )
    timings["sweep_s"] = time.perf_counter() - t

    t = time.perf_counter()
    rerender = f"python -m benchmarks.report {_rel(paths.out)} --costmodel {_rel(paths.costmodel_json)}"
    written = report.render(
        paths.sweep_dir,
        paths.out,
        paths.costmodel_json,
        f"python -m benchmarks.report {_rel(paths.sweep_dir)} --out {_rel(paths.out)} "
        f"--costmodel {_rel(paths.costmodel_json)}",
    )
    timings["report_s"] = time.perf_counter() - t
    (paths.out / "bench.json").write_text(
        json.dumps(bench_record(args, command, paths, rerender, timings, results), indent=1) + "\n"
    )
    print(
        f"[bench] report: {_rel(written['md'])} and {_rel(written['html'])} (results.json, bench.json, PNGs beside "
        f"them){'' if args.record else '; `--record` (make bench RECORD=1) writes the tracked copy'}"
    )
    return 0 if all(r["status"] == "ok" for r in results["points"]) else 1


def bench_record(
    args: argparse.Namespace,
    command: str,
    paths: BenchPaths,
    rerender: str,
    timings: dict[str, float],
    results: dict[str, Any],
) -> dict[str, Any]:
    """bench.json: what ran (command, sweep, data, outputs), how long each stage took, the machine, the points."""
    return {
        "command": command,
        "sweep_config": args.config,
        "sweep_dir": _rel(paths.sweep_dir),
        "record": args.record,
        "data": str(Path(args.data).resolve()) if args.data else None,
        "costmodel": _rel(paths.costmodel_json),
        "rerender": rerender,
        "timings_s": timings,
        "machine": results["machine"],
        "points_ok": sum(r["status"] == "ok" for r in results["points"]),
        "points": len(results["points"]),
        "reused": results.get("reused", []),
    }


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    sys.exit(main())
