"""GPU training throughput of every architecture on random tokens: the framework's step vs a bare PyTorch loop.

    python -m benchmarks.gpu_throughput [--sizes gpt3-small,gpt3-medium,gpt3-large,gpt3-xl]
        [--arms dense,demix-1,demix-2,demix-8,gshard] [--steps 5] [--warmup 2] [--micro-batch 4] [--grad-accum 2]
        [--seq-len 2048] [--precision bf16] [--recompute none|full] [--gshard-experts 8]
        [--record benchmarks/results/gpu_throughput.md]
    python -m benchmarks.gpu_throughput --tiny [--record PATH]     # CPU smoke run of the same code path

No prepared data: every micro-batch is uniform random token ids (throughput does not depend on the text), made
once per cell and given to both loops. One process, world size 1 (one GPU), ZeRO 1, bf16, sequence 2048.

Arms (each on one GPU, so each is "one rank" of a larger run):
* dense      - the dense GPT;
* demix-1    - DEMix with one domain per GPU: the rank holds 1 expert in every layer (a rank of the paper's
               8-domain, n-GPU layout); FLOPs and parameters equal dense's, the expert path is the difference;
* demix-N    - N domains on this one GPU (default arms N = 2 and 8): N experts per layer, the by-domain round
               robin of data/sampler.py (sample g of the step is domain g mod N);
* gshard     - GShard top-2 every other layer with `--gshard-experts` experts all held on this GPU
               (experts_per_rank = E, expert-parallel size 1: DeepSpeed's MoE layer without a remote all-to-all).

Per cell (size x arm) two phases run in the same process, one after the other, on the same batches:
* framework - the project's real training path: the plan (`launcher.plan.plan_layout`), process groups, the GPT
              with this rank's experts, activation recompute, `FFNKind.build_engine` (the DeepSpeed engine with
              the generated config, ZeRO stage and precision), then `launcher.train.train_step` per update, as
              `Trainer.setup` / `Trainer.run` do (`build_rank_model`, `build_rank_engine`: Trainer.setup's own
              functions; the prepared data it also opens is replaced by random tokens);
* bare      - the same model (a copy of the same initial weights; GShard keeps the plain single-process layer
              of model/gshard.py) in the loop anyone would write: autocast(bf16) forward, loss (+ aux),
              backward / grad_accum, `clip_grad_norm_`, `torch.optim.AdamW` (fp32 weights), zero_grad.
Each phase runs `--warmup` updates, then `--steps` timed updates between two CUDA events (with
torch.cuda.synchronize before and after the timed region only; perf_counter on CPU). Peak memory is
torch.cuda.max_memory_allocated of the phase (reset before it builds its model on the device). A phase that
runs out of memory is recorded as OOM and the sweep continues; one whose model states alone (parallel/memory.py
bytes per parameter x parameters held) exceed the device's memory is recorded as OOM without being tried.

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
Results: the markdown table at `--record` (default benchmarks/results/gpu_throughput.md for a full run) with the
command, GPU, driver, torch / CUDA / NCCL / DeepSpeed versions and the machine load, and a .json beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from data.argtypes import nonneg_int, positive_int

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_RECORD = RESULTS / "gpu_throughput.md"
SIZES = ("gpt3-small", "gpt3-medium", "gpt3-large", "gpt3-xl")
ARMS = ("dense", "demix-1", "demix-2", "demix-8", "gshard")
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


def build_model(plan):
    """This rank's GPT as the trainer builds it (launcher.train.build_rank_model), on the host."""
    from launcher.train import build_rank_model

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


def _peak_gib(device: torch.device) -> Optional[float]:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def framework_phase(plan, model, batches, warmup: int, device: torch.device) -> dict[str, Any]:
    """The DeepSpeed engine the trainer builds, stepped by `launcher.train.train_step`."""
    from launcher.train import train_step

    _reset_memory(device)
    bundle = build_bundle(plan, model)
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


def bare_phase(plan, model, batches, warmup: int, device: torch.device) -> dict[str, Any]:
    """The same model in a plain PyTorch loop: fp32 weights, autocast to the run's precision, torch AdamW."""
    from parallel.activation_recompute import apply_activation_recompute

    t = plan.cfg.train
    _reset_memory(device)
    model.to(device).train()
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
# One cell, the sweep
# ----------------------------------------------------------------------------------------------------


def predicted_states_gib(cfg, phase: str) -> float:
    """Parameters, gradients and optimizer states this rank holds, GiB (parallel/memory.py's bytes per parameter:
    the framework's precision at its ZeRO stage with one data-parallel rank; the bare loop's fp32 AdamW)."""
    from model.accounting import param_counts
    from parallel.memory import state_bytes_per_param

    n = param_counts(cfg.model, vocab_size=cfg.model.padded_vocab_size(cfg.parallel.tensor_parallel)).total
    per = (
        state_bytes_per_param(cfg.train.precision, cfg.parallel.zero_stage)
        if phase == "framework"
        else (4, 4, 8)
    )
    return n * sum(per) / GIB


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
        "predicted_states_gib": {p: round(predicted_states_gib(cfg, p), 2) for p in ("framework", "bare")},
    }


def _framework_on_copy(plan, template, batches, warmup: int, device: torch.device) -> dict[str, Any]:
    """The framework phase on a deep copy of the template (the bare phase then moves the template itself)."""
    return framework_phase(plan, copy.deepcopy(template), batches, warmup, device)


def run_cell(
    size: str,
    arm: Arm,
    a: argparse.Namespace,
    device: torch.device,
    device_label: str,
    memory_gib: Optional[float],
) -> dict[str, Any]:
    """Both phases of one (size, arm) on the same batches, framework first (the bare phase moves the template
    model itself to the device); OOM-safe."""
    t0 = time.perf_counter()
    plan = plan_random_tokens(run_config(size, arm, a), arm.domain_names())
    row = describe_cell(size, arm, plan.cfg)
    too_big = {
        p: g for p, g in row["predicted_states_gib"].items() if memory_gib is not None and g > memory_gib
    }
    template = build_model(plan) if len(too_big) < 2 else None  # the initial weights both phases start from
    row["params"] = template.num_parameters() if template is not None else None
    batches = random_batches(plan, a.warmup + a.steps, device)
    for phase in ("framework", "bare"):
        if phase in too_big:
            row[phase] = {
                "status": "OOM",
                "error": f"not run: model states alone {too_big[phase]:.1f} GiB > "
                f"{memory_gib:.1f} GiB of device memory",
            }
            continue
        phase_fn = _framework_on_copy if phase == "framework" else bare_phase
        fn = functools.partial(phase_fn, plan, template, batches, a.warmup, device)
        row[phase] = guarded(fn, device)
        del fn  # it holds the template and the batches, freed below
        throughput(plan.cfg, row[phase], device_label)
    del template, batches
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


def run(a: argparse.Namespace, sizes: list[str], arms: list[Arm]) -> dict[str, Any]:
    from benchmarks.machine import OtherLoad, gpu_versions, machine_info, uptime
    from launcher.distributed import start_distributed, training_device
    from launcher.metrics import device_name
    from model.accounting import peak_tflops

    start_distributed()  # as the trainer: NCCL on the GPU, gloo on CPU; a world of one
    device = training_device()
    label = device_name()
    memory = torch.cuda.get_device_properties(device).total_memory / GIB if device.type == "cuda" else None
    result: dict[str, Any] = {
        "device": label,
        "peak_tflops": peak_tflops(label, a.precision),
        "uptime_before": uptime(),
        "machine": machine_info(),
        "versions": gpu_versions(),
        "rows": [],
    }
    with OtherLoad() as others:
        for size in sizes:
            for arm in arms:
                row = run_cell(size, arm, a, device, label, memory)
                result["rows"].append(row)
                print(json.dumps({k: v for k, v in row.items() if not k.startswith("flops")}), flush=True)
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


def markdown(result: dict[str, Any]) -> str:
    v, s, ot = result["versions"], result["settings"], result["others"]
    peak = result["peak_tflops"]
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
        f"Machine load: before `{result['uptime_before']}`; after `{result['uptime_after']}`; other processes' "
        f"CPU during the sweep {ot['others_cores']} cores (benchmarks/machine.py OtherLoad) on "
        f"{result['machine']['cores']} cores.",
        "",
        f"Recipe: {s['precision']}, ZeRO {s['zero_stage']}, activation recompute {s['recompute']}, seq "
        f"{s['seq_len']}, micro-batch {s['micro_batch']} x grad_accum {s['grad_accum']} per update, "
        f"{s['warmup']} warm-up + {s['steps']} timed updates per phase; GShard: top-2 every other layer over "
        f"{s['gshard_experts']} experts on this GPU. Sweep wall time {result['wall_s']:.0f} s.",
        "",
        "| size | arm | params held | tokens/update | framework tok/s | TFLOP/s/GPU | MFU | HFU | peak GiB | "
        "bare tok/s | bare TFLOP/s | bare MFU | bare peak GiB | framework / bare |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        f, b = r["framework"], r["bare"]
        ratio = "n/a" if r["ratio"] is None else f"**{r['ratio']:.3f}**"
        params = f"{r['params']:,}" if r.get("params") else "-"
        lines.append(
            f"| {r['size']} | {r['arm']} | {params} | {r['tokens_per_update']:,} | "
            f"{_cell(f, 'tokens_per_s', ',.0f')} | {_cell(f, 'tflops_per_gpu', '.3g')} | {_cell(f, 'mfu', '.1%')} | "
            f"{_cell(f, 'hfu', '.1%')} | {_cell(f, 'peak_mem_gib', '.1f')} | {_cell(b, 'tokens_per_s', ',.0f')} | "
            f"{_cell(b, 'tflops_per_gpu', '.3g')} | {_cell(b, 'mfu', '.1%')} | {_cell(b, 'peak_mem_gib', '.1f')} | "
            f"{ratio} |"
        )
    notes = [
        f"- {r['size']} {r['arm']} {p}: {r[p]['status']} ({r[p].get('error', '')})"
        for r in result["rows"]
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
        "`clip_grad_norm_`, torch AdamW on fp32 weights. Peak memory: torch.cuda.max_memory_allocated per "
        "phase. OOM = out of memory (caught, or model states alone larger than the device).",
    ]
    if notes:
        lines += ["", "Cells not measured:", *notes]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--sizes", default=",".join(SIZES), help="model presets (configs/model/), comma-separated")
    p.add_argument("--arms", default=",".join(ARMS), help="dense, demix-<N> (N domains on the GPU), gshard")
    p.add_argument("--steps", type=positive_int, help="timed updates per phase (default 5; --tiny 3)")
    p.add_argument("--warmup", type=nonneg_int, help="untimed updates before them (default 2; --tiny 1)")
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
    p.add_argument("--tiny", action="store_true", help="2 layers, d 64, seq 64, vocab 512: runs on CPU")
    p.add_argument(
        "--record",
        help=f"results markdown (+ .json beside it); default {DEFAULT_RECORD.relative_to(ROOT)} "
        "for a full run, none for --tiny",
    )
    a = p.parse_args(argv)
    tiny = a.tiny
    a.steps = a.steps or (3 if tiny else 5)
    a.warmup = (1 if tiny else 2) if a.warmup is None else a.warmup
    a.micro_batch = a.micro_batch or 4
    a.seq_len = a.seq_len or (64 if tiny else 2048)
    return a


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse_args(argv)
    if not a.tiny and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    record = Path(a.record) if a.record else (None if a.tiny else DEFAULT_RECORD)
    if a.tiny and record is not None and record.resolve() == DEFAULT_RECORD.resolve():
        print(
            f"error: --tiny never writes the GPU results file {DEFAULT_RECORD.relative_to(ROOT)}; give another "
            "--record path",
            file=sys.stderr,
        )
        return 2
    try:
        arms = [parse_arm(n.strip(), a.gshard_experts) for n in a.arms.split(",") if n.strip()]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sizes = ["tiny"] if a.tiny else [s.strip() for s in a.sizes.split(",") if s.strip()]
    from launcher.config import ConfigError, model_presets

    unknown = [s for s in sizes if s != "tiny" and s not in model_presets()]
    if unknown or a.steps < 1 or a.warmup < 0 or a.micro_batch < 1 or a.grad_accum < 1:
        print(
            f"error: unknown sizes {unknown} (presets: {', '.join(model_presets())})"
            if unknown
            else "error: need --steps >= 1, --warmup >= 0, --micro-batch >= 1, --grad-accum >= 1",
            file=sys.stderr,
        )
        return 2
    t0 = time.perf_counter()
    try:
        result = run(a, sizes, arms)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["wall_s"] = time.perf_counter() - t0
    result["command"] = "python -m benchmarks.gpu_throughput " + shlex.join(
        sys.argv[1:] if argv is None else list(argv)
    )
    result["command"] = result["command"].strip()
    result["settings"] = {
        k: getattr(a, k)
        for k in (
            "tiny",
            "steps",
            "warmup",
            "micro_batch",
            "grad_accum",
            "seq_len",
            "precision",
            "zero_stage",
            "recompute",
            "gshard_experts",
        )
    }
    md = markdown(result)
    if record is not None:
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(md)
        record.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(md)
    failed = [r for r in result["rows"] for p in ("framework", "bare") if r[p]["status"] == "error"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
