"""Peak memory of one forward+backward of the project's GPT with today's whole-vocabulary loss vs the chunked
loss (model/gpt.py: chunked_token_loss), measured without allocating anything.

The model is built under torch's FakeTensorMode with bf16 as the default dtype (DeepSpeed's bf16 mode: bf16
parameters and activations) and forward+backward run inside `torch.distributed._tools.mem_tracker.MemTracker`
(parallel/memory.py `trace_peak`, as the dry run measures): every tensor's storage is accounted as it would be on a
device, but none is allocated, so gpt3-xl at micro-batch 8 x 2048 measures in seconds on a CPU. Nothing is timed.

    whole    the loss as it was before chunking: logits B x T x V (bf16), their fp32 copy, log-softmax saved for
             backward, then the fp32 gradient and its bf16 cast (the trainer's path, return_logits=False, with
             `loss_chunk_logits` set past B T V so that one chunk holds every token).
    chunked  the default: LOSS_CHUNK_LOGITS = 2^26 logits per chunk (1,334 tokens of a 50,304-entry vocabulary).

Run:  python -m experiments.loss_memory [--presets gpt3-small gpt3-xl] [--micro-batch 8] [--seq 2048]
"""

from __future__ import annotations

import argparse
import gc
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.machine import machine_info
from data.argtypes import positive_int
from launcher.config import load_run_config
from launcher.tables import markdown_table
from model.gpt import LOSS_CHUNK_LOGITS
from parallel.memory import trace_peak

GiB = 1024**3
RESULTS = Path(__file__).parent / "results" / "loss_memory.md"


def peak_bytes(preset: str, micro_batch: int, seq: int, chunked: bool, recompute: bool) -> dict[str, Any]:
    """Peak bytes (total and by MemTracker kind) of forward+backward under FakeTensorMode, nothing allocated
    (parallel/memory.py `trace_peak`, the dry run's measurement, with torch's MemTracker; no gradients before
    the backward), and the tokens per loss chunk."""
    cfg = load_run_config(None, [f"model.preset={preset}", f"model.seq_len={seq}", "model.dropout=0.0"]).model
    chunk = LOSS_CHUNK_LOGITS if chunked else 2**62
    m = trace_peak(
        cfg,
        micro_batch,
        None,
        recompute,
        torch.bfloat16,
        loss_chunk_logits=chunk,
        memtracker=True,
        preallocate_grads=False,
    )
    m.pop("activations")
    rows = max(1, LOSS_CHUNK_LOGITS // cfg.padded_vocab_size()) if chunked else micro_batch * seq
    return {**m, "rows": rows}


def run(presets: list[str], micro_batch: int, seq: int) -> list[dict[str, Any]]:
    rows = []
    for preset in presets:
        for recompute in (False, True):
            r = {"preset": preset, "recompute": recompute}
            for chunked in (False, True):
                t0 = time.perf_counter()
                m = peak_bytes(preset, micro_batch, seq, chunked, recompute)
                r["chunked" if chunked else "whole"] = m
                print(
                    f"{preset} recompute={recompute} chunked={chunked}: {m['total'] / GiB:.2f} GiB "
                    f"({time.perf_counter() - t0:.1f} s)",
                    file=sys.stderr,
                )
                gc.collect()
            rows.append(r)
    return rows


def report(rows: list[dict[str, Any]], micro_batch: int, seq: int, argv: list[str]) -> str:
    info = machine_info()
    lines = [
        "# Loss peak memory: whole-vocabulary fp32 logits vs the chunked loss",
        "",
        f"Command: `{shlex.join(['python', '-m', 'experiments.loss_memory', *argv])}` (OMP_NUM_THREADS=1)",
        "",
        f"Peak bytes of one forward+backward of the project's GPT (dense FFN), micro-batch {micro_batch}, seq {seq}, "
        "bf16 parameters and activations, dropout 0, measured under FakeTensorMode with torch's MemTracker "
        "(nothing allocated; no optimizer states). `whole` is the loss before chunking (B x T x V logits and their "
        f"fp32 temporaries); `chunked` the default, {LOSS_CHUNK_LOGITS:,} logits (256 MiB fp32) per chunk.",
        "",
        f"Machine: {info['cpu']} ({info['cores']} cores), {info['platform']}, Python {info['python']}, "
        f"torch {info['torch']}, GPU {info['gpu']}.",
        "",
    ]
    act = lambda m: m.get("ACT", 0) + m.get("TEMP", 0)  # noqa: E731
    table = []
    for r in rows:
        w, c = r["whole"], r["chunked"]
        table.append(
            [
                r["preset"],
                "full" if r["recompute"] else "none",
                f"{w['total'] / GiB:.2f}",
                f"{c['total'] / GiB:.2f}",
                f"{(w['total'] - c['total']) / GiB:.2f}",
                f"{c['total'] / w['total']:.2f}",
                c["rows"],
                f"{act(w) / GiB:.2f} -> {act(c) / GiB:.2f}",
            ]
        )
    lines += markdown_table(
        [
            "model",
            "recompute",
            "whole (GiB)",
            "chunked (GiB)",
            "saved (GiB)",
            "ratio",
            "tokens/chunk",
            "activations + temporaries, whole -> chunked (GiB)",
        ],
        table,
    )
    kinds = sorted(
        {k for r in rows for m in (r["whole"], r["chunked"]) for k in m if k not in ("total", "rows")}
    )
    lines += [
        "",
        "Peak by MemTracker kind (GiB, whole / chunked):",
        "",
        *markdown_table(
            ["model", "recompute", *kinds],
            [
                [
                    r["preset"],
                    "full" if r["recompute"] else "none",
                    *(
                        f"{r['whole'].get(k, 0) / GiB:.2f} / {r['chunked'].get(k, 0) / GiB:.2f}"
                        for k in kinds
                    ),
                ]
                for r in rows
            ],
        ),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["gpt3-small", "gpt3-xl"])
    ap.add_argument("--micro-batch", type=positive_int, default=8)
    ap.add_argument("--seq", type=positive_int, default=2048)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    rows = run(args.presets, args.micro_batch, args.seq)
    text = report(rows, args.micro_batch, args.seq, argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
