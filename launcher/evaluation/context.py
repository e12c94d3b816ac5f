"""`EvalContext`: what every stage of one evaluation (`evaluate_model`) shares - the model, the data, the settings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class EvalContext:
    """What every stage of one evaluation (`evaluate_model`) shares."""

    model: torch.nn.Module
    data_root: str | Path
    tokenizer: str
    manifest: dict[str, Any]
    train_domains: list[str]
    experts: list[str]
    modes: list[str]
    split: str
    dev_split: str
    seq_len: int
    max_blocks: int | None
    batch_size: int
    precision: str
    cached_blocks: int
    decay: float
    topk: int
    posterior: str
    cached_estimator: str
    unigram: bool
    domain_token: bool
    router_vectors: torch.Tensor | None = None  # E x D, expert j = experts[j] (model/mixture.py router eqs.)
    router_temperature: float | None = None  # τ, with a router mode only

    @property
    def passes_per_block(self) -> int:
        """Forward passes per block: one (all experts batched, or a dense model), G for +Domain-Token."""
        return len(self.train_domains) if self.domain_token and not self.experts else 1

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device
