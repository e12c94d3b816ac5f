"""Several DEMix experts on one process: the per-expert scatter + touch-every-expert forward
(before, kept here as the reference) against the one-permutation forward of model/demix.py (after), CPU step time.

    OMP_NUM_THREADS=1 python -m experiments.demix_local_experts [--repeats 7] [--out experiments/results]

Two measurements, each forward + backward (+ zero_grad) with 8 experts on one process:

* one DemixFFN layer at gpt3-small width (D 768, F 3072): B sequences of T tokens, the domains cycling over the
  batch as the trainer's by_domain sampler gives them (unsorted when B > #domains in the batch);
* a whole small GPT (the `tiny` preset, 8 experts per layer), the same batch layout.

Before and after alternate within each repeat (a change of machine load hits both); the result is the ratio of
the medians. The CPU time used by other processes while it ran (benchmarks.machine.OtherLoad) and `uptime` before
and after are recorded: this machine is shared.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from benchmarks.machine import OtherLoad, machine_info, uptime
from data.argtypes import positive_int
from launcher.tables import markdown_table
from model.demix import DemixFFN
from model.mlp import FFNOutput, expert_output_like


def reference_demix_hidden(ffn: DemixFFN, x_BTD: torch.Tensor, domain_ids_B: torch.Tensor) -> torch.Tensor:
    """The several-experts path written the obvious way (the forward before the grouped one): one out-of-place
    `index_put` of each expert's rows into the whole activation, every expert touched by a `0 x parameter` term.
    Slow, kept here as the reference the grouped forward is timed against and tested against
    (tests/model/test_demix.py)."""
    out_BTD = expert_output_like(x_BTD)
    seen = torch.zeros_like(domain_ids_B, dtype=torch.bool)
    for e in ffn.expert_ids:
        rows_N = (domain_ids_B == e).nonzero(as_tuple=True)[0]
        seen[rows_N] = True
        if rows_N.numel():
            rows_N = rows_N.to(x_BTD.device, non_blocking=True)
            out_BTD = out_BTD.index_put((rows_N,), ffn.experts[str(e)](x_BTD[rows_N]))
    if not bool(seen.all()):
        missing = sorted(set(domain_ids_B[~seen].tolist()))
        raise ValueError(
            f"domain ids {missing} have no expert here (this layer holds experts {ffn.expert_ids})"
        )
    for e in ffn.expert_ids:
        out_BTD = out_BTD + 0.0 * sum(p.view(-1)[0] for p in ffn.experts[str(e)].parameters())
    return out_BTD


def reference_forward(
    self: DemixFFN, x_BTD: torch.Tensor, domain_ids_B: torch.Tensor | None = None
) -> FFNOutput:
    """DemixFFN.forward before the grouped forward (`reference_demix_hidden`)."""
    if len(self.expert_ids) == 1:
        return FFNOutput(hidden=self.experts[str(self.expert_ids[0])](x_BTD))
    return FFNOutput(hidden=reference_demix_hidden(self, x_BTD, domain_ids_B))


@contextmanager
def old_forward() -> Iterator[None]:
    new = DemixFFN.forward
    DemixFFN.forward = reference_forward
    try:
        yield
    finally:
        DemixFFN.forward = new


def _cfg(preset: str, experts: int, seq: int, **over: object):
    from launcher.config import load_run_config

    sets = [
        f"model.preset={preset}",
        f"model.seq_len={seq}",
        "model.ffn.kind=demix",
        f"model.ffn.num_experts={experts}",
        "model.vocab_size=512",
    ] + [f"model.{k}={v}" for k, v in over.items()]
    return load_run_config(None, sets).model


def _time(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _alternate(step: Callable[[], None], repeats: int) -> dict[str, list[float]]:
    step(), step()  # warm-up, both paths
    with old_forward():
        step()
    times: dict[str, list[float]] = {"before": [], "after": []}
    for r in range(repeats):
        for which in ("before", "after") if r % 2 == 0 else ("after", "before"):
            if which == "before":
                with old_forward():
                    times[which].append(_time(step))
            else:
                times[which].append(_time(step))
    return times


def layer_case(experts: int, B: int, T: int, repeats: int) -> dict[str, list[float]]:
    torch.manual_seed(0)
    ffn = DemixFFN(_cfg("gpt3-small", experts, T), list(range(experts)))
    x = torch.randn(B, T, ffn.experts["0"].fc1.in_features, requires_grad=True)
    ids = torch.tensor([b % experts for b in range(B)])

    def step() -> None:
        ffn.zero_grad(set_to_none=True)
        x.grad = None
        ffn(x, ids).hidden.sum().backward()

    return _alternate(step, repeats)


def gpt_case(experts: int, B: int, T: int, repeats: int) -> dict[str, list[float]]:
    from model.gpt import GPT

    torch.manual_seed(0)
    model = GPT(_cfg("tiny", experts, T, n_layers=4))
    tokens = torch.randint(0, 512, (B, T + 1))
    ids = torch.tensor([b % experts for b in range(B)])

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(tokens[:, :-1], ids, targets_BT=tokens[:, 1:], return_logits=False).loss.backward()

    return _alternate(step, repeats)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=positive_int, default=7)
    ap.add_argument("--experts", type=positive_int, default=8)
    ap.add_argument("--out", type=Path, default=Path("experiments/results"))
    args = ap.parse_args(argv)
    cases = [
        ("DemixFFN layer, D 768 F 3072, B 8 x T 128 (8 domains, 1 sequence each)", layer_case, 8, 128),
        ("DemixFFN layer, D 768 F 3072, B 2 x T 1024 (2 of 8 domains)", layer_case, 2, 1024),
        ("DemixFFN layer, D 768 F 3072, B 16 x T 64 (8 domains cycling: unsorted)", layer_case, 16, 64),
        ("GPT tiny preset, 4 layers, B 8 x T 128 (8 domains, 1 sequence each)", gpt_case, 8, 128),
    ]
    up0, info = uptime(), machine_info()
    rows = []
    with OtherLoad() as ol:
        for name, fn, B, T in cases:
            t = fn(args.experts, B, T, args.repeats)
            before, after = statistics.median(t["before"]), statistics.median(t["after"])
            rows.append((name, before, after, before / after, t))
            print(
                f"{name}: before {before * 1e3:.1f} ms, after {after * 1e3:.1f} ms, ratio {before / after:.2f}x",
                flush=True,
            )
    load, up1 = ol.result(), uptime()
    cmd = "OMP_NUM_THREADS=1 python -m experiments.demix_local_experts " + " ".join(argv or sys.argv[1:])
    lines = [
        "# DEMix: several experts on one process, forward + backward step time",
        "",
        f"Command: `{cmd.strip()}`",
        "",
        "Before: per-expert out-of-place `index_put` into the whole activation + `0.0 * p.view(-1)[0]` of every "
        "expert parameter added to the output (a dense zero gradient for every expert in backward). After: "
        "model/demix.py `run_grouped`: one stable sort of the sequences by expert, each expert on its contiguous "
        "slice, one `index_copy_` back (none when the batch is already sorted), a zero gradient made in "
        "backward only for experts with no row. Median of "
        f"{args.repeats} alternated repeats (wall time per forward+backward+zero_grad), {args.experts} experts.",
        "",
        *markdown_table(
            ["case", "before (ms)", "after (ms)", "before / after"],
            [[n, f"{b * 1e3:.1f}", f"{a * 1e3:.1f}", f"{r:.2f}x"] for n, b, a, r, _ in rows],
            align="lrrr",
        ),
    ]
    lines += [
        "",
        "Machine (shared with other engineers' jobs while this ran):",
        "",
        f"- {info['cpu']}, {info['cores']} usable cores, torch {info['torch']}, OMP_NUM_THREADS="
        f"{info['omp_num_threads']}",
        f"- uptime before: `{up0}`",
        f"- uptime after: `{up1}`",
        f"- CPU used by other processes during the run (OtherLoad): {load['others_cores']} cores "
        f"(niced {load['niced_cores']}); this process {load['own_cores']} cores over {load['wall_s']} s",
        "",
        "All repeats (ms):",
        "",
    ]
    lines += [
        f"- {n}: before {[round(v * 1e3, 1) for v in t['before']]}, after {[round(v * 1e3, 1) for v in t['after']]}"
        for n, _, _, _, t in rows
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "demix_local_experts.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out / 'demix_local_experts.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
