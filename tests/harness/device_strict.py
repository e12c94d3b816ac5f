"""Device-strict mode: CUDA's placement rules for collectives, enforced on a CPU-only machine.

On a GPU cluster the training device is `cuda:i` and NCCL process groups have no CPU backend: a collective
on a tensor created on the host ("No backend type associated with device type cpu") crashes the run. On CPU
over gloo the same code passes, because host and training device are both the CPU. This mode tells them
apart again by *provenance*:

* a tensor is **host** when it was made without naming a device (`torch.zeros(2)`, `torch.tensor([x])`,
  `torch.from_numpy(a)`), or moved there with `.cpu()`;
* results of an operation are host when every tensor they were computed from is host (an in-place op keeps
  the tensor it writes into as it was);
* `t.to(device)`, `.cuda()` and factories given `device=` give device tensors, as do gradients (autograd)
  and everything loaded with `map_location`.

Every collective (all_reduce, all_gather, broadcast, reduce_scatter, all_to_all, send/recv, ...) then rejects
a host tensor, or a tensor on another device than the one the trainer trains on, naming the call. Enter it
with `enable(device)` in each rank process (`tests/harness/multirank.run_ranks(..., device_strict=True)` does).
Code under test that follows the rule "every tensor that meets a collective lives on the training device"
runs unchanged; code that would crash on NCCL fails here with the caller's traceback.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

# frames shown repo-relative
_REPO_PREFIX = str(__import__("pathlib").Path(__file__).resolve().parents[2]) + "/"

_HOST = "_device_strict_host"

# Factories that place their result on the default device (the host) unless given `device=`.
_FACTORIES = {
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.tensor,
    torch.arange,
    torch.linspace,
    torch.logspace,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.eye,
    torch.from_numpy,
    torch.scalar_tensor,
}
_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "gather",
    "scatter",
    "_all_gather_base",
    "_reduce_scatter_base",
)


class DevicePlacementError(RuntimeError):
    """A collective was handed a tensor that would not be on the accelerator on a GPU cluster."""


def is_host(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _HOST, False)


def _mark(t: Any, host: bool) -> None:
    if isinstance(t, torch.Tensor):
        try:
            setattr(t, _HOST, host)
        except (AttributeError, RuntimeError):  # e.g. some C++-owned views; leave them unmarked
            pass


def _tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten((args, kwargs or {}))
    return [x for x in flat if isinstance(x, torch.Tensor)]


def _is_inplace(func: Callable) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")


def _to_target_is_device(args: tuple, kwargs: dict) -> Any:
    """For Tensor.to(...): True (a device was named), a tensor (to(other)), or None (dtype only)."""
    if kwargs.get("device") is not None:
        return True
    for a in args[1:]:
        if isinstance(a, (torch.device, str, int)):
            return True
        if isinstance(a, torch.Tensor):
            return a
    return None


# Reading a device tensor on the host: on a GPU each of these waits for every queued kernel (a synchronisation).
_HOST_READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__"}
_sync_log: list | None = None  # where `record_host_reads` collects them, while active


class record_host_reads:
    """Context manager: the device-to-host reads made inside it, as (method, 'file:line function' of the three
    innermost project or library frames). A read of a *host* tensor (made without a device, e.g. the sampler's
    or the optimizer's step counters, which torch keeps on the CPU) is not a device read and is not recorded."""

    def __enter__(self) -> list:
        global _sync_log
        self.events: list = []
        _sync_log = self.events
        return self.events

    def __exit__(self, *exc: Any) -> None:
        global _sync_log
        _sync_log = None


def _note_read(name: str) -> None:
    import traceback

    frames = [f for f in traceback.extract_stack()[:-1] if "device_strict" not in f.filename]
    _sync_log.append(
        (
            name,
            " <- ".join(
                f"{f.filename.split('site-packages/')[-1].split(_REPO_PREFIX)[-1]}:{f.lineno} {f.name}"
                for f in reversed(frames[-3:])
            ),
        )
    )


class _ProvenanceMode(TorchFunctionMode):
    """Marks tensors host or device as the module docstring describes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        # .to("cpu") in the project's code names the host (the trainer moves tensors with its torch.device); in
        # DeepSpeed's, "cpu" is also its CPU accelerator's device name, so only the project's calls count
        to_host = (
            name == "to"
            and any(isinstance(a, str) and a == "cpu" for a in (*args[1:2], kwargs.get("device")))
            and "site-packages" not in sys._getframe(1).f_code.co_filename
        )
        if (
            _sync_log is not None
            and (name in _HOST_READS or to_host)
            and args
            and isinstance(args[0], torch.Tensor)
            and not is_host(args[0])
        ):
            _note_read("to('cpu')" if to_host else name)
        out = func(*args, **kwargs)
        if to_host:
            if out is not args[0]:
                _mark(out, True)
            return out
        if func in _FACTORIES:
            if isinstance(out, torch.Tensor):
                src = args[0] if func is torch.tensor and args and isinstance(args[0], torch.Tensor) else None
                _mark(out, kwargs.get("device") is None and (src is None or is_host(src)))
            return out
        if name == "cpu":
            _mark(out, True)
        elif name == "cuda":
            _mark(out, False)
        elif name == "to":
            target = _to_target_is_device(args, kwargs)
            if target is True:
                _mark(out, False)
            elif isinstance(target, torch.Tensor):
                _mark(out, is_host(target))
            elif out is not args[0]:
                _mark(out, is_host(args[0]))
        elif not _is_inplace(func):
            inputs = _tensors(args, kwargs)
            if inputs:
                host = all(is_host(t) for t in inputs)
                for o in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(o, torch.Tensor) and not any(o is t for t in inputs):
                        _mark(o, host)
        return out


def _guard(name: str, fn: Callable, device: torch.device) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        for t in _tensors(args, kwargs):
            if is_host(t):
                raise DevicePlacementError(
                    f"torch.distributed.{name} on a host tensor (shape {tuple(t.shape)}, {t.dtype}) made without "
                    f"device=: NCCL has no CPU backend; create it on the training device ({device})"
                )
            if t.device != device:
                raise DevicePlacementError(
                    f"torch.distributed.{name} on a tensor on {t.device}; the trainer trains on {device}"
                )
        return fn(*args, **kwargs)

    wrapper.__wrapped_by_device_strict__ = True
    return wrapper


def enable(device: torch.device | str = "cpu") -> None:
    """Turn device-strict mode on for the rest of this process (collectives guarded, provenance tracked)."""
    device = torch.device(device)
    for name in _COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None and not getattr(fn, "__wrapped_by_device_strict__", False):
            setattr(dist, name, _guard(name, fn, device))
    # not seen by torch-function modes
    if not getattr(torch.from_numpy, "__wrapped_by_device_strict__", False):
        torch.from_numpy = _host_factory(torch.from_numpy)
    _ProvenanceMode().__enter__()


def _host_factory(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        _mark(out, True)
        return out

    wrapper.__wrapped_by_device_strict__ = True
    return wrapper
