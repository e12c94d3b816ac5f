"""What machine a benchmark ran on: recorded beside every result."""

from __future__ import annotations

import os
import platform
import time
from typing import Any


def machine_info() -> dict[str, Any]:
    """Cores usable by this process, CPU model, platform, library versions, GPU, threads, 1-minute load."""
    import torch

    cpu = ""
    try:
        cpu = next(
            (l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), ""
        )
    except OSError:
        pass
    try:
        import deepspeed

        ds = deepspeed.__version__
    except Exception:  # the version is information only
        ds = None
    return {
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_count": os.cpu_count(),
        "cpu": cpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": ds,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def uptime() -> str:
    """`uptime`'s line (load averages), recorded before and after a long benchmark; "" where there is no `uptime`."""
    import subprocess

    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def _busy_jiffies() -> tuple[int, int] | None:
    """(all busy jiffies, of which niced) summed over every CPU, from /proc/stat's aggregate line; None where
    there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    steal = fields[7] if len(fields) > 7 else 0
    return user + nice + system + irq + softirq + steal, nice


class OtherLoad:
    """CPU used by *other* processes while a block runs, in cores:

        others = (busy CPU time of the whole machine - this process's and its children's CPU time) / wall time

    The 1-minute load average cannot say this for a benchmark that itself keeps every core busy (its own threads
    count in it, and it lags by a minute); this reads the kernel's busy counters (/proc/stat) before and after.
    `niced` is the part of the machine's busy time spent at a positive nice level (others' background jobs
    usually; a niced benchmark would count its own time there too). Both are None where /proc/stat is missing.

        with OtherLoad() as ol:
            work()
        ol.result()  # {"others_cores": 0.03, "niced_cores": 0.0, "own_cores": 1.98, "wall_s": 2.1}
    """

    def __enter__(self) -> OtherLoad:
        self._t0, self._own0, self._busy0 = time.perf_counter(), _own_cpu(), _busy_jiffies()
        return self

    def __exit__(self, *exc) -> None:
        self._t1, self._own1, self._busy1 = time.perf_counter(), _own_cpu(), _busy_jiffies()

    def result(self) -> dict[str, float | None]:
        wall = max(self._t1 - self._t0, 1e-9)
        own = (self._own1 - self._own0) / wall
        out: dict[str, float | None] = {
            "others_cores": None,
            "niced_cores": None,
            "own_cores": round(own, 3),
            "wall_s": round(wall, 3),
        }
        if self._busy0 is not None and self._busy1 is not None:
            hz = os.sysconf("SC_CLK_TCK")
            busy = (self._busy1[0] - self._busy0[0]) / hz / wall
            out["others_cores"] = round(max(0.0, busy - own), 3)
            out["niced_cores"] = round((self._busy1[1] - self._busy0[1]) / hz / wall, 3)
        return out


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def gpu_versions() -> dict[str, Any]:
    """The GPU stack a GPU result was taken on: GPU, compute capability, memory, driver; Python, torch, CUDA,
    cuDNN, NCCL, DeepSpeed, megatron-core. Information only: what cannot be read is None."""
    import subprocess

    import torch

    def _version(module: str) -> str | None:
        try:
            return __import__(module.replace("-", "_")).__version__
        except Exception:  # noqa: BLE001 - information only
            try:
                from importlib.metadata import version

                return version(module)
            except Exception:  # noqa: BLE001
                return None

    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": None,
        "nccl": None,
        "deepspeed": _version("deepspeed"),
        "megatron_core": _version("megatron-core"),
        "gpus": 0,
        "gpu": None,
        "capability": None,
        "gpu_memory_gib": None,
        "driver": None,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(
            gpus=torch.cuda.device_count(),
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            gpu_memory_gib=round(props.total_memory / 2**30, 2),
            cudnn=torch.backends.cudnn.version(),
        )
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            pass
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            out["driver"] = (
                smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else None
            )
        except (OSError, subprocess.SubprocessError):
            pass
    return out


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--versions"]:
        sys.exit("usage: python -m benchmarks.machine --versions")
    print(" ".join(f"{k}={v}" for k, v in gpu_versions().items()))
