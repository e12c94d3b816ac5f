"""fp16 at ZeRO 0: DeepSpeed's overflow decision from the global gradient norm the trainer already computes, one host
read per optimizer step instead of one per parameter.

At ZeRO 0 with fp16 the engine wraps our AdamW in DeepSpeed's FP16_UnfusedOptimizer. Its `step` (DeepSpeed 0.19.8)
reads the device on the host 1 + P + 2G times for P parameters in G groups: `bool()` of an inf/nan test of every
gradient (`CheckOverflow.has_overflow_serial`), `.item()` of the flag, then `float()` and `.item()` of each group's
gradient norm (`get_weight_norm`) - a norm it needs only to detect the overflow again, since its clipping is off at
ZeRO 0 (the trainer clips with the true global norm, parallel/engine.py). On a GPU each read waits for every queued
kernel. The trainer has the norm of all gradients of all ranks anyway (`global_grad_norm`, all-reduced over the
world), and a gradient holds an inf or a nan exactly when that norm is not finite:

    overflow  <=>  not isfinite(||g||)

(fp16 gradients are at most 65504 in magnitude, so the fp32 per-tensor norms and their float64 squares stay finite
for finite gradients.) `step_with_norm` is FP16_UnfusedOptimizer.step with those reads replaced by that one test,
which has to reach the host: DeepSpeed skips the update, the lr step and the loss-scale growth there
(`engine._take_model_step` reads `optimizer.overflow`). Everything else is DeepSpeed's own code path (the fp32 copy
of the gradients, `_update_scale`, `unscale_and_clip_grads`, the inner step, the copy back, `_skip_invalid_grad_norm`);
tests/parallel/test_overflow.py checks the result against DeepSpeed's step, with and without an overflow. Every rank
takes the same decision, as the norm is the world's.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from parallel import ds_private


def overflowed(norm: torch.Tensor) -> bool:
    """Whether the step's global gradient norm is inf or nan: the fp16 step's one device-to-host read."""
    return not bool(torch.isfinite(norm))


def install_norm_overflow_check(optimizer: Any) -> bool:
    """Make DeepSpeed's ZeRO-0 fp16 optimizer take its overflow decision from the norm handed to `set_step_norm`
    (`step_with_norm`). Returns whether it did: any other optimizer (ZeRO 1/2, bf16, fp32, a clipping or legacy
    fused-LAMB FP16_UnfusedOptimizer) keeps its own step."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if type(optimizer) is not FP16_UnfusedOptimizer or optimizer.clip_grad > 0 or optimizer.fused_lamb_legacy:
        return False
    optimizer.step_norm = None
    optimizer.step = types.MethodType(step_with_norm, optimizer)
    return True


def set_step_norm(optimizer: Any, norm: torch.Tensor) -> None:
    """Hand the next optimizer step the global gradient norm (a device scalar) to decide overflow by; a no-op for an
    optimizer `install_norm_overflow_check` left alone."""
    if hasattr(optimizer, "step_norm"):
        optimizer.step_norm = norm


def step_with_norm(self: Any, closure: Any | None = None) -> bool:
    """FP16_UnfusedOptimizer.step (DeepSpeed 0.19.8, not the legacy fused-LAMB path, `clip_grad` 0) deciding overflow
    from the norm given by `set_step_norm` (module docstring); without one, DeepSpeed's own step. Returns the
    overflow."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    norm, self.step_norm = self.step_norm, None
    if norm is None:
        return FP16_UnfusedOptimizer.step(self, closure)
    self.overflow = overflowed(norm)
    if self.overflow:
        return ds_private.skip_invalid_grad_norm(self)
    for fp32_group, fp16_group in zip(self.fp32_groups, self.fp16_groups):
        # the fp32 copies of the gradients, as DeepSpeed
        for fp32_param, fp16_param in zip(fp32_group, fp16_group):
            if fp16_param.grad is None:
                fp32_param.grad = torch.zeros(
                    fp16_param.size(), dtype=fp32_param.dtype, device=fp32_param.device
                )
            else:
                fp32_param.grad = fp16_param.grad.to(fp32_param.dtype)
    ds_private.set_global_grad_norm(
        self, norm
    )  # what engine.get_global_grad_norm() returns: the norm the trainer computed
    ds_private.update_loss_scale(self, False)
    self.unscale_and_clip_grads(norm)  # clip_grad is 0: divides by the loss scale only, the norm is not read
    self.optimizer.step()
    for fp32_group, fp16_group in zip(self.fp32_groups, self.fp16_groups):
        for fp32_param, fp16_param in zip(fp32_group, fp16_group):
            fp32_param.grad = None
            fp16_param.data.copy_(fp32_param.data)
    return self.overflow
