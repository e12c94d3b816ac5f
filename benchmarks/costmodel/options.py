"""The software choices that change a prediction (`CostOptions`) and the achieved compute efficiency e(h)
(`Efficiency`); the named choices every other module of the cost model validates against. docs/costmodel.md."""

from __future__ import annotations

from dataclasses import dataclass

from model import accounting as acc

ARCHS: tuple[str, ...] = ("dense", "demix", "gshard")
EFFICIENCY_FORMS: tuple[str, ...] = ("saturating", "constant")
RECOMPUTE: tuple[str, ...] = ("full", "none")
GSHARD_OVERHEADS: tuple[str, ...] = ("fairseq", "none")
OPTIMIZERS: tuple[str, ...] = ("fp16", "memory_efficient_fp16")  # fairseq --fp16 / --memory-efficient-fp16
ON_OOM: tuple[str, ...] = ("recompute", "ignore")
DTYPE_BYTES: dict[str, int] = {"fp16": 2, "bf16": 2, "fp32": 4}
GRAD_REDUCE: tuple[str, ...] = ("fixed", "overlap", "after_backward")  # CostOptions.grad_reduce


@dataclass(frozen=True)
class CostOptions:
    """Software choices that change the cost, not the hardware (defaults: the paper's fairseq setup)."""

    micro_batch: int = acc.PAPER_MICRO_BATCH
    grad_accum: int = acc.PAPER_GRAD_ACCUM
    grad_dtype: str = "fp16"  # gradients all-reduced in this dtype
    act_dtype: str = "fp16"  # activations exchanged by all-to-all
    recompute: str = "full"  # activation recomputation: a second forward (and its all-to-alls)
    overlap: float = (
        0.0  # grad_reduce "fixed": fraction of the gradient all-reduce hidden behind backward; 0 = none
    )
    bucket_mb: float = 25.0  # gradient bucket (PyTorch DDP / fairseq default), each pays the latency
    # "fixed": `overlap` and `bucket_mb` as given (the paper fit); "overlap" / "after_backward": this trainer's
    # parallel.grad_reduce, its bucket rule (parallel/grad_reduce.py bucket_elements, or `bucket_elements`) and the
    # hidden part derived (`exposed_allreduce_seconds`)
    grad_reduce: str = "fixed"
    bucket_elements: int | None = None  # the trainer's parallel.bucket_elements (None: the rule)
    gshard_overheads: str = (
        "fairseq"  # t_gshard: the fairseq MoE's einsums, gating, padding, ...; "none": left out
    )
    gate_calls: int = 2  # forward gate evaluations per MoE layer (the DEMix fork calls self.gate twice)
    gshard_optimizer: str = (
        "fp16"  # fairseq --fp16 (fp32 master weights, the reference GShard) or memory_efficient_fp16
    )
    on_oom: str = "recompute"  # recompute='none' and it does not fit the GPU: "recompute" it, or "ignore"

    def problems(self) -> list[str]:
        out = []
        if self.gate_calls < 1:
            out.append(f"gate_calls={self.gate_calls}: must be >= 1")
        for name, choices in (
            ("gshard_overheads", GSHARD_OVERHEADS),
            ("gshard_optimizer", OPTIMIZERS),
            ("on_oom", ON_OOM),
        ):
            if getattr(self, name) not in choices:
                out.append(f"{name}={getattr(self, name)!r}: choose one of {', '.join(choices)}")
        for name in ("grad_dtype", "act_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                out.append(f"{name}={getattr(self, name)!r}: choose one of {', '.join(DTYPE_BYTES)}")
        if self.recompute not in RECOMPUTE:
            out.append(f"recompute={self.recompute!r}: choose one of {', '.join(RECOMPUTE)}")
        if not 0.0 <= self.overlap <= 1.0:
            out.append(f"overlap={self.overlap}: must be in [0, 1]")
        if self.grad_reduce not in GRAD_REDUCE:
            out.append(f"grad_reduce={self.grad_reduce!r}: choose one of {', '.join(GRAD_REDUCE)}")
        if self.bucket_elements is not None and self.bucket_elements < 1:
            out.append(f"bucket_elements={self.bucket_elements}: must be >= 1")
        if self.micro_batch < 1 or self.grad_accum < 1 or self.bucket_mb <= 0:
            out.append("micro_batch, grad_accum must be >= 1 and bucket_mb > 0")
        return out


@dataclass(frozen=True)
class Efficiency:
    """Achieved fraction of peak for the model's FLOPs: e(h) = e_max · h / (h + h_half)."""

    e_max: float
    h_half: float
    form: str = "saturating"
    fitted_on: str = ""

    def at(self, d_model: int) -> float:
        return self.e_max * d_model / (d_model + self.h_half)
