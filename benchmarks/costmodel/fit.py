"""The achieved compute efficiency e(h), fitted on the paper's four Dense rows only (DEMix and GShard stay
predictions). docs/costmodel.md, "Step time"."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.costmodel.cluster import ClusterSpec, load_cluster
from benchmarks.costmodel.options import EFFICIENCY_FORMS, CostOptions, Efficiency
from benchmarks.costmodel.predict import predict
from model.config import ModelConfig


@dataclass(frozen=True)
class PaperPoint:
    """One (size, arch) of Tables 2/9 with the paper's measured TFLOPs/GPU."""

    size: str
    arch: str
    gpus: int
    cfg: ModelConfig
    measured_tflops_per_gpu: float


def paper_points() -> list[PaperPoint]:
    """The paper's 12 configurations, built from the shipped model presets."""
    from launcher.flops import paper_configs  # the presets + per-arch expert counts of Tables 2/9

    return [
        PaperPoint(s.size, cfg.ffn.kind, s.gpus, cfg, dict(s.tflops_per_gpu)[cfg.ffn.kind])
        for s, cfg in paper_configs()
    ]


def fit_efficiency(
    points: Sequence[PaperPoint],
    cluster: ClusterSpec,
    opts: CostOptions = CostOptions(),
    form: str = "saturating",
) -> Efficiency:
    """Fit e(h) on the **Dense** points only (others are ignored, so they stay predictions).

    For each Dense point, the measured step is t = F/(n·X) (X the measured TFLOP/s per GPU); subtracting
    the modelled exposed communication leaves t_compute, so y = n·P·t_compute/F = 1/e. With
    1/e(h) = 1/e_max + (h_half/e_max)·(1/h), ordinary least squares of y on 1/h gives
    e_max = 1/a, h_half = b/a ('saturating'); 'constant' fits y = a (h_half = 0).
    """
    if form not in EFFICIENCY_FORMS:
        raise ValueError(f"efficiency form {form!r}: choose one of {', '.join(EFFICIENCY_FORMS)}")
    dense = [pt for pt in points if pt.arch == "dense"]
    if len(dense) < (2 if form == "saturating" else 1):
        raise ValueError(f"need Dense points to fit the '{form}' efficiency, got {len(dense)}")
    unit = Efficiency(1.0, 0.0)
    xs, ys = [], []
    for pt in dense:
        pred = predict(pt.cfg, pt.gpus, cluster, unit, opts)  # communication does not depend on e
        measured_step = pred.tflops_per_update / (pt.gpus * pt.measured_tflops_per_gpu)  # paper's convention
        compute = measured_step - (pred.step_s - pred.compute_s)
        if compute <= 0:
            raise ValueError(f"{pt.size} dense: modelled communication exceeds the measured step time")
        xs.append(1.0 / pt.cfg.d_model)
        ys.append(compute / pred.compute_s)  # = 1/e, since pred.compute_s used e = 1
    label = ", ".join(pt.size for pt in dense) + f" Dense on {cluster.name}"
    if form == "constant":
        return Efficiency(1.0 / (sum(ys) / len(ys)), 0.0, form, label)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    return Efficiency(1.0 / intercept, slope / intercept, form, label)


def cluster_efficiency(cluster: ClusterSpec, opts: CostOptions, form: str = "saturating") -> Efficiency:
    """The cluster's own e(h) if its YAML gives one, else the fit on the paper's V100 Dense rows (the
    paper's cluster preset), which is only a guess for other devices."""
    if cluster.efficiency_max is not None and cluster.efficiency_h_half is not None:
        return Efficiency(
            cluster.efficiency_max, cluster.efficiency_h_half, "saturating", f"{cluster.name} YAML"
        )
    return fit_efficiency(paper_points(), load_cluster("v100-dgx1"), opts, form)
