"""What machine a benchmark ran on: recorded beside every result."""

from __future__ import annotations

import os
import platform
from typing import Any


def machine_info() -> dict[str, Any]:
    """Cores usable by this process, CPU model, platform, library versions, GPU, threads, 1-minute load."""
    import torch

    cpu = ""
    try:
        cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")
    except OSError:
        pass
    try:
        import deepspeed

        ds = deepspeed.__version__
    except Exception:  # the version is information only
        ds = None
    return {
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_count": os.cpu_count(), "cpu": cpu, "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "deepspeed": ds,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "loadavg_1m": round(os.getloadavg()[0], 2),
    }
