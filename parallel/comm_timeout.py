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

The message of a rank that gave up names what it was waiting in (`failed_collective`): the collective and its group,
read from the frames of torch's collective call in the exception's traceback (the `group` argument), with the names
`name_group` gave the project's groups; and what the rank was doing (`set_activity`: the training step, a save).
"""

from __future__ import annotations

import re
from datetime import timedelta

import torch.distributed as dist

# gloo: "Timed out waiting 10000ms for recv operation", TCPStore: "wait timeout after 600000ms", torch's c10d:
# "Timeout", NCCL's watchdog (when it raises rather than aborts): "Watchdog caught collective operation timeout"
_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)
# (seconds, where they come from) of the latest `set_comm_timeout` in this process
_current: tuple[float, str] | None = None
# id(group) -> (group, name) for the groups the project made (parallel/groups.py); the group is kept so its id stays
_names: dict[int, tuple[dist.ProcessGroup, str]] = {}
# what this rank is doing (the trainer: "start-up", "training step 12", "saving step 10"), for the message
_activity = "start-up"


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


def current_comm_timeout() -> tuple[float, str] | None:
    """(seconds, source) of the latest `set_comm_timeout` in this process, or None."""
    return _current


# gloo: "Connection closed by peer [127.0.0.1]:1234", "Connection reset by peer", "Broken pipe"; NCCL: "remote process
# exited or there was a network error"
_PEER_LOST = re.compile(r"connection (closed|reset) by peer|broken pipe|remote process exited", re.IGNORECASE)


def is_peer_lost(exc: BaseException) -> bool:
    """Whether `exc` is a collective failing because another rank's process or host went away (it died)."""
    return isinstance(exc, RuntimeError) and bool(_PEER_LOST.search(str(exc)))


def is_comm_timeout(exc: BaseException) -> bool:
    """Whether `exc` is a collective (or the rendezvous store) giving up on another rank after its timeout."""
    return isinstance(exc, RuntimeError) and bool(_TIMEOUT.search(str(exc)))


def name_group(group: dist.ProcessGroup, name: str) -> None:
    """Remember `name` (e.g. "the expert group of domain(s) cooking") for `group`, for `failed_collective`."""
    _names[id(group)] = (group, name)


def set_activity(activity: str) -> None:
    """What this rank does from now on, named by `failed_collective` (a string assignment: no collective)."""
    global _activity
    _activity = activity


def current_activity() -> str:
    """The latest `set_activity`."""
    return _activity


def describe_group(group: dist.ProcessGroup | None) -> str:
    """A group as a message names it: its name (`name_group`; the world group), and its ranks."""
    world = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    if group is None or group is world or group is dist.group.WORLD:
        return "the world group" + (f" (ranks 0-{dist.get_world_size() - 1})" if world is not None else "")
    try:
        ranks = f"ranks {dist.get_process_group_ranks(group)}"
    except Exception:  # not a member, or torch's registry no longer knows it
        ranks = "ranks unknown"
    named = _names.get(id(group))
    return f"{named[1]} ({ranks})" if named is not None and named[0] is group else f"a group of {ranks}"


def failed_collective(exc: BaseException) -> str | None:
    """ "all_reduce on the data-parallel group (ranks [0, 1])": the innermost torch.distributed collective in `exc`'s
    traceback and the group it was given, or the innermost waiting object with a `collective` property ((op, group):
    the wait of an asynchronous collective, whose call frame is gone); None when there is neither (e.g. a timeout of
    the rendezvous)."""
    found: str | None = None
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        owner = frame.f_locals.get("self")
        if owner is not None and isinstance(
            getattr(type(owner), "collective", None), property
        ):  # waiting on an asynchronous collective
            try:
                op, group = owner.collective
                found = f"{op} on {describe_group(group)}"
            except Exception:  # a description is never worth a second error
                pass
        if frame.f_code.co_filename.endswith("distributed_c10d.py") and not frame.f_code.co_name.startswith(
            "_"
        ):
            args = frame.f_locals
            if "group" in args or "process_group" in args:
                group = args.get("group", args.get("process_group"))
                if group is None or isinstance(group, dist.ProcessGroup):
                    found = f"{frame.f_code.co_name} on {describe_group(group)}"
        tb = tb.tb_next
    return found
