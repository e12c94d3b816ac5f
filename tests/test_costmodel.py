"""The cluster cost model (benchmarks/costmodel.py): collective formulas on hand-computed numbers,
communication plans per architecture, Dense-only fitting, cluster YAML validation, presets, and the
--paper output."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from benchmarks import costmodel as cm
from launcher.config import load_run_config
from launcher.typed import ConfigError
from model.config import ModelConfig

# A hand-sized cluster, independent of the shipped presets: B_nvl = 150 GB/s, B_node = 100 Gb/s.
CLUSTER = cm.ClusterSpec(
    name="test", device="v100", gpus_per_node=8, nvlink_gbytes_per_s=150.0, nvlink_latency_us=5.0,
    internode_gbits_per_s_per_node=100.0, internode_latency_us=10.0,
)


def preset(name: str, kind: str, num_experts: int = 0) -> ModelConfig:
    return load_run_config(None, [f"model.preset={name}", f"model.ffn.kind={kind}", f"model.ffn.num_experts={num_experts}"]).model


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
    dense, demix, gshard = (preset("gpt3-small", k, n) for k, n in (("dense", 0), ("demix", 8), ("gshard", 32)))
    (d_bytes, d_group), = cm.allreduce_plan(dense, 32, 2)
    assert d_group == 32
    (shared, s_group), (expert, e_group) = cm.allreduce_plan(demix, 32, 2)
    assert (s_group, e_group) == (32, 4)
    assert shared + expert == d_bytes  # the paper's footnote: DEMix's bandwidth cost (bytes/rank) = Dense's
    assert cm.allreduce_plan(gshard, 32, 4) == [(cm.acc.param_counts(gshard).shared * 4, 32)]  # experts not reduced


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
    assert full.step_s == pytest.approx(none.compute_s + none.alltoall_s)
    assert none.step_s == pytest.approx(none.compute_s + none.allreduce_s + none.alltoall_s)


# ---------------------------------------------------------------------------- fitting


def test_fit_uses_dense_rows_only() -> None:
    points = cm.paper_points()
    assert len(points) == 12
    for form in cm.EFFICIENCY_FORMS:
        base = cm.fit_efficiency(points, CLUSTER, form=form)
        scrambled = [p if p.arch == "dense" else replace(p, measured_tflops_per_gpu=p.measured_tflops_per_gpu * 3 + 1) for p in points]
        assert cm.fit_efficiency(scrambled, CLUSTER, form=form) == base
        dense_changed = [replace(p, measured_tflops_per_gpu=p.measured_tflops_per_gpu * 1.1) if p.arch == "dense" else p for p in points]
        assert cm.fit_efficiency(dense_changed, CLUSTER, form=form) != base


def test_fit_recovers_a_known_efficiency() -> None:
    truth = cm.Efficiency(0.8, 1500.0)
    points = [p for p in cm.paper_points() if p.arch == "dense"]
    synthetic = [replace(p, measured_tflops_per_gpu=cm.predict(p.cfg, p.gpus, CLUSTER, truth).tflops_per_gpu) for p in points]
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
        cm.cluster_from_dict({**raw, "gpus_per_node": 0, "internode_gbits_per_s_per_node": -1, "device": "tpu9", "efficiency_max": 0.5})
    assert len(err.value.problems) == 4
    with pytest.raises(ConfigError, match="required"):
        cm.cluster_from_dict({"name": "x"})
    custom = cm.cluster_from_dict({**raw, "device": "mystery", "peak_tflops": 100.0, "efficiency_max": 0.5, "efficiency_h_half": 0.0})
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
    assert {(r["size"], r["arch"]) for r in rows} == {(s, a) for s in ("125M", "350M", "760M", "1.3B") for a in cm.ARCHS}
    for r in rows:
        assert r["rel_err"] == pytest.approx((r["tflops_per_gpu"] - r["paper_tflops_per_gpu"]) / r["paper_tflops_per_gpu"])
        assert 0 <= r["comm_share"] < 1
    assert max(abs(r["rel_err"]) for r in rows if r["arch"] == "dense") < 0.02  # 2 constants, 4 Dense points
    md = (tmp_path / "costmodel_paper.md").read_text()
    assert md.count("| 125M |") == 3 and "Dense rows only" in md


def test_single_configuration_cli(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cm.main(["--preset", "gpt3-small", "--arch", "demix", "--gpus", "16", "--cluster", "a100-dgx", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["arch"] == "demix" and out["gpus"] == 16 and out["tflops_per_gpu"] > 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\n")
    assert cm.main(["--preset", "gpt3-small", "--cluster-file", str(bad)]) == 2
    assert "required" in capsys.readouterr().err
