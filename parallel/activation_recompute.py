"""Activation recompute (a.k.a. activation checkpointing) applied from outside: each transformer block recomputes
its forward in backward."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.utils.checkpoint import checkpoint

if TYPE_CHECKING:
    from model.gpt import GPT


def apply_activation_recompute(model: GPT) -> GPT:
    """Recompute every block's activations in backward (Narayanan et al.'s full recomputation).

    The block's forward is replaced in place, so parameter names and state dicts are unchanged.
    """
    for block in model.blocks:
        fwd = block.forward
        block.forward = lambda *a, _f=fwd, **k: checkpoint(_f, *a, use_reentrant=False, **k)
    return model
