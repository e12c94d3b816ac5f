"""Can this device train in the requested precision? Checked before any process group or model exists.

DeepSpeed refuses a precision the accelerator lacks only inside `deepspeed.initialize`, after the processes
started and the model was built ("Type fp16 is not supported on your device."), and a V100 asked for bf16
fails later still, in the first kernel. The same rules, asked up front:

* CUDA: fp16 everywhere; bf16 needs compute capability >= 8.0 (A100, H100, ...; not V100, whose mixed
  precision is fp16 with loss scaling, the DEMix paper's setting).
* CPU (DeepSpeed's CPU accelerator): bf16 always; fp16 only where oneDNN has fp16 kernels
  (`torch.ops.mkldnn._is_mkldnn_fp16_supported()`: avx512_fp16 or AMX-FP16, e.g. Sapphire Rapids; not AMD EPYC
  up to Zen 4).
* A named device from model/accounting.py's table (a dry run for a cluster): the precisions it has a tensor
  peak for.
"""

from __future__ import annotations

from typing import Optional

import torch

from model.accounting import DeviceSpec, normalise_precision


def cpu_supports_fp16() -> bool:
    """DeepSpeed's CPU accelerator's rule for fp16."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def local_precision_problems(precision: str) -> list[str]:
    """Why this machine's training device cannot train in `precision` (empty = fine)."""
    p = normalise_precision(precision)
    if p == "fp32":
        return []
    if torch.cuda.is_available():
        name, (major, minor) = torch.cuda.get_device_name(), torch.cuda.get_device_capability()
        if p == "bf16" and not torch.cuda.is_bf16_supported():
            return [f"train.precision=bf16: {name} (compute capability {major}.{minor}) has no bf16; use "
                    "train.precision=fp16 (loss-scaled, as the DEMix paper on V100) or fp32"]
        return []
    if p == "fp16" and not cpu_supports_fp16():
        return ["train.precision=fp16: this CPU has no fp16 kernels in oneDNN (needs avx512_fp16 or AMX-FP16), so "
                "DeepSpeed refuses it; use train.precision=bf16 or fp32 on this machine"]
    return []


def device_precision_problems(precision: str, device: DeviceSpec) -> list[str]:
    """Why a named accelerator (a dry run's --device) cannot train in `precision` (empty = fine)."""
    p = normalise_precision(precision)
    if p == "fp32" or device.key == "cpu" or device.peak(p) is not None:
        return []
    have = [q for q, _ in device.peaks if q in ("fp16", "bf16")]
    return [f"train.precision={p}: {device.label} has no {p}; use train.precision={' or '.join(have + ['fp32'])}"]


def precision_problems(precision: str, device: Optional[DeviceSpec] = None) -> list[str]:
    """For a named device when given, else for this machine."""
    return device_precision_problems(precision, device) if device is not None else local_precision_problems(precision)
