"""Distributed start-up: the environment a bare process needs, the process group, the training device."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from data.argtypes import check_host, in_range
from data.argtypes import port as PORT
from launcher.rundir import clear_stale_build_lock


def free_port() -> int:
    """A TCP port free on this host now (the rendezvous port of a local run)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Launchers that start every rank themselves and say who it is in their own variables, not torch's RANK/WORLD_SIZE
# (DeepSpeed's --launcher openmpi|mvapich|mpich|impi|slurm, a bare mpirun or srun): (name, rank, world size,
# local rank, local world size or None). Checked in this order; the first whose rank and size are both set wins.
SCHEDULER_ENVS: tuple[tuple[str, str, str, str, str | None], ...] = (
    (
        "Open MPI",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    (
        "MVAPICH",
        "MV2_COMM_WORLD_RANK",
        "MV2_COMM_WORLD_SIZE",
        "MV2_COMM_WORLD_LOCAL_RANK",
        "MV2_COMM_WORLD_LOCAL_SIZE",
    ),
    ("MPICH/Intel MPI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    # SLURM_STEP_NUM_TASKS is set by srun only: a batch script's own shell has SLURM_PROCID=0 and the job's
    # SLURM_NTASKS, and a bare `python -m launcher.train` there is a world of one.
    ("SLURM srun", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", None),
)


class LaunchEnvError(RuntimeError):
    """The process was started by a launcher whose environment does not say how to rendezvous."""


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist expression (`gpu[003-010,12],cpu1` -> `gpu003`): the master's node.
    LaunchEnvError when the expression is malformed or its first host is not a host name (`check_host`)."""
    out, i, text = [], 0, nodelist.strip()
    while i < len(text) and text[i] != ",":
        if text[i] == "[":
            end = text.find("]", i)
            if end < 0:
                raise LaunchEnvError(f"SLURM node list {nodelist!r}: '[' without ']'")
            out.append(text[i + 1 : end].split(",")[0].split("-")[0])
            i = end + 1
        else:
            out.append(text[i])
            i += 1
    try:
        return check_host("".join(out), f"the first host of SLURM node list {nodelist!r},")
    except ValueError as e:
        raise LaunchEnvError(str(e)) from None


def scheduler_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The torch.distributed variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
    this process needs, read from the launcher that started it; empty when torch's own are set (torchrun,
    DeepSpeed's pdsh/local launcher) and when no launcher is recognised (a bare process: see `ensure_env`).
    Raises LaunchEnvError when a launcher is recognised but the rendezvous address cannot be known."""
    if "RANK" in environ:
        if "WORLD_SIZE" not in environ:
            raise LaunchEnvError(
                "RANK is set but WORLD_SIZE is not: start the ranks with torchrun, deepspeed or "
                "python -m launcher.launch, which set RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and "
                "MASTER_PORT"
            )
        if "LOCAL_RANK" in environ:
            return {}
        local = next((environ[v[3]] for v in SCHEDULER_ENVS if v[3] in environ), None)
        if local is None and environ["WORLD_SIZE"] != "1":
            raise LaunchEnvError(
                f"RANK={environ['RANK']} of WORLD_SIZE={environ['WORLD_SIZE']} but LOCAL_RANK is "
                "not set: this rank cannot know its GPU; set LOCAL_RANK (its index on the node)"
            )
        return {"LOCAL_RANK": local or "0"}
    for name, rank, size, local, local_size in SCHEDULER_ENVS:  # noqa: B007 (used after the loop's break)
        if rank in environ and size in environ:
            break
    else:
        return {}
    out = {"RANK": environ[rank], "WORLD_SIZE": environ[size], "LOCAL_RANK": environ.get(local, "0")}
    if local_size and local_size in environ:
        out["LOCAL_WORLD_SIZE"] = environ[local_size]
    slurm = name.startswith("SLURM")
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
    addr = environ.get("MASTER_ADDR") or (first_slurm_host(nodelist) if slurm and nodelist.strip() else "")
    port = environ.get("MASTER_PORT") or (
        str(29500 + int(environ["SLURM_JOB_ID"]) % 1000)
        if slurm and environ.get("SLURM_JOB_ID", "").isdigit()
        else ""
    )
    if addr and port:
        check_rendezvous(addr, port, f"from {name}'s environment")
    if not addr or not port:
        raise LaunchEnvError(
            f"started by {name} ({rank}={environ[rank]}, {size}={environ[size]}) without MASTER_ADDR/MASTER_PORT: "
            "launch with `python -m launcher.launch --hostfile H --launcher ...` (it passes them to every rank), or "
            "give every rank the same MASTER_ADDR (the first host) and MASTER_PORT (e.g. mpirun -x MASTER_ADDR=node0 "
            "-x MASTER_PORT=29500)"
        )
    out.update(MASTER_ADDR=addr, MASTER_PORT=port)
    return out


def check_rendezvous(addr: str, port: str, where: str) -> None:
    """LaunchEnvError unless `addr` is a host name or IP address (data/argtypes.py `check_host`) and `port` a TCP
    port: they reach torch's rendezvous and the name of a /dev/shm segment this process unlinks (`shm_segment`),
    so a scheduler variable holding `../..` or an option-like `-o...` stops the rank at start."""
    try:
        check_host(addr, f"MASTER_ADDR {where}:")
        in_range(int(port) if str(port).isdigit() else -1, PORT, f"MASTER_PORT {where}")
    except ValueError as e:
        raise LaunchEnvError(str(e)) from None


def ensure_env(master_addr: str | None = None, master_port: int | None = None) -> int:
    """Give DeepSpeed the torch.distributed environment of this process before anything reads it, and return the
    world size. A launcher's own variables are translated (`scheduler_env`); a bare `python -m launcher.train`
    is a world of one. `master_addr`/`master_port` (the trainer's --master-addr/--master-port, passed by
    launcher.launch to MPI and SLURM ranks) fill MASTER_ADDR/MASTER_PORT where the launcher set none."""
    if master_addr:
        os.environ.setdefault("MASTER_ADDR", master_addr)
    if master_port:
        os.environ.setdefault("MASTER_PORT", str(master_port))
    found = scheduler_env(os.environ)
    if found:
        os.environ.update(found)
    elif "RANK" not in os.environ:
        os.environ.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()),
        )
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        check_rendezvous(
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], "in this process's environment"
        )
    return int(os.environ["WORLD_SIZE"])


def local_device_index(local_rank: int, visible: int) -> int:
    """The CUDA device of local rank `local_rank` when `visible` devices are visible to this process: its own
    index when every GPU of the node is visible, 0 when the scheduler shows each task only its own GPU
    (CUDA_VISIBLE_DEVICES of one device, e.g. srun --gpus-per-task=1)."""
    if visible <= 0:
        raise LaunchEnvError("no CUDA device is visible to this process")
    if local_rank < visible:
        return local_rank
    if visible == 1:
        return 0
    raise LaunchEnvError(
        f"LOCAL_RANK={local_rank} but this process sees {visible} GPUs "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): give each rank "
        "either every GPU of its node or exactly one"
    )


def start_distributed(timeout_s: float | None = None) -> tuple[int, int]:
    """Initialise torch.distributed through DeepSpeed (NCCL on GPUs, gloo on CPU); returns (rank, world size).
    `timeout_s`: how long the rendezvous and the world group's collectives wait for the other ranks (None:
    DeepSpeed's default, `DEEPSPEED_TIMEOUT` minutes or 10)."""
    import deepspeed
    import torch.distributed as dist

    from parallel.comm_timeout import timeout_of

    ensure_env()
    if torch.cuda.is_available():  # before the first NCCL communicator exists, so each rank binds its own GPU
        torch.cuda.set_device(local_device_index(int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()))
        # fp32 matmuls and convolutions on tensor cores (TF32, Ampere and later): what a GPU user expects of fp32
        # training; bf16/fp16 runs are unaffected
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        stale = clear_stale_build_lock()  # the shm op is built at init: a killed build's lock would hang it
        if stale:
            print(f"note: {stale}", file=sys.stderr)
    if not dist.is_initialized():
        deepspeed.init_distributed(
            dist_backend="nccl" if torch.cuda.is_available() else "gloo",
            **({} if timeout_s is None else {"timeout": timeout_of(timeout_s)}),
        )
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
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
