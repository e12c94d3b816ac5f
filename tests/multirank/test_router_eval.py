"""The router modes on 2 ranks: each rank computes the router weights of its own blocks from their features and
they are summed back over ranks like the log-likelihoods, so the numbers equal one process's, bit for bit (one
block per batch on both sides), with collectives that reject host tensors as NCCL does."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.multirank import run_ranks
from tests.launcher.evaluation.test_router_modes import save_routed

MODES = ["naive", "router", "router_posterior"]


def _evaluate(rank: int, world: int, ckpt: str, tokens: str) -> dict:
    from launcher.evaluation.evaluate import evaluate_checkpoint

    res = evaluate_checkpoint(
        ckpt,
        tokens,
        device="cpu",
        precision="fp32",
        modes=MODES,
        max_blocks=3,
        batch_size=1,
        progress=False,
        unigram=False,
    ).to_dict()
    return {d: (r["ppl"], r["block_nll"], r["router"]) for d, r in res["domains"].items()}


@pytest.mark.slow
def test_router_modes_on_two_ranks_equal_one_process(random_checkpoint, tiny_tokens, tmp_path):
    routed = save_routed(random_checkpoint(tmp_path / "plain", "demix"), tiny_tokens, tmp_path / "routed")
    one = _evaluate(0, 1, str(routed), str(tiny_tokens))
    two = run_ranks(_evaluate, 2, args=(str(routed), str(tiny_tokens)), device_strict=True)
    assert two[0] == two[1] == one
    assert set(one["cooking"][0]) == set(MODES) and Path(routed).is_dir()
