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

from contextlib import AbstractContextManager, nullcontext

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
        # not torch.cuda.is_bf16_supported(): it is True on sm70 (V100) through emulation, which would crawl
        if p == "bf16" and (major, minor) < (8, 0):
            return [
                f"train.precision=bf16: {name} (compute capability {major}.{minor}) has no bf16; use "
                "train.precision=fp16 (loss-scaled, as the DEMix paper on V100) or fp32"
            ]
        return []
    if p == "fp16" and not cpu_supports_fp16():
        return [
            "train.precision=fp16: this CPU has no fp16 kernels in oneDNN (needs avx512_fp16 or AMX-FP16), so "
            "DeepSpeed refuses it; use train.precision=bf16 or fp32 on this machine"
        ]
    return []


def device_precision_problems(precision: str, device: DeviceSpec) -> list[str]:
    """Why a named accelerator (a dry run's --device) cannot train in `precision` (empty = fine)."""
    p = normalise_precision(precision)
    if p == "fp32" or device.key == "cpu" or device.peak(p) is not None:
        return []
    have = [q for q, _ in device.peaks if q in ("fp16", "bf16")]
    return [
        f"train.precision={p}: {device.label} has no {p}; use train.precision={' or '.join(have + ['fp32'])}"
    ]


# ----------------------------------------------------------------------------------------------------
# The precision a forward pass runs in (training step, in-run evaluation, standalone evaluator alike)
# ----------------------------------------------------------------------------------------------------

AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


def forward_precision(
    module: torch.nn.Module, precision: str, device_type: str
) -> AbstractContextManager[None]:
    """The context a forward pass of `module` in `precision` runs under: the training step's regime, so that every
    evaluation scores the model as it was trained.

    DeepSpeed, configured by parallel/ds_config.py's `deepspeed_config`, trains bf16 at ZeRO 0 by torch autocast over
    fp32 weights (`torch_autocast`: engine.forward enters `torch.autocast(device, bfloat16)`), and otherwise casts
    the module itself (bf16 at ZeRO >= 1, fp16 at every stage). Hence one rule:

    * bf16/fp16 over fp32 parameters -> `torch.autocast(device_type, dtype)`: linears and matmuls in half
      precision, everything autocast keeps in fp32 (and the model's fp32 cross-entropy / log-prob sums) in fp32;
    * parameters already in half precision (a module DeepSpeed cast), or fp32 -> as is (no context).

    A bare `module(...)` on the engine's module at ZeRO 0 bf16 would otherwise run entirely in fp32."""
    dtype = AUTOCAST_DTYPES.get(normalise_precision(precision))
    first = next((p for p in module.parameters() if p.is_floating_point()), None)
    if dtype is None or first is None or first.dtype != torch.float32:
        return nullcontext()
    return torch.autocast(device_type, dtype=dtype)
