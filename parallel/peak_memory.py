"""The peak memory of one forward+backward, counted without allocating: the lean `PeakBytes` counter (or torch's
MemTracker, `measure_peak`), and `PlannedRouting`, which gives data-dependent shapes their planned sizes under
FakeTensorMode. parallel/memory.py traces each rank's training model with them (`trace_peaks`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from model.config import ModelConfig
from model.ffn import ffn_traits

_DEVICE = torch.ops.prim.device.default  # asked of every tensor by autograd: most operators a mode sees


class PlannedRouting(TorchDispatchMode):
    """Under FakeTensorMode: ops whose tensors are all real (the host-side domain ids the trainer passes, and
    what the layer computes from them: `tolist`, checks) run for real; `nonzero` of a fake mask, whose row count
    depends on values a fake tensor lacks, returns a planned count (`share` of the mask's elements: the balanced
    case, e.g. K S / E routes per GShard expert)."""

    def __init__(self, share: float) -> None:
        super().__init__()
        self.share = share

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.utils._python_dispatch import _disable_current_modes

        kwargs = kwargs or {}
        if func is _DEVICE:  # makes no tensor
            return func(*args, **kwargs)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tensors and not any(isinstance(t, FakeTensor) for t in tensors):
            with _disable_current_modes():
                return func(*args, **kwargs)
        if func is torch.ops.aten.nonzero.default:
            x = args[0]
            return torch.zeros(
                (max(1, round(x.numel() * self.share)), x.dim()), dtype=torch.long, device=x.device
            )
        return func(*args, **kwargs)


def routing_share(m: ModelConfig, expert_ids: Sequence[int] | None) -> float:
    """The planned share of a routing mask's elements that select one expert (see PlannedRouting)."""
    if ffn_traits(m.ffn.kind).deepspeed_moe:
        return 1.0 / max(1, m.ffn.num_experts)
    return 1.0 / max(1, len(expert_ids or [0]))


class PeakBytes(TorchDispatchMode):
    """A lean peak-memory counter: every storage an op returns is counted once, from its creation until Python
    drops it (a weakref finalizer), and the running total's maximum is kept. The same accounting as torch's
    MemTracker without its per-operator walk over every live tensor (~20 s for a gpt3-small step on a busy core,
    against a few seconds here); `tests/parallel/test_memory.py` checks the two agree."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen = WeakIdKeyDictionary()

    def track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if st in self._seen:
            return
        n = st.nbytes()
        self._seen[st] = n
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(st, self._free, n)

    def _free(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is _DEVICE:
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out


def _forward(model: torch.nn.Module, batch: dict, autocast: torch.dtype | None) -> torch.Tensor:
    ctx = (
        torch.autocast("cpu", dtype=autocast)
        if autocast is not None
        else torch.autocast("cpu", enabled=False)
    )
    with ctx:
        out = model(**batch, return_logits=False)
    return out.loss if out.aux_loss is None else out.loss + out.aux_loss


def _forward_backward(model: torch.nn.Module, batch: dict, autocast: torch.dtype | None) -> None:
    _forward(model, batch, autocast).backward()


def _preallocate_grads(model: torch.nn.Module) -> None:
    """As after the first micro-batch: gradients live, backward accumulates into them."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)


def count_peak(
    model: torch.nn.Module,
    batch: dict,
    autocast: torch.dtype | None = None,
    preallocate_grads: bool = True,
) -> dict[str, int]:
    """Peak bytes of one forward+backward with `PeakBytes`: `total` and `activations` (total - params - grads),
    and the activations at the peak of each phase, `forward` and `backward` (their maximum is `activations`)."""
    if preallocate_grads:
        _preallocate_grads(model)
    tracker = PeakBytes()
    with tracker:
        for p in model.parameters():
            tracker.track(p)
            if p.grad is not None:
                tracker.track(p.grad)
        states = tracker.live
        loss = _forward(model, batch, autocast)
        forward, tracker.peak = tracker.peak, tracker.live
        loss.backward()
        del loss
    total = max(forward, tracker.peak)
    return {
        "total": total,
        "activations": total - states,
        "forward": forward - states,
        "backward": tracker.peak - states,
    }


def measure_peak(
    model: torch.nn.Module,
    batch: dict,
    autocast: torch.dtype | None = None,
    preallocate_grads: bool = True,
) -> dict[str, int]:
    """Peak bytes of one forward+backward of `model(**batch, return_logits=False)` by torch's MemTracker kind
    (PARAM, GRAD, ACT, TEMP, ...) plus `total` and `activations` (total - PARAM - GRAD - OPT), at the moment of
    the total peak. Works on fake tensors (nothing allocated) and on real ones (the measurement the tests trust)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    if preallocate_grads:
        _preallocate_grads(model)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        _forward_backward(model, batch, autocast)
    per_device = next(iter(tracker.get_tracker_snapshot("peak").values()))
    kinds = {str(k).split(".")[-1]: v for k, v in per_device.items()}
    total = kinds.pop("Total")
    states = kinds.get("PARAM", 0) + kinds.get("GRAD", 0) + kinds.get("OPT", 0)
    return {"total": total, "activations": total - states, **kinds}
