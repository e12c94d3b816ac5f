"""Distributed start-up: the environment a bare process needs, the process group, the training device."""

from __future__ import annotations

import os
import socket

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
    return dist.get_rank(), dist.get_world_size()


def training_device() -> torch.device:
    """The one device this rank trains on; every tensor that meets a collective is made here."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
