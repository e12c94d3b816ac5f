"""The dry run's per-GPU memory estimate against torch's MemTracker, for Dense, DEMix and GShard at gpt3-small and
gpt3-xl, with and without activation recompute (bf16, micro-batch 8 x 2048 tokens: the GPU recipe's setting).

For each layout the dry run runs as a user runs it (`launcher.dryrun.main`, its printed table and JSON summary, the
trace cache cleared first so that its seconds are those of a cold run). Its numbers are then compared with a second,
separate measurement of the same rank's model: torch's `MemTracker` over one forward+backward under FakeTensorMode
(parallel/memory.py `trace_peaks(..., memtracker=True)`: nothing allocated), where the estimate counts with the lean
`PeakBytes` counter. Compared like with like:

    estimate     params + grads + activations of the dry run's row (ZeRO 1 for bf16 parameters, ZeRO 0 for bf16
                 autocast over fp32 weights: the two ways parallel/engine.py trains in bf16; at ZeRO 1 the
                 gradients are not yet partitioned)
    MemTracker   its peak total: PARAM + GRAD + ACT + TEMP (+ BUFFER, OTH). A forward+backward creates no optimizer
                 states, so the dry run's optimizer states and DeepSpeed's bucket buffers are left out of both
                 sides (they are shown in the dry-run total column, which is what the fit verdict uses)

and the activations alone (estimate's activations vs MemTracker's total - PARAM - GRAD). A row passes when both
ratios are within `TOLERANCE`. The old formula (Korthikanti et al., parallel/memory.py `activation_bytes`) is shown
beside them. Model states at ZeRO 2 are cross-checked against DeepSpeed's `estimate_zero2_model_states_mem_needs`.

Layouts (8 domains / experts): Dense on 8 GPUs; DEMix with one domain per GPU (the paper's) and with four domains on
each of 2 GPUs; GShard top-2 with all 8 experts on every GPU (experts_per_rank 8, expert-parallel size 1: a rank
whose experts are spread over an all-to-all group cannot be traced in one process, and the dry run says so and uses
the formula).

Run:  python -m experiments.memory_estimate [--tiny] [--presets gpt3-small gpt3-xl] [--micro-batch 8] [--seq 2048]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data.argtypes import positive_int
from launcher.tables import markdown_table

GIB = 1024**3
MIB = 1024**2
RESULTS = Path(__file__).parent / "results" / "memory_estimate.md"
TOLERANCE = 0.10
PRECISION = "bf16"
ZERO_SETUPS = (1, 0)  # bf16 parameters (ZeRO >= 1), bf16 autocast over fp32 weights (ZeRO 0)
TINY_ZERO_SETUPS = (1,)  # --tiny is for tests: the same code path, half the traces
TINY_MODEL = (
    "model.preset=tiny",
    "model.n_layers=2",
    "model.d_model=64",
    "model.n_heads=4",
    "model.vocab_size=512",
)


@dataclass(frozen=True)
class Layout:
    """One dry-run layout: its label, world size, --domains and config overrides."""

    label: str
    world_size: int
    domains: int | None
    sets: tuple[str, ...]


LAYOUTS = (
    Layout("dense", 8, None, ("data.mixture=natural",)),
    Layout("demix, 1 domain/GPU", 8, 8, ("model.ffn.kind=demix",)),
    Layout("demix, 4 domains/GPU", 2, 8, ("model.ffn.kind=demix",)),
    Layout(
        "gshard top-2, 8 experts/GPU",
        8,
        None,
        (
            "model.ffn.kind=gshard",
            "model.ffn.num_experts=8",
            "model.ffn.gshard.experts_per_rank=8",
            "data.mixture=natural",
        ),
    ),
)


def dry_run_argv(layout: Layout, model_sets: Sequence[str], micro_batch: int, out: Path) -> list[str]:
    """The dry run's command line for this layout."""
    argv = ["--world-size", str(layout.world_size)]
    if layout.domains is not None:
        argv += ["--domains", str(layout.domains)]
    return argv + [
        "--set",
        *model_sets,
        *layout.sets,
        f"train.precision={PRECISION}",
        f"train.micro_batch={micro_batch}",
        "--out",
        str(out),
    ]


def run_dry_run(argv: list[str]) -> dict[str, Any]:
    """`python -m launcher.dryrun ARGV` in this process from a cold trace cache: its summary, printed text, and
    seconds (wall and this process's CPU, with the CPU other processes used meanwhile)."""
    from benchmarks.machine import OtherLoad
    from launcher.dryrun import main
    from parallel import memory

    memory._cached_traces.cache_clear()
    printed = io.StringIO()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    with OtherLoad() as load, contextlib.redirect_stdout(printed):
        rc = main(argv)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    if rc != 0:
        raise RuntimeError(f"dry run {shlex.join(argv)} failed with status {rc}")
    summary = json.loads(Path(argv[argv.index("--out") + 1]).read_text())
    return {
        "summary": summary,
        "printed": printed.getvalue(),
        "wall_s": wall,
        "cpu_s": cpu,
        "others_cores": load.result()["others_cores"],
        "loadavg": os.getloadavg()[0],
    }


def standalone_dry_run(argv: list[str]) -> dict[str, Any]:
    """The dry run as a user starts it: a fresh `python -m launcher.dryrun` process, imports included. Wall and CPU
    seconds of the process, the activation estimate's own wall seconds, and the CPU other processes used meanwhile."""
    import subprocess

    from benchmarks.machine import OtherLoad

    cpu0, wall0 = os.times(), time.perf_counter()
    with OtherLoad() as load:
        proc = subprocess.run(
            [sys.executable, "-m", "launcher.dryrun", *argv],
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    wall, cpu1 = time.perf_counter() - wall0, os.times()
    if proc.returncode != 0:
        raise RuntimeError(f"dry run {shlex.join(argv)} failed: {proc.stderr[-2000:]}")
    summary = json.loads(Path(argv[argv.index("--out") + 1]).read_text())
    return {
        "argv": argv,
        "wall_s": wall,
        "cpu_s": (cpu1.children_user - cpu0.children_user) + (cpu1.children_system - cpu0.children_system),
        "estimate_s": summary["memory"]["activations"]["seconds"],
        "others_cores": load.result()["others_cores"],
        "loadavg": os.getloadavg()[0],
        "printed": _memory_lines(proc.stdout),
    }


def _memory_lines(printed: str) -> list[str]:
    """The dry run's memory table, from its printed output."""
    lines = printed.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("memory per GPU"))
    return [line for line in lines[start:] if line.startswith(("memory per GPU", "  "))]


def rank_model(layout: Layout, model_sets: Sequence[str], micro_batch: int, summary: dict[str, Any]):
    """The model config as the dry run resolved it (planned the same way) and the expert ids of the rank its memory
    table reports (from its summary)."""
    from launcher.config import load_run_config
    from launcher.dryrun import resolve_domains
    from launcher.plan import plan_layout

    cfg = load_run_config(
        None, [*model_sets, *layout.sets, f"train.precision={PRECISION}", f"train.micro_batch={micro_batch}"]
    )
    names, problems = resolve_domains(cfg, layout.domains)
    plan = plan_layout(cfg, layout.world_size, names)
    assert not problems and not plan.problems, problems + plan.problems  # the dry run has just accepted it
    rank = next(r for r in summary["ranks"] if r["rank"] == summary["memory"]["rank"])
    return plan.cfg.model, rank["expert_ids"] or None


def measure(model_cfg, micro_batch: int, expert_ids, zero: int) -> dict[bool, dict[str, int]]:
    """MemTracker's peak of one forward+backward per recompute mode, under FakeTensorMode."""
    from parallel.memory import trace_dtypes, trace_peaks

    dtype, autocast = trace_dtypes(PRECISION, zero)
    return trace_peaks(model_cfg, micro_batch, expert_ids, (False, True), dtype, autocast, memtracker=True)


def compare(
    layout: Layout,
    preset: str,
    dry: dict[str, Any],
    model_cfg,
    micro_batch: int,
    expert_ids,
    zero: int,
    measured: dict[bool, dict[str, int]],
) -> list[dict[str, Any]]:
    """One result row per recompute mode: the dry run's numbers for this ZeRO stage against MemTracker's."""
    from parallel.memory import activation_bytes

    mem = dry["summary"]["memory"]
    row = mem["rows"][zero]
    out = []
    for recompute in (False, True):
        mode = "recompute" if recompute else "no_recompute"
        m = measured[recompute]
        est_act = row[f"activations_{mode}"]
        out.append(
            {
                "layout": layout.label,
                "preset": preset,
                "zero": zero,
                "recompute": recompute,
                "method": mem["activations"]["method"],
                "formula_act": activation_bytes(model_cfg, micro_batch, 1, recompute, PRECISION),
                "est_act": est_act,
                "est_total": row["params"] + row["grads"] + est_act,
                "dry_run_total": row[f"total_{mode}"],
                "mt_act": m["total"] - m.get("PARAM", 0) - m.get("GRAD", 0),
                "mt_total": m["total"],
                "mt_kinds": {k: v for k, v in m.items() if k not in ("total", "activations")},
                "estimate_s": mem["activations"]["seconds"],
                "dry_run_wall_s": dry["wall_s"],
                "dry_run_cpu_s": dry["cpu_s"],
                "others_cores": dry["others_cores"],
            }
        )
    return out


def check(rows: Sequence[dict[str, Any]], tolerance: float = TOLERANCE) -> list[str]:
    """Every row whose estimate is more than `tolerance` off MemTracker (total or activations), as a sentence."""
    bad = []
    for r in rows:
        for what in ("total", "act"):
            ratio = r[f"est_{what}"] / r[f"mt_{what}"]
            if abs(ratio - 1) > tolerance:
                bad.append(
                    f"{r['layout']} {r['preset']} ZeRO {r['zero']} recompute={r['recompute']}: estimate/MemTracker "
                    f"{what} = {ratio:.3f} ({r[f'est_{what}'] / GIB:.2f} vs {r[f'mt_{what}'] / GIB:.2f} GiB)"
                )
    return bad


def run(
    presets: Sequence[str], micro_batch: int, seq: int, tiny: bool, layouts: Sequence[Layout] = LAYOUTS
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(comparison rows, ZeRO-2 model-state cross-checks, fresh-process dry runs of the last preset's DEMix and
    GShard layouts; none with --tiny) for every layout and preset."""
    rows, states, fresh = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in presets:
            model_sets = (
                [*TINY_MODEL, f"model.seq_len={seq}"]
                if tiny
                else [f"model.preset={preset}", f"model.seq_len={seq}"]
            )
            for layout in layouts:
                argv = dry_run_argv(layout, model_sets, micro_batch, Path(tmp) / "summary.json")
                dry = run_dry_run(argv)
                mem = dry["summary"]["memory"]
                model_cfg, ids = rank_model(layout, model_sets, micro_batch, dry["summary"])
                z2 = mem["rows"][2]
                states.append(
                    {
                        "layout": layout.label,
                        "preset": preset,
                        "ours": z2["model_states"],
                        "deepspeed": z2.get("deepspeed_estimate"),
                        "argv": argv,
                        "wall_s": dry["wall_s"],
                        "cpu_s": dry["cpu_s"],
                        "estimate_s": mem["activations"]["seconds"],
                        "others_cores": dry["others_cores"],
                        "loadavg": dry["loadavg"],
                    }
                )
                for zero in TINY_ZERO_SETUPS if tiny else ZERO_SETUPS:
                    t0 = time.perf_counter()
                    measured = measure(model_cfg, micro_batch, ids, zero)
                    new = compare(layout, preset, dry, model_cfg, micro_batch, ids, zero, measured)
                    rows += new
                    print(
                        f"{preset} {layout.label} ZeRO {zero}: dry run {dry['wall_s']:.1f} s wall / "
                        f"{dry['cpu_s']:.1f} s "
                        f"CPU; MemTracker {time.perf_counter() - t0:.1f} s; ratios "
                        + ", ".join(f"{r['est_total'] / r['mt_total']:.3f}" for r in new),
                        file=sys.stderr,
                        flush=True,
                    )
        if not tiny:
            model_sets = [f"model.preset={presets[-1]}", f"model.seq_len={seq}"]
            for layout in (layouts[1], layouts[-1]):
                fresh.append(
                    standalone_dry_run(
                        dry_run_argv(layout, model_sets, micro_batch, Path(tmp) / "fresh.json")
                        + ["--device", "h100"]
                    )
                )
                print(
                    f"fresh dry run {layout.label}: {fresh[-1]['wall_s']:.1f} s wall, {fresh[-1]['cpu_s']:.1f} s CPU",
                    file=sys.stderr,
                    flush=True,
                )
    return rows, states, fresh


def _size(nbytes: float, scale: float) -> str:
    return f"{nbytes / scale:.2f}"


def _header_lines(micro_batch: int, seq: int, argv: Sequence[str], tiny: bool, unit: str) -> list[str]:
    """The title, the command, what is compared with what, and the machine."""
    from benchmarks.machine import machine_info

    info = machine_info()
    model = "a tiny GPT (2 x 64, vocab 512)" if tiny else "gpt3-small and gpt3-xl"
    return [
        "# Dry-run memory estimate vs MemTracker",
        "",
        f"Command: `{shlex.join(['python', '-m', 'experiments.memory_estimate', *argv])}` (OMP_NUM_THREADS=1)",
        "",
        f"{model}, bf16, micro-batch {micro_batch}, seq {seq}. Per layout, the dry run "
        "(`python -m launcher.dryrun`, the "
        "commands below) estimates this rank's memory: activations traced from the rank's model under FakeTensorMode "
        "with the lean PeakBytes counter, plus model states by ZeRO stage. MemTracker measures one forward+backward of "
        "the same rank's model separately under FakeTensorMode (nothing allocated). Like with like: **estimate** = the "
        "dry run's params + grads + activations for that ZeRO stage; **MemTracker** = its peak total (PARAM + GRAD + "
        "ACT + TEMP). Optimizer states and DeepSpeed's buckets exist in neither a forward+backward nor this "
        "comparison; the **dry-run total** column adds them (what the fit verdict compares with the GPU). ZeRO 1: "
        "bf16 parameters; ZeRO 0: bf16 autocast over fp32 weights. Pass: estimate/MemTracker within "
        f"{TOLERANCE:.0%} for the total and for the activations. {unit} throughout.",
        "",
        f"Machine: {info['cpu']} ({info['cores']} cores), {info['platform']}, Python {info['python']}, "
        f"torch {info['torch']}, DeepSpeed {info['deepspeed']}, GPU {info['gpu']}.",
        "",
    ]


def _comparison_table(rows: Sequence[dict[str, Any]], scale: float) -> list[str]:
    """Estimate vs MemTracker per layout, ZeRO stage and recompute mode, with the pass verdict."""
    return markdown_table(
        [
            "layout",
            "model",
            "ZeRO",
            "recompute",
            "formula activ.",
            "dry-run activ.",
            "MemTracker activ.",
            "activ. ratio",
            "estimate",
            "MemTracker",
            "ratio",
            "pass",
            "dry-run total",
            "estimate s",
        ],
        [
            [
                r["layout"],
                r["preset"],
                r["zero"],
                "full" if r["recompute"] else "none",
                _size(r["formula_act"], scale),
                _size(r["est_act"], scale),
                _size(r["mt_act"], scale),
                f"{r['est_act'] / r['mt_act']:.3f}",
                _size(r["est_total"], scale),
                _size(r["mt_total"], scale),
                f"{r['est_total'] / r['mt_total']:.3f}",
                "yes" if not check([r]) else "**NO**",
                _size(r["dry_run_total"], scale),
                f"{r['estimate_s']:.1f}",
            ]
            for r in rows
        ],
    )


def _states_table(
    rows: Sequence[dict[str, Any]], states: Sequence[dict[str, Any]], scale: float
) -> list[str]:
    """The dry runs' cost and their ZeRO-2 model states against DeepSpeed's estimate."""
    methods = sorted({r["method"] for r in rows})
    lines = [
        "",
        f"Activations method in every dry run: {', '.join(methods)}. `estimate s` is the wall time of the "
        "dry run's activation estimate (every ZeRO stage and recompute mode: two traces of two passes each), "
        "cold; the machine was shared, so the CPU seconds below are the better measure.",
        "",
        "Dry runs (wall and CPU seconds of the whole command; CPU that other processes used meanwhile, in cores) "
        "and model states at ZeRO 2, ours vs DeepSpeed's `estimate_zero2_model_states_mem_needs`:",
        "",
    ]
    table = []
    for s in states:
        cmd = shlex.join(["python", "-m", "launcher.dryrun", *[a for a in s["argv"][:-2]]])
        ds = s["deepspeed"]
        table.append(
            [
                s["layout"],
                s["preset"],
                f"`{cmd}`",
                f"{s['wall_s']:.1f}",
                f"{s['cpu_s']:.1f}",
                "?" if s["others_cores"] is None else f"{s['others_cores']:.1f}",
                _size(s["ours"], scale),
                "-" if ds is None else _size(ds, scale),
                "-" if ds is None else f"{(s['ours'] - ds) / ds:+.1%}",
            ]
        )
    header = [
        "layout",
        "model",
        "command",
        "wall s",
        "CPU s",
        "other load (cores)",
        "ZeRO-2 states",
        "DeepSpeed",
        "diff",
    ]
    return lines + markdown_table(header, table)


def _fresh_lines(fresh: Sequence[dict[str, Any]]) -> list[str]:
    """The dry run as a user starts it (a fresh process), with what it printed."""
    if not fresh:
        return []
    lines = [
        "",
        "The dry run as a user starts it, a fresh process (imports included), against an H100's 80 GiB:",
        "",
    ]
    for f in fresh:
        others = "?" if f["others_cores"] is None else f"{f['others_cores']:.1f}"
        cmd = shlex.join(["python", "-m", "launcher.dryrun", *f["argv"]]).replace(
            f" --out {shlex.quote(f['argv'][f['argv'].index('--out') + 1])}", ""
        )
        lines += [
            f"`{cmd}`: {f['wall_s']:.1f} s wall, {f['cpu_s']:.1f} s CPU (activation estimate "
            f"{f['estimate_s']:.1f} s wall; other processes {others} cores, load average {f['loadavg']:.1f})",
            "",
            "```",
            *f["printed"],
            "```",
            "",
        ]
    return lines


def _kinds_table(rows: Sequence[dict[str, Any]], unit: str, scale: float) -> list[str]:
    """MemTracker's peak by kind, then the rows outside the tolerance."""
    kinds = sorted({k for r in rows for k in r["mt_kinds"]})
    lines = [
        "",
        f"MemTracker's peak by kind ({unit}):",
        "",
        *markdown_table(
            ["layout", "model", "ZeRO", "recompute", *kinds],
            [
                [
                    r["layout"],
                    r["preset"],
                    r["zero"],
                    "full" if r["recompute"] else "none",
                    *(_size(r["mt_kinds"].get(k, 0), scale) for k in kinds),
                ]
                for r in rows
            ],
        ),
    ]
    bad = check(rows)
    lines += ["", f"Rows outside {TOLERANCE:.0%}: " + ("none." if not bad else "; ".join(bad))]
    return lines


def report(
    rows: Sequence[dict[str, Any]],
    states: Sequence[dict[str, Any]],
    micro_batch: int,
    seq: int,
    argv: Sequence[str],
    tiny: bool,
    fresh: Sequence[dict[str, Any]] = (),
) -> str:
    """The Markdown report (experiments/results/memory_estimate.md)."""
    unit, scale = ("MiB", MIB) if tiny else ("GiB", GIB)
    lines = [
        *_header_lines(micro_batch, seq, argv, tiny, unit),
        *_comparison_table(rows, scale),
        *_states_table(rows, states, scale),
        *_fresh_lines(fresh),
        *_kinds_table(rows, unit, scale),
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--tiny", action="store_true", help="a tiny GPT instead of the presets (seconds; for tests)"
    )
    ap.add_argument("--presets", nargs="+", default=["gpt3-small", "gpt3-xl"])
    ap.add_argument("--micro-batch", type=positive_int, default=8)
    ap.add_argument(
        "--seq", type=positive_int, default=None, help="sequence length (default 2048; 128 with --tiny)"
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    seq = args.seq or (128 if args.tiny else 2048)
    presets = ["tiny"] if args.tiny else args.presets
    rows, states, fresh = run(presets, args.micro_batch, seq, args.tiny)
    text = report(rows, states, args.micro_batch, seq, argv, args.tiny, fresh)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 1 if check(rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
