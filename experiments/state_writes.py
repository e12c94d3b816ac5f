"""Who writes a training state, and how long the save takes, on 2 and 4 gloo ranks.

    python -m experiments.state_writes --label after [--ranks 2 4] [--rounds 3] [--d-model 256] [--layers 4]
    python -m experiments.state_writes --project [--preset gpt3-xl] [--gpus 8 64 128] [--domains 8]

For each layout (dense ZeRO 0, dense ZeRO 1, DEMix ZeRO 1 with 2 domains) a small GPT takes one training step (so
the Adam moments exist), then `launcher.state.save_training_state` runs `--rounds` times. Each rank counts the
bytes of every file it writes (the project's `launcher.state.save_hashed`, wrapped in the worker to stat what it wrote)
and times the whole save (from a barrier before it to its return, which is after rank 0's publish). Results of
each `--label` (e.g. "before" on the old code, "after" on the new) are kept in
experiments/results/state_writes.json and the table of every label in state_writes.md.

`--project` runs no process: the preset's model on the meta device, its files (fp32 + 2 Adam moments per
parameter) assigned as launcher/state.py assigns them (`assign_writers` per expert group, then the shared files
over every rank from those loads), against the old rule (rank 0 the shared files, each domain's first rank its
expert), for dense and DEMix (one domain per `gpus / domains` ranks). Kept under "projection" in the same files.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from data.argtypes import positive_int
from launcher.tables import markdown_table

RESULTS = Path(__file__).resolve().parent / "results"
LAYOUTS = (("dense", 0), ("dense", 1), ("demix", 1))


def _worker(rank: int, world: int, sets: list[str], run_dir: str, rounds: int) -> dict[str, Any]:
    import torch.distributed as dist

    import launcher.state as state
    from launcher.config import load_run_config
    from launcher.plan import make_plan
    from launcher.train import Trainer, train_step

    plan = make_plan(load_run_config(None, sets, check=False), world)
    trainer = Trainer.setup(plan, Path(run_dir), resume="never")
    train_step(trainer.bundle, plan.cfg, trainer.batches(0), len(plan.catalog.train_domains))
    written: dict[str, int] = {}
    real = state.save_hashed

    def counting(obj: Any, path: Path) -> str:
        digest = real(obj, path)
        written[str(path)] = Path(path).stat().st_size
        return digest

    state.save_hashed = counting
    times = []
    for r in range(rounds):
        written.clear()
        dist.barrier()
        t0 = time.perf_counter()
        state.save_training_state(Path(run_dir), r + 1, trainer.bundle, plan, rank)
        times.append(time.perf_counter() - t0)
    state.save_hashed = real
    zero = {p: n for p, n in written.items() if "/zero/" in p and not p.endswith("optimizer_state.pt")}
    return {
        "bytes": sum(written.values()),
        "param_bytes": sum(zero.values()),
        "param_files": len(zero),
        "largest_file": max(zero.values(), default=0),
        "seconds": times,
        "params": sum(p.numel() for p in trainer.bundle.engine.module.parameters()),
    }


def run(
    world: int, kind: str, zero: int, rounds: int, d_model: int, layers: int, tokens: Path
) -> dict[str, Any]:
    from experiments.ranks import run_ranks

    sets = [
        "model.preset=tiny",
        f"model.n_layers={layers}",
        f"model.d_model={d_model}",
        "model.n_heads=4",
        "model.seq_len=64",
        f"model.ffn.kind={kind}",
        f"data.path={tokens}",
        "data.tokenizer=gpt2",
        f"data.mixture={'by_domain' if kind == 'demix' else 'natural'}",
        "data.domains=[cooking,sailing]",
        "train.steps=100",
        "train.micro_batch=2",
        "train.grad_accum=1",
        f"parallel.zero_stage={zero}",
        "train.keep_checkpoints=1",
        "logging.wandb_mode=disabled",
        "logging.progress_bar=false",
    ]
    with tempfile.TemporaryDirectory(prefix="state_writes-") as run_dir:
        load = os.getloadavg()[0]
        per_rank = run_ranks(_worker, world, args=(sets, run_dir, rounds), timeout=1800)
    mean = statistics.mean(r["param_bytes"] for r in per_rank)
    return {
        "world": world,
        "kind": kind,
        "zero": zero,
        "params": per_rank[0]["params"],
        "bytes_by_rank": [r["bytes"] for r in per_rank],
        "param_bytes_by_rank": [r["param_bytes"] for r in per_rank],
        "param_files_by_rank": [r["param_files"] for r in per_rank],
        "largest_file": max(r["largest_file"] for r in per_rank),
        "max_over_mean": max(r["param_bytes"] for r in per_rank) / mean,
        "save_seconds_median": statistics.median(
            max(r["seconds"][i] for r in per_rank) for i in range(rounds)
        ),
        "save_seconds": [max(r["seconds"][i] for r in per_rank) for i in range(rounds)],
        "load_before": load,
        "load_after": os.getloadavg()[0],
    }


def project(preset: str, gpus: list[int], domains: int) -> list[dict[str, Any]]:
    """Bytes the busiest rank writes per training state, old rule vs balanced, from parameter shapes alone."""
    import torch

    from launcher.config import load_run_config
    from launcher.dryrun import _SkipMetaNormal
    from launcher.state import FILE_OVERHEAD_BYTES
    from model.gpt import GPT, expert_of_key
    from parallel.universal import assign_writers

    rows = []
    for kind in ("dense", "demix"):
        cfg = load_run_config(
            None,
            [
                f"model.preset={preset}",
                f"model.ffn.kind={kind}",
                f"model.ffn.num_experts={domains if kind == 'demix' else 0}",
            ],
            check=False,
        )
        with torch.device("meta"), _SkipMetaNormal():
            model = GPT(cfg.model, expert_ids=list(range(domains)) if kind == "demix" else None)
        files: dict[str, int] = {}
        expert_of: dict[str, int] = {}
        for name, p in model.named_parameters():
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                files[f"{name}/{key}"] = 4 * p.numel() + FILE_OVERHEAD_BYTES * (2 if key == "exp_avg" else 1)
                if expert_of_key(name) is not None:
                    expert_of[f"{name}/{key}"] = expert_of_key(name)
        total = sum(files.values())
        for n in gpus:
            per = n // domains
            old = [0] * n
            for f, size in files.items():
                old[expert_of[f] * per if f in expert_of else 0] += size
            load = [0] * n
            for g in range(domains if kind == "demix" else 0):
                group = {f: s for f, s in files.items() if expert_of.get(f) == g}
                for f, r in assign_writers(group, range(g * per, (g + 1) * per)).items():
                    load[r] += group[f]
            shared = {f: s for f, s in files.items() if f not in expert_of}
            for f, r in assign_writers(shared, range(n), dict(enumerate(load))).items():
                load[r] += shared[f]
            rows.append(
                {
                    "preset": preset,
                    "kind": kind,
                    "gpus": n,
                    "domains": domains if kind == "demix" else 0,
                    "params": sum(p.numel() for p in model.parameters()),
                    "total_bytes": total,
                    "old_max_bytes": max(old),
                    "new_max_bytes": max(load),
                    "mean_bytes": total / n,
                    "largest_file": max(files.values()),
                }
            )
    return rows


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "# Training-state writes per rank, and save time",
        "",
        "Bytes each rank writes in one `save_training_state` (every file, from the worker's count of what it "
        "saved: the `zero/<name>/*.pt` parameter files, `rng/`, and on rank 0 `trainer.pt` and DeepSpeed's two "
        "index files), and the save's wall time (median of the rounds; each round's time is the slowest "
        "rank's, barrier to return). CPU, gloo, every rank on one machine and one local disk (page cache), so "
        "times are indicative; the bytes are what a cluster's ranks would write.",
        "",
    ]
    for label, entry in results.items():
        if label == "projection":
            lines += [
                "## projection (no process: parameter shapes on the meta device)",
                "",
                f"Command: `{entry['command']}`",
                "",
                "Bytes of parameter files (fp32 + Adam moments) the busiest rank writes per training state. Old "
                "rule: rank 0 every shared parameter, each domain's first rank its expert. Balanced: "
                "launcher/state.py's assignment. The largest single file bounds the balance "
                "(max <= mean + largest file).",
                "",
            ]
            gib = lambda b: f"{b / 2**30:.2f}"  # noqa: E731
            lines += markdown_table(
                [
                    "model",
                    "GPUs",
                    "params",
                    "state GiB",
                    "old: busiest rank GiB",
                    "balanced: busiest rank GiB",
                    "mean GiB",
                    "largest file GiB",
                ],
                [
                    [
                        r["preset"]
                        + (f" DEMix {r['domains']} domains" if r["kind"] == "demix" else " dense"),
                        r["gpus"],
                        f"{r['params']:,}",
                        *(gib(r[k]) for k in ("total_bytes", "old_max_bytes", "new_max_bytes", "mean_bytes")),
                        gib(r["largest_file"]),
                    ]
                    for r in entry["rows"]
                ],
            )
            lines.append("")
            continue
        lines += [
            f"## {label}",
            "",
            f"Command: `{entry['command']}`",
            "",
            f"Code: {entry['code']}. Machine: {entry['machine']['cores']} cores, {entry['machine']['cpu']}; "
            f"`cat /proc/loadavg` before: `{entry['loadavg_before']}`, after: `{entry['loadavg_after']}`.",
            "",
        ]
        lines += markdown_table(
            [
                "ranks",
                "layout",
                "params",
                "MiB written by rank",
                "param files by rank",
                "max / mean (param files)",
                "largest file (MiB)",
                "save s (median; rounds)",
            ],
            [
                [
                    r["world"],
                    f"{r['kind']} ZeRO {r['zero']}",
                    f"{r['params']:,}",
                    " / ".join(f"{b / 2**20:.1f}" for b in r["bytes_by_rank"]),
                    " / ".join(str(n) for n in r["param_files_by_rank"]),
                    f"{r['max_over_mean']:.2f}",
                    f"{r['largest_file'] / 2**20:.1f}",
                    f"{r['save_seconds_median']:.2f} ({', '.join(f'{s:.2f}' for s in r['save_seconds'])})",
                ]
                for r in entry["rows"]
            ],
        )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", help="name of this measurement (e.g. before, after)")
    p.add_argument("--project", action="store_true", help="no processes: project the busiest rank's bytes")
    p.add_argument("--preset", default="gpt3-xl")
    p.add_argument("--gpus", type=positive_int, nargs="+", default=[8, 64, 128])
    p.add_argument("--domains", type=positive_int, default=8)
    p.add_argument("--code", default="the working tree", help="which code ran (recorded beside the numbers)")
    p.add_argument("--ranks", type=positive_int, nargs="+", default=[2, 4])
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--d-model", type=positive_int, default=256)
    p.add_argument("--layers", type=positive_int, default=4)
    args = p.parse_args(argv)
    if not args.project and not args.label:
        p.error("give --label (a measurement) or --project")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from benchmarks.machine import machine_info

    path = RESULTS / "state_writes.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    cmd = "python -m experiments.state_writes " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.project:
        results["projection"] = {
            "command": cmd.strip(),
            "rows": project(args.preset, args.gpus, args.domains),
        }
        return _write(results)
    from experiments.trainer_overhead import _corpus

    loadavg_before = Path("/proc/loadavg").read_text().strip()
    rows = []
    with tempfile.TemporaryDirectory(prefix="state_writes-corpus-") as root:
        tokens = _corpus(Path(root))
        for world in args.ranks:
            for kind, zero in LAYOUTS:
                rows.append(run(world, kind, zero, args.rounds, args.d_model, args.layers, tokens))
                print(json.dumps(rows[-1]), flush=True)
    results[args.label] = {
        "command": cmd.strip(),
        "code": args.code,
        "machine": machine_info(),
        "loadavg_before": loadavg_before,
        "loadavg_after": Path("/proc/loadavg").read_text().strip(),
        "rows": rows,
    }
    return _write(results)


def _write(results: dict[str, Any]) -> int:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "state_writes.json").write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / "state_writes.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
