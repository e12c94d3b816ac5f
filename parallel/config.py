"""Typed parallel-layout configuration (tensor parallel, ZeRO, domain -> GPU allocation)."""

from __future__ import annotations

from typing import Optional

from pydantic.dataclasses import dataclass

from model.config import CONFIG, StrictInt

EXPERT_GRAD_SCALINGS: tuple[str, ...] = ("domain_mean", "global")


@dataclass(frozen=True, config=CONFIG)
class ParallelConfig:
    """How ranks are laid out.

    allocation: None = even (world / domains data-parallel ranks per domain); else an explicit list of
    data-parallel rank counts per domain, in domain order (e.g. proportional to data). With fewer
    data-parallel ranks than domains, each rank holds several consecutive domains.
    expert_grad_scaling: "domain_mean" averages an expert's gradient over its domain group (default);
    "global" divides by the whole data-parallel world, as the reference fairseq code does.
    """

    tensor_parallel: StrictInt = 1
    zero_stage: StrictInt = 0
    allocation: Optional[list[StrictInt]] = None
    expert_grad_scaling: str = "domain_mean"

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
                f"{prefix}.expert_grad_scaling={self.expert_grad_scaling!r}: choose one of {', '.join(EXPERT_GRAD_SCALINGS)}"
            )
        return out
