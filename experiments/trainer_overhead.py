"""The trainer's step against a bare PyTorch loop on the same model and batches, alternated in one run.

    python -m experiments.trainer_overhead [--kind dense|demix] [--rounds 8] [--steps 4] [--out experiments/results]

One process (world size 1, gloo): `launcher.train.train_step` on the DeepSpeed engine the trainer builds
(ZeRO 0, fp32, gradient clipping, the LR schedule) against the loop anyone would write by hand on an identical
copy of the model: forward, backward, `clip_grad_norm_`, AdamW step, zero_grad, the loss summed on the device.
Both take the same micro-batches (from the trainer's own sampler on a small prepared corpus). Rounds alternate
trainer and bare (each `--steps` updates after a warm-up), so a change of machine load hits both; the result is
the ratio of the medians of the per-update times, with the 1-minute load average before and after. A result
taken under a load above 1.5 says so in its first line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.machine import machine_info
from data.argtypes import positive_int
from launcher.tables import markdown_table

HIGH_LOAD = 1.5


def _corpus(root: Path) -> Path:
    """A small 2-domain corpus, prepared (GPT-2 BPE); returns the tokens root."""
    import random

    from data.prepare import prepare_corpus

    rng = random.Random(0)
    words = {
        "cooking": "oven flour butter sugar whisk simmer garlic onion pan bake roast salt".split(),
        "sailing": "hull mast keel tack jib wind harbour anchor bow stern rudder sail".split(),
    }
    corpus = root / "corpus"
    corpus.mkdir(parents=True)
    for d, ws in words.items():
        with open(corpus / f"{d}.jsonl", "w") as f:
            for i in range(200):
                f.write(
                    json.dumps(
                        {"id": f"{d}{i}", "domain": d, "text": " ".join(rng.choice(ws) for _ in range(400))}
                    )
                    + "\n"
                )
    prepare_corpus(corpus, root / "tokens", workers=1, progress=False, anonymise=False)
    return root / "tokens"


def _bare_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    micro: list[dict[str, Any]],
    clip: float,
    total: torch.Tensor,
) -> None:
    for mb in micro:
        out = model(
            mb["tokens"],
            mb["expert_ids"],
            targets_BT=mb["targets"],
            loss_mask_BT=mb["loss_mask"],
            return_logits=False,
        )
        (out.loss / len(micro)).backward()
        total += out.loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _run_sets(
    kind: str, tokens: Path, d_model: int, layers: int, seq_len: int, micro_batch: int
) -> list[str]:
    """The trainer's run-config overrides: a small GPT of `kind` on the one-domain corpus, ZeRO 0, 2 micro-batches."""
    return [
        f"model.n_layers={layers}",
        f"model.d_model={d_model}",
        "model.n_heads=4",
        f"model.seq_len={seq_len}",
        "model.vocab_size=50304",
        f"model.ffn.kind={kind}",
        f"data.path={tokens}",
        "data.tokenizer=gpt2",
        f"data.mixture={'by_domain' if kind == 'demix' else 'natural'}",
        "data.domains=[cooking]",
        f"train.steps={10**6}",
        f"train.micro_batch={micro_batch}",
        "train.grad_accum=2",
        "train.clip_grad=1.0",
        "train.lr=3e-4",
        "parallel.zero_stage=0",
        "logging.wandb_mode=disabled",
        "logging.progress_bar=false",
    ]


def _bare_copy(trainer: Any, cfg: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The trainer's model as a plain GPT with the same weights, and a plain AdamW with the same settings."""
    from model.gpt import GPT

    model = GPT(cfg.model, expert_ids=list(trainer.bundle.engine.module.expert_ids), init_seed=cfg.train.seed)
    model.load_state_dict(trainer.bundle.engine.module.state_dict())
    model.train()
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.train.lr,
        betas=(cfg.train.beta1, cfg.train.beta2),
        eps=cfg.train.eps,
        weight_decay=cfg.train.weight_decay,
    )
    return model, opt


def _alternate(
    time_trainer: Callable[[], float], time_bare: Callable[[], float], rounds: int
) -> tuple[list[float], list[float]]:
    """A warm-up of each, then `rounds` rounds alternating which goes first: (trainer times, bare times)."""
    time_trainer(), time_bare()  # warm-up: lazy optimizer state, allocator
    t_trainer, t_bare = [], []
    for r in range(rounds):
        order = (time_trainer, time_bare) if r % 2 == 0 else (time_bare, time_trainer)
        for fn in order:
            (t_trainer if fn is time_trainer else t_bare).append(fn())
    return t_trainer, t_bare


def run(
    kind: str, rounds: int, steps: int, d_model: int, layers: int, seq_len: int, micro_batch: int
) -> dict[str, Any]:
    """Seconds per update of the trainer's `train_step` and of a bare loop on the same batches, alternated."""
    from launcher.config import load_run_config
    from launcher.plan import make_plan
    from launcher.train import Trainer, train_step

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", DS_ACCELERATOR="cpu")
    from launcher.distributed import free_port

    os.environ.setdefault("MASTER_PORT", str(free_port()))
    root = Path(tempfile.mkdtemp(prefix="trainer_overhead-"))
    tokens = _corpus(root)
    sets = _run_sets(kind, tokens, d_model, layers, seq_len, micro_batch)
    plan = make_plan(load_run_config(None, sets, check=False), 1)
    cfg = plan.cfg
    trainer = Trainer.setup(plan, root / "run", resume="never")
    model, opt = _bare_copy(trainer, cfg)
    n = len(plan.catalog.train_domains)
    batches = [trainer.batches(s) for s in range(steps)]
    total = torch.zeros((), device=trainer.device)

    def time_trainer() -> float:
        t0 = time.perf_counter()
        for b in batches:
            train_step(trainer.bundle, cfg, b, n)
        return (time.perf_counter() - t0) / steps

    def time_bare() -> float:
        t0 = time.perf_counter()
        for b in batches:
            _bare_step(model, opt, b, cfg.train.clip_grad, total)
        return (time.perf_counter() - t0) / steps

    load_before = os.getloadavg()[0]
    t_trainer, t_bare = _alternate(time_trainer, time_bare, rounds)
    load_after = os.getloadavg()[0]
    med_t, med_b = statistics.median(t_trainer), statistics.median(t_bare)
    return {
        "kind": kind,
        "rounds": rounds,
        "steps_per_round": steps,
        "micro_batch": micro_batch,
        "grad_accum": 2,
        "d_model": d_model,
        "layers": layers,
        "seq_len": seq_len,
        "params": sum(p.numel() for p in model.parameters()),
        "trainer_s_per_update": t_trainer,
        "bare_s_per_update": t_bare,
        "median_trainer_s": med_t,
        "median_bare_s": med_b,
        "ratio_trainer_over_bare": med_t / med_b,
        "load_before": load_before,
        "load_after": load_after,
    }


def markdown(results: list[dict[str, Any]], command: str, machine: dict[str, Any]) -> str:
    loads = [max(r["load_before"], r["load_after"]) for r in results]
    lines = []
    if max(loads) > HIGH_LOAD:
        lines += [
            f"**Taken under load** (1-minute load average up to {max(loads):.2f} > {HIGH_LOAD} on "
            f"{machine.get('cores', '?')} cores): the ratio is indicative only.",
            "",
        ]
    lines += [
        "# Trainer step vs a bare PyTorch loop (same model, same batches, alternated in one run)",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {json.dumps(machine)}",
        "",
        *markdown_table(
            [
                "kind",
                "params",
                "update = micro x accum x seq",
                "trainer s/update (median)",
                "bare s/update (median)",
                "trainer / bare",
                "load before / after",
            ],
            [
                [
                    r["kind"],
                    f"{r['params']:,}",
                    f"{r['micro_batch']} x {r['grad_accum']} x {r['seq_len']}",
                    f"{r['median_trainer_s']:.4f}",
                    f"{r['median_bare_s']:.4f}",
                    f"**{r['ratio_trainer_over_bare']:.3f}**",
                    f"{r['load_before']:.2f} / {r['load_after']:.2f}",
                ]
                for r in results
            ],
        ),
    ]
    lines += [
        "",
        "The trainer's step is `launcher.train.train_step` on the DeepSpeed engine (ZeRO 0, fp32): forward, "
        "loss, backward, the global gradient norm and clipping, AdamW, the LR schedule, per-domain loss sums on "
        "the device. The bare loop: forward, backward, `clip_grad_norm_`, `torch.optim.AdamW`. Neither reads "
        "anything back from the device inside the step (tests/launcher/test_train_host_syncs.py).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", default="dense,demix")
    p.add_argument("--rounds", type=positive_int, default=8)
    p.add_argument("--steps", type=positive_int, default=4)
    p.add_argument("--d-model", type=positive_int, default=256)
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--seq-len", type=positive_int, default=128)
    p.add_argument("--micro-batch", type=positive_int, default=4)
    p.add_argument("--out", default="experiments/results")
    a = p.parse_args(argv)
    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    results = [
        run(k, a.rounds, a.steps, a.d_model, a.layers, a.seq_len, a.micro_batch) for k in a.kinds.split(",")
    ]
    command = "python -m experiments.trainer_overhead " + " ".join(argv if argv is not None else sys.argv[1:])
    md = markdown(results, command.strip(), machine_info())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "trainer_overhead.md").write_text(md)
    (out / "trainer_overhead.json").write_text(
        json.dumps({"command": command, "results": results}, indent=2) + "\n"
    )
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
