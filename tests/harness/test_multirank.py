"""The harness itself: real processes, real gloo collectives, failures propagate."""

import pytest
import torch
import torch.distributed as dist

from tests.harness.multirank import run_ranks


def _allreduce(rank: int, world: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_one(rank: int, world: int) -> None:
    if rank == 1:
        raise RuntimeError("boom on rank 1")


def test_all_reduce_over_gloo_on_four_processes():
    assert run_ranks(_allreduce, 4) == [10.0] * 4


def test_failure_in_one_rank_is_reported_with_its_traceback():
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_ranks(_fail_on_one, 2, timeout=120)
