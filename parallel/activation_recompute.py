"""Activation recompute (a.k.a. activation checkpointing) applied from outside: each transformer block recomputes
its forward in backward."""

from __future__ import annotations

import torch.nn as nn
from torch.utils.checkpoint import checkpoint


def apply_activation_recompute(model: nn.Module) -> nn.Module:
    """Recompute every block's activations in backward (Narayanan et al.'s full recomputation).

    The block's forward is replaced in place, so parameter names and state dicts are unchanged.
    """
    for block in model.blocks:
        fwd = block.forward
        block.forward = lambda *a, _f=fwd, **k: checkpoint(_f, *a, use_reentrant=False, **k)
    return model
