"""How long a collective may wait for the other ranks, on every process group this rank belongs to.

torch gives a group its timeout when it is made: `init_process_group(timeout=)` for the world group (DeepSpeed's
`DEEPSPEED_TIMEOUT` reaches only that one) and `new_group(timeout=)` for the others, whose default is 30 minutes
for gloo and NCCL whatever the world group got. A rank that stops responding therefore held every other rank for
half an hour. `set_comm_timeout` changes the timeout of every group that exists on this rank, whoever made it (ours,
DeepSpeed's expert groups, megatron-core's), through torch's `_set_pg_timeout`, which both gloo and NCCL honour for
the collectives issued after it. The trainer gives a long one for start-up, checkpoint saves and the export, and a
shorter one for training steps (`parallel.comm_init_timeout_s`, `parallel.comm_timeout_s`).

What happens at the timeout depends on the backend. gloo raises a RuntimeError ("Timed out waiting 10000ms for recv
operation to complete") in the waiting rank (`is_comm_timeout` recognises it); NCCL's watchdog aborts the process
itself with its own message.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

# gloo: "Timed out waiting 10000ms for recv operation", TCPStore: "wait timeout after 600000ms", torch's c10d:
# "Timeout", NCCL's watchdog (when it raises rather than aborts): "Watchdog caught collective operation timeout"
_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)
# (seconds, where they come from) of the latest `set_comm_timeout` in this process
_current: Optional[tuple[float, str]] = None


def timeout_of(seconds: float) -> timedelta:
    """`seconds` as the timedelta torch's groups take."""
    return timedelta(seconds=float(seconds))


def member_groups() -> list[dist.ProcessGroup]:
    """Every process group this rank belongs to, the world group first (torch's registry of groups)."""
    if not dist.is_initialized():
        return []
    world = dist.distributed_c10d._get_default_group()
    return [world] + [pg for pg in dist.distributed_c10d._world.pg_map if pg is not world]


def set_comm_timeout(seconds: float, source: str = "") -> int:
    """Make `seconds` the timeout of every collective issued from now on, on every group of this rank (see the module
    docstring); returns how many groups got it (none before the process group exists). `source` (e.g. the config key)
    is kept with the value for an error message (`current_comm_timeout`). Local: no collective."""
    global _current
    _current = (float(seconds), source)
    set_pg_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_pg_timeout is None:  # an older torch: the groups keep the timeouts they were made with
        return 0
    done = 0
    for pg in member_groups():
        try:
            set_pg_timeout(timeout_of(seconds), pg)
            done += 1
        except ValueError:  # not a member after all
            pass
    return done


def current_comm_timeout() -> Optional[tuple[float, str]]:
    """(seconds, source) of the latest `set_comm_timeout` in this process, or None."""
    return _current


def is_comm_timeout(exc: BaseException) -> bool:
    """Whether `exc` is a collective (or the rendezvous store) giving up on another rank after its timeout."""
    return isinstance(exc, RuntimeError) and bool(_TIMEOUT.search(str(exc)))
