"""Gradient all-reduce per step, DEMix vs Dense, on 8 gloo ranks in the same run.

    python -m experiments.allreduce [--ranks 8] [--domains 4] [--steps 5]

Every `torch.distributed.all_reduce` that DeepSpeed issues during backward and step is recorded (payload
bytes, group size, seconds). Per step we report the payload all-reduced over the whole data-parallel group
(shared parameters) and over domain groups (experts), the bytes each rank sends under a ring all-reduce,
2(p-1)/p x payload, and the time spent inside all-reduce. DEMix sends expert gradients only to the ranks
of their domain; Dense sends every gradient to every rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from data.argtypes import positive_int
from launcher.tables import markdown_table

RESULTS = Path(__file__).resolve().parent / "results"


def _worker(rank: int, world: int, kind: str, domains: int, steps: int) -> dict:
    import torch.distributed as dist

    from launcher.config import load_run_config
    from launcher.ffn_kinds import ffn_kind
    from launcher.train import train_step
    from model.gpt import GPT
    from parallel.groups import ProcessGroups
    from parallel.topology import build_topology

    n_dom = domains if kind == "demix" else 1
    cfg = load_run_config(
        None,
        [
            "model.preset=tiny",
            "model.n_layers=4",
            "model.d_model=256",
            "model.n_heads=4",
            "model.seq_len=128",
            "model.vocab_size=8192",
            f"model.ffn.kind={kind}",
            f"model.ffn.num_experts={domains if kind == 'demix' else 0}",
            "train.micro_batch=2",
            "train.grad_accum=1",
            f"train.steps={steps}",
        ],
    )
    topo = build_topology(world, 1, n_dom)
    groups = ProcessGroups.create(topo)
    info = topo.rank_info(rank)
    torch.manual_seed(0)
    model = GPT(cfg.model, expert_ids=list(info.domains) if kind == "demix" else None)
    bundle = ffn_kind(cfg).build_engine(model, cfg, groups)
    log: list[tuple[int, int, float]] = []
    real = dist.all_reduce

    def recording(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        t0 = time.perf_counter()
        out = real(tensor, op=op, group=group, async_op=async_op)
        if out is not None and async_op:
            out.wait()
        log.append(
            (tensor.numel() * tensor.element_size(), dist.get_world_size(group), time.perf_counter() - t0)
        )
        return out

    g = torch.Generator().manual_seed(rank)
    step_times = []
    for step in range(steps + 1):  # step 0 is warm-up, not recorded
        x = torch.randint(0, 8192, (2, 129), generator=g)
        mb = {
            "tokens": x[:, :-1],
            "targets": x[:, 1:],
            "domain_ids": torch.full((2,), info.domains[0]),
            "expert_ids": torch.full((2,), info.domains[0]),  # one expert per domain, in the domains' order
            "loss_mask": torch.ones(2, 128),
        }
        dist.barrier()
        if step == 1:
            dist.all_reduce = recording
        t0 = time.perf_counter()
        train_step(bundle, cfg, [mb], n_dom)
        step_times.append(time.perf_counter() - t0)
    dist.all_reduce = real
    # Only gradient reductions: the trainer's own scalars (norm, metrics) are < 64 bytes.
    grads = [r for r in log if r[0] > 64]
    by_group: dict[int, list[int]] = {}
    for nbytes, size, _ in grads:
        by_group.setdefault(size, []).append(nbytes)
    return {
        "params_on_rank": sum(p.numel() for p in model.parameters()),
        "payload_bytes_per_step": {str(k): sum(v) / steps for k, v in by_group.items()},
        "ring_bytes_sent_per_step": sum(n * 2 * (s - 1) / s for n, s, _ in grads) / steps,
        "allreduce_seconds_per_step": sum(t for _, _, t in grads) / steps,
        "step_seconds": sum(step_times[1:]) / steps,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=positive_int, default=8)
    p.add_argument("--domains", type=positive_int, default=4)
    p.add_argument("--steps", type=positive_int, default=5)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from benchmarks.machine import machine_info
    from experiments.ranks import run_ranks

    rows = {}
    for kind in ("dense", "demix"):
        per_rank = run_ranks(_worker, args.ranks, args=(kind, args.domains, args.steps), timeout=1200)
        mean = lambda key, rs=per_rank: sum(r[key] for r in rs) / len(rs)  # noqa: E731
        rows[kind] = {
            "params_on_rank": per_rank[0]["params_on_rank"],
            "payload_bytes_per_step_by_group_size": per_rank[0]["payload_bytes_per_step"],
            "ring_bytes_sent_per_rank_per_step": mean("ring_bytes_sent_per_step"),
            "allreduce_seconds_per_step": mean("allreduce_seconds_per_step"),
            "step_seconds": mean("step_seconds"),
        }
    d, m = rows["dense"], rows["demix"]
    ratio = {
        "ring_bytes_sent": m["ring_bytes_sent_per_rank_per_step"] / d["ring_bytes_sent_per_rank_per_step"],
        "allreduce_seconds": m["allreduce_seconds_per_step"] / d["allreduce_seconds_per_step"],
    }
    cmd = "python -m experiments.allreduce " + " ".join(argv if argv is not None else sys.argv[1:])
    out = {
        "command": cmd.strip(),
        "ranks": args.ranks,
        "domains": args.domains,
        "steps": args.steps,
        "machine": machine_info(),
        "rows": rows,
        "demix_over_dense": ratio,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "allreduce.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [
        f"# Gradient all-reduce per step: DEMix vs Dense ({args.ranks} gloo ranks, {args.domains} domains)",
        "",
        f"Command: `{out['command']}` on {os.cpu_count()} CPU cores (all ranks on one machine: times are gloo over "
        "shared memory, bytes are what a cluster would move).",
        "",
    ]
    table = []
    for kind, r in rows.items():
        pay = r["payload_bytes_per_step_by_group_size"]
        world = pay.get(str(args.ranks), 0.0)
        domain = sum(v for k, v in pay.items() if k != str(args.ranks))
        table.append(
            [
                kind,
                f"{r['params_on_rank']:,}",
                f"{world / 1e6:.2f}",
                f"{domain / 1e6:.2f}",
                f"{r['ring_bytes_sent_per_rank_per_step'] / 1e6:.2f}",
                f"{r['allreduce_seconds_per_step']:.4f}",
                f"{r['step_seconds']:.3f}",
            ]
        )
    lines += markdown_table(
        [
            "model",
            "params on a rank",
            "payload over all ranks (MB)",
            "payload over domain groups (MB)",
            "ring bytes sent per rank (MB)",
            "all-reduce s/step",
            "step s",
        ],
        table,
    )
    lines += [
        "",
        f"DEMix / Dense: ring bytes sent {ratio['ring_bytes_sent']:.3f}x, time in all-reduce "
        f"{ratio['allreduce_seconds']:.3f}x.",
    ]
    (RESULTS / "allreduce.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
