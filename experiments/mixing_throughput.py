"""Throughput and peak memory of scoring text with every expert: one batched all-experts pass vs E passes.

    python -m experiments.mixing_throughput [--experts 1,2,4,8] [--layers 4] [--d-model 256] [--seq-len 256]
        [--batch 2] [--repeats 3] [--threads N,1] [--device cpu] [--gemm-repeats 10] [--no-memory]

The model is a randomly initialised DEMix GPT with max(--experts) experts and the GPT-2 vocabulary (timing does
not depend on the weights). For each E, three paths compute the same E x B x T token log-likelihoods
ll[j, b, t] = log p(x_t | x_<t, D = j) for the first E experts in the same run:

* batched    - model/batched.py `expert_log_likelihoods(model, x, y, [0..E-1])`: shared layers once, the batch
               fanned out E ways at the first expert layer, target log-probs through the tied head in
               cache-sized blocks (never the whole logits tensor).
* sequential - the fair baseline: E single-expert passes of the same code, `expert_log_likelihoods(model, x, y,
               [j])` for j < E (the same efficient LM head per expert).
* forward    - the previous baseline: E ordinary `GPT.forward` passes with domain_ids = j for every sequence
               (full B x T x V logits, then cross-entropy); this is also the parity reference.

Each path is timed round-robin with the others (one warm-up each, then --repeats rounds; best of each), in wall
and in process CPU seconds (CPU time is less sensitive to other processes on a shared machine). The whole sweep
runs once per torch thread count in --threads (default: torch's own default on this machine, which is what
`evaluate` runs with, then 1). Beside each row: the CPU other processes used while it was timed, in cores
(benchmarks/machine.py `OtherLoad`: the kernel's busy counters minus this process's CPU time; the 1-minute load
average cannot say it for a benchmark that keeps every core busy itself), and the 1-minute load average; when
others used more than OTHERS_WARN cores the results file says so. Peak memory of one pass of
each path is measured in a fresh subprocess per (path, E): the kernel's resident high-water mark (VmHWM) is reset
just before the pass (/proc/self/clear_refs) and the peak above the resident size at that moment is reported, with
glibc told to return every allocation above 64 KiB to the system at once (MALLOC_MMAP_THRESHOLD_) so that freed
memory cannot hide a peak. Because a top-k mixture with experts chosen by the cached prior runs exactly k experts,
its cost is the batched row with E = k (plus the mixture maths, timed separately on the E x B x T log-likelihoods:
eqs. 6-9).

To show how close each path is to what the core can compute, the same run (same device, same torch thread
count) measures the achievable fp32 GEMM rate: `torch.mm` on the LM-head block shape the batched path uses
(DEFAULT_HEAD_ROWS rows x the block's vocabulary entries x d_model, the weight rows transposed as in
model/batched.py) and on a square 1024 x 1024 x 1024, best of --gemm-repeats timed samples after a warm-up, in
GFLOP/s; the higher of the two is the reference rate. Each path's achieved rate is its expert-tokens/s times the
forward FLOPs per expert-token of `flop_model` (the same useful work for every path; the batched pass does up to
`ceiling_vs_sequential` less), and its fraction of the reference rate bounds what any faster implementation could
gain: no path doing these FLOPs can beat *forward* by more than reference rate / forward's achieved rate.
Results go to experiments/results/mixing_throughput.{md,json}.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from data.argtypes import positive_int
from launcher.tables import markdown_table

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
PATHS = ("batched", "sequential", "forward")
OTHERS_WARN = (
    0.25  # cores used by other processes during a timed row above which the results say "under load"
)
TARGET_VS_FORWARD = 1.5  # the target: batched >= 1.5x the E forward passes at E = 8
NOISE = (
    0.98  # batched / sequential below this is "slower"; at E = 1 both run identical code and differ by ~1-2 %
)
GEMM_SAMPLE_S = 0.05  # each timed GEMM sample repeats the product until it lasts about this long


def _build(args: argparse.Namespace, experts_held: int):
    from launcher.config import load_run_config
    from model.gpt import GPT

    torch.set_num_threads(args.threads)
    cfg = load_run_config(
        None,
        [
            "model.preset=tiny",
            f"model.n_layers={args.layers}",
            f"model.d_model={args.d_model}",
            f"model.n_heads={args.heads}",
            f"model.seq_len={args.seq_len}",
            "model.ffn.kind=demix",
            f"model.ffn.num_experts={experts_held}",
        ],
    )
    dev = torch.device(args.device)
    model = GPT(cfg.model, init_seed=0).to(dev).eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.model.vocab_size, (args.batch, args.seq_len + 1), generator=g).to(dev)
    return model, x[:, :-1], x[:, 1:]


def _paths(model, tokens, targets, ids: list[int], fanout: int) -> dict[str, Callable[[], torch.Tensor]]:
    from model.batched import expert_log_likelihoods, sequential_log_likelihoods

    return {
        "batched": lambda: expert_log_likelihoods(model, tokens, targets, ids, fanout_tokens=fanout),
        "sequential": lambda: torch.cat([expert_log_likelihoods(model, tokens, targets, [j]) for j in ids]),
        "forward": lambda: sequential_log_likelihoods(model, tokens, targets, ids),
    }


def _round_robin(fns: dict[str, Callable[[], object]], repeats: int, sync: Callable[[], None]) -> dict:
    """Best wall and process-CPU seconds of each function, timed in turns (one warm-up each first)."""
    for fn in fns.values():
        fn()
        sync()
    wall = {k: float("inf") for k in fns}
    cpu = dict(wall)
    for _ in range(repeats):
        for k, fn in fns.items():
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            sync()
            wall[k] = min(wall[k], time.perf_counter() - w0)
            cpu[k] = min(cpu[k], time.process_time() - c0)
    return {"wall": wall, "cpu": cpu}


def _proc_status() -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"(Vm\w+):\s+(\d+) kB", Path("/proc/self/status").read_text())}


def _probe_memory(args: argparse.Namespace) -> dict:
    """In this (fresh) process: peak resident memory of one pass of `args.probe_memory` above the resident size
    just before it, in MiB."""
    E = args.probe_experts
    model, tokens, targets = _build(args, E)
    ids = list(range(E))
    _paths(model, tokens[:1, :16], targets[:1, :16], ids, args.fanout_tokens)[args.probe_memory]()  # start-up
    fn = _paths(model, tokens, targets, ids, args.fanout_tokens)[args.probe_memory]
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to the current resident size
    before = _proc_status()["VmRSS"]
    fn()
    return {"peak_extra_mib": round((_proc_status()["VmHWM"] - before) / 1024, 1)}


def _peak_memory(args: argparse.Namespace, path: str, E: int) -> float | None:
    if not Path("/proc/self/clear_refs").exists():
        return None
    cmd = [
        sys.executable,
        "-m",
        "experiments.mixing_throughput",
        "--layers",
        str(args.layers),
        "--d-model",
        str(args.d_model),
        "--heads",
        str(args.heads),
        "--seq-len",
        str(args.seq_len),
        "--batch",
        str(args.batch),
        "--threads",
        str(args.threads),
        "--device",
        "cpu",
        "--fanout-tokens",
        str(args.fanout_tokens),
        "--probe-memory",
        path,
        "--probe-experts",
        str(E),
    ]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT)}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        print(f"memory probe {path} E={E} failed: {res.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(res.stdout.strip().splitlines()[-1])["peak_extra_mib"]


def flop_model(cfg, vocab: int, T: int, E: int) -> dict:
    """Approximate forward FLOPs per expert-token and the most the batched path can save over E passes that use
    the same LM head: the embeddings and the first expert layer's attention run once instead of E times."""
    D, Fd, L = cfg.d_model, cfg.d_ffn, cfg.n_layers
    head = 2 * D * vocab
    attn = 2 * 4 * D * D + 2 * 2 * D * (T + 1) / 2  # qkv + proj, causal scores and values
    layer = attn + 2 * 2 * D * Fd
    per_expert_token = head + L * layer
    shared = attn  # DEMix: every layer is an expert layer, the first one's attention is shared
    return {
        "head_flops": head,
        "per_expert_token_flops": per_expert_token,
        "head_share": head / per_expert_token,
        "shared_flops": shared,
        "ceiling_vs_sequential": E * per_expert_token / (E * per_expert_token - (E - 1) * shared),
    }


def gemm_rates(
    shapes: dict[str, tuple[int, int, int, bool]],
    device: torch.device,
    repeats: int,
    sync: Callable[[], None],
) -> dict:
    """Achievable fp32 `torch.mm` rate for each named (M, K, N, B transposed) shape: best of `repeats` samples
    (each about GEMM_SAMPLE_S long) after a warm-up, in GFLOP/s (2·M·K·N per product), with the current torch
    thread count; `rate_gflop_s` is the highest."""
    g = torch.Generator().manual_seed(0)
    out: dict = {"shapes": {}, "repeats": repeats, "threads": torch.get_num_threads()}
    for name, (M, K, N, nt) in shapes.items():
        a = torch.randn(M, K, generator=g).to(device)
        b = torch.randn(N, K, generator=g).to(device) if nt else torch.randn(K, N, generator=g).to(device)
        c = torch.empty(M, N, device=device)
        fn = (
            (lambda a=a, b=b, c=c: torch.mm(a, b.t(), out=c))
            if nt
            else (lambda a=a, b=b, c=c: torch.mm(a, b, out=c))
        )
        fn()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        inner = max(1, round(GEMM_SAMPLE_S / max(time.perf_counter() - t0, 1e-6)))
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            sync()
            best = min(best, (time.perf_counter() - t0) / inner)
        out["shapes"][name] = {
            "m": M,
            "k": K,
            "n": N,
            "b_transposed": nt,
            "seconds": round(best, 7),
            "gflop_s": round(2 * M * K * N / best / 1e9, 2),
        }
    out["rate_gflop_s"] = max(v["gflop_s"] for v in out["shapes"].values())
    return out


def head_floor(
    model, tokens: torch.Tensor, targets: torch.Tensor, repeats: int, sync: Callable[[], None]
) -> dict:
    """One expert's LM head over the batch, split into what it cannot avoid: the blocked GEMM over the whole
    vocabulary alone, the GEMM with the in-place exp of every logit (torch's vectorised exp), and the real head
    (`target_log_probs`: + sums, target gather, log) -- best wall seconds of each, round-robin."""
    from model.batched import DEFAULT_HEAD_ROWS, _default_budget, expert_hidden_states, target_log_probs

    with torch.inference_mode():
        ids = [model.blocks[0].ffn.expert_ids[0]] if hasattr(model.blocks[0].ffn, "expert_ids") else None
        h_ND = expert_hidden_states(model, tokens, ids)[0].reshape(-1, model.cfg.d_model).contiguous()
        W_VD, t_N = model.lm_head.embedding[0].weight, targets.reshape(-1)
        R = min(h_ND.shape[0], DEFAULT_HEAD_ROWS)
        C = _default_budget(h_ND.device) // R
        buf = torch.empty(R * C, device=h_ND.device)

        def blocks(exp: bool) -> None:
            for s in range(0, h_ND.shape[0], R):
                h = h_ND[s : s + R]
                for v in range(0, W_VD.shape[0], C):
                    w = W_VD[v : v + C]
                    l = torch.mm(h, w.t(), out=buf[: h.shape[0] * w.shape[0]].view(h.shape[0], w.shape[0]))
                    if exp:
                        l.exp_()

        t = _round_robin(
            {
                "gemm": lambda: blocks(False),
                "gemm_exp": lambda: blocks(True),
                "head": lambda: target_log_probs(model, h_ND, t_N),
            },
            repeats,
            sync,
        )["wall"]
    return {k: round(v, 5) for k, v in t.items()}


def _time_row(args: argparse.Namespace, model, tokens, targets, E: int, sync, gemm: dict) -> dict:
    """One expert count: every path timed round-robin, parity against forward, the mixture maths, the rates."""
    from benchmarks.machine import OtherLoad
    from model import mixture as mx

    BT = args.batch * args.seq_len
    load0 = os.getloadavg()[0]
    ids = list(range(E))
    fns = _paths(model, tokens, targets, ids, args.fanout_tokens)
    ref = fns["forward"]()
    err = {k: float((fns[k]() - ref).abs().max()) for k in ("batched", "sequential")}
    with OtherLoad() as others:
        t = _round_robin(fns, args.repeats, sync)
    ll = fns["batched"]().double().cpu()
    t_m = _round_robin(
        {"m": lambda: mx.posterior_mixture_log_probs(ll, mx.updating_priors(ll).log_prior_EB)},
        args.repeats,
        lambda: None,
    )["wall"]["m"]
    row = {"experts": E, "loadavg_1m_start": round(load0, 2), "others": others.result()}
    for k in PATHS:
        row[f"{k}_s"], row[f"{k}_cpu_s"] = round(t["wall"][k], 5), round(t["cpu"][k], 5)
    row.update(
        {
            "speedup_vs_sequential": round(t["wall"]["sequential"] / t["wall"]["batched"], 3),
            "speedup_vs_forward": round(t["wall"]["forward"] / t["wall"]["batched"], 3),
            "cpu_speedup_vs_sequential": round(t["cpu"]["sequential"] / t["cpu"]["batched"], 3),
            "cpu_speedup_vs_forward": round(t["cpu"]["forward"] / t["cpu"]["batched"], 3),
            "batched_text_tok_s": round(BT / t["wall"]["batched"], 1),
            "batched_expert_tok_s": round(E * BT / t["wall"]["batched"], 1),
            "sequential_expert_tok_s": round(E * BT / t["wall"]["sequential"], 1),
            "forward_expert_tok_s": round(E * BT / t["wall"]["forward"], 1),
            "mixture_maths_s": round(t_m, 5),
            "max_abs_diff_batched": err["batched"],
            "max_abs_diff_sequential": err["sequential"],
            "full_logits_mib": round(E * BT * model.vocab_size * 4 / 2**20, 1),
            "loadavg_1m_end": round(os.getloadavg()[0], 2),
        }
    )
    row["flops"] = flop_model(model.cfg, model.vocab_size, args.seq_len, E)
    for k in PATHS:
        rate = row[f"{k}_expert_tok_s"] * row["flops"]["per_expert_token_flops"] / 1e9
        row[f"{k}_gflop_s"] = round(rate, 2)
        row[f"{k}_gemm_fraction"] = round(rate / gemm["rate_gflop_s"], 3)
    row["ceiling_vs_forward"] = round(gemm["rate_gflop_s"] / row["forward_gflop_s"], 3)
    return row


def run(args: argparse.Namespace) -> dict:
    """One sweep over `--experts` at the current torch thread count: the reference GEMM rates, then a row per E."""
    from model.batched import DEFAULT_HEAD_ROWS, DEFAULT_LOGIT_BUDGET, DEFAULT_LOGIT_BUDGET_CUDA

    sweep = [int(e) for e in args.experts.split(",")]
    E_max = max(sweep)
    model, tokens, targets = _build(args, E_max)
    dev = tokens.device
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
    BT = args.batch * args.seq_len
    budget = DEFAULT_LOGIT_BUDGET if dev.type == "cpu" else DEFAULT_LOGIT_BUDGET_CUDA
    gemm = gemm_rates(
        {
            "head_block": (DEFAULT_HEAD_ROWS, args.d_model, budget // DEFAULT_HEAD_ROWS, True),
            "square": (1024, 1024, 1024, False),
        },
        dev,
        args.gemm_repeats,
        sync,
    )
    gemm["head_floor_s"] = head_floor(model, tokens, targets, max(3, args.repeats), sync)
    print(json.dumps({"gemm": gemm}), flush=True)
    rows = []
    for E in sweep:
        rows.append(_time_row(args, model, tokens, targets, E, sync, gemm))
        print(json.dumps(rows[-1]), flush=True)
    if args.memory and args.device == "cpu":
        for row in rows:
            row["peak_extra_mib"] = {k: _peak_memory(args, k, row["experts"]) for k in PATHS}
            print(
                json.dumps({"experts": row["experts"], "peak_extra_mib": row["peak_extra_mib"]}), flush=True
            )
    return {
        "model": {
            "layers": args.layers,
            "d_model": args.d_model,
            "d_ffn": model.cfg.d_ffn,
            "heads": args.heads,
            "seq_len": args.seq_len,
            "vocab": model.vocab_size,
            "experts_held": E_max,
            "params": model.num_parameters(),
        },
        "batch": args.batch,
        "tokens_per_pass": BT,
        "repeats": args.repeats,
        "threads": args.threads,
        "device": str(dev) if dev.type != "cuda" else torch.cuda.get_device_name(dev),
        "head_block": {
            "logits": DEFAULT_LOGIT_BUDGET,
            "rows": DEFAULT_HEAD_ROWS,
            "mib": DEFAULT_LOGIT_BUDGET * 4 / 2**20,
        },
        "fanout_tokens": args.fanout_tokens,
        "gemm": gemm,
        "rows": rows,
    }


def write(result: dict, out: Path) -> None:
    """experiments/results/mixing_throughput.{json,md}: a summary against the targets, then one section per torch
    thread count."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "mixing_throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    m, runs, mach = result["model"], result["runs"], result["machine"]
    rows = [r for run in runs for r in run["rows"]]
    loads = [r[k] for r in rows for k in ("loadavg_1m_start", "loadavg_1m_end")] + [mach["loadavg_1m"]]
    others = [
        r["others"]["others_cores"] for r in rows if r.get("others", {}).get("others_cores") is not None
    ]
    lines = ["# Mixing throughput: batched all-experts pass vs E sequential passes", ""]
    if others and max(others) > OTHERS_WARN:
        lines += [
            f"**WARNING: other processes used up to {max(others):.2f} cores (> {OTHERS_WARN}) while rows were "
            "timed: the wall-clock times (and, through shared caches, the CPU times) of those rows are "
            "unreliable. Re-run on an idle machine.**",
            "",
        ]
    lines += [
        f"Command: `{result['command']}`",
        "",
        f"Machine: {mach['cores']} usable cores (os.cpu_count() = {mach['cpu_count']}), {mach['cpu'] or 'cpu'}, "
        f"{mach['platform']}, torch {mach['torch']}, device {runs[0]['device']}; torch's default thread count here "
        f"{result['default_threads']}. Other processes' CPU while rows were timed: "
        + (f"{min(others):.2f} to {max(others):.2f} cores" if others else "not measurable (no /proc/stat)")
        + f"; 1-minute load average {min(loads):.2f} to {max(loads):.2f} (it counts this benchmark's own threads).",
        "",
        f"Model: DEMix GPT, {m['layers']} layers, d={m['d_model']}, ffn {m['d_ffn']}, {m['heads']} heads, vocab "
        f"{m['vocab']} (GPT-2, padded), {m['experts_held']} experts held, {m['params']:,} parameters. Batch: "
        f"{runs[0]['batch']} x {m['seq_len']} = {runs[0]['tokens_per_pass']} text tokens per pass; best of "
        f"{runs[0]['repeats']} round-robin rounds after a warm-up. All paths compute the same E x B x T "
        "log-likelihoods. *sequential* = E single-expert passes of the same efficient code (the fair baseline); "
        "*forward* = E `GPT.forward` passes with full logits and cross-entropy (the previous baseline and the parity "
        "reference).",
        "",
        "## Against the targets",
        "",
        f"Target: the batched pass never slower than sequential at any E, and at least {TARGET_VS_FORWARD}x "
        "the E forward passes at the largest E.",
        "",
    ]
    targets = []
    for run in runs:
        last, low = run["rows"][-1], min(r["speedup_vs_sequential"] for r in run["rows"])
        oc = [r["others"]["others_cores"] for r in run["rows"] if r["others"]["others_cores"] is not None]
        met = last["speedup_vs_forward"] >= TARGET_VS_FORWARD and low >= NOISE
        targets.append(
            [
                run["threads"],
                f"{last['speedup_vs_forward']:.2f}x (E = {last['experts']})",
                f"{low:.3f}x",
                _cores(max(oc) if oc else None),
                "yes" if met else "no",
            ]
        )
    lines += markdown_table(
        [
            "torch threads",
            "batched vs forward at E = max",
            "batched vs sequential, lowest over E",
            "others' CPU, cores (max)",
            "met",
        ],
        targets,
    )
    lines += [
        "",
        "At E = 1 the batched and sequential paths run the same computation, so their ratio there is timing "
        f'noise; "never slower" is read as no ratio below {NOISE} (that noise band).',
    ]
    for run in runs:
        lines += _section(run)
    (out / "mixing_throughput.md").write_text("\n".join(lines) + "\n")


def _wall_table(rows: list[dict]) -> list[str]:
    lines = [
        "### Wall-clock time",
        "",
    ]
    header = [
        "experts E (= top-k k)",
        "batched s",
        "sequential s",
        "forward s",
        "speed-up vs sequential",
        "speed-up vs forward",
        "batched text tok/s",
        "batched expert-tok/s",
        "sequential expert-tok/s",
        "forward expert-tok/s",
        "others' CPU, cores",
        "load 1m",
    ]
    return lines + markdown_table(
        header,
        [
            [
                r["experts"],
                *(f"{r[k]:.4f}" for k in ("batched_s", "sequential_s", "forward_s")),
                f"{r['speedup_vs_sequential']:.2f}x",
                f"{r['speedup_vs_forward']:.2f}x",
                *(
                    f"{r[k]:,.0f}"
                    for k in (
                        "batched_text_tok_s",
                        "batched_expert_tok_s",
                        "sequential_expert_tok_s",
                        "forward_expert_tok_s",
                    )
                ),
                _cores(r["others"]["others_cores"]),
                f"{r['loadavg_1m_start']:.2f} -> {r['loadavg_1m_end']:.2f}",
            ]
            for r in rows
        ],
    )


def _cpu_table(rows: list[dict]) -> list[str]:
    lines = [
        "",
        "### Process CPU time (less sensitive to other load)",
        "",
    ]
    header = [
        "experts E",
        "batched CPU s",
        "sequential CPU s",
        "forward CPU s",
        "speed-up vs sequential",
        "speed-up vs forward",
    ]
    return lines + markdown_table(
        header,
        [
            [
                r["experts"],
                *(f"{r[k]:.4f}" for k in ("batched_cpu_s", "sequential_cpu_s", "forward_cpu_s")),
                f"{r['cpu_speedup_vs_sequential']:.2f}x",
                f"{r['cpu_speedup_vs_forward']:.2f}x",
            ]
            for r in rows
        ],
    )


def _rate_table(rows: list[dict], gm: dict) -> list[str]:
    """Achieved GFLOP/s of each path against the GEMM rate measured in the same run."""
    shp = "; ".join(
        f"{k.replace('_', ' ')} {v['m']} x {v['k']} x {v['n']} (M x K x N"
        f"{', B transposed' if v['b_transposed'] else ''}): {v['gflop_s']:.1f} GFLOP/s"
        for k, v in gm["shapes"].items()
    )
    lines = [
        "",
        "### Achieved rate",
        "",
        f"Achievable fp32 GEMM rate measured in this run with the same {gm['threads']} torch thread(s) "
        f"(`torch.mm`, best of {gm['repeats']} samples after a warm-up): {shp}. Reference = the higher, "
        f"{gm['rate_gflop_s']:.1f} GFLOP/s. Achieved = expert-tok/s (wall) x "
        f"{rows[-1]['flops']['per_expert_token_flops'] / 1e6:.1f} MFLOP per expert-token (forward FLOPs, the "
        "same for every path); fraction = achieved / reference. Best possible speed-up vs forward = "
        "reference / forward's achieved rate: the most any implementation of these FLOPs could gain.",
        "",
    ]
    header = [
        "experts E",
        "batched GFLOP/s",
        "sequential GFLOP/s",
        "forward GFLOP/s",
        "batched / GEMM",
        "sequential / GEMM",
        "forward / GEMM",
        "best possible speed-up vs forward",
    ]
    paths = ("batched", "sequential", "forward")
    return lines + markdown_table(
        header,
        [
            [
                r["experts"],
                *(f"{r[p + '_gflop_s']:.1f}" for p in paths),
                *(f"{r[p + '_gemm_fraction']:.0%}" for p in paths),
                f"{r['ceiling_vs_forward']:.2f}x",
            ]
            for r in rows
        ],
    )


def _mib(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f}"


def _memory_table(rows: list[dict]) -> list[str]:
    lines = [
        "",
        "### Peak memory and parity",
        "",
        "Peak resident memory of one pass above the resident size just before it (fresh subprocess per cell; "
        "see the module docstring; measured in the first thread count's sweep only), next to the size the "
        "E x B x T x V float32 logits would have if materialised. Max |diff| is against the forward path.",
        "",
    ]
    header = [
        "experts E",
        "batched peak MiB",
        "sequential peak MiB",
        "forward peak MiB",
        "E·B·T·V logits MiB",
        "max abs diff batched",
        "max abs diff sequential",
        "mixture maths s",
    ]
    return lines + markdown_table(
        header,
        [
            [
                r["experts"],
                *(_mib((r.get("peak_extra_mib") or {}).get(p)) for p in ("batched", "sequential", "forward")),
                f"{r['full_logits_mib']:,.1f}",
                f"{r['max_abs_diff_batched']:.1e}",
                f"{r['max_abs_diff_sequential']:.1e}",
                f"{r['mixture_maths_s']:.4f}",
            ]
            for r in rows
        ],
    )


def _notes(result: dict) -> list[str]:
    """The LM head's blocks, cost growth with E, the mixture maths, and where the time goes."""
    rows, hb, gm = result["rows"], result["head_block"], result["gemm"]
    fl, last = rows[-1]["flops"], rows[-1]
    base = rows[0]
    return [
        "",
        f"The LM head works on blocks of at most {hb['logits']:,} logits ({hb['rows']} rows x "
        f"{hb['logits'] // hb['rows']} vocabulary entries, {hb['mib']:.0f} MiB of float32: an L2 cache) whatever "
        "E, B, T and V are; what grows with E in the batched column is the E·B·T·D activations of the transformer "
        "itself (and the attention of E·B sequences), not logits, and that growth stops at "
        f"{result['fanout_tokens']:,} expert-tokens fanned out at once (beyond it the experts go in groups; "
        "`--fanout-tokens` sets it). At E = 1 the batched and sequential columns run the same computation, so "
        "their ratio there is timing noise.",
        "",
        f"Cost growth relative to E = {base['experts']:d} (batched): "
        + ", ".join(f"E={r['experts']}: {r['batched_s'] / base['batched_s']:.2f}x" for r in rows)
        + ". A top-k mixture with "
        "experts chosen by the cached prior runs only k experts, so its cost is the row E = k; choosing top-k per "
        "token from the full posterior needs all E experts' likelihoods and costs the row E = all.",
        "",
        "Mixture maths = updating-prior recursion (eq. 9) + posterior (eqs. 7-8) + eq. 6 on the E x B x T "
        "log-likelihoods in float64: negligible next to the forward passes.",
        "",
        f"Where the time goes: with the GPT-2 vocabulary the tied LM head is {fl['head_share']:.0%} of the forward "
        f"FLOPs per expert-token at this width ({fl['head_flops'] / 1e6:.1f} of "
        f"{fl['per_expert_token_flops'] / 1e6:.1f} MFLOP), and it is the same for every path. The batched pass can "
        "only save work that is the same for all experts: the embeddings and the first expert layer's attention "
        f"(every layer is a DEMix layer), {fl['shared_flops'] / 1e6:.2f} MFLOP per text token, so at "
        f"E = {rows[-1]['experts']} it can beat the fair sequential baseline by at most "
        f"{fl['ceiling_vs_sequential']:.3f}x in FLOPs. Its gain over *forward* comes from the head: logits in "
        "cache-sized blocks with the target logit gathered from embedding rows, instead of a B x T x V tensor "
        "written to memory and read back by cross-entropy; the sequential column gets that gain too. "
        f"At E = {last['experts']} the batched pass already runs at {last['batched_gemm_fraction']:.0%} of the "
        f"measured fp32 GEMM rate ({last['batched_gflop_s']:.1f} of {gm['rate_gflop_s']:.1f} GFLOP/s) and "
        f"*forward* at {last['forward_gemm_fraction']:.0%}, so no path computing these FLOPs at this thread count "
        f"can be more than {last['ceiling_vs_forward']:.2f}x faster than *forward* (GEMM rate / forward's achieved "
        f"rate), against the {last['speedup_vs_forward']:.2f}x the batched pass gets.",
    ]


def _head_floor_note(result: dict) -> list[str]:
    """What a pass built from these torch ops costs at least (when the head floor was measured)."""
    hf = result["gemm"].get("head_floor_s")
    if not hf:
        return []
    e1 = result["rows"][0]
    rest = e1["batched_s"] / e1["experts"] - hf["head"]
    best = rest + hf["gemm_exp"]
    return [
        "",
        f"The head's floor, one expert over the batch: the blocked GEMM over the whole vocabulary alone "
        f"takes {hf['gemm']:.4f} s, with torch's in-place exp of every logit {hf['gemm_exp']:.4f} s "
        f"({hf['gemm_exp'] / hf['gemm'] - 1:.0%} more: the exp of B·T·V values cannot be skipped for an "
        f"exact log-partition), and the whole head (`target_log_probs`) {hf['head']:.4f} s. With the rest "
        f"of the pass ({rest:.4f} s per expert at E = {e1['experts']}) a pass built from these torch ops "
        f"takes at least {best:.4f} s per expert, which is "
        f"{e1['forward_s'] / e1['experts'] / best:.2f}x *forward*.",
    ]


def _section(result: dict) -> list[str]:
    """The tables and notes of one thread count's sweep."""
    rows = result["rows"]
    return [
        "",
        f"## {result['threads']} torch thread(s)",
        "",
        *_wall_table(rows),
        *_cpu_table(rows),
        *_rate_table(rows, result["gemm"]),
        *_memory_table(rows),
        *_notes(result),
        *_head_floor_note(result),
    ]


def _cores(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def main(argv: Sequence[str] | None = None) -> dict:
    from benchmarks.machine import machine_info

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", default="1,2,4,8", help="comma-separated expert counts to sweep")
    ap.add_argument("--layers", type=positive_int, default=4)
    ap.add_argument("--d-model", type=positive_int, default=256)
    ap.add_argument("--heads", type=positive_int, default=4)
    ap.add_argument("--seq-len", type=positive_int, default=256)
    ap.add_argument("--batch", type=positive_int, default=2)
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument(
        "--threads",
        default=None,
        help="comma-separated torch thread counts, one sweep each (default: torch's default here, then 1)",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--gemm-repeats", type=positive_int, default=10, help="timed samples of each reference GEMM shape"
    )
    ap.add_argument(
        "--fanout-tokens",
        type=positive_int,
        default=None,
        help="expert-tokens fanned out at once by the batched path (default: model/batched.py's)",
    )
    ap.add_argument(
        "--no-memory", dest="memory", action="store_false", help="skip the peak-memory subprocesses"
    )
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--probe-memory", choices=PATHS, help=argparse.SUPPRESS)
    ap.add_argument("--probe-experts", type=positive_int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    default_threads = torch.get_num_threads()
    counts = [int(t) for t in args.threads.split(",")] if args.threads else [default_threads, 1]
    counts = list(dict.fromkeys(counts))  # keep the order, drop repeats (a 1-core machine's default is 1)
    if any(t < 1 for t in counts):
        ap.error(f"--threads takes positive thread counts, got {args.threads}")
    args.threads = counts[0]
    if args.fanout_tokens is None:
        from model.batched import DEFAULT_FANOUT_TOKENS

        args.fanout_tokens = DEFAULT_FANOUT_TOKENS
    if args.probe_memory:
        result = _probe_memory(args)
        print(json.dumps(result))
        return result
    runs = []
    for i, threads in enumerate(counts):
        runs.append(
            run(argparse.Namespace(**{**vars(args), "threads": threads, "memory": args.memory and i == 0}))
        )
    result = {"model": runs[0].pop("model"), "default_threads": default_threads, "runs": runs}
    for r in runs[1:]:
        r.pop("model")
    argv = list(argv) if argv is not None else sys.argv[1:]
    result["command"] = "python -m experiments.mixing_throughput " + shlex.join(argv)
    result["machine"] = machine_info()
    write(result, Path(args.out))
    return result


if __name__ == "__main__":
    main()
