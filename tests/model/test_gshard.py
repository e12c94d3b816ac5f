"""GShard top-k MoE, single process: the plain layer's maths, its agreement with DeepSpeed's gating, the pure
expert-parallel layout, and the per-domain gating report."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from model.config import FFNConfig, GShardConfig, ModelConfig
from model.ffn import DenseFFN
from model.gshard import GShardFFN, expert_capacity, route_tokens


def _cfg(experts: int, d: int = 8, **gshard) -> ModelConfig:
    g = GShardConfig(**{"min_capacity": 4, **gshard})
    return ModelConfig(
        n_layers=2,
        d_model=d,
        n_heads=2,
        seq_len=16,
        vocab_size=64,
        make_vocab_size_divisible_by=8,
        ffn=FFNConfig(kind="gshard", num_experts=experts, gshard=g),
    )


@pytest.mark.parametrize("training", [True, False])
def test_one_expert_equals_dense_ffn(training: bool) -> None:
    torch.manual_seed(0)
    cfg = _cfg(1)
    moe, dense = GShardFFN(cfg), DenseFFN(cfg)
    dense.mlp.load_state_dict(moe.experts["0"].state_dict())
    moe.train(training), dense.train(training)
    x = torch.randn(3, 5, cfg.d_model)
    out = moe(x)
    assert torch.equal(out.hidden, dense(x).hidden)
    assert float(out.aux_loss) == pytest.approx(cfg.ffn.gshard.aux_loss_weight)  # l_aux = 1 with one expert
    assert float(out.stats["dropped_fraction"]) == 0.0


def test_load_balancing_loss_by_hand() -> None:
    # Identity gate on D = 2 = E: logits are the inputs. Rows: p = (3/4, 1/4), (1/4, 3/4), (3/4, 1/4), (1/2, 1/2).
    cfg = _cfg(2, d=2, aux_loss_weight=0.5)
    moe = GShardFFN(cfg)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.eye(2))
    l3 = math.log(3.0)
    x = torch.tensor([[[l3, 0.0], [0.0, l3], [l3, 0.0], [0.0, 0.0]]])
    out = moe(x)
    # first choices (0, 1, 0, 0): f = (3/4, 1/4); mean probs P = (2.25/4, 1.75/4)
    l_aux = 2 * (2.25 / 4 * 3 / 4 + 1.75 / 4 * 1 / 4)
    assert l_aux == pytest.approx(1.0625)
    assert float(out.stats["l_aux"]) == pytest.approx(l_aux, rel=1e-6)
    assert float(out.aux_loss) == pytest.approx(0.5 * l_aux, rel=1e-6)
    torch.testing.assert_close(out.stats["gate_prob_BE"], torch.tensor([[2.25 / 4, 1.75 / 4]]))
    # top-2 of two experts: every token goes to both, weights p / (p1 + p2) = p; nothing dropped (C = max(4, 4))
    torch.testing.assert_close(out.stats["expert_load_E"], torch.tensor([0.5, 0.5]))
    assert float(out.stats["dropped_fraction"]) == 0.0
    h = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert float(out.stats["router_entropy"]) == pytest.approx((3 * h + math.log(2)) / 4, rel=1e-6)


def test_capacity_rounds_up_to_a_multiple_of_the_tensor_parallel_size() -> None:
    """With tp > 1 each TP rank sends C / tp slots of every expert: C = 11 becomes 12 at tp=2, 12 stays 12."""
    assert expert_capacity(32, 4, 2, 0.6875, 1) == 11
    assert expert_capacity(32, 4, 2, 0.6875, 1, multiple_of=2) == 12
    assert (
        expert_capacity(32, 4, 2, 0.75, 1, multiple_of=2) == 12 and expert_capacity(4, 4, 2, 1.0, 5, 4) == 8
    )
    logits = torch.randn(32, 4)
    one, two = (
        route_tokens(logits, 2, 0.6875, 1, "all"),
        route_tokens(logits, 2, 0.6875, 1, "all", capacity_multiple=2),
    )
    assert (one.capacity, two.capacity) == (11, 12)
    # one more slot per expert, never fewer kept routes
    assert int(two.kept_KS.sum()) >= int(one.kept_KS.sum())
    moe = GShardFFN(_cfg(4, capacity_factor=0.6875, min_capacity=1))
    moe.capacity_multiple = 2
    assert moe.route(torch.randn(32, moe.gate.in_features)).capacity == 12


def test_tokens_over_capacity_are_dropped_and_counted() -> None:
    # Every token prefers expert 0, then expert 1. S = 16, E = 4, K = 2, factor 1: C = ceil(16 / 4 * 2) = 8.
    cfg = _cfg(4, capacity_factor=1.0, second_expert_policy="all")
    moe = GShardFFN(cfg)
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[0, 0], moe.gate.weight[1, 0] = 4.0, 2.0
    x = torch.randn(2, 8, cfg.d_model)
    x[..., 0] = x[..., 0].abs() + 1.0
    out = moe(x)
    assert expert_capacity(16, 4, 2, 1.0, 4) == 8
    y = out.hidden.reshape(16, -1)
    # slots fill in token order: tokens 0-7 keep both routes, tokens 8-15 lose both (zero output, residual passes)
    assert torch.equal(y[8:], torch.zeros_like(y[8:]))
    xs = x.reshape(16, -1)
    p = torch.softmax(xs @ moe.gate.weight.T, dim=1)
    w0, w1 = p[:8, 0] / (p[:8, 0] + p[:8, 1]), p[:8, 1] / (p[:8, 0] + p[:8, 1])
    want = w0[:, None] * moe.experts["0"](xs[:8]) + w1[:, None] * moe.experts["1"](xs[:8])
    torch.testing.assert_close(y[:8], want)
    assert float(out.stats["dropped_fraction"]) == 0.5  # 16 of 32 routes
    torch.testing.assert_close(out.stats["expert_load_E"], torch.tensor([0.5, 0.5, 0.0, 0.0]))
    # eval uses eval_capacity_factor (2.0): C = 16, nothing dropped
    moe.eval()
    assert float(moe(x).stats["dropped_fraction"]) == 0.0


@pytest.mark.parametrize("policy", ["all", "sampling"])
@pytest.mark.parametrize("tokens,experts,factor", [(32, 4, 1.0), (40, 8, 0.5), (16, 4, 2.0)])
def test_routing_equals_deepspeed_top2gating(policy: str, tokens: int, experts: int, factor: float) -> None:
    """Same experts, slots, kept routes, weights, counts and l_aux as DeepSpeed's top2gating (same seed)."""
    from deepspeed.moe.sharded_moe import top2gating

    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(tokens)) * 2
    torch.manual_seed(1)
    r = route_tokens(logits.clone(), 2, factor, 4, policy, training=True)
    torch.manual_seed(1)
    l_aux, cap, _, idx, loc, gates, counts = top2gating(
        logits.clone(), factor, 4, True, None, policy == "sampling", sparse_routes=True
    )
    assert int(cap) == r.capacity
    assert (
        torch.equal(l_aux, r.l_aux) and torch.equal(counts, r.counts_E) and torch.equal(gates, r.weights_KS)
    )
    assert torch.equal(idx.long(), torch.where(r.kept_KS, r.experts_KS, -1))
    assert torch.equal(loc.long()[r.kept_KS], r.slots_KS[r.kept_KS])


def test_random_policy() -> None:
    logits = torch.tensor([[5.0, 0.0, -9.0], [0.0, 0.0, -9.0]] * 50)
    r_eval = route_tokens(logits, 2, 2.0, 4, "random", training=False)
    assert bool(r_eval.kept_KS[1].all())  # eval: the second expert always
    torch.manual_seed(0)
    r = route_tokens(logits, 2, 2.0, 4, "random", training=True)
    # 2 g2 ~ 0.013 for the confident rows, 1 for the tied ones
    assert r.kept_KS[1, 0::2].float().mean() < 0.1 and bool(r.kept_KS[1, 1::2].all())
    assert int(r.counts_E.sum()) == 100 + int(r.kept_KS[1].sum())


def test_gpt_gshard_layers_and_stats() -> None:
    from model.gpt import GPT

    cfg = replace(_cfg(4), n_layers=4)
    assert cfg.moe_layer_ids() == [1, 3]
    model = GPT(cfg, init_seed=0)
    assert "blocks.1.ffn.experts.3.fc1.weight" in model.state_dict()
    assert model.blocks[1].ffn.gate.weight.shape == (4, cfg.d_model) and model.blocks[1].ffn.gate.bias is None
    out = model(torch.randint(0, 64, (2, 16)), targets_BT=torch.randint(0, 64, (2, 16)))
    assert out.ffn_stats["layer1/gate_prob_BE"].shape == (2, 4)
    assert out.ffn_stats["layer3/expert_load_E"].shape == (4,)
    (out.loss + out.aux_loss).backward()
    assert model.blocks[1].ffn.gate.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="needs all of them"):
        GPT(cfg, expert_ids=[0, 1], init_seed=0)(torch.randint(0, 64, (1, 4)))


def test_layout() -> None:
    from parallel.gshard import gshard_layout, gshard_layout_problems, resolve_num_experts

    cfg = _cfg(0)
    assert resolve_num_experts(cfg, 4) == 4
    lay = [gshard_layout(cfg, 4, r) for r in range(4)]  # one expert per rank, ep = dp
    assert [l.local_experts for l in lay] == [(0,), (1,), (2,), (3,)] and lay[0].ep_ranks == (0, 1, 2, 3)
    assert lay[0].edp_ranks == (0,) and lay[0].group_name == "ep_size_4"
    two = [gshard_layout(replace(cfg, ffn=replace(cfg.ffn, num_experts=2)), 4, r) for r in range(4)]
    # DeepSpeed's E+D: ep groups (0,1), (2,3)
    assert [l.local_experts for l in two] == [
        (0,),
        (1,),
        (0,),
        (1,),
    ]
    assert two[0].edp_ranks == (0, 2) and two[1].ep_ranks == (0, 1)
    d_e = [gshard_layout(replace(cfg, ffn=replace(cfg.ffn, num_experts=2)), 4, r, True) for r in range(4)]
    assert [l.local_experts for l in d_e] == [(0,), (0,), (1,), (1,)] and d_e[0].edp_ranks == (0, 1)
    per2 = replace(cfg, ffn=replace(cfg.ffn, gshard=replace(cfg.ffn.gshard, experts_per_rank=2)))
    assert [gshard_layout(per2, 2, r).local_experts for r in range(2)] == [(0, 1), (2, 3)]
    # tensor parallelism: experts stay whole, one per GPU, and the all-to-all group spans the TP lanes
    assert gshard_layout_problems(cfg, 4, 2) == [] and resolve_num_experts(cfg, 4) == 4
    tp = [gshard_layout(cfg, 4, r, tensor_parallel=2) for r in range(4)]
    assert [l.local_experts for l in tp] == [(0,), (1,), (2,), (3,)] and tp[1].ep_ranks == (0, 1, 2, 3)
    assert tp[0].tensor_parallel == 2
    bad = replace(cfg, ffn=replace(cfg.ffn, num_experts=3))
    assert "does not divide the 4 ranks" in gshard_layout_problems(bad, 4)[0]
    assert "does not divide the 4 ranks" in gshard_layout_problems(bad, 4, 2)[0]
    with pytest.raises(ValueError, match="does not divide"):
        gshard_layout(bad, 4, 0)


def test_gating_report(tmp_path) -> None:
    from launcher.evaluation.gating import gating_matrix, write_gating_report
    from model.gpt import GPT

    cfg = replace(_cfg(4), n_layers=4)
    model = GPT(cfg, init_seed=0)
    g = torch.Generator().manual_seed(0)
    batches = {
        d: [{"tokens_BT": torch.randint(lo, lo + 32, (2, 16), generator=g)} for _ in range(2)]
        for d, lo in (("web", 0), ("code", 32))
    }
    m = gating_matrix(model, batches)
    assert (
        m["domains"] == ["web", "code"]
        and m["num_experts"] == 4
        and list(m["layers"]) == ["layer1", "layer3"]
    )
    rows = torch.tensor(m["layers"]["layer1"])
    assert rows.shape == (2, 4) and torch.allclose(rows.sum(1), torch.ones(2, dtype=rows.dtype))
    paths = write_gating_report(m, tmp_path)
    report = json.loads(paths["json"].read_text())
    assert len(report["row_entropy"]["layer3"]) == 2 and paths["png"].stat().st_size > 1000


def test_gating_cli_on_a_consolidated_checkpoint(tmp_path, tiny_tokens) -> None:
    from launcher.checkpoint import save_consolidated
    from launcher.config import load_run_config
    from launcher.evaluation.gating import main
    from model.gpt import GPT

    domains = sorted(json.loads((tiny_tokens / "gpt2" / "manifest.json").read_text())["counts"])[:2]
    cfg = load_run_config(
        None,
        [
            "model.preset=tiny",
            "model.n_layers=2",
            "model.seq_len=32",
            "model.ffn.kind=gshard",
            "model.ffn.num_experts=4",
            "data.tokenizer=gpt2",
        ],
    )
    save_consolidated(tmp_path / "ckpt", GPT(cfg.model, init_seed=0).state_dict(), cfg, domains)
    assert (
        main(
            [
                str(tmp_path / "ckpt"),
                "--data",
                str(tiny_tokens),
                "--out",
                str(tmp_path / "out"),
                "--batches",
                "1",
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "out" / "gating.json").read_text())
    assert report["domains"] == domains and len(report["layers"]["layer1"]) == 2
