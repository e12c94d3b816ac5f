"""Where and in what precision an evaluation runs: this process's rank, the device (`resolve_eval_device`), the
precision (`resolve_eval_precision`, the trainer's autocast rule) and joining a launcher's ranks (`join_ranks`)."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from launcher.distributed import ensure_env, start_distributed, training_device
from model.accounting import normalise_precision
from parallel.precision import local_precision_problems

EVAL_DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
EVAL_PRECISIONS: tuple[str, ...] = ("auto", "fp32", "bf16", "fp16")


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the process group this process joined; (0, 1) without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def say(progress: bool, *a: Any) -> None:
    """Print on stderr from rank 0 when `progress`."""
    if progress and rank_and_world()[0] == 0:
        print(*a, file=sys.stderr, flush=True)


def resolve_eval_device(choice: str = "auto") -> torch.device:
    """The device to evaluate on: `cpu`; `cuda`, this rank's GPU (the training device: `torch.cuda.current_device()`,
    which `start_distributed` binds to LOCAL_RANK), refused (ValueError) where CUDA is not available; `auto`, the GPU
    where CUDA is available unless this process already joined a gloo group (its collectives run on the host),
    else the CPU."""
    if choice not in EVAL_DEVICES:
        raise ValueError(f"device {choice!r}: choose from {', '.join(EVAL_DEVICES)}")
    if choice == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if choice == "cuda":
            raise ValueError(
                f"--device cuda: CUDA is not available on this machine (torch {torch.__version__}, "
                f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use --device cpu"
            )
        return torch.device("cpu")
    if (
        choice == "auto"
        and torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_backend() == "gloo"
    ):
        return torch.device("cpu")
    return training_device()


def resolve_eval_precision(choice: str, trained: str, device: torch.device) -> str:
    """fp32, bf16 or fp16 for `choice` (`auto` or one of them) on `device`, for a checkpoint trained in `trained`.

    `auto`: on a GPU the training precision where the GPU has it (`local_precision_problems`; e.g. a V100 has no
    bf16: fp32 then), on the CPU fp32 (the numbers CPU evaluations always gave; CPU autocast is real bf16
    arithmetic, slower than fp32 without AMX). An explicit precision the GPU lacks is refused (ValueError)."""
    if choice == "auto":
        p = normalise_precision(trained)
        return p if device.type != "cpu" and not local_precision_problems(p) else "fp32"
    p = normalise_precision(choice)
    problems = local_precision_problems(p) if device.type == "cuda" else []
    if problems:
        raise ValueError(f"--precision {p} on {device}: " + "; ".join(problems))
    return p


def join_ranks(device_choice: str) -> torch.device:
    """Under a launcher of several ranks (torchrun, deepspeed, MPI, srun), join them - on GPUs through the trainer's
    `start_distributed` (each rank binds its own GPU, NCCL), on the CPU a gloo group - and return this rank's
    evaluation device. A single process joins nothing."""
    world = ensure_env()  # MPI/SLURM ranks: torch's variables, from the launcher's own (the trainer's rule)
    if world > 1 and not torch.distributed.is_initialized():
        if resolve_eval_device(device_choice).type == "cuda":
            start_distributed()
        else:  # a gloo group, as before: no DeepSpeed (its CPU start-up JIT-compiles a shared-memory op)
            torch.distributed.init_process_group("gloo")
    return resolve_eval_device(device_choice)
