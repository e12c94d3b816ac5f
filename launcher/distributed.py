"""Distributed start-up: the environment a bare process needs, the process group, the training device."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch


def free_port() -> int:
    """A TCP port free on this host now (the rendezvous port of a local run)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_env() -> None:
    """A bare `python -m launcher.train` is a world of one: give DeepSpeed the env a launcher would."""
    if "RANK" in os.environ:
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def start_distributed() -> tuple[int, int]:
    """Initialise torch.distributed through DeepSpeed (NCCL on GPUs, gloo on CPU); returns (rank, world size)."""
    import deepspeed
    import torch.distributed as dist

    ensure_env()
    if torch.cuda.is_available():  # before the first NCCL communicator exists, so each rank binds its own GPU
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    if not torch.cuda.is_available():
        dist.barrier()  # every rank has mapped every peer's shared-memory segment (DeepSpeed's shm_initialize)
        release_shm_name(dist.get_rank())
    return dist.get_rank(), dist.get_world_size()


def shm_segment(rank: int) -> Path:
    """The /dev/shm segment DeepSpeed's CPU shared-memory all-reduce creates for `rank` of this rendezvous
    (deepspeed/ops/csrc/cpu/comm/shm.cpp: `deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`,
    about 66 MB of RAM)."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def release_shm_name(rank: int) -> None:
    """Unlink this rank's shared-memory segment name. DeepSpeed never unlinks it, so every CPU run (and every
    killed one) left 66 MB per rank in /dev/shm until reboot. Call once every rank has opened every peer's
    segment (after init and a barrier): the mappings stay valid until the processes exit, and then the
    kernel frees the memory, however the run ends."""
    shm_segment(rank).unlink(missing_ok=True)


def training_device() -> torch.device:
    """The one device this rank trains on; every tensor that meets a collective is made here."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
