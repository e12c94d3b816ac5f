"""One trainer for every variant: dense (natural mix), dense-balanced, +domain-token, DEMix, GShard.

    python -m launcher.train --config configs/demo/demix.yaml --run-dir runs/x [--set train.steps=50]

Usually started through `python -m launcher.launch` (the deepspeed launcher, N local processes or a
hostfile); started bare it runs as a single process. Everything that can be checked (config, data,
layout, resume compatibility) is checked before any process group or model exists. On the console: a resume
says where from, DeepSpeed's first (slow) build of its CPU op is announced, and Ctrl-C ends every rank with
status 130 and no traceback, rank 0 saying where the last checkpoint is (unless the launcher says it). SIGTERM or
SIGUSR1 (preemption) saves the state of the step in progress and exits with 75 (launcher/preemption.py).

The loop (`train`) reads top to bottom: batch -> forward -> loss (+aux) -> backward -> step -> metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data.argtypes import host
from data.argtypes import port as tcp_port
from data.atomic import write_json_atomic
from data.cli import exit_process, usage_error
from launcher.batches import build_rank_sampler, expert_ids_of, step_expert_tokens, to_model_batch
from launcher.checkpoint import CheckpointError
from launcher.config import ConfigError, RunConfig, load_run_config
from launcher.distributed import LaunchEnvError, ensure_env, start_distributed, training_device
from launcher.ffn_kinds import StepHook, ffn_kind
from launcher.metrics import MetricsLogger, device_name, peak_memory_gb
from launcher.nonfinite import EXIT_NONFINITE, NonFiniteError, NonFiniteGuard, nonfinite_line
from launcher.plan import Plan, make_plan
from launcher.preemption import PREEMPTED_EXIT, Preempted
from launcher.preemption import current as preempt_watch
from launcher.preemption import install as install_preempt_watch
from launcher.rundir import (
    LAUNCHER_ENV,
    SHM_OP,
    interrupted_line,
    op_build_notice,
    out_dir_override,
    use_extensions_dir,
)
from launcher.state import (
    check_resumable,
    check_shared_run_dir,
    export_consolidated,
    layout_changes,
    load_init_weights,
    load_training_state,
    save_training_state,
)
from launcher.state_discovery import latest_checkpoint, resume_candidates, verified_state
from model.accounting import flops_per_update, head_recomputed, mfu, tflops_per_gpu
from model.gpt import GPT, LOSS_CHUNK_LOGITS
from parallel.activation_recompute import apply_activation_recompute
from parallel.comm_stats import CommStats
from parallel.comm_timeout import (
    current_activity,
    current_comm_timeout,
    failed_collective,
    is_comm_timeout,
    is_peer_lost,
    set_activity,
    set_comm_timeout,
    timeout_of,
)
from parallel.engine import EngineBundle, backward_loss_factor, clip_grads_, global_grad_norm, loss_scale
from parallel.groups import ProcessGroups
from parallel.overflow import install_norm_overflow_check, set_step_norm

# ----------------------------------------------------------------------------------------------------
# Metrics, evaluation, export
# ----------------------------------------------------------------------------------------------------


def domain_loss_sums(
    token_loss_BT: torch.Tensor, mask_BT: torch.Tensor, domain_ids_B: torch.Tensor, n: int
) -> torch.Tensor:
    """[2, n]: summed token loss and token count per domain id, on the loss's device (no host sync)."""
    out = torch.zeros(2, n, dtype=torch.float64, device=token_loss_BT.device)
    dom = domain_ids_B.to(out.device)
    out[0].index_add_(0, dom, (token_loss_BT * mask_BT).sum(1).double())
    out[1].index_add_(0, dom, mask_BT.sum(1).double())
    return out


def reduce_domain_sums(sums: torch.Tensor, bundle: EngineBundle) -> torch.Tensor:
    """Sum over ranks; tensor-parallel replicas of the same batch count once."""
    import torch.distributed as dist

    sums = sums.clone() if bundle.groups.tp_rank == 0 else torch.zeros_like(sums)
    dist.all_reduce(sums)
    return sums


@torch.no_grad()
def evaluate(bundle: EngineBundle, plan: Plan, rank: int, device: torch.device) -> dict[str, float]:
    """Validation loss per training domain: each rank scores the first `eval_batches` micro-batches of its
    domains' validation blocks (disjoint shards within a domain group), summed over ranks.

    The forward runs in the training step's precision (`forward_precision`): the engine's module is called bare
    (no engine side effects), and at ZeRO 0 with bf16 DeepSpeed trains by autocast, which only its engine.forward
    enters; loss sums stay fp32/fp64."""
    from parallel.precision import forward_precision

    cfg = plan.cfg
    sampler = build_rank_sampler(plan, rank, "valid")
    model = bundle.engine.module
    was_training = model.training
    model.eval()
    n = len(plan.catalog.train_domains)
    sums = torch.zeros(2, n, dtype=torch.float64, device=device)
    for i in range(cfg.train.eval_batches):
        b = to_model_batch(sampler.batch(i // cfg.train.grad_accum, i % cfg.train.grad_accum), device, plan)
        with forward_precision(model, cfg.train.precision, device.type):
            out = model(
                b["tokens"],
                b["expert_ids"],
                targets_BT=b["targets"],
                loss_mask_BT=b["loss_mask"],
                return_logits=False,
            )
        sums += domain_loss_sums(out.token_loss, b["loss_mask"], b["domain_ids"], n)
    model.train(was_training)
    sums = reduce_domain_sums(sums, bundle)
    out = {}
    for d, name in enumerate(plan.catalog.train_domains):
        if sums[1, d] > 0:
            loss = float(sums[0, d] / sums[1, d])
            out[f"val_loss/{name}"] = loss
            out[f"val_ppl/{name}"] = float(np.exp(min(loss, 50.0)))
    return out


def freeze_all_but_experts(model: torch.nn.Module) -> None:
    """requires_grad only on expert parameters (DEMix-DAPT trains the new expert alone, DEMix §6)."""
    experts = {id(p) for ps in model.expert_parameters().values() for p in ps}
    for p in model.parameters():
        p.requires_grad_(id(p) in experts)


def throughput_record(plan: Plan, seconds: float, steps: int) -> dict[str, Any]:
    """tokens/s, TFLOPs/GPU in both conventions (labelled), MFU and HFU against the device's peak.

    MFU counts model FLOPs (no recompute: what the model needs, Narayanan et al. eq. 3 without the recomputed
    forward); HFU counts the FLOPs the hardware executes (`FlopsReport.hardware`): the layers' second forward when
    activation checkpointing is on (HFU = 4/3 x MFU of the layers) and the LM head's forward that its checkpointed
    chunks recompute in backward once a micro-batch outgrows one chunk (`head_recomputed`, model/gpt.py
    `chunked_token_loss`). `tflops_per_gpu` is that executed count."""
    cfg, topo = plan.cfg, plan.topo
    global_batch = cfg.train.micro_batch * cfg.train.grad_accum * topo.dp_size
    rep = flops_per_update(cfg.model, global_batch, vocab_size=cfg.model.vocab_size)
    per_update = seconds / max(1, steps)
    rec = {"tokens_per_s": global_batch * cfg.model.seq_len / per_update, "step_time_s": per_update}
    for conv in ("recompute", "no_recompute"):
        rec[f"tflops_per_gpu_{conv}"] = tflops_per_gpu(rep.get(conv), per_update, topo.world_size)
    tp = cfg.parallel.tensor_parallel
    head = head_recomputed(
        cfg.train.micro_batch * cfg.model.seq_len, cfg.model.padded_vocab_size(tp) // tp, LOSS_CHUNK_LOGITS
    )
    hardware = rep.hardware(cfg.train.activation_checkpointing == "full", head)
    rec["tflops_per_gpu"] = tflops_per_gpu(hardware, per_update, topo.world_size)
    rec["mfu"] = mfu(rec["tflops_per_gpu_no_recompute"], device_name(), cfg.train.precision)
    rec["hfu"] = mfu(rec["tflops_per_gpu"], device_name(), cfg.train.precision)
    return rec


# ----------------------------------------------------------------------------------------------------
# Set-up, then the loop
# ----------------------------------------------------------------------------------------------------


@dataclass
class StepResult:
    """What one optimizer update returns; every tensor stays on the training device until a log interval."""

    domain_sums: torch.Tensor  # [2, domains]: summed token loss and scored tokens per data domain (this rank)
    grad_norm: torch.Tensor  # the global gradient norm (unscaled)
    aux_loss: torch.Tensor | None = None  # mean over the micro-batches (GShard's load-balancing loss)
    # routing statistics, means over micro-batches
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    # False when DeepSpeed reported no norm (grad_norm is then NaN for the record, not a divergence)
    grad_norm_known: bool = True


def build_rank_model(plan: Plan, rank: int) -> GPT:
    """This rank's GPT on the host: only its experts, the run's seed, `train.init_from` weights, frozen shared
    weights for `train.trainable: experts`."""
    cfg = plan.cfg
    torch.manual_seed(cfg.train.seed)
    expert_ids = ffn_kind(cfg).rank_experts(cfg, plan.topo, rank, plan.expert_of_domain)
    model = GPT(
        cfg.model,
        expert_ids=expert_ids,
        tensor_parallel=cfg.parallel.tensor_parallel,
        init_seed=cfg.train.seed,
    )
    if cfg.train.init_from:
        load_init_weights(model, cfg)
    if cfg.train.trainable == "experts":
        freeze_all_but_experts(model)
    return model


def build_rank_engine(plan: Plan, model: GPT, groups: ProcessGroups) -> EngineBundle:
    """The FFN kind's DeepSpeed engine bundle (parallel/engine.py) on `model`, with activation recompute as planned,
    fp16's overflow test from the step's global norm at ZeRO 0 (parallel/overflow.py) and `train.compile`.
    The process group must exist (`start_distributed`)."""
    if plan.cfg.train.activation_checkpointing == "full":
        apply_activation_recompute(model)
    bundle = ffn_kind(plan.cfg).build_engine(model, plan.cfg, groups)
    # fp16 at ZeRO 0: one host read per step, not one per tensor
    install_norm_overflow_check(bundle.engine.optimizer)
    if plan.cfg.train.compile:
        compile_model(bundle.engine.module)
    return bundle


def compile_model(model: torch.nn.Module) -> list[str]:
    """torch.compile the compute of every block in place; returns the compiled modules' names.

    A block whose FFN is dense is compiled whole (LayerNorms, attention, MLP and residual adds fuse). In a block with
    experts only the attention and each expert MLP are: the routing stays eager, because DEMix routes by host ids,
    CSE reads its cluster counts (model/cse.py) and GShard's layer runs all-to-alls - graph breaks in a compiled
    region - and because CSE's clustering captures the layer's input with a forward hook added mid-run, which a
    compiled caller would not see (torch._dynamo skips guards on module hooks). `nn.Module.compile` (what DeepSpeed's
    `engine.compile` calls on the whole module) compiles in place: parameter and buffer names, hence checkpoints and
    exports, keep their keys (no `_orig_mod.` of a `torch.compile(module)` wrapper). Compilation happens at the first
    call; modules of the same code share compiled graphs (varying expert row counts become one dynamic shape)."""
    from model.mlp import MLP, DenseFFN

    names = []
    for i, block in enumerate(model.blocks):
        parts = (
            [("", block)]
            if isinstance(block.ffn, DenseFFN)
            else [("attn", block.attn)]
            + [(f"ffn.{n}", m) for n, m in block.ffn.named_modules() if isinstance(m, MLP)]
        )
        for name, module in parts:
            module.compile()
            names.append(f"blocks.{i}" + (f".{name}" if name else ""))
    return names


@dataclass
class Trainer:
    """One rank's training run, set up (`Trainer.setup`) apart from the loop (`run`)."""

    plan: Plan
    run_dir: Path
    rank: int
    device: torch.device
    bundle: EngineBundle
    sampler: Any  # data.sampler's sampler for this rank
    log: MetricsLogger
    start: int  # the first step to run (> 0 after a resume)
    resumed_from: Path | None = None
    hook: StepHook | None = None  # the FFN kind's after-step hook (CSE)
    # bytes, calls and time of every collective, per group (parallel/comm_stats.py)
    comm: CommStats | None = None
    # the first step with a non-finite loss or gradient norm, and the decision to stop (launcher/nonfinite.py)
    guard: NonFiniteGuard | None = None

    @classmethod
    def setup(cls, plan: Plan, run_dir: Path, resume: str = "auto") -> Trainer:
        """Check the resume point, start the process group, build the model and the engine, restore state."""
        cfg, kind = plan.cfg, ffn_kind(plan.cfg)
        ckpt = (
            latest_checkpoint(run_dir) if resume == "auto" else (Path(resume) if resume != "never" else None)
        )
        start = check_resumable(ckpt, plan) if ckpt is not None else 0  # before any expensive work
        planned = plan
        # another number of GPUs, allocation, ZeRO stage or batch shape: allowed, announced
        if ckpt is not None:
            plan = replace(planned, notes=planned.notes + tuple(layout_changes(ckpt, planned)))
        # every collective of start-up, the first step, saves and the export may wait this long for the others
        init_timeout = cfg.parallel.comm_init_timeout_s
        set_comm_timeout(init_timeout, INIT_TIMEOUT_KEY)
        rank, world = start_distributed(init_timeout)
        if world != plan.topo.world_size:
            raise ConfigError([f"planned for {plan.topo.world_size} ranks, launched with {world}"], "launch")
        check_shared_run_dir(run_dir, rank, world, training_device())
        # checksums, read by all ranks together; a damaged newest state falls back to an older one
        if ckpt is not None:
            candidates = resume_candidates(run_dir) if resume == "auto" else [ckpt]
            verified = verified_state(candidates, rank, world, training_device())
            if verified is None:
                raise CheckpointError(
                    f"{ckpt} is damaged (see the warning); "
                    + (
                        "no older intact state to fall back to: restore it, or start a new run directory"
                        if resume == "auto"
                        else "resume from another state (`--resume auto` picks the newest intact one)"
                    )
                )
            if verified != ckpt:
                ckpt, start = verified, check_resumable(verified, planned)
                plan = replace(planned, notes=planned.notes + tuple(layout_changes(ckpt, planned)))
            if rank == 0:  # on the console too (metrics.jsonl's start record has it as well)
                print(resume_line(ckpt, start, cfg.train.steps), file=sys.stderr, flush=True)
        groups = ProcessGroups.create(plan.topo, timeout=timeout_of(init_timeout))
        bundle = build_rank_engine(plan, build_rank_model(plan, rank), groups)
        # the same for the groups DeepSpeed made itself (GShard's expert groups)
        set_comm_timeout(init_timeout, INIT_TIMEOUT_KEY)
        if rank == 0:  # what DeepSpeed got, bucket sizes included (the launcher's copy predates the model)
            write_json_atomic(run_dir / "deepspeed_config.json", bundle.deepspeed_config)
        if ckpt is not None:
            start = load_training_state(ckpt, bundle, plan, rank)
        hook = kind.step_hook(
            bundle.engine.module, cfg, groups, bundle.engine.optimizer, plan.catalog.train_domains
        )
        log = MetricsLogger(run_dir, cfg, rank == 0, cfg.train.steps, start)
        return cls(
            plan,
            run_dir,
            rank,
            training_device(),
            bundle,
            build_rank_sampler(plan, rank),
            log,
            start,
            ckpt,
            hook,
            CommStats.for_groups(groups).install(),
            NonFiniteGuard(cfg.train.precision, training_device(), cfg.train.stop_on_nonfinite),
        )

    def batches(self, step: int, first: int = 0, count: int | None = None) -> list[dict[str, torch.Tensor]]:
        """Model inputs of micro-batches `first`.. of `step` (past the step's last they continue into the next)."""
        ga = self.plan.cfg.train.grad_accum
        count = ga if count is None else count
        return [
            to_model_batch(self.sampler.batch(step + i // ga, i % ga), self.device, self.plan)
            for i in range(first, first + count)
        ]

    def run(self) -> dict[str, Any]:
        """The loop: batch -> step -> (hook) -> log -> eval -> save; then final eval, state and export.

        Collectives wait `parallel.comm_init_timeout_s` for the other ranks until the first step is done and during
        saves and the export, `parallel.comm_timeout_s` otherwise. A non-finite loss or gradient norm is recorded on
        the device and acted on at the next log interval, evaluation or save (`NonFiniteGuard`): NonFiniteError on
        every rank, before anything from that step is saved."""
        cfg, plan, rank = self.plan.cfg, self.plan, self.rank
        world = plan.topo.world_size
        if self.guard is None:
            self.guard = NonFiniteGuard(cfg.train.precision, self.device, cfg.train.stop_on_nonfinite)
        self._announce()
        sums = torch.zeros(2, len(plan.catalog.train_domains), dtype=torch.float64, device=self.device)
        window_t, window_steps = time.perf_counter(), 0
        self.comm.take()  # from here on, only the steps' own communication is counted
        preempt = preempt_watch()
        if preempt is not None:  # the step an abort names
            preempt.begin(self.start)
        for step in range(self.start, cfg.train.steps):
            if step == self.start + 1:  # start-up and the first step (compilation, lazy state) are behind
                set_comm_timeout(cfg.parallel.comm_timeout_s, TRAIN_TIMEOUT_KEY)
            set_activity(f"training step {step + 1}")
            out = train_step(self.bundle, cfg, self.batches(step), len(plan.catalog.train_domains))
            sums += out.domain_sums
            window_steps, done = window_steps + 1, step + 1
            self.guard.observe(done, out, self.bundle.engine)
            if self.hook is not None:  # e.g. CSE: warm-up, then cluster sequence embeddings and copy the FFN
                rec = self.hook.after_step(done, lambda i, s=done: self.batches(s, i, 1)[0])
                if rec is not None:
                    self.log.log({"kind": cfg.model.ffn.kind, "step": done, **rec})
            logged = done % cfg.logging.log_interval == 0 or done == cfg.train.steps
            if logged:
                with self.comm.paused():
                    rec = {
                        "kind": "train",
                        "step": done,
                        **step_record(out, self.bundle, plan, sums, window_t, window_steps),
                        **self.comm.take(per=window_steps),  # collectives per update
                    }
                self.log.log(rec)
                self.log.progress(done, rec)
                window_t, window_steps, sums = time.perf_counter(), 0, torch.zeros_like(sums)
            evaluate_now = bool(cfg.train.eval_interval) and done % cfg.train.eval_interval == 0
            save_now = bool(cfg.train.save_interval) and done % cfg.train.save_interval == 0
            if done < cfg.train.steps and (logged or evaluate_now or save_now):
                with self.comm.paused():
                    self.guard.check(rank, world)
            if evaluate_now and done < cfg.train.steps:
                with self.comm.paused():
                    self.log.log(
                        {"kind": "eval", "step": done, **evaluate(self.bundle, plan, rank, self.device)}
                    )
            saved = None
            if save_now and done < cfg.train.steps:
                with self.comm.paused(), self.patient(f"saving the state of step {done}"):
                    saved = save_training_state(self.run_dir, done, self.bundle, plan, rank)
            if (
                preempt is not None
            ):  # SIGTERM/SIGUSR1 to any rank: this step's state, then exit (preemption.py)
                with self.comm.paused():
                    try:
                        preempt.at_step_end(
                            done, self.device, lambda d=done, s=saved: s or self._preempt_save(d)
                        )
                    except Preempted:
                        self.log.close()
                        raise
        if preempt is not None:
            preempt.end(cfg.train.steps)
        self.guard.check(rank, world)
        final = evaluate(self.bundle, plan, rank, self.device)
        self.log.log({"kind": "eval", "step": cfg.train.steps, **final})
        with self.patient("saving the final state and exporting the model"):
            if self.start < cfg.train.steps:
                save_training_state(self.run_dir, cfg.train.steps, self.bundle, plan, rank)
            export_consolidated(self.bundle, plan, rank, self.run_dir / "model", cfg.train.steps)
        self.log.close()
        return final

    def _preempt_save(self, done: int) -> Any:
        """The training state of step `done` after a preemption signal, once the ranks agree the step is finite
        (NonFiniteError otherwise: a diverged state is never published)."""
        plan = self.plan
        self.guard.check(self.rank, plan.topo.world_size)
        with self.patient(f"saving the state of step {done} after a preemption signal"):
            return save_training_state(self.run_dir, done, self.bundle, plan, self.rank)

    @contextmanager
    def patient(self, activity: str) -> Iterator[None]:
        """Collectives wait `parallel.comm_init_timeout_s` inside the block (a save or the export: ranks write files
        of unequal sizes, on a filesystem that may stall), the training timeout again after it; `activity` is what a
        timeout's message says the rank was doing."""
        before, doing = current_comm_timeout(), current_activity()
        set_comm_timeout(self.plan.cfg.parallel.comm_init_timeout_s, INIT_TIMEOUT_KEY)
        set_activity(activity)
        try:
            yield
        finally:
            set_activity(doing)
            if before is not None:
                set_comm_timeout(*before)

    def _announce(self) -> None:
        if self.rank != 0:
            return
        self.log.log(
            {
                "kind": "start",
                "step": self.start,
                "world_size": self.plan.topo.world_size,
                "resumed_from": str(self.resumed_from) if self.resumed_from else None,
                "device": device_name(),
                "topology": self.plan.topo.describe(),
                "notes": list(self.plan.notes),
            }
        )
        for note in self.plan.notes:
            print(f"note: {note}", file=sys.stderr)


# The config keys of the two collective timeouts, named in the message of a rank that gave up waiting
INIT_TIMEOUT_KEY, TRAIN_TIMEOUT_KEY = "parallel.comm_init_timeout_s", "parallel.comm_timeout_s"
# Exit status of a rank (and of launcher.launch) whose collective gave up waiting for another rank
EXIT_COMM_TIMEOUT = 4


def comm_timeout_line(rank: int, exc: BaseException) -> str:
    """The one line of a rank whose collective gave up waiting for another rank: what it was doing, the collective
    and its group (parallel/comm_timeout.py `failed_collective`), the timeout and how to change it."""
    seconds, key = current_comm_timeout() or (None, TRAIN_TIMEOUT_KEY)
    waited = f"{seconds:g} s ({key})" if seconds is not None else f"its timeout ({key})"
    collective = failed_collective(exc)
    return (
        f"rank {rank}: {collective or 'a collective'} during {current_activity()} waited {waited} for another rank "
        f"and gave up: a rank stopped responding (hung, "
        f"stopped, lost its device, or far slower than the others), so the job ends. If the ranks are legitimately "
        f"that slow, raise it (--set {key}=SECONDS); `--resume auto` continues from the last saved state "
        f"[{str(exc).splitlines()[0][-120:]}]"
    )


# Exit status of a rank whose collective failed because another rank's process went away (a crash's status: the
# launcher reports the dead rank's own, e.g. 137)
EXIT_PEER_LOST = 1


def peer_lost_line(rank: int, exc: BaseException) -> str:
    """The one line of a rank whose collective failed because another rank died: what it was doing, the collective
    and its group, and where to look (the launcher names the dead rank and its signal)."""
    collective = failed_collective(exc)
    return (
        f"rank {rank}: {collective or 'a collective'} during {current_activity()} lost another rank (its process "
        f"died or its host went away; the launcher's line names it and how it ended), so this rank stops too; "
        f"`--resume auto` continues from the last saved state [{str(exc).splitlines()[0][-120:]}]"
    )


def resume_line(ckpt: Path, step: int, steps: int) -> str:
    """The console line of a resume (rank 0)."""
    return f"resuming from {ckpt} at step {step} (of {steps} steps)"


def train(plan: Plan, run_dir: Path, resume: str = "auto") -> dict[str, Any]:
    """Train `plan` on this process's rank; returns the final validation metrics (all ranks)."""
    return Trainer.setup(plan, run_dir, resume).run()


def train_step(
    bundle: EngineBundle, cfg: RunConfig, micro: list[dict[str, torch.Tensor]], n_domains: int
) -> StepResult:
    """One optimizer update over `grad_accum` micro-batches: forward, loss (+aux), backward, (clip), step.

    Everything it returns stays on the training device (no host sync inside the step); `step_record`
    brings values to the host at log intervals."""
    engine = bundle.engine
    device = next(engine.module.parameters()).device
    factor = backward_loss_factor(engine)  # fp16 at ZeRO 0: the loss scale DeepSpeed would not apply
    if bundle.expert_scale is not None:  # each expert's gradient = the mean over its domain's tokens
        bundle.expert_scale.set_step_tokens(*step_expert_tokens(micro))
    sums = torch.zeros(2, n_domains, dtype=torch.float64, device=device)
    aux_total: torch.Tensor | None = None
    stats: dict[str, torch.Tensor] = {}
    for i, mb in enumerate(micro):
        out = engine(
            mb["tokens"],
            expert_ids_of(mb),
            targets_BT=mb["targets"],
            loss_mask_BT=mb["loss_mask"],
            return_logits=False,
        )
        loss = out.loss if out.aux_loss is None else out.loss + out.aux_loss
        engine.backward(loss * factor if factor != 1.0 else loss)
        sums += domain_loss_sums(out.token_loss.detach(), mb["loss_mask"], mb["domain_ids"], n_domains)
        if out.aux_loss is not None:
            aux = out.aux_loss.detach().double() / len(micro)
            aux_total = aux if aux_total is None else aux_total + aux
        for k, v in out.ffn_stats.items():
            if v.numel() == 1 or k.endswith("_E"):  # scalars and per-expert vectors (e.g. expert_load_E)
                v = v.detach().double() / len(micro)
                stats[k] = v if k not in stats else stats[k] + v
        if i < len(micro) - 1:
            engine.step()  # a no-op update: DeepSpeed counts micro-steps to find the accumulation boundary
    norm = None
    if cfg.parallel.zero_stage == 0:  # DeepSpeed would average per-rank norms here; use the true global norm
        # fp16: the gradients still carry the loss scale; clipping the scaled gradients by the unscaled norm's
        # coefficient is the same as clipping the unscaled ones (the optimizer unscales afterwards).
        norm = global_grad_norm(engine.module, bundle.groups) / loss_scale(engine)
        if cfg.train.clip_grad > 0:
            clip_grads_(engine.module, cfg.train.clip_grad, norm)
        # fp16: DeepSpeed's overflow test from this norm (parallel/overflow.py)
        set_step_norm(engine.optimizer, norm)
    engine.step()
    known = True
    if norm is None:
        gn = engine.get_global_grad_norm()
        known = gn is not None
        norm = gn if isinstance(gn, torch.Tensor) else torch.tensor(float("nan") if gn is None else float(gn))
    return StepResult(sums, norm, aux_total, stats, grad_norm_known=known)


def step_record(
    out: StepResult, bundle: EngineBundle, plan: Plan, sums: torch.Tensor, t0: float, steps: int
) -> dict[str, Any]:
    """The per-interval training record: loss (overall and per domain), lr, grad norm, throughput, memory."""
    import torch.distributed as dist

    total = reduce_domain_sums(sums, bundle)
    rec: dict[str, Any] = {"loss": float(total[0].sum() / total[1].sum().clamp_min(1))}
    for d, name in enumerate(plan.catalog.train_domains):
        if total[1, d] > 0:
            rec[f"loss/{name}"] = float(total[0, d] / total[1, d])
    rec["lr"] = bundle.scheduler.get_last_lr()[0]
    rec["grad_norm"] = float(out.grad_norm)
    if out.aux_loss is not None:
        rec["aux_loss"] = float(out.aux_loss)
    for k, v in out.stats.items():
        rec[k] = v.tolist() if isinstance(v, torch.Tensor) else v
    mem = torch.tensor([peak_memory_gb()], device=sums.device)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    rec["peak_mem_gb"] = float(mem)
    rec.update(throughput_record(plan, time.perf_counter() - t0, steps))
    return rec


# ----------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="run YAML (configs/...)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value",
    )
    p.add_argument("--run-dir", help="output directory (default: logging.out_dir)")
    p.add_argument(
        "--resume",
        default="auto",
        help="auto (latest checkpoint in the run dir), never, or a checkpoint path",
    )
    p.add_argument(
        "--master-addr",
        type=host,
        help="rendezvous address where the launcher sets no MASTER_ADDR (MPI, srun)",
    )
    p.add_argument(
        "--master-port",
        type=tcp_port,
        help="rendezvous port where the launcher sets no MASTER_PORT (MPI, srun)",
    )
    return p.parse_args(argv)


def prepare_op_cache() -> None:
    """TORCH_EXTENSIONS_DIR defaulted for ranks started without the launcher (torchrun, srun; launcher/rundir.py
    `use_extensions_dir`, an explicit value is kept), and, on each node's first CPU rank, one line before DeepSpeed
    builds its shared-memory op there for the first time (`op_build_notice`). GPU ranks build no op."""
    use_extensions_dir()
    if os.environ.get("LOCAL_RANK", "0") != "0" or torch.cuda.is_available() or sys.platform != "linux":
        return
    try:
        from deepspeed.git_version_info import installed_ops

        if installed_ops.get(SHM_OP):  # installed prebuilt (DS_BUILD_SHM_COMM=1): nothing is built
            return
    except ImportError:
        pass
    note = op_build_notice()
    if note:
        print(note, file=sys.stderr, flush=True)


def report_interrupt(run_dir: Path | None) -> int:
    """Ctrl-C in a rank: exit status 130 and no traceback; global rank 0 prints one line saying where the last
    checkpoint is and how to resume, unless launcher.launch started the ranks (it says so itself once they have
    ended, launcher/launch.py `run_and_report`). Every other rank is silent; a second Ctrl-C is ignored."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.environ.get("RANK", "0") == "0" and not os.environ.get(LAUNCHER_ENV):
        print(interrupted_line(run_dir), file=sys.stderr, flush=True)
    return 130


def report_nonfinite(err: NonFiniteError, run_dir: Path, cfg: RunConfig) -> int:
    """A run stopped by a non-finite loss, gradient norm or weight (every rank raised it at the same point): rank 0
    prints one line naming the step, the values and the state to resume from; then a barrier, so that no rank exits
    (and has DeepSpeed's launcher kill the others) before that line is out. Returns EXIT_NONFINITE."""
    import torch.distributed as dist

    if int(os.environ.get("RANK", "0")) == 0:
        try:
            resume_from = latest_checkpoint(run_dir)
        except CheckpointError:
            resume_from = None
        print(f"error: {nonfinite_line(err, run_dir, cfg, resume_from)}", file=sys.stderr, flush=True)
    if dist.is_initialized():
        try:
            dist.barrier()
        except RuntimeError:
            pass
    return EXIT_NONFINITE


def main(argv: Sequence[str] | None = None) -> int:
    """Train one rank: exit status 0, 2 for an input problem (one `error:` line), 3 when the loss, gradient norm or
    weights stop being finite (launcher/nonfinite.py), 4 when a collective gives up waiting for another rank
    (`parallel.comm_timeout_s`), 75 when SIGTERM or SIGUSR1 stopped it with the step's state saved, 143 when such
    a stop could not save (launcher/preemption.py), 130 on Ctrl-C."""
    args = parse_args(argv)
    run_dir: Path | None = Path(args.run_dir) if args.run_dir else None
    rank0 = int(os.environ.get("RANK", "0")) == 0
    try:
        try:
            # MPI/SLURM ranks: their world, before planning
            world = ensure_env(args.master_addr, args.master_port)
            cfg = load_run_config(
                args.config, [*args.overrides, *out_dir_override(args.run_dir)], check=False
            )
            run_dir = Path(args.run_dir or cfg.logging.out_dir)
            watch = install_preempt_watch(cfg.train.preempt_grace_s, 0 if rank0 else 1, run_dir)
            plan = make_plan(cfg, world, check_local_device=True)
        except (ConfigError, CheckpointError, LaunchEnvError) as e:
            return usage_error(e)
        prepare_op_cache()
        try:
            final = train(plan, run_dir, args.resume)
        except (ConfigError, CheckpointError, LaunchEnvError) as e:
            return usage_error(e)
        except Preempted as e:
            if rank0:
                print(watch.saved_line(e), file=sys.stderr, flush=True)
            return PREEMPTED_EXIT
        except NonFiniteError as e:
            return report_nonfinite(e, run_dir, plan.cfg)
        except RuntimeError as e:
            if is_peer_lost(
                e
            ):  # another rank died: the launcher names it; one line here, not gloo's traceback
                print(
                    f"error: {peer_lost_line(int(os.environ.get('RANK', '0')), e)}",
                    file=sys.stderr,
                    flush=True,
                )
                return EXIT_PEER_LOST
            if not is_comm_timeout(e):
                raise
            print(
                f"error: {comm_timeout_line(int(os.environ.get('RANK', '0')), e)}",
                file=sys.stderr,
                flush=True,
            )
            return EXIT_COMM_TIMEOUT
    except KeyboardInterrupt:
        return report_interrupt(run_dir)
    if rank0:
        print(json.dumps({"run_dir": str(run_dir), **final}))
    return 0


if __name__ == "__main__":
    exit_process(main())
