"""Throughput of scoring text with every expert: one batched all-experts pass vs E sequential passes.

    python -m benchmarks.mixing_throughput [--experts 1,2,4,8] [--layers 4] [--d-model 256] [--seq-len 256]
        [--batch 2] [--repeats 3] [--threads 1] [--device cpu]

The model is a randomly initialised DEMix GPT with max(--experts) experts and the GPT-2 vocabulary (timing does
not depend on the weights). For each E, both paths compute the same E x B x T token log-likelihoods
ll[j, b, t] = log p(x_t | x_<t, D = j) for the first E experts in the same run:

* batched    - model/batched.py `expert_log_likelihoods`: the batch replicated E times through the shared layers,
               DEMix layers as grouped matmuls over stacked expert weights, target log-probs in chunks.
* sequential - E ordinary `GPT.forward` passes with domain_ids = j for every sequence (full B x T x V logits).

Because a top-k mixture with experts chosen by the cached prior runs exactly k experts, its cost is the batched
row with E = k (plus the mixture maths, timed separately on the E x B x T log-likelihoods: eqs. 6-9). Reported:
seconds per pass (best of --repeats after one warm-up), text tokens/s (B*T tokens scored by the E-expert mixture
per second) and expert-token evaluations/s (E*B*T per second). Results go to
benchmarks/results/mixing_throughput.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def _best(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def run(args: argparse.Namespace) -> dict:
    from launcher.config import load_run_config
    from model import mixture as mx
    from model.batched import expert_log_likelihoods, sequential_log_likelihoods
    from model.gpt import GPT

    torch.set_num_threads(args.threads)
    sweep = [int(e) for e in args.experts.split(",")]
    E_max = max(sweep)
    cfg = load_run_config(None, [
        "model.preset=tiny", f"model.n_layers={args.layers}", f"model.d_model={args.d_model}",
        f"model.n_heads={args.heads}", f"model.seq_len={args.seq_len}", "model.ffn.kind=demix",
        f"model.ffn.num_experts={E_max}",
    ])
    dev = torch.device(args.device)
    model = GPT(cfg.model, init_seed=0).to(dev).eval()
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.model.vocab_size, (args.batch, args.seq_len + 1), generator=g).to(dev)
    tokens, targets = x[:, :-1], x[:, 1:]
    BT = args.batch * args.seq_len
    rows = []
    for E in sweep:
        ids = list(range(E))
        a = expert_log_likelihoods(model, tokens, targets, ids)
        b = sequential_log_likelihoods(model, tokens, targets, ids)
        err = float((a - b).abs().max())
        t_b = _best(lambda: expert_log_likelihoods(model, tokens, targets, ids), args.repeats, sync)
        t_s = _best(lambda: sequential_log_likelihoods(model, tokens, targets, ids), args.repeats, sync)
        ll = a.double().cpu()
        t_m = _best(lambda: mx.posterior_mixture_log_probs(ll, mx.updating_priors(ll).log_prior_EB), args.repeats,
                    lambda: None)
        rows.append({
            "experts": E, "batched_s": round(t_b, 5), "sequential_s": round(t_s, 5),
            "batched_text_tok_s": round(BT / t_b, 1), "sequential_text_tok_s": round(BT / t_s, 1),
            "batched_expert_tok_s": round(E * BT / t_b, 1), "sequential_expert_tok_s": round(E * BT / t_s, 1),
            "speedup": round(t_s / t_b, 3), "mixture_maths_s": round(t_m, 5), "max_abs_diff": err,
        })
        print(json.dumps(rows[-1]), flush=True)
    return {
        "model": {"layers": args.layers, "d_model": args.d_model, "heads": args.heads, "seq_len": args.seq_len,
                  "vocab": model.vocab_size, "experts_held": E_max, "params": model.num_parameters()},
        "batch": args.batch, "tokens_per_pass": BT, "repeats": args.repeats, "threads": args.threads,
        "device": str(dev) if dev.type != "cuda" else torch.cuda.get_device_name(dev),
        "rows": rows,
    }


def write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "mixing_throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    m = result["model"]
    lines = [
        "# Mixing throughput: batched all-experts pass vs E sequential passes", "",
        f"Command: `{result['command']}`", "",
        f"Machine: {result['machine']['cores']} usable cores (os.cpu_count() = {result['machine']['cpu_count']}), "
        f"{result['machine']['platform']}, torch {result['machine']['torch']}, {result['threads']} torch thread(s), "
        f"device {result['device']}; 1-minute load average at the end {result['machine']['loadavg_1m']} "
        "(the machine is shared, so absolute numbers are noisy).", "",
        f"Model: DEMix GPT, {m['layers']} layers, d={m['d_model']}, {m['heads']} heads, vocab {m['vocab']} (GPT-2, "
        f"padded), {m['experts_held']} experts held, {m['params']:,} parameters. Batch: {result['batch']} x "
        f"{m['seq_len']} = {result['tokens_per_pass']} text tokens per pass; best of {result['repeats']} after a "
        "warm-up. Both paths compute the same E x B x T log-likelihoods (max |diff| in the last column).", "",
        "| experts E (= top-k k) | batched s | sequential s | speed-up | batched text tok/s | sequential text tok/s "
        "| batched expert-tok/s | sequential expert-tok/s | mixture maths s | max abs diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['experts']} | {r['batched_s']:.4f} | {r['sequential_s']:.4f} | {r['speedup']:.2f}x | "
            f"{r['batched_text_tok_s']:,.0f} | {r['sequential_text_tok_s']:,.0f} | {r['batched_expert_tok_s']:,.0f} | "
            f"{r['sequential_expert_tok_s']:,.0f} | {r['mixture_maths_s']:.4f} | {r['max_abs_diff']:.1e} |")
    rows = result["rows"]
    base = rows[0]
    lines += ["", "Cost growth relative to E = %d (batched): " % base["experts"] + ", ".join(
        f"E={r['experts']}: {r['batched_s'] / base['batched_s']:.2f}x" for r in rows) + ". A top-k mixture with "
        "experts chosen by the cached prior runs only k experts, so its cost is the row E = k; choosing top-k per "
        "token from the full posterior needs all E experts' likelihoods and costs the row E = all.",
        "", "Mixture maths = updating-prior recursion (eq. 9) + posterior (eqs. 7-8) + eq. 6 on the E x B x T "
        "log-likelihoods in float64: negligible next to the forward passes.",
        "", "Both paths do the same FLOPs per expert-token (with the GPT-2 vocabulary the tied LM head is most of "
        "them at this width); the batched path saves the first layer's attention and embedding (run once, not E "
        "times) and turns E small FFN matmuls into one grouped matmul, which pays off where launches and small "
        "matmuls dominate (accelerators, small batches) rather than on a busy 1-thread CPU."]
    (out / "mixing_throughput.md").write_text("\n".join(lines) + "\n")


def main(argv: Optional[Sequence[str]] = None) -> dict:
    from benchmarks.machine import machine_info

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", default="1,2,4,8", help="comma-separated expert counts to sweep")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    result = run(args)
    argv = list(argv) if argv is not None else sys.argv[1:]
    result["command"] = "python -m benchmarks.mixing_throughput " + shlex.join(argv)
    result["machine"] = machine_info()
    write(result, Path(args.out))
    return result


if __name__ == "__main__":
    main()
