"""Run a function on N local processes over gloo and collect what each returns: the experiments' own runner.

    results = run_ranks(worker, world_size=4, args=(kind,))

`fn(rank, world_size, *args)` runs in each spawned child after `torch.distributed` is initialised on gloo with the
standard environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), as under `deepspeed` or `torchrun`;
its picklable return value (plain values, no tensors) comes back in rank order. A rank that raises fails the call
with its traceback. (The test suite's tests/harness/multirank.py does the same with a preloading forkserver and the
tests' device checks.)
"""

from __future__ import annotations

import os
import queue as queue_lib
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch.multiprocessing as mp

from launcher.distributed import free_port


def _child(rank: int, world_size: int, port: int, fn: Callable, args: Sequence[Any], queue: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        from launcher.distributed import release_shm_name

        release_shm_name(rank)  # DeepSpeed never unlinks its shared-memory segment
        queue.put((rank, True, result))  # plain values (numbers, dicts): no tensors through the queue
    except BaseException:  # report every failure, including SystemExit from libraries
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_ranks(
    fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), timeout: float = 600.0
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned processes; return the results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    try:
        for _ in range(world_size):
            try:
                rank, ok, payload = queue.get(timeout=timeout)
            except queue_lib.Empty:
                missing = sorted(set(range(world_size)) - set(results) - set(failures))
                raise RuntimeError(
                    f"ranks {missing} of {world_size} returned nothing within {timeout:.0f} s"
                ) from None
            if ok:
                results[rank] = payload
            else:
                failures[rank] = payload
                break
    finally:
        for p in procs:
            p.join(timeout=5 if failures else 60)
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        rank = min(failures)
        raise RuntimeError(f"rank {rank} of {world_size} failed:\n{failures[rank]}")
    return [results[r] for r in range(world_size)]
