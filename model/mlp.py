"""The building blocks every feed-forward kind shares: its output type, the GPT-3 MLP, the dense layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.config import ModelConfig


@dataclass
class FFNOutput:
    """What a feed-forward layer returns: hidden states, an auxiliary loss, routing statistics."""

    hidden: torch.Tensor
    aux_loss: torch.Tensor | None = None
    stats: dict[str, torch.Tensor] = field(default_factory=dict)


class MLP(nn.Module):
    """The dense FFN of GPT-3: D -> F -> D with GELU. One DEMix expert has exactly this shape."""

    def __init__(self, d_model: int, d_ffn: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ffn)
        self.fc2 = nn.Linear(d_ffn, d_model)
        # scaled init (GPT-2), see GPT.reset_parameters. A plain flag: torch types Module.__setattr__ for tensors and
        # modules only
        self.fc2.is_residual_projection = True  # type: ignore[assignment]
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc2(F.gelu(self.fc1(x))))


class DenseFFN(nn.Module):
    """The degenerate case: one expert, every token."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.mlp = MLP(cfg.d_model, cfg.d_ffn, cfg.dropout)

    def forward(self, x_BTD: torch.Tensor, domain_ids_B: torch.Tensor | None = None) -> FFNOutput:
        return FFNOutput(hidden=self.mlp(x_BTD))


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype torch.autocast computes matmuls in on `device_type` now, None where autocast is off (or the
    device has no autocast, e.g. meta)."""
    on = torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)
    return torch.get_autocast_dtype(device_type) if on else None


def expert_output_like(x_BTD: torch.Tensor) -> torch.Tensor:
    """Zeros shaped like `x_BTD` in the dtype an MLP computes from it: the autocast dtype where autocast is on for
    its device (bf16/fp16 mixed precision: the experts' outputs are that dtype), else `x_BTD`'s. The buffer that
    several experts' rows are scattered into."""
    dtype = autocast_dtype(x_BTD.device.type) if x_BTD.is_floating_point() else None
    return torch.zeros_like(x_BTD, dtype=dtype or x_BTD.dtype)
