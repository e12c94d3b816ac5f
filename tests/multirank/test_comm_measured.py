"""Communication measured in the running trainer equals the cost model's byte formulas, per process group.

Real ranks over gloo train two updates (ZeRO 0, fp32) with `logging.log_interval=1`; the trainer records per
update what every collective was handed, per group (parallel/comm_stats.py), in metrics.jsonl. Those bytes
must be exactly what benchmarks/costmodel/'s `allreduce_plan` and `alltoall_volume` say (with the model's
padded vocabulary: the embedding all-reduced is the padded one), plus the one 8-byte all-reduce of the global
gradient norm (parallel/engine.py:global_grad_norm). 16 ranks stand for two nodes of 8.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from tests.harness.multirank import run_ranks

NORM_BYTES = 8  # global_grad_norm: one float64 all-reduced over the world (costmodel.NORM_BYTES)


def _train(rank: int, world: int, tokens: str, kind: str, domains: str, run_dir: str) -> dict:
    from launcher.config import load_run_config
    from launcher.plan import make_plan
    from launcher.train import train
    from launcher.typed import to_dict

    sets = [
        "model.preset=tiny",
        "model.n_layers=2",
        "model.d_model=64",
        "model.n_heads=2",
        "model.seq_len=32",
        f"model.ffn.kind={kind}",
        f"data.path={tokens}",
        "data.tokenizer=gpt2",
        f"data.domains=[{domains}]",
        f"data.mixture={'by_domain' if kind == 'demix' else 'natural'}",
        "train.steps=2",
        "train.micro_batch=2",
        "train.grad_accum=2",
        "parallel.zero_stage=0",
        "logging.wandb_mode=disabled",
        "logging.progress_bar=false",
        "logging.log_interval=1",
        "train.save_interval=0",
        "train.eval_batches=1",
    ]
    plan = make_plan(load_run_config(None, sets, check=False), world)
    train(plan, Path(run_dir), resume="never")
    return to_dict(plan.cfg.model)


def _measured(run_dir: Path) -> list[dict]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if k.startswith("comm/")} for r in recs if r.get("kind") == "train"]


@pytest.mark.parametrize(
    "kind,world,domains",
    [
        ("dense", 8, "cooking,sailing"),
        ("demix", 8, "cooking,sailing"),
        ("gshard", 8, "cooking,sailing"),
        ("dense", 16, "cooking,sailing"),  # two nodes of 8
        ("demix", 16, "cooking,sailing"),  # two nodes of 8, one domain each
        ("gshard", 16, "cooking,sailing"),
    ],
)
def test_measured_bytes_per_group_equal_the_cost_model(tiny_tokens, kind, world, domains):
    from benchmarks import costmodel
    from launcher.typed import from_dict
    from model.config import ModelConfig

    run_dir = Path(tempfile.mkdtemp())
    model = from_dict(
        ModelConfig, run_ranks(_train, world, args=(str(tiny_tokens), kind, domains, str(run_dir)))[0]
    )
    model = replace(model, vocab_size=model.padded_vocab_size())
    opts = costmodel.CostOptions(
        micro_batch=2, grad_accum=2, grad_dtype="fp32", act_dtype="fp32", recompute="none"
    )
    modelled = costmodel.comm_bytes_per_update(model, world, opts)
    plan = costmodel.allreduce_plan(model, world, 4)
    records = _measured(run_dir)
    assert len(records) == 2
    for rec in records:
        # every group and collective, nothing more and nothing less, to the byte
        assert {
            k[len("comm/") : -len("/bytes")]: v for k, v in rec.items() if k.endswith("/bytes")
        } == modelled, rec
        shared_bytes, shared_group = plan[0]
        assert shared_group == world
        assert rec["comm/data_parallel/all_reduce/bytes"] == shared_bytes + NORM_BYTES, rec
        if kind == "demix":  # each domain's experts only inside its domain's group (rank 0's: its own domain)
            expert_bytes, expert_group = plan[1]
            assert rec["comm/expert/all_reduce/bytes"] == expert_bytes, rec
        else:  # GShard's one expert per rank: DeepSpeed all-reduces it over the rank alone (`local`)
            assert not any(k.startswith("comm/expert/") for k in rec)
        if kind == "gshard":
            volume, count = costmodel.alltoall_volume(model, opts)
            assert rec["comm/data_parallel/all_to_all_single/calls"] == count, rec
            assert rec["comm/data_parallel/all_to_all_single/bytes"] == volume * count, rec
        else:
            assert not any("all_to_all" in k for k in rec)
