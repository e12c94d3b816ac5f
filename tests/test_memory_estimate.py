"""The dry run's traced activation memory (parallel/memory.py) against torch's MemTracker on a real forward+backward."""

from __future__ import annotations

import pytest
import torch

from model.config import ModelConfig
from model.gpt import GPT
from parallel.activation_recompute import apply_activation_recompute
from parallel.memory import estimate_activations, measure_peak, rank_batch, rank_domain_ids, trace_peak

KINDS = {
    "dense": ({"kind": "dense"}, None),
    "demix": ({"kind": "demix", "num_experts": 4}, [1, 2]),  # a rank holding two of four domains
    "gshard": ({"kind": "gshard", "num_experts": 4, "gshard.moe_every": 1}, [0, 1, 2, 3]),
}


def _cfg(kind: str) -> ModelConfig:
    from launcher.config import load_run_config

    ffn = KINDS[kind][0]
    sets = [f"model.ffn.{k}={v}" for k, v in ffn.items()]
    return load_run_config(None, ["model.preset=tiny", "model.n_layers=2", "model.d_model=64", "model.n_heads=4",
                                  "model.seq_len=128", "model.vocab_size=512", "model.dropout=0.0", *sets]).model


@pytest.mark.parametrize("recompute", [False, True], ids=["no-recompute", "recompute"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_traced_estimate_matches_memtracker_on_real_tensors(kind, recompute):
    """Fake-tensor trace with planned routing (the dry run's number) vs MemTracker on real tensors and real routing:
    within 10 % (fp32, micro-batch 8)."""
    m, experts = _cfg(kind), KINDS[kind][1]
    torch.manual_seed(0)
    model = GPT(m, expert_ids=experts, init_seed=0)
    if recompute:
        apply_activation_recompute(model)
    measured = measure_peak(model, {**rank_batch(m, 8), **rank_domain_ids(m, 8, experts)})["activations"]
    est = estimate_activations(m, 8, 1, "fp32", experts, stages=(1,))
    assert est.method == "traced", est.reason
    assert est(1, recompute) == pytest.approx(measured, rel=0.10), (est(1, recompute), measured)


def test_lean_counter_equals_memtracker_on_fake_tensors():
    m = _cfg("demix")
    lean = trace_peak(m, 4, [1, 2], recompute=False, dtype=torch.bfloat16)
    tracked = trace_peak(m, 4, [1, 2], recompute=False, dtype=torch.bfloat16, memtracker=True)
    assert lean["total"] == tracked["total"] and lean["activations"] == tracked["activations"]


def test_formula_fallback_says_why():
    m = _cfg("gshard")
    est = estimate_activations(m, 2, 2, "bf16", [0, 1, 2, 3])
    assert est.method == "formula" and "tensor_parallel=2" in est.reason
    est = estimate_activations(m, 2, 1, "bf16", [0])
    assert est.method == "formula" and "1 of 4 experts" in est.reason and "process group" in est.reason
