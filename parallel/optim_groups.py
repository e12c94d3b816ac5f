"""The optimizer's parameter groups: decay and no-decay, expert parameters in size-limited chunks, and the same
number of groups on every rank (ZeRO 1/2 run one collective over the data-parallel group per group).

DeepSpeed's own split (`split_params_into_different_moe_groups_for_optimizer`) gives a rank as many expert groups
as its experts need; here each rank counts its chunks with DeepSpeed's rule, the ranks agree on one count, and
each rank splits or merges its chunks to reach it (`optimizer_param_groups`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel.demix_sync import is_expert_param


def _split_max_numel() -> int | None:
    """DeepSpeed's threshold for splitting expert parameters into optimizer groups (its default argument)."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

    return split.__defaults__[0] if split.__defaults__ else None


def _greedy_chunks(params: list[nn.Parameter], max_numel: int | None) -> list[list[nn.Parameter]]:
    """DeepSpeed's split: consecutive parameters while the running size stays <= max_numel."""
    chunks: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        if chunks and (max_numel is None or size + p.numel() <= max_numel):
            chunks[-1].append(p)
            size += p.numel()
        else:
            chunks.append([p])
            size = p.numel()
    return chunks


def _refine(chunks: list[list[nn.Parameter]], count: int) -> list[list[nn.Parameter]]:
    """Split the largest chunks in two (by size, keeping order) until there are `count` of them."""
    chunks = [list(c) for c in chunks]
    while len(chunks) < count:
        splittable = [i for i, c in enumerate(chunks) if len(c) > 1]
        if not splittable:
            raise ValueError(
                f"cannot split {sum(map(len, chunks))} expert tensors into {count} optimizer groups"
            )
        i = max(splittable, key=lambda j: sum(p.numel() for p in chunks[j]))
        c, half, acc, cut = chunks[i], sum(p.numel() for p in chunks[i]) / 2, 0, 1
        for k, p in enumerate(c[:-1]):
            acc += p.numel()
            if acc >= half:
                cut = k + 1
                break
        else:
            cut = len(c) - 1
        chunks[i : i + 1] = [c[:cut], c[cut:]]
    return chunks


def _merge(chunks: list[list[nn.Parameter]], count: int) -> list[list[nn.Parameter]]:
    """Merge the smallest adjacent pair of chunks until there are `count` of them (order kept)."""
    chunks = [list(c) for c in chunks]
    size = [sum(p.numel() for p in c) for c in chunks]
    while len(chunks) > count:
        i = min(range(len(chunks) - 1), key=lambda j: size[j] + size[j + 1])
        chunks[i : i + 2] = [chunks[i] + chunks[i + 1]]
        size[i : i + 2] = [size[i] + size[i + 1]]
    return chunks


def _agree_on_chunks(chunked: list[list[list[nn.Parameter]]]) -> list[int]:
    """How many optimizer groups each base group's expert parameters get, the same on every rank: the most
    chunks any rank's DeepSpeed split makes, but never more than the fewest tensors any rank holds (each
    group needs one). One small all-reduce, on the training device."""
    counts = [len(c) for c in chunked]
    tensors = [sum(map(len, c)) for c in chunked]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from deepspeed.accelerator import get_accelerator

        t = torch.tensor(
            counts + [-n for n in tensors], dtype=torch.int64, device=get_accelerator().current_device_name()
        )
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        values = t.tolist()
        counts, tensors = values[: len(counts)], [-v for v in values[len(counts) :]]
    return [min(c, n) for c, n in zip(counts, tensors)]


def _exactly(chunks: list[list[nn.Parameter]], count: int) -> list[list[nn.Parameter]]:
    """`chunks` made into `count` chunks: split further (sizes stay under DeepSpeed's threshold) or merged."""
    return _refine(chunks, count) if len(chunks) <= count else _merge(chunks, count)


def optimizer_param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices and embeddings, not biases or norms; expert parameters in their own groups, split by size
    as DeepSpeed does, into the *same number of groups on every rank*.

    DeepSpeed splits a rank's expert parameters into groups of at most ~179M elements
    (`split_params_into_different_moe_groups_for_optimizer`). A rank holding two experts would get more
    groups than a rank holding one, and ZeRO 1/2 run one norm all-reduce over the whole data-parallel group
    per group: unequal counts deadlock. So each base group's expert chunks are counted with DeepSpeed's rule,
    the ranks agree on the largest count (a collective: every rank calls this), and ranks with fewer chunks
    split theirs further. (Should a rank hold fewer tensors than that, the count drops to its tensor count
    and larger ranks merge chunks past the threshold: only with a threshold far below a layer's size.) Group
    order is the same everywhere: shared decay, shared no-decay, then the expert chunks of each.
    """
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"name": "decay", "params": decay, "weight_decay": weight_decay},
        {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
    ]
    if any(is_expert_param(p) for p in decay + no_decay):
        shared = split_params_into_different_moe_groups_for_optimizer(groups, max_group_size=None)
        expert_groups = [g for g in shared if g.get("moe")]
        shared = [g for g in shared if not g.get("moe")]
        limit = _split_max_numel()
        chunked = [_greedy_chunks(g["params"], limit) for g in expert_groups]
        counts = _agree_on_chunks(chunked)
        groups = shared + [
            {**g, "params": part}
            for g, c, n in zip(expert_groups, chunked, counts)
            for part in _exactly(c, n)
        ]
    # Drop empty groups (e.g. all shared parameters frozen for DEMix-DAPT): DeepSpeed drops them from the
    # optimizer, and the LR scheduler must see the same groups.
    return [g for g in groups if g["params"]]
