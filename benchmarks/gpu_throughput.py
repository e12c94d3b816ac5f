"""GPU training throughput of Dense, DEMix and GShard on random tokens: the framework's step vs a bare PyTorch loop.

    python -m benchmarks.gpu_throughput [--quick] [--record benchmarks/results/gpu_throughput.md]
        [--sizes gpt3-small,...|all] [--arms dense,demix-1,demix-<N>,gshard|all] [--steps 3] [--warmup 2]
        [--micro-batch 4] [--grad-accum 2] [--seq-len 2048] [--precision bf16|fp32] [--zero-stage 1]
        [--recompute none|full] [--gshard-experts 8] [--deadline-s S] [--memory-gib G]
    python -m benchmarks.gpu_throughput --tiny [--quick] [--arms ...] [--record PATH]   # CPU smoke run, same path

No prepared data: every micro-batch is uniform random token ids (throughput does not depend on the text), made
once per cell and given to both loops. One process, world size 1 (one GPU), ZeRO 1, bf16, sequence 2048.

Arms (each on one GPU, so each is "one rank" of a larger run):
* dense      - the dense GPT;
* demix-1    - DEMix with one domain per GPU: the rank holds 1 expert in every layer (a rank of the paper's
               8-domain, n-GPU layout); FLOPs and parameters equal dense's, the expert path is the difference;
* demix-N    - N domains on this one GPU: N experts per layer, the by-domain round robin of data/sampler.py
               (sample g of the step is domain g mod N);
* gshard     - GShard top-2 every other layer with `--gshard-experts` experts all held on this GPU
               (experts_per_rank = E, expert-parallel size 1: DeepSpeed's MoE layer without a remote all-to-all).

Cells (size x arm). The default preset, at the recipe (bf16, ZeRO 1, micro-batch 4 x grad_accum 2 x seq 2048,
no recompute), warm-up 2 + 3 timed updates per phase:
* gpt3-small x dense, demix-1, demix-8, gshard - every architecture, cheaply (40 ms of model FLOPs per update);
* gpt3-xl x dense, demix-1, demix-4 - the paper's 1.3B model, the largest size whose DEMix rank the planner says
  fits one H200 (~139 GiB as torch reports it): predicted framework peaks dense / demix-1 37.7 GiB, demix-4
  82.7 GiB, demix-8 142.7 GiB (does not fit; bare 125.2). demix-1 is the paper's layout (one domain per GPU) at
  the same FLOPs as dense; demix-4 the most experts one GPU holds (3.7 B parameters: the optimizer step and the
  memory of a rank that holds several domains). gpt3-medium and -large add no new question between these two.
`--quick`: gpt3-small x dense, demix-1, demix-8, warm-up 1 + 2 timed updates (Dense vs DEMix, 1 and 8 experts).
`--sizes` and/or `--arms` replace the preset by their product (the one not given: every size, every arm;
`all`: every one), e.g. `--sizes all --arms all` for the whole 4 x 5 grid (cells that do not fit are skipped).

Time estimates (an H200; nothing has been timed there yet). Model FLOPs per update (model/accounting.py):
gpt3-small 1.6e13 (GShard 1.9e13), gpt3-xl 1.5e14, i.e. 40 ms and 372 ms at ~400 TFLOP/s effective. Per cell
on top of its 2 phases x (warm-up + steps) updates: the planner's trace of the activations on the host, measured
5-14 s per cell here (2 busy cores; GShard 24 s), ~2 x 1 s to build the two models on the device and ~3-5 s for
DeepSpeed's engine (assumed). Start: ~5 s of imports (measured here) + CUDA context and NCCL (~15 s, assumed).
* --quick: 20 s + 3 cells x (~8 s planner + ~6 s builds + 6 x 40 ms) ~ 65 s (<= 2 min); deadline 150 s.
* default: 20 s + small 4 x (~12 s planner + ~6 s builds + 10 x ~45 ms) ~ 75 s + xl 3 x (~10 s planner + ~8-12 s
  builds + 10 x 372 ms, 6 s at 250 TFLOP/s) ~ 75 s ~ 170 s (<= 4 min); deadline 270 s.

Per cell two phases run in the same process, one after the other, on the same batches:
* framework - the project's real training path: the plan (`launcher.plan.plan_layout`), process groups, the GPT
              with this rank's experts, activation recompute, `FFNKind.build_engine` (the DeepSpeed engine with
              the generated config, ZeRO stage and precision), then `launcher.train.train_step` per update, as
              `Trainer.setup` / `Trainer.run` do (`build_rank_model`, `build_rank_engine`: Trainer.setup's own
              functions; the prepared data it also opens is replaced by random tokens);
* bare      - the same model (GShard keeps the plain single-process layer of model/gshard.py) in the loop anyone
              would write: autocast(bf16) forward, loss (+ aux), backward / grad_accum, `clip_grad_norm_`,
              `torch.optim.AdamW` (fp32 weights), zero_grad.
Each phase builds its own model with `build_rank_model` directly on the device (`with torch.device(device)`), so
nothing is initialised on one host thread and copied over, and no template copy holds device memory during the
other phase; the run's seed gives both phases identical initial weights. On a GPU they are drawn by the CUDA
generator (GPT.reset_parameters: deterministic, but other values than a host build's; the same distribution,
which is all throughput needs); on the CPU (--tiny) they are the trainer's host weights, as before.
Each phase runs `--warmup` updates, then `--steps` timed updates between two CUDA events (with
torch.cuda.synchronize before and after the timed region only; perf_counter on CPU). Peak memory is
torch.cuda.max_memory_allocated of the phase (reset before it builds its model on the device).

Memory: before a cell is built the project's planner (parallel/memory.py, as the dry run's memory table) predicts
each phase's peak: model states at the recipe's precision and ZeRO stage, the gradient-reduction buffers and the
activations traced from the model itself on fake tensors (`estimate_activations`; the bare loop: 16 bytes per
parameter and the activations of fp32 weights under autocast). A phase whose prediction exceeds the device's
memory (`--memory-gib`, default the GPU's total; none on CPU) is recorded as "skipped: planner predicts X GiB > Y
GiB" and never tried; both figures are in the table next to the measured peak. A phase that still runs out of
memory is recorded as OOM and the sweep continues.

Deadline: `--deadline-s S` (from the start of `main`; default 270 s for the default preset, 150 s for --quick,
none with --sizes/--arms or --tiny; 0 = none): a cell or phase not started by then is recorded as "not run:
deadline" and the sweep ends on time, whatever it found. A running phase is not interrupted.

Metrics (model/accounting.py, as `launcher.train.throughput_record` logs them during training), per update of
B = micro_batch x grad_accum sequences of s tokens on 1 GPU taking t seconds:

    tokens/s      = B·s / t
    TFLOP/s/GPU   = F_model / t / 10¹²,  F_model = flops_per_update(cfg, B).no_recompute  (fwd + bwd = 3 passes)
    MFU           = TFLOP/s/GPU / peak(device, precision)                (H100 SXM bf16 dense: 989 TFLOP/s)
    HFU           = F_hw / t / 10¹² / peak,  F_hw = .recompute when --recompute full (4 passes of the layers),
                    else F_model (HFU = MFU)
    framework/bare = framework tokens/s / bare tokens/s  (1 = the framework costs nothing; < 1 = slower)

F follows Narayanan et al. (2021) eq. 3 with the unpadded vocabulary, as the trainer logs it; DEMix runs one
expert per token (dense FLOPs), GShard k = 2 experts in its expert layers (at capacity factor 1.0 DeepSpeed's
layer computes exactly k·S expert rows; the plain layer of the bare loop skips dropped routes, so its executed
FLOPs are slightly lower than the count, see model/accounting.py).

Without CUDA the full sweep is refused (exit 2); `--tiny` runs a 2-layer, d 64, seq 64, vocab 512 model through
the same code on CPU (writes nothing unless `--record PATH` is given, and never the GPU results file).
Results, written as the sweep goes (a killed run keeps every finished cell): after each cell one JSON line is
appended to `<record>.jsonl` and the markdown table at `--record` (default benchmarks/results/gpu_throughput.md
for a full run; the command, GPU, driver, torch / CUDA / NCCL / DeepSpeed versions, the machine load) and the
.json beside it are rewritten.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from data.argtypes import nonneg_float, nonneg_int, positive_float, positive_int
from data.cli import usage_error
from launcher.tables import markdown_table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_RECORD = RESULTS / "gpu_throughput.md"
SIZES = ("gpt3-small", "gpt3-medium", "gpt3-large", "gpt3-xl")
ARMS = ("dense", "demix-1", "demix-2", "demix-8", "gshard")
# The presets: (size, its arms) in order; why these cells, and their time estimates, in the module docstring.
DEFAULT_CELLS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("gpt3-small", ("dense", "demix-1", "demix-8", "gshard")),
    ("gpt3-xl", ("dense", "demix-1", "demix-4")),
)
QUICK_CELLS: tuple[tuple[str, tuple[str, ...]], ...] = (("gpt3-small", ("dense", "demix-1", "demix-8")),)
DEFAULT_DEADLINE_S = 270.0  # the default preset's estimate (~170 s) with room for a slow start
QUICK_DEADLINE_S = 150.0  # --quick's (~70 s) likewise
GIB = 1024**3
NO_CUDA = (
    "benchmarks.gpu_throughput: no CUDA device here (torch.cuda.is_available() is False); the full sweep "
    "needs a GPU. Run `python -m benchmarks.gpu_throughput --tiny` for the CPU smoke run of the same code path."
)
# The tiny configuration: small enough for a CPU step in milliseconds, every arm still meaningful.
TINY_MODEL = ("model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.vocab_size=512")


@dataclass(frozen=True)
class Arm:
    """One architecture as one rank sees it: the FFN kind and the domains (DEMix) or experts (GShard) it holds."""

    name: str
    kind: str
    domains: int = 1  # DEMix: domains (= experts) on this GPU
    experts: int = 0  # GShard: experts, all on this GPU

    def overrides(self) -> list[str]:
        out = [
            f"model.ffn.kind={self.kind}",
            f"data.mixture={'by_domain' if self.kind == 'demix' else 'natural'}",
            f"data.domains=[{','.join(self.domain_names())}]",
        ]
        if self.kind == "gshard":
            out += [
                f"model.ffn.num_experts={self.experts}",
                f"model.ffn.gshard.experts_per_rank={self.experts}",
            ]
        return out

    def domain_names(self) -> list[str]:
        return [f"d{i}" for i in range(self.domains)]


def parse_arm(name: str, gshard_experts: int) -> Arm:
    """'dense', 'demix-<N>' (N domains on this GPU) or 'gshard' (top-2 over `gshard_experts` local experts)."""
    if name == "dense":
        return Arm(name, "dense")
    if name == "gshard":
        return Arm(name, "gshard", experts=gshard_experts)
    if name.startswith("demix-") and name[6:].isdigit() and int(name[6:]) >= 1:
        return Arm(name, "demix", domains=int(name[6:]))
    raise ValueError(
        f"unknown arm {name!r}: choose dense, demix-<N> (N domains on the GPU, e.g. demix-1) or gshard"
    )


# ----------------------------------------------------------------------------------------------------
# The framework's path, without prepared data
# ----------------------------------------------------------------------------------------------------


def run_config(size: str, arm: Arm, a: argparse.Namespace):
    """The run config of one cell: the size's preset (or the tiny model), the arm, the recipe under test."""
    from launcher.config import load_run_config

    model = ["model.preset=tiny", *TINY_MODEL] if size == "tiny" else [f"model.preset={size}"]
    sets = [
        *model,
        f"model.seq_len={a.seq_len}",
        *arm.overrides(),
        "data.path=(random tokens)",
        f"train.steps={a.warmup + a.steps}",
        f"train.micro_batch={a.micro_batch}",
        f"train.grad_accum={a.grad_accum}",
        f"train.precision={a.precision}",
        f"train.activation_checkpointing={a.recompute}",
        f"parallel.zero_stage={a.zero_stage}",
        "logging.wandb_mode=disabled",
        "logging.progress_bar=false",
    ]
    return load_run_config(None, sets, check=False)


def plan_random_tokens(cfg, domain_names: Sequence[str]):
    """A validated one-rank `Plan` without prepared data: `make_plan`'s checks minus the data's (the config's
    problems, this device's precision, the layout), and a catalog naming the arm's domains over random tokens."""
    from data.catalog import Catalog
    from launcher.config import ConfigError
    from launcher.plan import Plan, plan_layout
    from parallel.precision import local_precision_problems

    problems = cfg.problems()
    problems += [] if problems else local_precision_problems(cfg.train.precision)
    layout = plan_layout(cfg, 1, domain_names)
    problems += layout.problems
    if problems:
        raise ConfigError(problems, "gpu_throughput")
    catalog = Catalog(Path(cfg.data.path), "random", cfg.model.vocab_size, 0, tuple(domain_names), (), {})
    return Plan(layout.cfg, catalog, layout.topo, notes=layout.notes)


def build_model(plan, device: torch.device):
    """This rank's GPT as the trainer builds it (launcher.train.build_rank_model: the run's seed, this rank's
    experts), made directly on `device`: on a GPU every tensor is allocated and initialised there (its values
    drawn by the CUDA generator, GPT.reset_parameters), not built on one host thread and copied over. Each phase
    builds its own: the same seed gives the same initial weights on the same device type."""
    from launcher.train import build_rank_model

    with torch.device(device):
        return build_rank_model(plan, 0)


def build_bundle(plan, model):
    """The trainer's engine on a built model (launcher.train.build_rank_engine: recompute, the FFN kind's DeepSpeed
    engine with the generated config), over this layout's process groups (the process group must exist)."""
    from launcher.train import build_rank_engine
    from parallel.groups import ProcessGroups

    return build_rank_engine(plan, model, ProcessGroups.create(plan.topo))


def random_batches(plan, updates: int, device: torch.device, seed: int = 0) -> list[list[dict[str, Any]]]:
    """`updates` x grad_accum micro-batches of uniform random tokens in the sampler's format, made model inputs by
    the trainer's own `to_model_batch`; domain of sample g of the run = g mod (domains), as the by-domain round
    robin (data/sampler.py) gives a rank holding several domains."""
    from launcher.batches import to_model_batch

    cfg = plan.cfg
    B, ga, T, V = cfg.train.micro_batch, cfg.train.grad_accum, cfg.model.seq_len, cfg.model.vocab_size
    k = len(plan.catalog.train_domains)
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(updates):
        micro = []
        for m in range(ga):
            x_BT = torch.randint(0, V, (B, T + 1), generator=g)
            base = (step * ga + m) * B
            b = {
                "tokens_BT": x_BT[:, :-1].contiguous(),
                "targets_BT": x_BT[:, 1:].contiguous(),
                "loss_mask_BT": torch.ones((B, T), dtype=torch.float32),
                "domain_ids_B": torch.tensor([(base + i) % k for i in range(B)], dtype=torch.long),
            }
            micro.append(to_model_batch(b, device, plan))
        out.append(micro)
    return out


# ----------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_updates(
    step: Callable[[list[dict[str, Any]]], Any],
    batches: list[list[dict[str, Any]]],
    warmup: int,
    device: torch.device,
) -> float:
    """Seconds per update over batches[warmup:], after running batches[:warmup] untimed. On CUDA: two events
    around the timed region, synchronised only before and after it."""
    for micro in batches[:warmup]:
        step(micro)
    timed = batches[warmup:]
    _sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for micro in timed:
            step(micro)
        end.record()
        torch.cuda.synchronize(device)
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for micro in timed:
            step(micro)
        seconds = time.perf_counter() - t0
    return seconds / len(timed)


def _reset_memory(device: torch.device) -> None:
    """Free what the last phase left (its engine's reference cycles too) and reset the peak counter."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def framework_phase(plan, batches, warmup: int, device: torch.device) -> dict[str, Any]:
    """The DeepSpeed engine the trainer builds, on this phase's own model, stepped by `launcher.train.train_step`."""
    from launcher.train import train_step

    _reset_memory(device)
    bundle = build_bundle(plan, build_model(plan, device))
    n = len(plan.catalog.train_domains)
    try:
        seconds = time_updates(lambda micro: train_step(bundle, plan.cfg, micro, n), batches, warmup, device)
        return {"status": "ok", "s_per_update": seconds, "peak_mem_gib": _peak_gib(device)}
    finally:
        if hasattr(bundle.engine, "destroy"):
            bundle.engine.destroy()


def bare_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    micro: list[dict[str, Any]],
    clip: float,
    autocast: Callable[[], Any],
) -> None:
    """forward (autocast) -> loss (+aux) -> backward / accum, per micro-batch; clip; AdamW; zero_grad."""
    for mb in micro:
        with autocast():
            out = model(
                mb["tokens"],
                mb["expert_ids"],
                targets_BT=mb["targets"],
                loss_mask_BT=mb["loss_mask"],
                return_logits=False,
            )
            loss = out.loss if out.aux_loss is None else out.loss + out.aux_loss
        (loss / len(micro)).backward()
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


def bare_phase(plan, batches, warmup: int, device: torch.device) -> dict[str, Any]:
    """The same model (its own build, the same initial weights) in a plain PyTorch loop: fp32 weights, autocast
    to the run's precision, torch AdamW."""
    from parallel.activation_recompute import apply_activation_recompute

    t = plan.cfg.train
    _reset_memory(device)
    model = build_model(plan, device).train()
    if t.activation_checkpointing == "full":
        apply_activation_recompute(model)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        eps=t.eps,
    )
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision)
    autocast = (
        (lambda: torch.autocast(device.type, dtype=dtype)) if dtype is not None else contextlib.nullcontext
    )
    seconds = time_updates(
        lambda micro: bare_step(model, opt, micro, t.clip_grad, autocast), batches, warmup, device
    )
    return {"status": "ok", "s_per_update": seconds, "peak_mem_gib": _peak_gib(device)}


def guarded(phase: Callable[[], dict[str, Any]], device: torch.device) -> dict[str, Any]:
    """Run a phase; an out-of-memory error becomes {"status": "OOM"}, any other error {"status": "error"}."""
    try:
        return phase()
    except Exception as e:  # noqa: BLE001 - one cell's failure must not end the sweep
        out = {"status": "OOM" if _is_oom(e) else "error", "error": f"{type(e).__name__}: {str(e)[:300]}"}
    finally:
        _reset_memory(device)
    return out


# ----------------------------------------------------------------------------------------------------
# The memory planner's verdict
# ----------------------------------------------------------------------------------------------------


def predict_memory(cfg) -> dict[str, Any]:
    """Each phase's peak GiB as the project's planner (parallel/memory.py, the dry run's table) predicts it for
    this one-GPU rank holding every expert: model states (eq. Z at the run's ZeRO stage, one data-parallel rank),
    gradient-reduction buffers and the traced activations of one micro-batch (`estimate_activations`: this model
    at the recipe's micro-batch, sequence, precision and recompute on fake tensors). The bare loop: fp32 weights,
    gradients and AdamW moments (16 bytes per parameter) and the activations traced as ZeRO 0 trains (fp32
    weights under autocast), no buffers. Also: the parameters held and how the activations were obtained."""
    from model.accounting import param_counts
    from parallel.memory import RankParams, buffer_bytes, estimate_activations, model_state_bytes
    from parallel.precision import normalise_precision

    t, par = cfg.train, cfg.parallel
    precision, zero = normalise_precision(t.precision), par.zero_stage
    recompute = t.activation_checkpointing == "full"
    counts = param_counts(cfg.model, vocab_size=cfg.model.padded_vocab_size(par.tensor_parallel))
    held = RankParams(counts.shared, counts.expert, 1, 1)
    act = estimate_activations(
        cfg.model, t.micro_batch, par.tensor_parallel, precision, None, stages=(0, zero)
    )
    states = sum(model_state_bytes(held, precision, zero, t.grad_reduce_dtype).values())
    buffers = buffer_bytes(precision, zero, held, par.grad_reduce, par.bucket_elements, t.grad_reduce_dtype)
    bare_states = sum(model_state_bytes(held, precision, 0).values())
    return {
        "params": counts.total,
        "gib": {
            "framework": (states + buffers + act(zero, recompute)) / GIB,
            "bare": (bare_states + act(0, recompute)) / GIB,
        },
        "activations": act.method + (f" ({act.reason})" if act.reason else ""),
        "seconds": act.seconds,
    }


def planner_skip(predicted_gib: float | None, memory_gib: float | None) -> str | None:
    """Why a phase is not tried: the planner's prediction exceeds the device's memory (None: try it)."""
    if predicted_gib is None or memory_gib is None or predicted_gib <= memory_gib:
        return None
    return f"skipped: planner predicts {gib(predicted_gib)} GiB > {gib(memory_gib)} GiB"


def gib(x: float) -> str:
    """GiB to one decimal, small amounts (the --tiny model's) to two significant digits."""
    return f"{x:.1f}" if x >= 1 else f"{x:.2g}"


# ----------------------------------------------------------------------------------------------------
# One cell, the sweep
# ----------------------------------------------------------------------------------------------------


def throughput(cfg, res: dict[str, Any], device_label: str) -> None:
    """Add tokens/s, TFLOP/s/GPU (model and hardware FLOPs), MFU and HFU to a phase's result, in place."""
    from model.accounting import flops_per_update, mfu, tflops_per_gpu

    if res.get("status") != "ok":
        return
    B = cfg.train.micro_batch * cfg.train.grad_accum
    rep = flops_per_update(cfg.model, B, vocab_size=cfg.model.vocab_size)
    t = res["s_per_update"]
    model = tflops_per_gpu(rep.no_recompute, t, 1)
    hw = tflops_per_gpu(
        rep.recompute if cfg.train.activation_checkpointing == "full" else rep.no_recompute, t, 1
    )
    res.update(
        tokens_per_s=B * cfg.model.seq_len / t,
        tflops_per_gpu=model,
        hw_tflops_per_gpu=hw,
        mfu=mfu(model, device_label, cfg.train.precision),
        hfu=mfu(hw, device_label, cfg.train.precision),
    )


def describe_cell(size: str, arm: Arm, cfg) -> dict[str, Any]:
    """The (size, arm) row's fixed part: shape, batch, FLOPs per update in both conventions."""
    from model.accounting import flops_per_update

    B = cfg.train.micro_batch * cfg.train.grad_accum
    rep = flops_per_update(cfg.model, B, vocab_size=cfg.model.vocab_size)
    return {
        "size": size,
        "arm": arm.name,
        "kind": cfg.model.ffn.kind,
        "domains": arm.domains if arm.kind == "demix" else None,
        "experts": cfg.model.ffn.num_experts if arm.kind != "dense" else 0,
        "layers": cfg.model.n_layers,
        "d_model": cfg.model.d_model,
        "seq_len": cfg.model.seq_len,
        "micro_batch": cfg.train.micro_batch,
        "grad_accum": cfg.train.grad_accum,
        "tokens_per_update": B * cfg.model.seq_len,
        "flops_per_update_no_recompute": rep.no_recompute,
        "flops_per_update_recompute": rep.recompute,
    }


def not_run(reason: str) -> dict[str, Any]:
    """A phase that was never tried (the planner's verdict, the deadline): status and why."""
    return {"status": reason.split(":")[0], "reason": reason}


def deadline_reason(deadline: float | None, clock: Callable[[], float] = time.monotonic) -> str | None:
    """Why nothing more starts: the deadline (a `clock` time) has passed (None: go on)."""
    if deadline is None or clock() < deadline:
        return None
    return "not run: deadline passed before it started"


def run_cell(
    size: str,
    arm: Arm,
    a: argparse.Namespace,
    device: torch.device,
    device_label: str,
    memory_gib: float | None,
    deadline: float | None = None,
) -> dict[str, Any]:
    """Both phases of one (size, arm) on the same batches, framework first, each on its own model built on the
    device from the same seed; OOM-safe. A phase the planner predicts does not fit `memory_gib` is recorded as
    skipped, and one not started before `deadline` (time.monotonic) as not run: neither builds anything."""
    t0 = time.perf_counter()
    plan = plan_random_tokens(run_config(size, arm, a), arm.domain_names())
    row = describe_cell(size, arm, plan.cfg)
    try:
        pred = predict_memory(plan.cfg)
    except Exception as e:  # noqa: BLE001 - no verdict: the phases are tried, the OOM guard still holds
        pred = {"params": None, "gib": {}, "activations": f"planner failed: {type(e).__name__}: {e}"[:300]}
    row["params"] = pred["params"]
    row["predicted_gib"] = {p: round(g, 4) for p, g in pred["gib"].items()}
    row["planner"] = {k: pred[k] for k in ("activations", "seconds") if k in pred}
    row["device_memory_gib"] = None if memory_gib is None else round(memory_gib, 4)
    skip = {p: planner_skip(pred["gib"].get(p), memory_gib) for p in ("framework", "bare")}
    batches = None  # made for the first phase that runs
    for phase, phase_fn in (("framework", framework_phase), ("bare", bare_phase)):
        reason = skip[phase] or deadline_reason(deadline)
        if reason:
            row[phase] = not_run(reason)
            continue
        batches = batches or random_batches(plan, a.warmup + a.steps, device)
        row[phase] = guarded(functools.partial(phase_fn, plan, batches, a.warmup, device), device)
        throughput(plan.cfg, row[phase], device_label)
    del batches
    _reset_memory(device)
    # No model or engine is alive now: what survived the collection (imported modules, results) is never garbage.
    # Frozen out of later collections, it no longer costs every phase's collection 0.2-0.4 s (CPU, measured).
    gc.freeze()
    f, b = row["framework"], row["bare"]
    row["ratio"] = (
        f["tokens_per_s"] / b["tokens_per_s"] if "tokens_per_s" in f and "tokens_per_s" in b else None
    )
    row["cell_s"] = time.perf_counter() - t0
    return row


class ResultWriter:
    """The results as the sweep goes, so that a killed run still leaves every finished cell: after each cell one
    JSON line appended to `<record>.jsonl` (flushed and synced), and the markdown table at `record` and the .json
    beside it rewritten whole (each written to a temporary file and renamed over the old). No `record`: nothing."""

    def __init__(self, record: Path | None) -> None:
        self.record = record
        if record is not None:
            record.parent.mkdir(parents=True, exist_ok=True)
            self.jsonl.write_text("")

    @property
    def jsonl(self) -> Path:
        assert self.record is not None
        return self.record.with_suffix(".jsonl")

    def cell(self, result: dict[str, Any], row: dict[str, Any]) -> None:
        """Append `row` (already in `result["rows"]`) and rewrite the tables."""
        if self.record is None:
            return
        with self.jsonl.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.write(result)

    def write(self, result: dict[str, Any]) -> None:
        """Rewrite the markdown and the .json from `result` (finished or not)."""
        if self.record is None:
            return
        for path, text in (
            (self.record, markdown(result)),
            (self.record.with_suffix(".json"), json.dumps(result, indent=1, default=str) + "\n"),
        ):
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, path)


def sweep(
    cells: Sequence[tuple[str, Arm]],
    measure: Callable[[str, Arm], dict[str, Any]],
    result: dict[str, Any],
    writer: ResultWriter,
    deadline: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """`measure` each cell in turn into `result["rows"]`, each written as soon as it is done; a cell not started
    before `deadline` (a `clock` time) is recorded as not run, without being measured."""
    for size, arm in cells:
        reason = deadline_reason(deadline, clock)
        if reason:
            row = {"size": size, "arm": arm.name, "framework": not_run(reason), "bare": not_run(reason)}
            row["ratio"] = None
        else:
            row = measure(size, arm)
        result["rows"].append(row)
        writer.cell(result, row)
        print(json.dumps({k: v for k, v in row.items() if not k.startswith("flops")}), flush=True)


def run(
    a: argparse.Namespace,
    cells: Sequence[tuple[str, Arm]],
    result: dict[str, Any],
    writer: ResultWriter,
    deadline: float | None = None,
) -> dict[str, Any]:
    """The sweep in this process, a world of one (NCCL on the GPU, gloo on the CPU), into `result`."""
    from benchmarks.machine import OtherLoad, gpu_versions, machine_info, uptime
    from launcher.distributed import start_distributed, training_device
    from launcher.metrics import device_name
    from model.accounting import peak_tflops

    start_distributed()  # as the trainer: NCCL on the GPU, gloo on CPU; a world of one
    device = training_device()
    label = device_name()
    memory = a.memory_gib
    if memory is None and device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory / GIB
    result.update(
        device=label,
        peak_tflops=peak_tflops(label, a.precision),
        uptime_before=uptime(),
        machine=machine_info(),
        versions=gpu_versions(),
        device_memory_gib=memory,
        cells=[f"{size} {arm.name}" for size, arm in cells],
        rows=[],
    )
    writer.write(result)
    with OtherLoad() as others:
        sweep(
            cells,
            lambda size, arm: run_cell(size, arm, a, device, label, memory, deadline),
            result,
            writer,
            deadline,
        )
    result["others"] = others.result()
    result["uptime_after"] = uptime()
    return result


# ----------------------------------------------------------------------------------------------------
# Results file
# ----------------------------------------------------------------------------------------------------


def _cell(res: dict[str, Any], key: str, fmt: str) -> str:
    if res.get("status") != "ok":
        return res.get("status", "?")
    v = res.get(key)
    return "n/a" if v is None else format(v, fmt)


def _fmt(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _gib_or_dash(v: float | None) -> str:
    return "-" if v is None else gib(v)


def markdown(result: dict[str, Any]) -> str:
    """The results table with the command, device, versions, load and recipe; a sweep still running (or killed)
    says how many of its cells are in."""
    v, s = result["versions"], result["settings"]
    ot = result.get("others")
    peak = result["peak_tflops"]
    rows = result["rows"]
    cells = result.get("cells", [])
    finished = "wall_s" in result
    memory = result.get("device_memory_gib")
    lines = [
        "# GPU training throughput: the framework's step vs a bare PyTorch loop (random tokens, one GPU)",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Device: {v['gpu'] or 'CPU (no CUDA): a --tiny smoke run, not a measurement'}"
        + (
            f" ({v['gpu_memory_gib']} GiB, compute capability {v.get('capability')}), driver {v['driver']}"
            if v["gpu"]
            else ""
        )
        + f"; torch {v['torch']}, CUDA {v['cuda']}, NCCL {v['nccl']}, DeepSpeed {v['deepspeed']}; "
        f"peak {s['precision']} {peak if peak is not None else 'n/a'} TFLOP/s (model/accounting.py).",
        "",
        f"Machine load: before `{result['uptime_before']}`; "
        + (
            f"after `{result['uptime_after']}`; other processes' CPU during the sweep {ot['others_cores']} cores "
            "(benchmarks/machine.py OtherLoad)"
            if ot is not None
            else "after: the sweep has not finished"
        )
        + f" on {result['machine']['cores']} cores.",
        "",
        f"Recipe: {s['precision']}, ZeRO {s['zero_stage']}, activation recompute {s['recompute']}, seq "
        f"{s['seq_len']}, micro-batch {s['micro_batch']} x grad_accum {s['grad_accum']} per update, "
        f"{s['warmup']} warm-up + {s['steps']} timed updates per phase; GShard: top-2 every other layer over "
        f"{s['gshard_experts']} experts on this GPU. "
        + (
            f"Sweep wall time {result['wall_s']:.0f} s."
            if finished
            else f"**Sweep in progress (or killed): {len(rows)} of {len(cells)} cells written.**"
        ),
        "",
        f"Planner (parallel/memory.py) against {_gib_or_dash(memory)} GiB of device memory"
        f"{'' if memory is not None else ' (unknown: every phase is tried)'}; deadline "
        f"{'none' if s.get('deadline_s') is None else str(s['deadline_s']) + ' s'}.",
        "",
    ]
    table = []
    for r in rows:
        f, b = r["framework"], r["bare"]
        planned = r.get("predicted_gib", {})
        table.append(
            [
                r["size"],
                r["arm"],
                _fmt(r.get("params"), ","),
                _fmt(r.get("tokens_per_update"), ","),
                _cell(f, "tokens_per_s", ",.0f"),
                _cell(f, "tflops_per_gpu", ".3g"),
                _cell(f, "mfu", ".1%"),
                _cell(f, "hfu", ".1%"),
                _cell(f, "peak_mem_gib", ".1f"),
                _gib_or_dash(planned.get("framework")),
                _cell(b, "tokens_per_s", ",.0f"),
                _cell(b, "tflops_per_gpu", ".3g"),
                _cell(b, "mfu", ".1%"),
                _cell(b, "peak_mem_gib", ".1f"),
                _gib_or_dash(planned.get("bare")),
                "n/a" if r["ratio"] is None else f"**{r['ratio']:.3f}**",
            ]
        )
    header = [
        "size",
        "arm",
        "params held",
        "tokens/update",
        "framework tok/s",
        "TFLOP/s/GPU",
        "MFU",
        "HFU",
        "peak GiB",
        "planned GiB",
        "bare tok/s",
        "bare TFLOP/s",
        "bare MFU",
        "bare peak GiB",
        "bare planned GiB",
        "framework / bare",
    ]
    lines += markdown_table(header, table)
    notes = [
        f"- {r['size']} {r['arm']} {p}: {r[p].get('reason') or r[p]['status'] + ' (' + r[p].get('error', '') + ')'}"
        for r in rows
        for p in ("framework", "bare")
        if r[p].get("status") != "ok"
    ]
    lines += [
        "",
        "TFLOP/s/GPU and MFU: model FLOPs without recompute (Narayanan et al. eq. 3, 3 passes, unpadded "
        "vocabulary: model/accounting.py `flops_per_update`), against the device's dense peak; HFU adds the "
        "recomputed forward when recompute is on (else HFU = MFU). framework / bare = framework tokens/s over "
        "bare tokens/s on the same batches in the same process. *framework*: `launcher.train.train_step` on "
        "the DeepSpeed engine the trainer builds (its generated config; DeepSpeed's throughput timer, on by "
        "default, synchronises the device in forward and step). *bare*: autocast forward, backward, "
        "`clip_grad_norm_`, torch AdamW on fp32 weights. Each phase builds its model on the device from the "
        "same seed. Peak memory: torch.cuda.max_memory_allocated per phase; planned: the memory planner's "
        "prediction (model states, buffers, traced activations). OOM = out of memory (caught); skipped = the "
        "planner predicts more than the device's memory (never tried); not run = the deadline had passed.",
    ]
    if notes:
        lines += ["", "Cells not measured:", *notes]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------


def select_cells(a: argparse.Namespace) -> list[tuple[str, str]]:
    """The (size, arm) pairs to measure, in order: with --tiny the tiny model x `--arms` (default every arm; with
    --quick the quick preset's arms); with `--sizes` and/or `--arms` their product (the one not given: every size,
    every arm; `all` names every one); else the preset, `QUICK_CELLS` with --quick, `DEFAULT_CELLS` without."""
    preset = QUICK_CELLS if a.quick else DEFAULT_CELLS

    def names(arg: str | None, every: Sequence[str]) -> list[str]:
        given = [n.strip() for n in (arg or "").split(",") if n.strip()]
        return list(every) if not given or given == ["all"] else given

    if a.tiny:
        preset_arms = list(dict.fromkeys(arm for _, arms in preset for arm in arms)) if a.quick else ARMS
        return [("tiny", arm) for arm in names(a.arms, preset_arms)]
    if a.sizes is None and a.arms is None:
        return [(size, arm) for size, arms in preset for arm in arms]
    return [(size, arm) for size in names(a.sizes, SIZES) for arm in names(a.arms, ARMS)]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--sizes",
        help="model presets (configs/model/), comma-separated, or all: replaces the preset (x every arm unless --arms)",
    )
    p.add_argument(
        "--arms",
        help="dense, demix-<N> (N domains on the GPU), gshard, comma-separated, or all: replaces the preset "
        "(x every size unless --sizes)",
    )
    p.add_argument(
        "--quick", action="store_true", help="the quick preset: gpt3-small dense, demix-1, demix-8"
    )
    p.add_argument("--steps", type=positive_int, help="timed updates per phase (default 3; --quick 2)")
    p.add_argument(
        "--warmup", type=nonneg_int, help="untimed updates before them (default 2; --quick, --tiny 1)"
    )
    p.add_argument("--micro-batch", type=positive_int, help="sequences per micro-batch (default 4)")
    p.add_argument("--grad-accum", type=positive_int, default=2, help="micro-batches per update")
    p.add_argument("--seq-len", type=positive_int, help="tokens per sequence (default 2048; --tiny 64)")
    p.add_argument(
        "--precision",
        default="bf16",
        choices=("bf16", "fp32"),
        help="bf16: DeepSpeed bf16 (ZeRO >= 1) vs autocast; fp32 on both sides",
    )
    p.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2))
    p.add_argument("--recompute", default="none", choices=("none", "full"), help="activation recompute")
    p.add_argument(
        "--gshard-experts", type=positive_int, default=8, help="experts of the gshard arm, all on this GPU"
    )
    p.add_argument(
        "--deadline-s",
        type=nonneg_float,
        help=f"seconds from the start after which no cell or phase starts (recorded as not run); 0: none. Default "
        f"{DEFAULT_DEADLINE_S:.0f} for the default preset, {QUICK_DEADLINE_S:.0f} for --quick, none otherwise",
    )
    p.add_argument(
        "--memory-gib",
        type=positive_float,
        help="device memory the planner's predictions are held against (default: the GPU's; none on CPU)",
    )
    p.add_argument("--tiny", action="store_true", help="2 layers, d 64, seq 64, vocab 512: runs on CPU")
    p.add_argument(
        "--record",
        help=f"results markdown (+ .json and .jsonl beside it); default {DEFAULT_RECORD.relative_to(ROOT)} "
        "for a full run, none for --tiny",
    )
    a = p.parse_args(argv)
    short = a.tiny or a.quick
    a.steps = a.steps or (2 if a.quick else 3)
    a.warmup = (1 if short else 2) if a.warmup is None else a.warmup
    a.micro_batch = a.micro_batch or 4
    a.seq_len = a.seq_len or (64 if a.tiny else 2048)
    if a.deadline_s is None and not a.tiny and a.sizes is None and a.arms is None:
        a.deadline_s = QUICK_DEADLINE_S if a.quick else DEFAULT_DEADLINE_S
    a.deadline_s = a.deadline_s or None  # 0: none
    return a


def main(argv: Sequence[str] | None = None) -> int:
    started = time.monotonic()
    a = parse_args(argv)
    if not a.tiny and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    record = Path(a.record) if a.record else (None if a.tiny else DEFAULT_RECORD)
    if a.tiny and record is not None and record.resolve() == DEFAULT_RECORD.resolve():
        return usage_error(
            f"--tiny never writes the GPU results file {DEFAULT_RECORD.relative_to(ROOT)}; give another --record path"
        )
    try:
        cells = [(size, parse_arm(name, a.gshard_experts)) for size, name in select_cells(a)]
    except ValueError as e:
        return usage_error(e)
    from launcher.config import ConfigError, model_presets

    unknown = sorted({s for s, _ in cells if s != "tiny" and s not in model_presets()})
    if (
        unknown
        or a.steps < 1
        or a.warmup < 0
        or a.micro_batch < 1
        or a.grad_accum < 1
        or (a.deadline_s or 0) < 0
    ):
        return usage_error(
            f"unknown sizes {unknown} (presets: {', '.join(model_presets())})"
            if unknown
            else "need --steps >= 1, --warmup >= 0, --micro-batch >= 1, --grad-accum >= 1, --deadline-s >= 0"
        )
    t0 = time.perf_counter()
    command = "python -m benchmarks.gpu_throughput " + shlex.join(
        sys.argv[1:] if argv is None else list(argv)
    )
    result: dict[str, Any] = {
        "command": command.strip(),
        "settings": {
            k: getattr(a, k)
            for k in (
                "tiny",
                "quick",
                "steps",
                "warmup",
                "micro_batch",
                "grad_accum",
                "seq_len",
                "precision",
                "zero_stage",
                "recompute",
                "gshard_experts",
                "deadline_s",
            )
        },
    }
    writer = ResultWriter(record)
    deadline = None if a.deadline_s is None else started + a.deadline_s
    try:
        run(a, cells, result, writer, deadline)
    except ConfigError as e:
        return usage_error(e)
    result["wall_s"] = time.perf_counter() - t0
    writer.write(result)
    print(markdown(result))
    failed = [r for r in result["rows"] for p in ("framework", "bare") if r[p]["status"] == "error"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
