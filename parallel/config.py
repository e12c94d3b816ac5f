"""Typed configuration of what parallel/ applies: the layout (tensor parallel, ZeRO, domain -> GPU
allocation) and the training recipe the DeepSpeed engine is built with (optimizer, schedule, precision)."""

from __future__ import annotations

from pydantic import StrictBool, StrictInt
from pydantic.dataclasses import dataclass

from model.config import CONFIG, Float

EXPERT_GRAD_SCALINGS: tuple[str, ...] = ("domain_mean", "global")
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
SCHEDULES: tuple[str, ...] = ("polynomial", "cosine", "constant")
CHECKPOINTING: tuple[str, ...] = ("none", "full")
TRAINABLE: tuple[str, ...] = ("all", "experts")
GRAD_REDUCES: tuple[str, ...] = ("overlap", "after_backward")
GRAD_REDUCE_DTYPES: tuple[str, ...] = ("bf16", "fp32")


@dataclass(frozen=True, config=CONFIG)
class ParallelConfig:
    """How ranks are laid out.

    allocation: None = even (world / domains data-parallel ranks per domain); else an explicit list of
    data-parallel rank counts per domain, in domain order (e.g. proportional to data). With fewer
    data-parallel ranks than domains, each rank holds several consecutive domains.
    expert_grad_scaling: "domain_mean" averages an expert's gradient over its domain group (default);
    "global" divides by the whole data-parallel world, as the reference fairseq code does.
    grad_reduce: "overlap" (default) reduces the gradients bucket by bucket while the backward of the
    accumulation boundary still runs (ZeRO 0: parallel/demix_sync.py `OverlappedGradReduce`; ZeRO 1/2:
    DeepSpeed's `overlap_comm`); "after_backward" reduces them all once the backward has finished (DeepSpeed's own
    ZeRO-0 path).
    bucket_elements: gradient elements per bucket; None = parallel/grad_reduce.py `bucket_elements`' rule
    (Megatron-core's max(4e7, 1e6 x data-parallel ranks), bounded by the rank's trainable parameters).
    comm_init_timeout_s: seconds any collective may wait for the other ranks during start-up (rendezvous, resume
    checks, loading, compilation), the first training step, checkpoint saves and the final export.
    comm_timeout_s: the same for every other collective, from the second step on. A rank that stops responding
    (hung, stopped, lost its GPU) ends the job after that long instead of torch's 30 minutes (docs/cluster.md).
    """

    tensor_parallel: StrictInt = 1
    zero_stage: StrictInt = 0
    allocation: list[StrictInt] | None = None
    expert_grad_scaling: str = "domain_mean"
    grad_reduce: str = "overlap"
    bucket_elements: StrictInt | None = None
    comm_init_timeout_s: Float = 600.0
    comm_timeout_s: Float = 300.0

    def problems(self, prefix: str = "parallel") -> list[str]:
        out = []
        if self.tensor_parallel < 1:
            out.append(f"{prefix}.tensor_parallel={self.tensor_parallel}: must be >= 1")
        if self.zero_stage not in (0, 1, 2):
            out.append(f"{prefix}.zero_stage={self.zero_stage}: supported ZeRO stages are 0, 1 and 2")
        if self.allocation is not None and any(n < 1 for n in self.allocation):
            out.append(f"{prefix}.allocation={self.allocation}: every domain needs at least one rank")
        if self.expert_grad_scaling not in EXPERT_GRAD_SCALINGS:
            out.append(
                f"{prefix}.expert_grad_scaling={self.expert_grad_scaling!r}: "
                f"choose one of {', '.join(EXPERT_GRAD_SCALINGS)}"
            )
        if self.grad_reduce not in GRAD_REDUCES:
            out.append(f"{prefix}.grad_reduce={self.grad_reduce!r}: choose one of {', '.join(GRAD_REDUCES)}")
        if self.bucket_elements is not None and self.bucket_elements < 1:
            out.append(
                f"{prefix}.bucket_elements={self.bucket_elements}: must be >= 1 (or unset for the size rule)"
            )
        for name in ("comm_init_timeout_s", "comm_timeout_s"):
            if getattr(self, name) <= 0:
                out.append(
                    f"{prefix}.{name}={getattr(self, name)}: must be > 0 seconds (how long a collective may wait "
                    "for a rank that stopped responding before the job ends)"
                )
        return out


@dataclass(frozen=True, config=CONFIG)
class TrainConfig:
    """The paper's recipe by default (DEMix Tables 9-12): AdamW (0.9, 0.95), eps 1e-8, weight decay 0.1,
    clip 0.1, polynomial decay with 8 % warm-up, 2 sequences per GPU x 8 accumulation steps."""

    steps: StrictInt = 100
    micro_batch: StrictInt = 2
    grad_accum: StrictInt = 8
    lr: Float = 5e-4
    min_lr: Float = 0.0
    schedule: str = "polynomial"
    warmup_fraction: Float = 0.08
    beta1: Float = 0.9
    beta2: Float = 0.95
    eps: Float = 1e-8
    weight_decay: Float = 0.1
    clip_grad: Float = 0.1
    precision: str = "fp32"
    activation_checkpointing: str = "none"
    seed: StrictInt = 1234
    init_from: str | None = None  # a consolidated checkpoint to start from (DAPT, continued training)
    trainable: str = "all"  # "all", or "experts": freeze everything but the experts (DEMix-DAPT, §6)
    eval_interval: StrictInt = 0  # 0 = only at the end
    eval_batches: StrictInt = 4
    save_interval: StrictInt = 0  # 0 = only at the end
    keep_checkpoints: StrictInt = 0  # training states kept in checkpoints/ (the newest N); 0 = all
    # torch.compile each block's compute in place (launcher/train.py compile_model); a bool (StrictBool: 1 or "fast"
    # are refused). Off until a GPU measurement shows the gain.
    compile: StrictBool = False
    # bf16 only: the dtype ZeRO 1/2 reduce the gradients in (None: bf16, DeepSpeed's default). "fp32": DeepSpeed's
    # communication_data_type fp32, and at ZeRO 2 also data_types.grad_accum_dtype fp32 (parallel/ds_config.py
    # `deepspeed_config`). Recommended when grad_accum x data-parallel ranks >= 32 (the sum's bf16 rounding grows
    # with the number of terms); costs twice the gradient bytes on the wire.
    grad_reduce_dtype: str | None = None
    # After SIGTERM/SIGUSR1 (preemption, launcher/preemption.py): seconds to finish the step and save its state
    # before the rank aborts unsaved. Below SLURM's KillWait (30 s by default) between SIGTERM and SIGKILL.
    preempt_grace_s: Float = 25.0
    # Stop every rank at the first optimizer step whose loss or gradient norm is NaN or infinite (fp16: after
    # FP16_SKIP_LIMIT consecutive overflow-skipped steps), before anything from it is saved (launcher/nonfinite.py).
    stop_on_nonfinite: StrictBool = True

    def problems(self, prefix: str = "train") -> list[str]:
        out = []
        for name in ("steps", "micro_batch", "grad_accum", "eval_batches"):
            if getattr(self, name) < 1:
                out.append(f"{prefix}.{name}={getattr(self, name)}: must be >= 1")
        for name in ("eval_interval", "save_interval", "keep_checkpoints"):
            if getattr(self, name) < 0:
                out.append(f"{prefix}.{name}={getattr(self, name)}: must be >= 0")
        if self.preempt_grace_s <= 0:
            out.append(f"{prefix}.preempt_grace_s={self.preempt_grace_s}: must be > 0")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            out.append(f"{prefix}: need 0 <= min_lr ({self.min_lr}) <= lr ({self.lr}) and lr > 0")
        if not 0.0 <= self.warmup_fraction < 1.0:
            out.append(f"{prefix}.warmup_fraction={self.warmup_fraction}: must be in [0, 1)")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            out.append(f"{prefix}: betas ({self.beta1}, {self.beta2}) must be in [0, 1)")
        if self.clip_grad < 0 or self.weight_decay < 0 or self.eps <= 0:
            out.append(f"{prefix}: clip_grad and weight_decay must be >= 0, eps > 0")
        for name, allowed in (
            ("precision", PRECISIONS),
            ("schedule", SCHEDULES),
            ("activation_checkpointing", CHECKPOINTING),
            ("trainable", TRAINABLE),
        ):
            if getattr(self, name) not in allowed:
                out.append(f"{prefix}.{name}={getattr(self, name)!r}: choose one of {', '.join(allowed)}")
        if self.grad_reduce_dtype is not None:
            if self.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
                out.append(
                    f"{prefix}.grad_reduce_dtype={self.grad_reduce_dtype!r}: choose one of "
                    f"{', '.join(GRAD_REDUCE_DTYPES)} (or leave it unset)"
                )
            elif self.precision != "bf16":
                out.append(
                    f"{prefix}.grad_reduce_dtype={self.grad_reduce_dtype!r} applies to train.precision=bf16 only "
                    f"(with {self.precision!r} the gradients are reduced in {self.precision}): unset it"
                )
        return out
