"""experiments/ranks.py: the experiments' own multi-process runner (they never import the test harness)."""

import pytest

from experiments.ranks import run_ranks


def _sum_of_ranks(rank: int, world_size: int, scale: int) -> dict:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "world": world_size, "sum": float(t) * scale}


def _fails_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one fails")


def test_ranks_run_over_gloo_and_return_in_rank_order():
    assert run_ranks(_sum_of_ranks, 2, args=(10,), timeout=300) == [
        {"rank": 0, "world": 2, "sum": 10.0},
        {"rank": 1, "world": 2, "sum": 10.0},
    ]


def test_a_failing_rank_fails_the_call_with_its_traceback():
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed:(.|\n)*rank one fails"):
        run_ranks(_fails_on_rank_one, 2, timeout=300)
