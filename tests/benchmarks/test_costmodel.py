"""The cluster cost model (benchmarks/costmodel/): collective formulas on hand-computed numbers,
communication plans per architecture, Dense-only fitting, the GShard terms beyond all-to-all volume
(einsum FLOPs and routing bytes checked against direct counts), memory, cluster YAML validation, presets,
and the --paper output."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import costmodel as cm
from launcher.config import load_run_config
from launcher.typed import ConfigError
from model import accounting as acc
from model.config import ModelConfig

# A hand-sized cluster, independent of the shipped presets: B_nvl = 150 GB/s, B_node = 100 Gb/s.
CLUSTER = cm.ClusterSpec(
    name="test",
    device="v100",
    gpus_per_node=8,
    nvlink_gbytes_per_s=150.0,
    nvlink_latency_us=5.0,
    internode_gbits_per_s_per_node=100.0,
    internode_latency_us=10.0,
)


def preset(name: str, kind: str, num_experts: int = 0) -> ModelConfig:
    return load_run_config(
        None, [f"model.preset={name}", f"model.ffn.kind={kind}", f"model.ffn.num_experts={num_experts}"]
    ).model


# ---------------------------------------------------------------------------- collectives


def test_ring_allreduce_hand_numbers() -> None:
    # 2·3/4 · 1e9 / 1e11 = 0.015 s; latency 2·3·10 µs = 60 µs per message.
    assert cm.ring_allreduce_seconds(1e9, 4, 1e11, 1e-5) == pytest.approx(0.015 + 6e-5)
    assert cm.ring_allreduce_seconds(1e9, 4, 1e11, 1e-5, messages=10) == pytest.approx(0.015 + 6e-4)
    assert cm.ring_allreduce_seconds(1e9, 1, 1e11, 1e-5) == 0.0


def test_allreduce_intra_node_is_a_nvlink_ring() -> None:
    s = 3e8  # one bucket of this size: one message
    want = 2 * 3 / 4 * s / 150e9 + 2 * 3 * 5e-6
    assert cm.allreduce_seconds(s, 4, CLUSTER, bucket_bytes=s) == pytest.approx(want)


def test_allreduce_hierarchical_hand_numbers() -> None:
    # 16 ranks = 2 nodes: 2·7/8·S/150e9 + 2·1/2·S/12.5e9 + (2·7·5 µs + 2·1·10 µs)
    s = 1.2e9
    want = 2 * 7 / 8 * s / 150e9 + s / 12.5e9 + 2 * 7 * 5e-6 + 2 * 10e-6
    assert want == pytest.approx(0.014 + 0.096 + 9e-5)
    assert cm.allreduce_seconds(s, 16, CLUSTER, bucket_bytes=s) == pytest.approx(want)
    assert cm.allreduce_internode_bytes(s, 16, 8) == pytest.approx(s)
    assert cm.allreduce_internode_bytes(s, 8, 8) == 0.0


def test_gshard_alltoall_hand_example() -> None:
    cfg = preset("gpt3-small", "gshard", 32)  # 12 layers, d = 768, top-2 every other layer, c = 1
    volume, count = cm.alltoall_volume(cfg, cm.CostOptions())
    assert volume == 1.0 * 2 * (2 * 1024) * 768 * 2 == 6_291_456
    assert count == 6 * 6 * 8  # 6 MoE layers x (fwd + bwd + recompute) x 2 x 8 micro-batches
    assert cm.alltoall_volume(cfg, cm.CostOptions(recompute="none"))[1] == 6 * 4 * 8
    # 32 experts on 4 nodes: off-node 8·24/32·V per node over 12.5 GB/s dominates NVLink's 7/32·V/150e9.
    want = 8 * 24 / 32 * volume / 12.5e9 + 7 * 5e-6 + 24 * 10e-6
    assert cm.alltoall_seconds(volume, 32, CLUSTER) == pytest.approx(want)
    assert cm.alltoall_internode_bytes(volume, 32, 8) == pytest.approx(6 * volume)
    padded = replace(cfg, ffn=replace(cfg.ffn, gshard=replace(cfg.ffn.gshard, capacity_factor=1.25)))
    assert cm.alltoall_volume(padded, cm.CostOptions())[0] == pytest.approx(1.25 * volume)
    assert cm.alltoall_volume(preset("gpt3-small", "dense"), cm.CostOptions()) == (0.0, 0)


# ---------------------------------------------------------------------------- plans per arch


def test_plans_per_architecture() -> None:
    dense, demix, gshard = (
        preset("gpt3-small", k, n) for k, n in (("dense", 0), ("demix", 8), ("gshard", 32))
    )
    ((d_bytes, d_group),) = cm.allreduce_plan(dense, 32, 2)
    assert d_group == 32
    (shared, s_group), (expert, e_group) = cm.allreduce_plan(demix, 32, 2)
    assert (s_group, e_group) == (32, 4)
    assert shared + expert == d_bytes  # the paper's footnote: DEMix's bandwidth cost (bytes/rank) = Dense's
    # one expert per GPU: its expert-data-parallel group is the rank alone (an all-reduce that moves nothing)
    g = acc.param_counts(gshard)
    assert cm.allreduce_plan(gshard, 32, 4) == [(g.shared * 4, 32), (g.expert // 32 * 4, 1)]


def test_demix_communicates_less_than_dense_when_domains_fit_in_nodes() -> None:
    for size, gpus in (("gpt3-small", 32), ("gpt3-medium", 64)):  # n/8 = 4, 8 <= 8 GPUs per node
        eff = cm.Efficiency(0.4, 0.0)
        dense = cm.predict(preset(size, "dense"), gpus, CLUSTER, eff)
        demix = cm.predict(preset(size, "demix", 8), gpus, CLUSTER, eff)
        assert demix.internode_bytes < dense.internode_bytes
        assert demix.allreduce_s < dense.allreduce_s
        assert demix.tflops_per_gpu > dense.tflops_per_gpu
        assert demix.compute_s == dense.compute_s


def test_overlap_hides_allreduce_only() -> None:
    cfg, eff = preset("gpt3-small", "gshard", 32), cm.Efficiency(0.4, 0.0)
    none = cm.predict(cfg, 32, CLUSTER, eff)
    full = cm.predict(cfg, 32, CLUSTER, eff, cm.CostOptions(overlap=1.0))
    assert full.step_s == pytest.approx(none.compute_s + none.alltoall_s + none.gshard_s)
    assert none.step_s == pytest.approx(none.compute_s + none.allreduce_s + none.alltoall_s + none.gshard_s)


def test_comm_bytes_per_update_is_the_plan_under_the_trainers_group_names() -> None:
    opts = cm.CostOptions(micro_batch=2, grad_accum=8, grad_dtype="fp16", recompute="none")
    dense, demix = preset("gpt3-small", "dense"), preset("gpt3-small", "demix", 8)
    ((d_bytes, _),) = cm.allreduce_plan(dense, 32, 2)
    assert cm.comm_bytes_per_update(dense, 32, opts) == {"data_parallel/all_reduce": d_bytes + cm.NORM_BYTES}
    (shared, _), (expert, _) = cm.allreduce_plan(demix, 32, 2)
    assert cm.comm_bytes_per_update(demix, 32, opts) == {
        "data_parallel/all_reduce": shared + cm.NORM_BYTES,
        "expert/all_reduce": expert,
    }
    # GShard with 8 experts on 32 GPUs: DeepSpeed's groups as rank 0 sees them (experts 0..7, replicas 0,8,16,24)
    gshard = preset("gpt3-small", "gshard", 8)
    volume, count = cm.alltoall_volume(gshard, opts)
    got = cm.comm_bytes_per_update(gshard, 32, opts)
    assert got == {
        "data_parallel/all_reduce": acc.param_counts(gshard).shared * 2 + cm.NORM_BYTES,
        "ranks_0_8_16_24/all_reduce": acc.param_counts(gshard).expert // 8 * 2,
        "ranks_0_1_2_3_4_5_6_7/all_to_all_single": volume * count,
    }
    one_per_gpu = cm.comm_bytes_per_update(preset("gpt3-small", "gshard", 32), 32, opts)
    assert set(one_per_gpu) == {
        "data_parallel/all_reduce",
        "local/all_reduce",
        "data_parallel/all_to_all_single",
    }
    alone = cm.comm_bytes_per_update(preset("gpt3-small", "gshard", 1), 1, opts)  # one rank: no all-to-all
    assert alone == {
        "data_parallel/all_reduce": acc.param_counts(preset("gpt3-small", "gshard", 1)).total * 2 + 8
    }


def test_demix_with_more_domains_than_ranks() -> None:
    """8 domains on 2 ranks: 4 experts per rank, each domain's group that one rank (all-reduced over a group of
    one, as DeepSpeed does: bytes, no network time); on one rank every all-reduce is data_parallel's."""
    demix, opts = preset("gpt3-small", "demix", 8), cm.CostOptions(grad_dtype="fp32")
    params = acc.param_counts(demix)
    per_domain = params.expert // params.num_experts
    assert cm.allreduce_plan(demix, 2, 4) == [(params.shared * 4, 2), (per_domain * 4 * 4, 1)]
    assert cm.comm_bytes_per_update(demix, 2, opts) == {
        "data_parallel/all_reduce": params.shared * 4 + cm.NORM_BYTES,
        "expert/all_reduce": per_domain * 4 * 4,
    }
    assert cm.comm_bytes_per_update(demix, 1, opts) == {
        "data_parallel/all_reduce": (params.shared + 8 * per_domain) * 4 + cm.NORM_BYTES
    }
    pred = cm.predict(demix, 2, CLUSTER, cm.Efficiency(0.4, 0.0), opts)
    assert pred.allreduce_s == pytest.approx(cm.allreduce_seconds(params.shared * 4, 2, CLUSTER, 25 * 2**20))
    with pytest.raises(ValueError, match="3 GPUs cannot be split evenly among 8 domains"):
        cm.allreduce_plan(demix, 3, 4)


def test_predict_prices_measured_bytes_when_given() -> None:
    cfg, eff = preset("gpt3-small", "gshard", 8), cm.Efficiency(0.4, 0.0)
    opts = cm.CostOptions(recompute="none")
    formulas = cm.predict(cfg, 32, CLUSTER, eff, opts)
    same = cm.predict(cfg, 32, CLUSTER, eff, opts, measured_bytes=cm.comm_bytes_per_update(cfg, 32, opts))
    assert (formulas.bytes_from, same.bytes_from) == ("formulas", "measured")
    assert same.allreduce_s == pytest.approx(formulas.allreduce_s, rel=1e-9)
    assert same.alltoall_s == pytest.approx(formulas.alltoall_s) and same.step_s == pytest.approx(
        formulas.step_s, rel=1e-9
    )
    doubled = cm.predict(
        cfg,
        32,
        CLUSTER,
        eff,
        opts,
        measured_bytes={k: 2 * v for k, v in cm.comm_bytes_per_update(cfg, 32, opts).items()},
    )
    assert (
        doubled.allreduce_s > 1.5 * formulas.allreduce_s
        and doubled.alltoall_bytes == 2 * formulas.alltoall_bytes
    )
    with pytest.raises(ValueError, match="tensor_parallel/all_reduce"):
        cm.predict(cfg, 32, CLUSTER, eff, opts, measured_bytes={"tensor_parallel/all_reduce": 1.0})


# ---------------------------------------------------------------------------- fitting


def test_fit_uses_dense_rows_only() -> None:
    points = cm.paper_points()
    assert len(points) == 12
    for form in cm.EFFICIENCY_FORMS:
        base = cm.fit_efficiency(points, CLUSTER, form=form)
        scrambled = [
            p if p.arch == "dense" else replace(p, measured_tflops_per_gpu=p.measured_tflops_per_gpu * 3 + 1)
            for p in points
        ]
        assert cm.fit_efficiency(scrambled, CLUSTER, form=form) == base
        dense_changed = [
            replace(p, measured_tflops_per_gpu=p.measured_tflops_per_gpu * 1.1) if p.arch == "dense" else p
            for p in points
        ]
        assert cm.fit_efficiency(dense_changed, CLUSTER, form=form) != base


def test_fit_recovers_a_known_efficiency() -> None:
    truth = cm.Efficiency(0.8, 1500.0)
    points = [p for p in cm.paper_points() if p.arch == "dense"]
    synthetic = [
        replace(p, measured_tflops_per_gpu=cm.predict(p.cfg, p.gpus, CLUSTER, truth).tflops_per_gpu)
        for p in points
    ]
    fit = cm.fit_efficiency(synthetic, CLUSTER)
    assert fit.e_max == pytest.approx(0.8, rel=1e-9)
    assert fit.h_half == pytest.approx(1500.0, rel=1e-6)


# ---------------------------------------------------------------------------- cluster YAML


def test_every_preset_loads() -> None:
    names = cm.cluster_presets()
    assert {"v100-dgx1", "v100-dgx1-4ib", "a100-dgx", "h100-dgx"} <= set(names)
    for name in names:
        spec = cm.load_cluster(name)
        assert spec.name == name and spec.peak > 0 and spec.problems() == []


def test_cluster_yaml_reports_every_problem(tmp_path: Path) -> None:
    raw = yaml.safe_load((cm.CLUSTER_DIR / "v100-dgx1.yaml").read_text())
    raw.update(gpus_per_node="eight", nvlink_gbytes_per_s=True, infiniband="edr")
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as err:
        cm.load_cluster(path)
    text = str(err.value)
    assert len(err.value.problems) == 3
    assert "gpus_per_node" in text and "nvlink_gbytes_per_s" in text and "infiniband: unknown key" in text


def test_cluster_yaml_semantic_checks() -> None:
    raw = yaml.safe_load((cm.CLUSTER_DIR / "v100-dgx1.yaml").read_text())
    with pytest.raises(ConfigError) as err:
        cm.cluster_from_dict(
            {
                **raw,
                "gpus_per_node": 0,
                "internode_gbits_per_s_per_node": -1,
                "device": "tpu9",
                "efficiency_max": 0.5,
            }
        )
    assert len(err.value.problems) == 4
    with pytest.raises(ConfigError, match="required"):
        cm.cluster_from_dict({"name": "x"})
    custom = cm.cluster_from_dict(
        {**raw, "device": "mystery", "peak_tflops": 100.0, "efficiency_max": 0.5, "efficiency_h_half": 0.0}
    )
    assert custom.peak == 100.0
    assert cm.cluster_efficiency(custom, cm.CostOptions()).at(1024) == 0.5


# ---------------------------------------------------------------------------- CLI


def test_paper_cli_writes_12_rows_with_errors(tmp_path: Path) -> None:
    assert cm.main(["--paper", "--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "costmodel_paper.json").read_text())
    assert data["command"] == f"python -m benchmarks.costmodel --paper --out-dir {tmp_path}"
    assert data["fitted"]["fitted_on_archs"] == ["dense"] and data["fitted"]["e_max"] > 0
    rows = data["rows"]
    assert len(rows) == 12
    assert {(r["size"], r["arch"]) for r in rows} == {
        (s, a) for s in ("125M", "350M", "760M", "1.3B") for a in cm.ARCHS
    }
    for r in rows:
        assert r["rel_err"] == pytest.approx(
            (r["tflops_per_gpu"] - r["paper_tflops_per_gpu"]) / r["paper_tflops_per_gpu"]
        )
        assert 0 <= r["comm_share"] < 1
    assert max(abs(r["rel_err"]) for r in rows if r["arch"] == "dense") < 0.02  # 2 constants, 4 Dense points
    md = (tmp_path / "costmodel_paper.md").read_text()
    assert md.count("| 125M |") == 3 + 1 and "Dense rows only" in md  # main table + GShard before/after
    assert "## GShard: before / after" in md and "not explained" in md
    ba = data["gshard_before_after"]
    assert [r["size"] for r in ba] == ["125M", "350M", "760M", "1.3B"]
    for r in ba:  # the earlier, all-to-all-only model's GShard errors are reproduced by "before"
        old = {"125M": -0.128, "350M": -0.150, "760M": -0.096, "1.3B": 0.666}[r["size"]]
        assert r["before_rel_err"] == pytest.approx(old, abs=6e-4)
        assert r["after_step_s"] > r["before_step_s"]


def test_single_configuration_cli(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert (
        cm.main(
            ["--preset", "gpt3-small", "--arch", "demix", "--gpus", "16", "--cluster", "a100-dgx", "--json"]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["arch"] == "demix" and out["gpus"] == 16 and out["tflops_per_gpu"] > 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\n")
    assert cm.main(["--preset", "gpt3-small", "--cluster-file", str(bad)]) == 2
    assert "required" in capsys.readouterr().err


# ---------------------------------------------------------------------------- GShard terms


class _ByteCounter(TorchDispatchMode):
    """Bytes read + written by every non-view aten op, counting only tensors of exactly `n` elements."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.total = n, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if not func.is_view and func._schema.name != "aten::detach":
            tensors = [
                t
                for t in tree_flatten((args, kwargs))[0] + tree_flatten(out)[0]
                if isinstance(t, torch.Tensor)
            ]
            self.total += sum(t.numel() * t.element_size() for t in tensors if t.numel() == self.n)
        return out


def _fairseq_routing(S: int, E: int, M: int):  # type: ignore[no-untyped-def]
    """The routing tensors of fairseq's top2gating (fp32) and MOELayer, on a tiny random example."""
    torch.manual_seed(0)
    C = cm.gshard_capacity(S, E, 2)
    gates = torch.rand(S, E).softmax(-1).requires_grad_()
    m1 = torch.nn.functional.one_hot(torch.randint(0, E, (S,)), E).float()
    m2 = torch.nn.functional.one_hot(torch.randint(0, E, (S,)), E).float()
    l1 = torch.nn.functional.one_hot(torch.randint(0, C, (S,)), C).float()
    l2 = torch.nn.functional.one_hot(torch.randint(0, C, (S,)), C).float()
    return C, gates, (m1, m2, l1, l2), torch.randn(S, M, requires_grad=True)


def test_gshard_capacity_is_fairseqs() -> None:
    assert cm.gshard_capacity(2048, 32, 2) == 128  # 2·ceil(S/E): E·C = 2S exactly when E divides S
    assert cm.gshard_capacity(2048, 128, 2) == 32
    assert cm.gshard_capacity(2048, 3, 2) == 2 * 683  # rounding up: 2 padded rows
    assert cm.gshard_capacity(2048, 32, 2, 1.25) == 160


@pytest.mark.parametrize("forward_passes", [1, 2])
def test_dispatch_combine_flops_match_a_direct_count(forward_passes: int) -> None:
    S, E, M = 48, 4, 16
    C, gates, (m1, m2, l1, l2), x = _fairseq_routing(S, E, M)
    combine = torch.bmm((gates * m1).unsqueeze(-1), l1.unsqueeze(1)) + torch.bmm(
        (gates * m2).unsqueeze(-1), l2.unsqueeze(1)
    )
    dispatch_mask = combine.bool().float().permute(1, 2, 0)  # S,E,C -> E,C,S
    # its gradient is counted; passing it on to the gates is gating work
    combine = combine.detach().requires_grad_()

    def layer() -> torch.Tensor:
        dispatched = torch.mm(dispatch_mask.reshape(E * C, S), x)  # einsum sec,sm->ecm
        # the expert (no matmul here: only the routing counts)
        expert_out = torch.nn.functional.gelu(dispatched)
        return combine.view(S, E * C).mm(expert_out)  # einsum sec,ecm->sm

    with FlopCounterMode(display=False) as counter:
        if forward_passes == 2:  # activation checkpointing: a forward without grad, then the recomputed one
            with torch.no_grad():
                layer()
        layer().sum().backward()
    assert counter.get_total_flops() == cm.dispatch_combine_flops(S, E, C, M, forward_passes)
    assert cm.dispatch_combine_flops(S, E, C, M, forward_passes) == 2 * S * E * C * M * (
        2 * forward_passes + 3
    )


def test_routing_bytes_match_a_direct_count() -> None:
    S, E = 64, 4
    C, gates, (m1, m2, l1, l2), _ = _fairseq_routing(S, E, 8)
    N = S * E * C
    g1, g2 = gates * m1, gates * m2
    with _ByteCounter(N) as gate_call:  # top2gating's (s, e, c) part, --moe-gating-use-fp32
        combine = torch.bmm(g1.unsqueeze(-1), l1.unsqueeze(1)) + torch.bmm(g2.unsqueeze(-1), l2.unsqueeze(1))
        dispatch_mask = combine.bool()
        combine16 = combine.to(torch.float16)
    with _ByteCounter(N) as layer:  # MOELayer: dispatch_mask.to(input.dtype).permute(1, 2, 0)
        dispatch_mask.to(torch.float16).permute(1, 2, 0)
    grad = torch.ones_like(combine16)
    with _ByteCounter(N) as backward:
        combine16.backward(grad)
    assert gate_call.total == cm.SEC_BYTES_PER_GATE_CALL * N == 31 * N
    assert layer.total == cm.SEC_BYTES_PER_FORWARD * N
    assert backward.total == cm.SEC_BYTES_BACKWARD * N
    se = S * E * (cm.SE_BYTES_PER_GATE_CALL * 2 * 1 + cm.SE_BYTES_BACKWARD)
    assert cm.gating_bytes(S, E, C, 1, 2) == N * (31 * 2 + 3 + 14) + se


def _gshard_points() -> list:
    return [p for p in cm.paper_points() if p.arch == "gshard"]


def test_gshard_terms_non_negative_and_zero_elsewhere() -> None:
    eff = cm.Efficiency(0.8, 1500.0)
    cluster = cm.load_cluster("v100-dgx1")
    for opts in (
        cm.CostOptions(),
        cm.CostOptions(recompute="none"),
        cm.CostOptions(gate_calls=1, micro_batch=1, grad_accum=16),
    ):
        for pt in cm.paper_points():
            pred = cm.predict(pt.cfg, pt.gpus, cluster, eff, opts)
            terms = [getattr(pred, k) for k in cm.GSHARD_TERM_KEYS]
            assert all(t >= 0 for t in terms) and pred.gshard_s == pytest.approx(sum(terms))
            if pt.arch != "gshard":
                assert pred.gshard_s == 0.0
            else:
                assert pred.dispatch_combine_s > 0 and pred.gating_s > 0 and pred.fp32_master_s > 0
                assert pred.capacity_padding_s == 0.0 and pred.expert_roofline_s == 0.0  # E | S, 2S-row GEMMs
            assert pred.step_s == pytest.approx(
                pred.compute_s + pred.allreduce_s + pred.alltoall_s + pred.gshard_s
            )
    off = cm.predict(_gshard_points()[0].cfg, 32, cluster, eff, cm.CostOptions(gshard_overheads="none"))
    assert off.gshard_s == 0.0


def test_gshard_terms_by_hand_for_125m() -> None:
    cfg, eff = preset("gpt3-small", "gshard", 32), cm.Efficiency(0.8, 1500.0)
    cluster = cm.load_cluster("v100-dgx1")
    terms = cm.gshard_terms(cfg, 32, cluster, eff, cm.CostOptions(), recompute=True)
    S, E, C, d = 2048, 32, 128, 768
    N = S * E * C
    assert N == 2 * S * S
    per_update = 6 * 8  # MoE layers x micro-batches
    assert terms.dispatch_combine_s == pytest.approx(per_update * 2 * N * d * 7 / (125e12 * 0.8))
    routing = per_update * (N * ((31 * 2 + 3) * 2 + 14) + S * E * (516 * 2 * 2 + 110)) / 900e9
    gate_gemm = (
        per_update * (2 * 2 + 2) * max(2 * S * d * E / (125e12 * 0.8), 2 * (S * d + d * E + S * E) / 900e9)
    )
    assert terms.gating_s == pytest.approx(routing + gate_gemm)
    assert terms.fp32_master_s == pytest.approx(28 * cm.params_per_gpu(cfg, 32) / 900e9)


def test_capacity_padding_and_roofline_when_they_apply() -> None:
    eff, cluster = cm.Efficiency(0.8, 1500.0), cm.load_cluster("v100-dgx1")
    # E does not divide S = 2048: C = 1366, E·C = 4098 rows for 4096 routes
    odd = preset("gpt3-small", "gshard", 3)
    t = cm.gshard_terms(odd, 3, cluster, eff, cm.CostOptions(), recompute=True)
    want = 6 * 8 * 4 * 4 * 768 * 3072 * 2 / (125e12 * eff.at(768))
    assert t.capacity_padding_s == pytest.approx(want)
    # 32 experts per GPU on 2 GPUs, 64-row expert GEMMs: memory-bound
    many = preset("gpt3-small", "gshard", 64)
    t = cm.gshard_terms(many, 2, cluster, eff, cm.CostOptions(micro_batch=1, grad_accum=16), recompute=False)
    assert t.expert_roofline_s > 0


def test_gshard_memory_and_recompute_fallback() -> None:
    cluster, eff = cm.load_cluster("v100-dgx1"), cm.Efficiency(0.6, 1400.0)
    limit = cluster.gpu_memory_bytes
    assert limit == 32 * 2**30 and cluster.hbm_bytes_per_s == 900e9
    none = cm.CostOptions(recompute="none")
    for pt in cm.paper_points():
        assert cm.memory_bytes(pt.cfg, pt.gpus, cm.CostOptions(), True) < limit  # all fit with recompute
        too_big = cm.memory_bytes(pt.cfg, pt.gpus, none, False) > limit
        assert too_big == (pt.size == "1.3B" and pt.arch == "gshard")  # 20 B/param x 1.32B + activations
        pred = cm.predict(pt.cfg, pt.gpus, cluster, eff, none)
        assert pred.recompute == ("full" if too_big else "none")
    xl = next(p for p in _gshard_points() if p.size == "1.3B")
    assert cm.params_per_gpu(xl.cfg, 128) == pytest.approx(1.317e9, rel=1e-3)
    assert cm.predict(xl.cfg, 128, cluster, eff, replace(none, on_oom="ignore")).recompute == "none"
    lean = replace(none, gshard_optimizer="memory_efficient_fp16")
    assert cm.memory_bytes(xl.cfg, 128, lean, False) < cm.memory_bytes(xl.cfg, 128, none, False) - 8 * 1.3e9


def test_dense_and_demix_predictions_unchanged_by_gshard_terms() -> None:
    cluster = cm.load_cluster("v100-dgx1")
    for opts in (cm.CostOptions(), cm.CostOptions(recompute="none"), cm.CostOptions(overlap=1.0)):
        new, old = cm.paper_report(cluster, opts), cm.paper_report(cluster, cm.before_options(opts))
        assert new["fitted"] == old["fitted"]
        for a, b in zip(new["rows"], old["rows"]):
            if a["arch"] != "gshard":
                assert a["step_s"] == b["step_s"] and a["tflops_per_gpu"] == b["tflops_per_gpu"]
    fit = cm.paper_report(cluster)["fitted"]  # the constants of the earlier report
    assert fit["e_max"] == pytest.approx(0.8762, abs=1e-4) and fit["h_half"] == pytest.approx(1774.4, abs=0.1)


def test_no_gshard_row_used_anywhere() -> None:
    """Scrambling the paper's GShard and DEMix TFLOPs/GPU changes no prediction: only Dense rows are fitted."""
    cluster = cm.load_cluster("v100-dgx1")
    points = cm.paper_points()
    scrambled = [
        p if p.arch == "dense" else replace(p, measured_tflops_per_gpu=p.measured_tflops_per_gpu * 7 + 3)
        for p in points
    ]
    for opts in (cm.CostOptions(), cm.CostOptions(recompute="none")):
        a, b = cm.fit_efficiency(points, cluster, opts), cm.fit_efficiency(scrambled, cluster, opts)
        assert a == b
        for p in points:
            assert cm.predict(p.cfg, p.gpus, cluster, a, opts) == cm.predict(p.cfg, p.gpus, cluster, b, opts)


def test_unknown_device_leaves_memory_bound_terms_out() -> None:
    custom = replace(CLUSTER, device="mystery", peak_tflops=100.0)
    assert custom.hbm_bytes_per_s is None and custom.gpu_memory_bytes is None
    t = cm.gshard_terms(
        preset("gpt3-small", "gshard", 32), 32, custom, cm.Efficiency(0.8, 0.0), cm.CostOptions(), True
    )
    # gating keeps the gate GEMM
    assert t.fp32_master_s == 0.0 and t.dispatch_combine_s > 0 and t.gating_s > 0
    given = replace(custom, memory_gbytes_per_s=1000.0, gpu_memory_gib=16.0)
    assert given.hbm_bytes_per_s == 1e12 and given.gpu_memory_bytes == 16 * 2**30
    assert given.problems() == [] and replace(given, memory_gbytes_per_s=0.0).problems()


def test_gshard_options_are_validated() -> None:
    bad = cm.CostOptions(gshard_overheads="maybe", gshard_optimizer="fp8", on_oom="crash", gate_calls=0)
    assert len(bad.problems()) == 4
    with pytest.raises(ConfigError):
        cm.predict(preset("gpt3-small", "gshard", 32), 32, CLUSTER, cm.Efficiency(0.5, 0.0), bad)
