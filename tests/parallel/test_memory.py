"""The dry run's traced activation memory (parallel/memory.py) against torch's MemTracker on a real forward+backward,
and experiments/memory_estimate.py (the dry run's estimate against MemTracker under fake tensors) end to end."""

from __future__ import annotations

import pytest
import torch

from model.config import ModelConfig
from model.gpt import GPT
from parallel.activation_recompute import apply_activation_recompute
from parallel.memory import (
    estimate_activations,
    rank_batch,
    rank_domain_ids,
    trace_peak,
    with_training_layers,
)
from parallel.peak_memory import measure_peak

KINDS = {
    "dense": ({"kind": "dense"}, None),
    "demix": ({"kind": "demix", "num_experts": 4}, [1, 2]),  # a rank holding two of four domains
    "gshard": ({"kind": "gshard", "num_experts": 4, "gshard.moe_every": 1}, [0, 1, 2, 3]),
}


def _cfg(kind: str) -> ModelConfig:
    from launcher.config import load_run_config

    ffn = KINDS[kind][0]
    sets = [f"model.ffn.{k}={v}" for k, v in ffn.items()]
    return load_run_config(
        None,
        [
            "model.preset=tiny",
            "model.n_layers=2",
            "model.d_model=64",
            "model.n_heads=4",
            "model.seq_len=128",
            "model.vocab_size=512",
            "model.dropout=0.0",
            *sets,
        ],
    ).model


@pytest.mark.parametrize("recompute", [False, True], ids=["no-recompute", "recompute"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_traced_estimate_matches_memtracker_on_real_tensors(kind, recompute):
    """Fake-tensor trace with planned routing (the dry run's number) vs MemTracker on real tensors and real routing,
    with the layers training runs (GShard: DeepSpeed's MoE layer): within 10 % (fp32, micro-batch 8)."""
    m, experts = _cfg(kind), KINDS[kind][1]
    torch.manual_seed(0)
    model = with_training_layers(GPT(m, expert_ids=experts, init_seed=0), m)
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


def test_gshard_traced_with_the_layer_training_runs():
    """The trace swaps GShard's plain layers for DeepSpeed's MoE layer (parallel/gshard.py), as training does, and
    leaves no fake tensor in DeepSpeed's cached Gumbel sampler (a module global) for a later real run: the sampler's
    scalars are made from host data, which _PlannedRouting runs for real."""
    from torch._subclasses.fake_tensor import FakeTensor

    from parallel.gshard import DistributedGShardFFN
    from parallel.memory import training_model_on_meta

    m = _cfg("gshard")
    model = training_model_on_meta(m, [0, 1, 2, 3])
    assert all(isinstance(b.ffn, DistributedGShardFFN) for b in model.blocks)
    assert all(p.is_meta for p in model.parameters())
    trace_peak(m, 2, [0, 1, 2, 3], recompute=False)
    from deepspeed.moe import sharded_moe

    assert sharded_moe.gumbel_map  # the trace sampled the second expert (policy 'sampling')
    assert not any(
        isinstance(t, FakeTensor)
        for f in sharded_moe.gumbel_map.values()
        for t in (f.__self__.loc, f.__self__.scale)
    )


@pytest.mark.slow  # end to end: four dry runs and their MemTracker measurements (~20 s of CPU)
def test_memory_estimate_benchmark_tiny_end_to_end(tmp_path, monkeypatch):
    """`python -m experiments.memory_estimate --tiny`: for every layout (dense, DEMix with one and with four domains
    per GPU, GShard with every expert on the GPU) and recompute mode, the dry run's estimate is within 10 % of
    MemTracker's measurement (total and activations), traced in seconds, with ZeRO-2 model states within 10 % of
    DeepSpeed's estimator. The check flags a planted wrong estimate."""
    from experiments import memory_estimate as bench

    seen = {}
    real_run = bench.run

    def spy(*args, **kw):
        seen["rows"], seen["states"], fresh = real_run(*args, **kw)
        return seen["rows"], seen["states"], fresh

    monkeypatch.setattr(bench, "run", spy)
    out = tmp_path / "memory_estimate.md"
    assert bench.main(["--tiny", "--out", str(out)]) == 0
    rows, states = seen["rows"], seen["states"]
    assert {(r["layout"], r["recompute"]) for r in rows} == {
        (l.label, c) for l in bench.LAYOUTS for c in (False, True)
    }
    assert {r["method"] for r in rows} == {"traced"} and bench.check(rows) == []
    assert all(r["estimate_s"] > 0 for r in rows)
    for s in states:
        assert s["deepspeed"] == pytest.approx(s["ours"], rel=0.10)
    text = out.read_text()
    assert "Rows outside 10%: none." in text and "**NO**" not in text and "python -m launcher.dryrun" in text

    planted = dict(rows[0], est_act=rows[0]["est_act"] * 1.25)  # the activations a quarter too high
    flagged = bench.check([planted, *rows[1:]])
    assert len(flagged) == 1 and "act = 1.250" in flagged[0]
    planted = dict(rows[1], est_total=rows[1]["mt_total"] * 0.85)  # the total 15 % low
    assert len(bench.check([planted])) == 1
    assert "**NO**" in bench.report([planted], states, 8, 128, ["--tiny"], tiny=True)
    assert bench.check([dict(rows[2], est_act=rows[2]["mt_act"] * 1.05)]) == []  # inside the tolerance


@pytest.mark.parametrize(
    "kind,sets,experts",
    [
        ("dense", [], None),
        ("demix", ["model.ffn.num_experts=4"], (1, 2)),
        ("gshard", ["model.ffn.num_experts=4", "model.ffn.gshard.moe_every=2"], (0, 1, 2, 3)),
    ],
)
def test_a_deep_model_traced_shallow_and_extrapolated_equals_the_whole_trace(kind, sets, experts):
    """The dry run traces 2 and 4 groups of blocks and extrapolates over the depth: equal to tracing all 12 layers
    (both recompute modes; bf16 parameters, and fp32 under bf16 autocast as ZeRO 0 runs), within 0.01 %."""
    from launcher.config import load_run_config
    from parallel.memory import _cached_traces, trace_peaks, traced_depths

    m = load_run_config(
        None,
        [
            "model.preset=tiny",
            "model.n_layers=12",
            "model.d_model=64",
            "model.n_heads=4",
            "model.seq_len=128",
            "model.vocab_size=512",
            f"model.ffn.kind={kind}",
            *sets,
        ],
    ).model
    assert traced_depths(m) is not None and traced_depths(m)[1] < m.n_layers
    for dtypes in ((torch.bfloat16, None), (torch.float32, torch.bfloat16)):
        whole = {r: t["activations"] for r, t in trace_peaks(m, 4, experts, (False, True), *dtypes).items()}
        _cached_traces.cache_clear()
        shallow = _cached_traces(m, 4, experts, *dtypes)
        for r in (False, True):
            assert shallow[r] == pytest.approx(whole[r], rel=1e-4), (dtypes, r, shallow[r], whole[r])


def test_extrapolation_follows_the_peak_from_the_backward_to_the_forward():
    """DEMix with recompute under autocast (ZeRO 0): the backward holds the peak up to 8 layers, the forward (each
    block's cached bf16 weights) beyond, so one line through 2 and 4 layers would miss 12 layers by 6 %; each
    phase extrapolated on its own is exact."""
    from dataclasses import replace

    from launcher.config import load_run_config
    from parallel.memory import _cached_traces, trace_peaks

    m = load_run_config(
        None,
        ["model.preset=gpt3-small", "model.ffn.kind=demix", "model.seq_len=256", "model.ffn.num_experts=4"],
    ).model
    dtypes = (torch.float32, torch.bfloat16)
    shallow = {L: trace_peaks(replace(m, n_layers=L), 2, (1, 2), (True,), *dtypes)[True] for L in (2, 4)}
    whole = trace_peaks(m, 2, (1, 2), (True,), *dtypes)[True]
    assert (
        all(t["backward"] > t["forward"] for t in shallow.values()) and whole["forward"] > whole["backward"]
    )
    one_line = shallow[2]["activations"] + (shallow[4]["activations"] - shallow[2]["activations"]) * 5
    assert one_line < 0.97 * whole["activations"]
    _cached_traces.cache_clear()
    assert _cached_traces(m, 2, (1, 2), *dtypes)[True] == pytest.approx(whole["activations"], rel=1e-4)


def test_models_whose_blocks_do_not_repeat_are_traced_whole():
    from launcher.config import load_run_config
    from parallel.memory import traced_depths

    def model(*sets):
        return load_run_config(None, ["model.preset=tiny", *sets]).model

    assert traced_depths(model("model.n_layers=12", "model.ffn.kind=cse", "model.ffn.num_experts=4")) is None
    assert traced_depths(model("model.n_layers=4")) is None  # shallow already
    assert (
        traced_depths(model("model.n_layers=9", "model.ffn.kind=gshard", "model.ffn.num_experts=4")) is None
    )
    assert traced_depths(model("model.n_layers=24")) == (2, 4)
