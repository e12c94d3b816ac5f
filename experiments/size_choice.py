"""Which model size, sequence length and vocabulary learn most per CPU-second on the demo corpus: the evidence
behind `make reproduce`'s budget (configs/reproduce/full.yaml).

    python -m experiments.size_choice [--seconds 120] [--out runs/size_choice]
                                     [--record experiments/results/size_choice.md]

1. Cost. Tokens/s of one training update (forward, backward, AdamW; one process, one thread, 4 x T random ids)
   for every candidate shape, with the demo's 8k sentencepiece vocabulary and with GPT-2's 50,257 ids; and the
   tokens per byte of text of both tokenizers on the demo's test documents, so that the rates compare as bytes of
   text per CPU-second (a bigger vocabulary needs fewer tokens for the same text).
2. Learning. Each candidate with the sentencepiece vocabulary trained as a Dense model through the launcher on
   2 ranks (the reproduce setting: 2,048 tokens per update, the same learning rate) for about `--seconds` of
   wall clock (steps = seconds x the measured rate); the mean validation loss over the training domains at the
   end, in nats per token and per byte. The shape with the lowest loss per byte after the same seconds learns
   most per CPU-second at this budget. (Longer budgets favour bigger models; the comparison is for ~10 minutes an
   arm, what `make reproduce` can afford.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.machine import machine_info
from data.argtypes import positive_float
from launcher.tables import markdown_table

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "artifacts" / "demo" / "tokens"
TOKENS_PER_RANK = 1024  # 2 ranks x 1,024 = the reproduce budget's 2,048 tokens per update


@dataclass(frozen=True)
class Shape:
    name: str
    n_layers: int
    d_model: int
    seq_len: int

    def sets(self) -> list[str]:
        return [
            f"model.n_layers={self.n_layers}",
            f"model.d_model={self.d_model}",
            f"model.seq_len={self.seq_len}",
            f"model.n_heads={max(2, self.d_model // 32)}",
            f"train.micro_batch={TOKENS_PER_RANK // self.seq_len}",
        ]


SHAPES = (
    Shape("L4 d128 T256 (chosen)", 4, 128, 256),
    Shape("L4 d64 T256", 4, 64, 256),
    Shape("L4 d256 T256", 4, 256, 256),
    Shape("L4 d128 T512", 4, 128, 512),
)
VOCABS = {"sentencepiece 8k": 8200, "gpt2 50k": 50257}


def update_rate(shape: Shape, vocab: int, steps: int = 5) -> float:
    """Tokens/s of forward + backward + AdamW on one thread (median-free: total time of `steps` after 2 warm-ups)."""
    from model.config import ModelConfig
    from model.gpt import GPT

    cfg = ModelConfig(
        n_layers=shape.n_layers,
        d_model=shape.d_model,
        n_heads=max(2, shape.d_model // 32),
        seq_len=shape.seq_len,
        vocab_size=vocab,
    )
    model = GPT(cfg, init_seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    B = TOKENS_PER_RANK // shape.seq_len
    x = torch.randint(0, vocab, (B, shape.seq_len + 1))
    for i in range(steps + 2):
        if i == 2:
            t0 = time.perf_counter()
        logits = model(x[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1])[:, :vocab], x[:, 1:].reshape(-1)
        )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return steps * B * shape.seq_len / (time.perf_counter() - t0)


def tokens_per_byte(max_docs: int = 20) -> dict[str, float]:
    """Tokens per UTF-8 byte of the demo's test documents for both tokenizers."""
    from data.tokenizer import load_prepared_tokenizer, load_tokenizer
    from launcher.checkpoint_data import split_documents_text

    texts, _ = split_documents_text(DATA, "sentencepiece", "test", max_docs)
    docs = [t for ts in texts.values() for t in ts]
    nbytes = sum(len(t.encode("utf-8")) for t in docs)
    toks = {
        "sentencepiece 8k": load_prepared_tokenizer(DATA, "sentencepiece"),
        "gpt2 50k": load_tokenizer("gpt2"),
    }
    return {name: sum(len(tok.encode(t)) for t in docs) / nbytes for name, tok in toks.items()}


def loss_at(recs: list[dict[str, Any]], seconds: float, log_interval: int = 10) -> float | None:
    """Training loss (mean of the last 3 logged intervals) after `seconds` of training steps (sum of step times)."""
    done, losses = 0.0, []
    for r in recs:
        if r.get("kind") != "train" or "step_time_s" not in r:
            continue
        done += r["step_time_s"] * log_interval
        if done > seconds:
            break
        losses.append(r["loss"])
    return sum(losses[-3:]) / len(losses[-3:]) if losses else None


def train(shape: Shape, steps: int, out: Path, reuse: bool = False) -> dict[str, Any]:
    """Dense on 2 ranks for `steps` (`reuse`: a finished run of the shape as it is); the final validation loss,
    the wall seconds, the training seconds (sum of step times) and the logged records."""
    from launcher.launch import main as launch
    from launcher.metrics import read_metrics

    run = out / shape.name.split(" (")[0].replace(" ", "-")
    if reuse and (run / "model" / "meta.json").is_file():
        recs = list(read_metrics(run / "metrics.jsonl"))
        return _summary(recs, json.loads((run / "model" / "meta.json").read_text())["step"], None)
    sets = [
        *shape.sets(),
        f"train.steps={steps}",
        "logging.wandb_mode=disabled",
        "train.eval_batches=16",
        "logging.log_interval=10",
        f"train.save_interval={steps}",
        "train.keep_checkpoints=1",
    ]
    t0 = time.perf_counter()
    rc = launch(
        [
            "--config",
            str(ROOT / "configs/demo/dense.yaml"),
            "--nproc",
            "2",
            "--run-dir",
            str(run),
            "--resume",
            "never",
            *[a for s in sets for a in ("--set", s)],
        ]
    )
    wall = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"training {shape.name} failed (exit {rc}); see {run}")
    return _summary(list(read_metrics(run / "metrics.jsonl")), steps, wall)


def _summary(recs: list[dict[str, Any]], steps: int, wall: float | None) -> dict[str, Any]:
    ev = [r for r in recs if r.get("kind") == "eval"][-1]
    losses = [v for k, v in ev.items() if k.startswith("val_loss/")]
    train_s = sum(r["step_time_s"] * 10 for r in recs if r.get("kind") == "train" and "step_time_s" in r)
    return {
        "steps": steps,
        "val_loss": sum(losses) / len(losses),
        "wall_s": wall,
        "train_s": train_s,
        "records": recs,
    }


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m experiments.size_choice", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--seconds", type=positive_float, default=120.0, help="training wall clock per shape (part 2)"
    )
    p.add_argument("--out", default=str(ROOT / "runs" / "size_choice"))
    p.add_argument("--record", default=None, help="also write the markdown here")
    p.add_argument(
        "--reuse", action="store_true", help="reuse finished runs under --out (part 2 not retrained)"
    )
    return p.parse_args(argv)


def _cost_lines(
    argv: Sequence[str] | None, m0: dict, tpb: dict[str, float], rates: dict[tuple[str, str], float]
) -> list[str]:
    """The heading and part 1: the update rate of every shape and vocabulary."""
    lines = [
        "# Model shape and vocabulary per CPU-second (make reproduce's budget)",
        "",
        f"`python -m experiments.size_choice {' '.join(argv if argv is not None else sys.argv[1:])}`",
        "",
        f"Machine: {m0['cpu']}, {m0['cores']} cores, 1-min load {m0['loadavg_1m']} at the start.",
        "",
        "## 1. Cost: one update (forward, backward, AdamW), one thread, 1,024 tokens",
        "",
        "Tokens per byte of the demo's test text: " + ", ".join(f"{k} {v:.3f}" for k, v in tpb.items()) + ".",
        "",
    ]
    base = rates[(SHAPES[0].name, "sentencepiece 8k")] / tpb["sentencepiece 8k"]
    return lines + markdown_table(
        ["shape", "vocabulary", "tokens/s", "bytes of text/s", "vs chosen"],
        [
            [s, v, f"{r:,.0f}", f"{r / tpb[v]:,.0f}", f"{r / tpb[v] / base:.2f}x"]
            for (s, v), r in rates.items()
        ],
    )


def _learn(
    a: argparse.Namespace, rates: dict[tuple[str, str], float]
) -> tuple[dict[str, dict], float, dict[str, float]]:
    """Part 2: train every shape for about `a.seconds`; (results, T the shortest training time, loss at T)."""
    out = Path(a.out)
    results = {}
    for s in SHAPES:
        per_rank = rates[(s.name, "sentencepiece 8k")]  # 2 ranks in parallel, each at about the 1-thread rate
        # 1.15: trainer + all-reduce overhead
        steps = max(20, int(a.seconds * per_rank / TOKENS_PER_RANK / 1.15))
        results[s.name] = train(s, steps, out, a.reuse)
    T = min(r["train_s"] for r in results.values())
    at = {k: loss_at(r["records"], T) for k, r in results.items()}
    return results, T, at


def _learning_lines(
    a: argparse.Namespace, results: dict[str, dict], T: float, at: dict[str, float], tpb: dict[str, float]
) -> list[str]:
    """Part 2's table: steps, tokens, seconds, final validation loss and the training loss at T."""
    lines = [
        "",
        f"## 2. Learning: Dense, 2 ranks, about {a.seconds:.0f} s of training each, sentencepiece 8k",
        "",
        "Steps come from part 1's rate, so the training seconds differ under a changing load; the comparison "
        "that counts is the training loss after the same seconds of training (T = the shortest run's step "
        "time; mean of the last 3 logged intervals before T).",
        "",
        *markdown_table(
            [
                "shape",
                "steps",
                "tokens",
                "training s (steps)",
                "final val loss (nats/token)",
                "train loss at T",
                "nats/byte at T",
            ],
            [
                [
                    s.name,
                    results[s.name]["steps"],
                    f"{results[s.name]['steps'] * 2 * TOKENS_PER_RANK:,}",
                    f"{results[s.name]['train_s']:.0f}",
                    f"{results[s.name]['val_loss']:.3f}",
                    f"{at[s.name]:.3f}",
                    f"{at[s.name] * tpb['sentencepiece 8k']:.3f}",
                ]
                for s in SHAPES
            ],
        ),
    ]
    lines += [
        "",
        f"T = {T:.0f} s."
        + (
            " Part 2's runs were reused from an earlier invocation (`--reuse`); part 1 was measured again."
            if a.reuse
            else ""
        ),
    ]
    return lines


def _verdict_lines(at: dict[str, float], m0: dict, m1: dict) -> list[str]:
    best = min(at, key=lambda k: at[k])
    return [
        "",
        f"Lowest training loss after the same seconds: **{best}**. 1-min load at the start {m0['loadavg_1m']}, "
        f"at the end {m1['loadavg_1m']}"
        + (
            " (above 2.5, more than the benchmark's own 2 ranks: figures taken under load)"
            if max(m0["loadavg_1m"], m1["loadavg_1m"]) > 2.5
            else ""
        )
        + ".",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Part 1 (cost per update), part 2 (learning per second); print the markdown and write it with --record."""
    a = _parse(argv)
    torch.set_num_threads(1)
    m0 = machine_info()
    tpb = tokens_per_byte()
    rates = {(s.name, v): update_rate(s, n) for s in SHAPES for v, n in VOCABS.items()}
    lines = _cost_lines(argv, m0, tpb, rates)
    results, T, at = _learn(a, rates)
    lines += _learning_lines(a, results, T, at, tpb)
    lines += _verdict_lines(at, m0, machine_info())
    text = "\n".join(lines) + "\n"
    print(text)
    if a.record:
        Path(a.record).write_text(text)
        Path(a.record).with_suffix(".json").write_text(
            json.dumps(
                {
                    "rates": {f"{s}|{v}": r for (s, v), r in rates.items()},
                    "tokens_per_byte": tpb,
                    "loss_at_T": at,
                    "T": T,
                    "learning": {
                        k: {x: y for x, y in r.items() if x != "records"} for k, r in results.items()
                    },
                    "seconds": a.seconds,
                    "machine": m0,
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
