"""Run a function on N real processes over gloo, the way a launcher would, and collect results.

    results = run_ranks(_my_check, world_size=4, args=(cfg_dict,))

`fn(rank, world_size, *args)` runs in each child after `torch.distributed` is initialised on gloo with
the standard environment variables set (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so
DeepSpeed and megatron-core find them as they would under `deepspeed` or `torchrun`. Its return value
(picklable) comes back in rank order. An exception in any rank fails the call with that rank's traceback.

Ranks are forked from a forkserver that has already imported torch, DeepSpeed and the project (started once per
session by `start_rank_server`, from conftest): a fresh, single-threaded process per rank as with "spawn", without
paying ~3 s of imports per rank on every call. Each rank gets the caller's environment, working directory and
sys.path at call time, as a spawned child would.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue as queue_lib
import sys
import traceback
from collections.abc import Callable, Sequence
from multiprocessing import reduction
from typing import Any

import torch.multiprocessing as mp

from launcher.distributed import free_port

# What every rank imports anyway: preloaded once in the forkserver, so a rank starts in ~0.1 s instead of ~3 s.
PRELOAD = [
    "torch",
    "torch.distributed",
    "deepspeed",
    "launcher.train",
    "launcher.evaluation.evaluate",
    "model.gpt",
    "parallel.engine",
    "tests.harness.multirank",
    # what a rank imports once it trains (2,200 modules, ~4 s of CPU per rank when each child imports them):
    # DeepSpeed's engine, ZeRO and MoE (which import torch._dynamo and torch._inductor, hence sympy and
    # networkx), megatron-core's token reader and tensor-parallel layers, wandb, and the tests' own modules
    "deepspeed.runtime.engine",
    "deepspeed.runtime.zero.stage_1_and_2",
    "deepspeed.moe.layer",
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "megatron.core.datasets.indexed_dataset",
    "deepspeed.module_inject",
    "deepspeed.ops.op_builder",
    "parallel.tensor_parallel",
    "wandb",
    "pytest",
    "tests.e2e.test_train",
]
# The environment the preloading server imports under: DeepSpeed picks its accelerator at import time.
SERVER_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def _context() -> Any:
    """forkserver where the platform has it (Linux), else spawn."""
    return mp.get_context(
        "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    )


def start_rank_server() -> None:
    """Start the preloading forkserver now (it imports in the background while tests are collected).

    Idempotent; a no-op where there is no forkserver. The server is started under `SERVER_ENV` so that DeepSpeed
    selects its CPU accelerator even on a GPU machine (ranks run over gloo); the caller's environment is restored."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return
    from multiprocessing import forkserver

    forkserver.set_forkserver_preload(PRELOAD)
    saved = {k: os.environ.get(k) for k in SERVER_ENV}
    os.environ.update(SERVER_ENV)
    try:
        forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _attach_stdio(out: Any, err: Any) -> None:
    """In a rank, as its arguments are unpickled: make fds 1 and 2 the caller's (pytest's capture, a log file)."""
    os.dup2(out.detach(), 1)
    os.dup2(err.detach(), 2)


class _CallerStdio:
    """The caller's fds 1 and 2, handed to a rank as it starts: a forked-from-the-server rank would otherwise write
    to the server's, and a test's capfd would not see what its ranks print."""

    def __reduce__(self) -> tuple:
        return _attach_stdio, (reduction.DupFd(1), reduction.DupFd(2))  # sent with the process (SCM_RIGHTS)


def _child(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable,
    args: Sequence[Any],
    queue: Any,
    init_pg: bool,
    device_strict: bool,
    caller: tuple[dict[str, str], str, list[str]],
    stdio: None,
) -> None:
    env, cwd, path = caller
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
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
        if init_pg:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        if device_strict:
            from tests.harness import device_strict as strict

            strict.enable("cpu")
        result = fn(rank, world_size, *args)
        # fn's collectives ran after every rank mapped every peer's DeepSpeed shm segment: drop this rank's name
        # so the 66 MB segment is freed when the process exits (DeepSpeed never unlinks it).
        from launcher.distributed import release_shm_name

        release_shm_name(rank)
        # Plain pickle (not the multiprocessing one): tensors travel as bytes, not as shared-memory handles
        # that would vanish when this process exits.
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # report every failure, including SystemExit from libraries
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout: float = 600.0,
    init_pg: bool = True,
    device_strict: bool = False,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned processes; return results by rank.

    `device_strict=True` runs each rank under tests/harness/device_strict.py: collectives reject tensors that would be
    on the host on a GPU cluster (the NCCL rule), so device-placement bugs fail here on CPU."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    caller = (dict(os.environ), os.getcwd(), list(sys.path))
    procs = [
        ctx.Process(
            target=_child,
            args=(r, world_size, port, fn, args, queue, init_pg, device_strict, caller, _CallerStdio()),
        )
        for r in range(world_size)
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
                raise AssertionError(
                    f"ranks {missing} of {world_size} returned nothing within {timeout:.0f} s: "
                    "hung (e.g. a collective some ranks never called) or deadlocked"
                ) from None
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
            if failures:
                break
    finally:
        for p in procs:
            p.join(timeout=5 if failures else 60)
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        rank = min(failures)
        raise AssertionError(f"rank {rank} of {world_size} failed:\n{failures[rank]}")
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        raise AssertionError(f"ranks {missing} of {world_size} returned nothing (crashed or hung)")
    return [results[r] for r in range(world_size)]
