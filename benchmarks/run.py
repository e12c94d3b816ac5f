"""`make bench`: the CPU throughput sweep, the cost model's paper table, and the report.

    python -m benchmarks.run [--force] [--config configs/sweeps/cpu.yaml] [--sweep-dir runs/sweeps/cpu]
                             [--out benchmarks/results/sweep_cpu]

1. makes sure the demo data exists (builds it with `python -m data.build_demo --tokenizers sentencepiece`
   if artifacts/demo/tokens/sentencepiece is missing, and says so);
2. regenerates the cost model's table for the paper's 12 configurations (`python -m benchmarks.costmodel
   --paper` -> benchmarks/results/costmodel_paper.{md,json});
3. runs the sweep (configs/sweeps/cpu.yaml: the tiny demo GPT as Dense, DEMix and GShard on 1, 2 and 4 local
   CPU ranks); point run directories go to --sweep-dir (ignored by git), points finished earlier are reused
   unless --force;
4. renders report.md, report.html, the PNGs and results.json into --out, plus bench.json (command, machine,
   timings), and prints where the report is.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from benchmarks import costmodel, report, sweep

ROOT = Path(__file__).resolve().parents[1]
DEMO_TOKENS = ROOT / "artifacts" / "demo" / "tokens" / "sentencepiece"


def ensure_demo_data() -> None:
    if (DEMO_TOKENS / "manifest.json").is_file():
        return
    cmd = [sys.executable, "-m", "data.build_demo", "--tokenizers", "sentencepiece"]
    print(f"[bench] demo data missing ({DEMO_TOKENS}); building it first: {shlex.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/sweeps/cpu.yaml")
    p.add_argument("--sweep-dir", default=str(ROOT / "runs" / "sweeps" / "cpu"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sweep_cpu"))
    p.add_argument("--force", action="store_true", help="rerun sweep points that finished earlier")
    args = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    command = "make bench  # = python -m benchmarks.run" + (" " + shlex.join(argv) if argv else "")
    timings: dict[str, float] = {}
    try:
        cfg = sweep.load_sweep(ROOT / args.config)
    except sweep.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t = time.perf_counter()
    ensure_demo_data()
    timings["demo_data_s"] = time.perf_counter() - t

    t = time.perf_counter()
    if costmodel.main(["--paper"]) != 0:
        return 1
    timings["costmodel_s"] = time.perf_counter() - t

    t = time.perf_counter()
    sweep_dir = Path(args.sweep_dir)
    results = sweep.run_sweep(cfg, sweep_dir, args.force, command=command, config_path=args.config)
    timings["sweep_s"] = time.perf_counter() - t

    t = time.perf_counter()
    out = Path(args.out)
    paths = report.render(sweep_dir, out, report.COSTMODEL_JSON,
                          f"python -m benchmarks.report {_rel(sweep_dir)} --out {_rel(out)}")
    timings["report_s"] = time.perf_counter() - t
    (out / "bench.json").write_text(json.dumps({
        "command": command, "sweep_config": args.config, "sweep_dir": _rel(sweep_dir),
        "rerender": f"python -m benchmarks.report {_rel(out)}", "timings_s": timings,
        "machine": results["machine"], "points_ok": sum(r["status"] == "ok" for r in results["points"]),
        "points": len(results["points"]),
    }, indent=1) + "\n")
    print(f"[bench] report: {_rel(paths['md'])} and {_rel(paths['html'])} (results.json, bench.json, PNGs beside them)")
    return 0 if all(r["status"] == "ok" for r in results["points"]) else 1


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    sys.exit(main())
