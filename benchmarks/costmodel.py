"""A cluster cost model for Dense, DEMix and GShard training, checked against DEMix Tables 2 and 9.

    python -m benchmarks.costmodel --paper [--cluster v100-dgx1 | --cluster-file my.yaml]
    python -m benchmarks.costmodel --preset gpt3-xl --arch demix --gpus 128 --cluster a100-dgx

The step time of one optimizer update is modelled as

    t_step = t_compute + (1 - overlap) · t_allreduce + t_alltoall

    t_compute   = F / (n · P · e(h))          F: FLOPs per update actually executed (model/accounting,
                                              recompute convention when activations are recomputed),
                                              n GPUs, P the device's dense fp16 peak, e(h) an achieved
                                              compute efficiency that depends on the hidden size h
    e(h)        = e_max · h / (h + h_half)    i.e. t_compute = F/(n·P·e_max) · (1 + h_half/h): the matmul
                                              work (∝ h²) runs at e_max of peak and the memory-bound work
                                              (LayerNorm, GELU, softmax, dropout, Adam; ∝ h) adds a
                                              relative cost h_half/h. e_max and h_half are fitted on the
                                              paper's four *Dense* rows only; DEMix and GShard are
                                              predictions. `--efficiency-form constant` fits one e instead.
    t_allreduce gradient synchronisation once per update (gradient accumulation syncs only on the
                last micro-batch), see `allreduce_seconds`; `overlap` (default 0, none) is the fraction
                hidden behind the backward pass.
    t_alltoall  GShard's token exchange, on the critical path (never overlapped), see `alltoall_seconds`.

Gradient bytes per update (grad_bytes = 2 for the paper's fairseq fp16 gradients):
    Dense   all parameters over all n ranks.
    DEMix   shared parameters over all n ranks, then each domain's expert parameters over its n/G ranks
            (G domains; the G groups run concurrently, placed on consecutive ranks, so a group of
            n/G <= gpus_per_node stays inside one node).
    GShard  shared (non-expert, gates included) parameters over all n ranks; with one expert per GPU the
            expert-data-parallel group has size 1 and expert gradients are not reduced at all.

GShard all-to-all volume (per GPU, per all-to-all):
    V = c · k · T · d · act_bytes             T = micro_batch · seq_len tokens, k = top_k, d = d_model,
                                              c = capacity factor (buffers are padded to capacity)
    count = L_moe · (2 forward [dispatch + combine] + 2 backward + 2 recompute if recomputing) · accum
Of V, a fraction (E-1)/E leaves the GPU and (E-g)/E leaves the node when the E expert ranks span nodes
of g GPUs.

Known omissions (they show up as residual error, see the --paper report): gating/softmax/top-k and the
load-balancing loss, fp32 gating, the scatter/gather of tokens into capacity buffers, memory-bound
small expert matmuls, load imbalance and dropped tokens, stragglers, NCCL protocol/channel effects,
contention between concurrent collectives, and the optimizer step beyond what e(h) absorbs.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

import yaml
from pydantic import StrictInt
from pydantic.dataclasses import dataclass as pydantic_dataclass

from launcher.typed import ConfigError, build_lenient
from model import accounting as acc
from model.config import CONFIG, Float, ModelConfig

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_DIR = ROOT / "configs" / "clusters"
RESULTS_DIR = ROOT / "benchmarks" / "results"
ARCHS: tuple[str, ...] = ("dense", "demix", "gshard")
EFFICIENCY_FORMS: tuple[str, ...] = ("saturating", "constant")
RECOMPUTE: tuple[str, ...] = ("full", "none")
DTYPE_BYTES: dict[str, int] = {"fp16": 2, "bf16": 2, "fp32": 4}


# --------------------------------------------------------------------------------------------------
# Cluster description
# --------------------------------------------------------------------------------------------------


@pydantic_dataclass(frozen=True, config=CONFIG)
class ClusterSpec:
    """The hardware: one kind of node, repeated. Bandwidths are *one direction, per GPU* for NVLink
    (what a ring step can push: 600 GB/s "bidirectional" NVSwitch is 300 GB/s here) and *total per node*
    for the inter-node fabric (all NICs of a node together, in Gbit/s as NICs are sold)."""

    name: str
    device: str  # a key or name model.accounting knows ("v100-sxm2", "a100", "h100-sxm")
    gpus_per_node: StrictInt
    nvlink_gbytes_per_s: Float  # intra-node, per GPU, one direction, GB/s
    nvlink_latency_us: Float
    internode_gbits_per_s_per_node: Float  # e.g. 4 x 100 Gb/s EDR = 400
    internode_latency_us: Float
    precision: str = "fp16"
    peak_tflops: Optional[Float] = None  # overrides the device table
    efficiency_max: Optional[Float] = None  # compute efficiency e(h) for this device; None = V100 fit
    efficiency_h_half: Optional[Float] = None
    description: str = ""

    def problems(self) -> list[str]:
        out = []
        if self.gpus_per_node < 1:
            out.append(f"gpus_per_node={self.gpus_per_node}: must be >= 1")
        for name in ("nvlink_gbytes_per_s", "internode_gbits_per_s_per_node"):
            if getattr(self, name) <= 0:
                out.append(f"{name}={getattr(self, name)}: must be > 0")
        for name in ("nvlink_latency_us", "internode_latency_us"):
            if getattr(self, name) < 0:
                out.append(f"{name}={getattr(self, name)}: must be >= 0")
        try:
            acc.normalise_precision(self.precision)
        except ValueError as e:
            out.append(str(e))
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            out.append(f"peak_tflops={self.peak_tflops}: must be > 0")
        if self.peak_tflops is None and acc.match_device_name(self.device) is None:
            out.append(f"device={self.device!r}: unknown; set peak_tflops or use one of {', '.join(d.key for d in acc.DEVICES)}")
        elif self.peak_tflops is None and acc.peak_tflops(self.device, self.precision) is None:
            out.append(f"device={self.device!r} has no {self.precision} peak in model/accounting: set peak_tflops")
        if (self.efficiency_max is None) != (self.efficiency_h_half is None):
            out.append("efficiency_max and efficiency_h_half: give both or neither")
        if self.efficiency_max is not None and not 0 < self.efficiency_max <= 1:
            out.append(f"efficiency_max={self.efficiency_max}: must be in (0, 1]")
        if self.efficiency_h_half is not None and self.efficiency_h_half < 0:
            out.append(f"efficiency_h_half={self.efficiency_h_half}: must be >= 0")
        return out

    @property
    def peak(self) -> float:
        """Dense peak TFLOP/s per GPU in the cluster's precision."""
        if self.peak_tflops is not None:
            return self.peak_tflops
        peak = acc.peak_tflops(self.device, self.precision)
        assert peak is not None, "validated in problems()"
        return peak

    @property
    def nvlink_bytes_per_s(self) -> float:
        return self.nvlink_gbytes_per_s * 1e9

    @property
    def node_bytes_per_s(self) -> float:
        return self.internode_gbits_per_s_per_node * 1e9 / 8


def cluster_presets() -> list[str]:
    """Names of the shipped cluster presets (configs/clusters/*.yaml)."""
    return sorted(p.stem for p in CLUSTER_DIR.glob("*.yaml"))


def cluster_from_dict(data: object, source: str = "cluster") -> ClusterSpec:
    """Validate a parsed cluster YAML: unknown keys, wrong types and bad values in one ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError([f"expected a mapping at the top level, got {type(data).__name__}"], source)
    spec, problems = build_lenient(ClusterSpec, data)
    if spec is not None and not problems:
        problems = spec.problems()
    if problems or spec is None:
        raise ConfigError(problems or ["could not build the cluster"], source)
    return spec


def load_cluster(name_or_path: str | Path) -> ClusterSpec:
    """A preset by name ('v100-dgx1') or a YAML file by path."""
    path = Path(name_or_path)
    if not path.suffix and str(name_or_path) in cluster_presets():
        path = CLUSTER_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ConfigError([f"no cluster file {str(path)!r}; presets: {', '.join(cluster_presets())}"], "cluster")
    return cluster_from_dict(yaml.safe_load(path.read_text()), str(path))


# --------------------------------------------------------------------------------------------------
# Collectives (alpha-beta model)
# --------------------------------------------------------------------------------------------------


def ring_allreduce_seconds(nbytes: float, p: int, bytes_per_s: float, latency_s: float, messages: int = 1) -> float:
    """Ring all-reduce of `nbytes` over p ranks (reduce-scatter + all-gather, Patarasuk & Yuan 2009):

        t = 2·(p-1)/p · S / bw + m · 2·(p-1) · α

    bw: per-rank link bandwidth (one direction); α: per-step latency; m: messages (gradient buckets),
    each paying the latency once. Zero for p = 1.
    """
    if p <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (p - 1) / p * nbytes / bytes_per_s + messages * 2 * (p - 1) * latency_s


def allreduce_seconds(nbytes: float, p: int, cluster: ClusterSpec, bucket_bytes: float) -> float:
    """All-reduce of `nbytes` per rank over a group of p consecutive ranks, in buckets of `bucket_bytes`.

    p <= g (one node, g = gpus_per_node): a ring on NVLink, `ring_allreduce_seconds(S, p, B_nvl, α_nvl)`.
    p = N·g (whole nodes): hierarchical — reduce-scatter in the node, all-reduce of each GPU's S/g shard
    across the N nodes (the g shards share the node's NICs, B_node in total), all-gather in the node:

        t = 2·(g-1)/g · S/B_nvl + 2·(N-1)/N · S/B_node + m·(2·(g-1)·α_nvl + 2·(N-1)·α_ib)

    otherwise (groups straddling nodes unevenly): a flat ring whose slowest link is a GPU's share of
    the NICs, 2(p-1)/p · S/(B_node/g) + m·2(p-1)·α_ib (pessimistic).
    """
    if p <= 1 or nbytes <= 0:
        return 0.0
    g, m = cluster.gpus_per_node, max(1, math.ceil(nbytes / bucket_bytes))
    a_nvl, a_ib = cluster.nvlink_latency_us * 1e-6, cluster.internode_latency_us * 1e-6
    if p <= g:
        return ring_allreduce_seconds(nbytes, p, cluster.nvlink_bytes_per_s, a_nvl, m)
    if p % g == 0:
        n_nodes = p // g
        intra = 2 * (g - 1) / g * nbytes / cluster.nvlink_bytes_per_s
        inter = 2 * (n_nodes - 1) / n_nodes * nbytes / cluster.node_bytes_per_s
        return intra + inter + m * (2 * (g - 1) * a_nvl + 2 * (n_nodes - 1) * a_ib)
    return ring_allreduce_seconds(nbytes, p, cluster.node_bytes_per_s / g, a_ib, m)


def allreduce_internode_bytes(nbytes: float, p: int, gpus_per_node: int) -> float:
    """Bytes one node pushes through its NICs for the all-reduce `allreduce_seconds` models:
    0 inside a node, 2·(N-1)/N·S for whole nodes (hierarchical), 2·(p-1)/p·S·g for the flat fallback."""
    g = gpus_per_node
    if p <= g or nbytes <= 0:
        return 0.0
    if p % g == 0:
        return 2 * (p // g - 1) / (p // g) * nbytes
    return 2 * (p - 1) / p * nbytes * g


def alltoall_internode_bytes(nbytes: float, p: int, gpus_per_node: int) -> float:
    """Bytes one node sends off-node in one all-to-all: g·(p-g)/p·S (0 when p <= g)."""
    g = gpus_per_node
    return 0.0 if p <= g else g * (p - g) / p * nbytes


def alltoall_seconds(nbytes: float, p: int, cluster: ClusterSpec) -> float:
    """All-to-all where each of p consecutive ranks holds `nbytes`, 1/p of it for every rank (itself
    included). Pairwise exchange (Thakur, Rabenseifner & Gropp 2005), NVLink and NICs working at once:

        p <= g:  t = (p-1)/p · S / B_nvl + (p-1)·α_nvl
        p > g:   t = max((g-1)/p · S / B_nvl,  g·(p-g)/p · S / B_node) + (g-1)·α_nvl + (p-g)·α_ib

    (g·(p-g)/p·S is what the node's g GPUs send off-node through its shared NICs.)
    """
    if p <= 1 or nbytes <= 0:
        return 0.0
    g = cluster.gpus_per_node
    a_nvl, a_ib = cluster.nvlink_latency_us * 1e-6, cluster.internode_latency_us * 1e-6
    if p <= g:
        return (p - 1) / p * nbytes / cluster.nvlink_bytes_per_s + (p - 1) * a_nvl
    intra = (g - 1) / p * nbytes / cluster.nvlink_bytes_per_s
    inter = g * (p - g) / p * nbytes / cluster.node_bytes_per_s
    return max(intra, inter) + (g - 1) * a_nvl + (p - g) * a_ib


# --------------------------------------------------------------------------------------------------
# Workloads and predictions
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CostOptions:
    """Software choices that change the cost, not the hardware (defaults: the paper's fairseq setup)."""

    micro_batch: int = acc.PAPER_MICRO_BATCH
    grad_accum: int = acc.PAPER_GRAD_ACCUM
    grad_dtype: str = "fp16"  # gradients all-reduced in this dtype
    act_dtype: str = "fp16"  # activations exchanged by all-to-all
    recompute: str = "full"  # activation recomputation: a second forward (and its all-to-alls)
    overlap: float = 0.0  # fraction of the gradient all-reduce hidden behind backward; 0 = none
    bucket_mb: float = 25.0  # gradient bucket (PyTorch DDP / fairseq default), each pays the latency

    def problems(self) -> list[str]:
        out = []
        for name in ("grad_dtype", "act_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                out.append(f"{name}={getattr(self, name)!r}: choose one of {', '.join(DTYPE_BYTES)}")
        if self.recompute not in RECOMPUTE:
            out.append(f"recompute={self.recompute!r}: choose one of {', '.join(RECOMPUTE)}")
        if not 0.0 <= self.overlap <= 1.0:
            out.append(f"overlap={self.overlap}: must be in [0, 1]")
        if self.micro_batch < 1 or self.grad_accum < 1 or self.bucket_mb <= 0:
            out.append("micro_batch, grad_accum must be >= 1 and bucket_mb > 0")
        return out


@dataclass(frozen=True)
class Efficiency:
    """Achieved fraction of peak for the model's FLOPs: e(h) = e_max · h / (h + h_half)."""

    e_max: float
    h_half: float
    form: str = "saturating"
    fitted_on: str = ""

    def at(self, d_model: int) -> float:
        return self.e_max * d_model / (d_model + self.h_half)


@dataclass(frozen=True)
class Prediction:
    """One configuration's predicted update: times in seconds, bytes per GPU per update."""

    arch: str
    gpus: int
    d_model: int
    tflops_per_update: float  # recompute convention (the paper's), whatever is executed
    efficiency: float
    compute_s: float
    allreduce_s: float
    alltoall_s: float
    step_s: float
    tflops_per_gpu: float  # recompute convention (the paper's Tables 2/9)
    tflops_per_gpu_no_recompute: float  # forward + backward only (3 forwards)
    comm_share: float  # exposed communication / step time
    allreduce_bytes: float  # gradient bytes each rank all-reduces (over groups of > 1 rank)
    alltoall_bytes: float  # bytes each GPU hands to all-to-all per update (its own slice included)
    internode_bytes: float  # bytes each node sends through its NICs per update (all-reduce + all-to-all)


def _domains(cfg: ModelConfig, gpus: int) -> int:
    n = acc.resolved_num_experts(cfg)
    if gpus % n:
        raise ValueError(f"DEMix: {gpus} GPUs cannot be split evenly among {n} domains")
    return n


def allreduce_plan(cfg: ModelConfig, gpus: int, grad_bytes: int) -> list[tuple[float, int]]:
    """(bytes per rank, group size) of each gradient all-reduce of one update (see module docstring)."""
    params = acc.param_counts(cfg)
    kind = cfg.ffn.kind
    if kind == "dense":
        return [(params.total * grad_bytes, gpus)]
    if kind == "demix":
        per_domain = params.expert // params.num_experts
        return [(params.shared * grad_bytes, gpus), (per_domain * grad_bytes, gpus // _domains(cfg, gpus))]
    if kind == "gshard":
        n_exp = params.num_experts
        if n_exp % gpus and gpus % n_exp:
            raise ValueError(f"GShard: {n_exp} experts cannot be spread evenly over {gpus} GPUs")
        plan = [(params.shared * grad_bytes, gpus)]
        if n_exp < gpus:  # replicated experts: each reduced over the gpus/E ranks holding it
            plan.append((params.expert // n_exp * grad_bytes, gpus // n_exp))
        return plan
    raise ValueError(f"ffn kind {kind!r} is not modelled (dense, demix, gshard)")


def alltoall_volume(cfg: ModelConfig, opts: CostOptions) -> tuple[float, int]:
    """(bytes per GPU per all-to-all, all-to-alls per update) for GShard; (0, 0) otherwise.

        V = c · k · (micro_batch · seq_len) · d · act_bytes
        count = L_moe · (2 + 2 + [2 if recompute]) · grad_accum
    """
    if cfg.ffn.kind != "gshard":
        return 0.0, 0
    gs = cfg.ffn.gshard
    tokens = opts.micro_batch * cfg.seq_len
    volume = gs.capacity_factor * gs.top_k * tokens * cfg.d_model * DTYPE_BYTES[opts.act_dtype]
    per_layer = 6 if opts.recompute == "full" else 4
    return volume, len(cfg.moe_layer_ids()) * per_layer * opts.grad_accum


def predict(cfg: ModelConfig, gpus: int, cluster: ClusterSpec, eff: Efficiency, opts: CostOptions = CostOptions()) -> Prediction:
    """Predicted step time and TFLOPs/GPU of one update of `cfg` data-parallel over `gpus` GPUs."""
    problems = opts.problems()
    if problems:
        raise ConfigError(problems, "cost options")
    flops = acc.flops_per_update(cfg, gpus * opts.micro_batch * opts.grad_accum)
    executed = flops.get("recompute" if opts.recompute == "full" else "no_recompute")
    e = eff.at(cfg.d_model)
    compute = executed / (gpus * cluster.peak * 1e12 * e)
    bucket = opts.bucket_mb * 2**20
    plan = allreduce_plan(cfg, gpus, DTYPE_BYTES[opts.grad_dtype])
    allreduce = sum(allreduce_seconds(nbytes, p, cluster, bucket) for nbytes, p in plan)
    volume, count = alltoall_volume(cfg, opts)
    ep_group = min(gpus, acc.resolved_num_experts(cfg)) if count else 1
    alltoall = count * alltoall_seconds(volume, ep_group, cluster)
    exposed = (1 - opts.overlap) * allreduce + alltoall
    step = compute + exposed
    g = cluster.gpus_per_node
    internode = sum(allreduce_internode_bytes(nbytes, p, g) for nbytes, p in plan)
    internode += count * alltoall_internode_bytes(volume, ep_group, g)
    return Prediction(
        arch=cfg.ffn.kind, gpus=gpus, d_model=cfg.d_model, tflops_per_update=flops.recompute / 1e12, efficiency=e,
        compute_s=compute, allreduce_s=allreduce, alltoall_s=alltoall, step_s=step,
        tflops_per_gpu=flops.recompute / (gpus * step) / 1e12,
        tflops_per_gpu_no_recompute=flops.no_recompute / (gpus * step) / 1e12, comm_share=exposed / step,
        allreduce_bytes=sum(nbytes for nbytes, p in plan if p > 1), alltoall_bytes=volume * count,
        internode_bytes=internode,
    )


# --------------------------------------------------------------------------------------------------
# Fitting on the paper's Dense rows
# --------------------------------------------------------------------------------------------------


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
    points: Sequence[PaperPoint], cluster: ClusterSpec, opts: CostOptions = CostOptions(), form: str = "saturating"
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
        return Efficiency(cluster.efficiency_max, cluster.efficiency_h_half, "saturating", f"{cluster.name} YAML")
    return fit_efficiency(paper_points(), load_cluster("v100-dgx1"), opts, form)


def paper_report(cluster: ClusterSpec, opts: CostOptions = CostOptions(), form: str = "saturating") -> dict:
    """Fit on Dense, predict all 12 configurations, and compare with the paper (JSON-ready)."""
    points = paper_points()
    eff = fit_efficiency(points, cluster, opts, form)
    rows = []
    for pt in points:
        pred = predict(pt.cfg, pt.gpus, cluster, eff, opts)
        err = (pred.tflops_per_gpu - pt.measured_tflops_per_gpu) / pt.measured_tflops_per_gpu
        rows.append({"size": pt.size, **asdict(pred), "paper_tflops_per_gpu": pt.measured_tflops_per_gpu, "rel_err": err})
    mean_abs = {a: sum(abs(r["rel_err"]) for r in rows if r["arch"] == a) / 4 for a in ARCHS}
    return {
        "cluster": asdict(cluster),
        "options": asdict(opts),
        "fitted": {**asdict(eff), "fitted_on_archs": ["dense"]},
        "rows": rows,
        "mean_abs_rel_err": mean_abs,
    }


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------

_COLUMNS = (
    ("size", "size"), ("arch", "arch"), ("GPUs", "gpus"), ("TFLOPs/upd", "tflops_per_update"),
    ("e(h)", "efficiency"), ("compute s", "compute_s"), ("all-reduce s", "allreduce_s"),
    ("all-to-all s", "alltoall_s"), ("NIC GB/node", "internode_bytes"), ("step s", "step_s"), ("comm share", "comm_share"),
    ("pred TFLOPs/GPU", "tflops_per_gpu"), ("paper", "paper_tflops_per_gpu"), ("error", "rel_err"),
)


def _cell(key: str, value: object) -> str:
    if key in ("comm_share", "efficiency"):
        return f"{100 * float(value):.1f}%"
    if key == "rel_err":
        return f"{100 * float(value):+.1f}%"
    if key == "internode_bytes":
        return f"{float(value) / 1e9:.2f}"
    if key.endswith("_s"):
        return f"{float(value):.3f}"
    if key in ("tflops_per_gpu", "tflops_per_update"):
        return f"{float(value):,.1f}"
    return str(value)


def format_table(rows: Sequence[dict], markdown: bool = False) -> str:
    """Rows as an aligned text table or a Markdown table (columns missing from a row are skipped)."""
    cols = [(n, k) for n, k in _COLUMNS if k in rows[0]]
    header = [n for n, _ in cols]
    body = [[_cell(k, r[k]) for _, k in cols] for r in rows]
    if markdown:
        return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(b) + " |" for b in body])
    widths = [max(len(c) for c in col) for col in zip(header, *body)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(b) for b in body])


def _fitted_line(fit: dict) -> str:
    if fit["form"] == "constant":
        return f"e = {fit['e_max']:.4f} (one constant), fitted on {fit['fitted_on']}"
    return f"e(h) = {fit['e_max']:.4f} · h / (h + {fit['h_half']:.1f}), fitted on {fit['fitted_on']}"


def sensitivity(opts: CostOptions) -> list[dict]:
    """Mean |error| per arch under alternative assumptions (each refitted on Dense only)."""
    out = []
    variants = [(c, f, o, r) for c in ("v100-dgx1", "v100-dgx1-4ib") for f in EFFICIENCY_FORMS for o in (0.0, 1.0) for r in ("full",)]
    variants += [(c, "saturating", 0.0, "none") for c in ("v100-dgx1", "v100-dgx1-4ib")]
    for cluster_name, form, overlap, recompute in variants:
        o = CostOptions(**{**asdict(opts), "overlap": overlap, "recompute": recompute})
        rep = paper_report(load_cluster(cluster_name), o, form)
        out.append({"cluster": cluster_name, "efficiency_form": form, "overlap": overlap, "recompute": recompute,
                    **{f"{a}_mean_abs_err": rep["mean_abs_rel_err"][a] for a in ARCHS},
                    **{f"{r['size']}_{r['arch']}_err": r["rel_err"] for r in rep["rows"] if r["arch"] != "dense"}})
    return out


def write_paper_report(report: dict, sens: list[dict], command: str, out_dir: Path) -> tuple[Path, Path]:
    """benchmarks/results/costmodel_paper.{md,json}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "costmodel_paper.json", out_dir / "costmodel_paper.md"
    json_path.write_text(json.dumps({"command": command, **report, "sensitivity": sens}, indent=1) + "\n")
    c = report["cluster"]
    lines = [
        "# Cluster cost model vs DEMix Tables 2/9 (V100 TFLOPs/GPU)", "",
        f"Command: `{command}`", "",
        f"Cluster `{c['name']}`: {c['description']}", "",
        f"Fitted (Dense rows only; DEMix and GShard are predictions): {_fitted_line(report['fitted'])}.", "",
        f"Options: {report['options']}", "",
        format_table(report["rows"], markdown=True), "",
        "Mean |error|: " + ", ".join(f"{a} {100 * v:.1f}%" for a, v in report["mean_abs_rel_err"].items()), "",
        "## Sensitivity (each variant refitted on Dense only)", "",
        "Mean |error| per arch, then each GShard point's error.", "",
        "| cluster | e(h) form | overlap | recompute | dense | demix | gshard | GShard 125M / 350M / 760M / 1.3B |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {s['cluster']} | {s['efficiency_form']} | {s['overlap']:.0%} | {s['recompute']} | "
              + " | ".join(f"{100 * s[f'{a}_mean_abs_err']:.1f}%" for a in ARCHS) + " | "
              + " / ".join(f"{100 * s[f'{z}_gshard_err']:+.0f}%" for z in ("125M", "350M", "760M", "1.3B")) + " |" for s in sens]
    md_path.write_text("\n".join(lines) + "\n\n" + REPORT_NOTES + "\n")
    return md_path, json_path


REPORT_NOTES = """## Model
t_step = F/(n·P·e(h)) + (1 − overlap)·t_allreduce + t_alltoall, P = 125 TFLOP/s (V100 fp16).
Ring all-reduce 2(p−1)/p·S/bw + m·2(p−1)·α; hierarchical (NVLink reduce-scatter, inter-node all-reduce
of the shard, NVLink all-gather) when a group spans nodes; m = 25 MB gradient buckets.
Gradients (fp16): Dense all params over n; DEMix shared over n + each domain's experts over n/8
(inside one node when n/8 <= 8); GShard shared over n, experts not reduced (one expert per GPU).
GShard all-to-all per GPU: c·k·(2·1024)·d·2 bytes, 6 per MoE layer per micro-batch (dispatch+combine in
forward, backward and recomputed forward), pairwise-exchange cost with (E−1)/E off-GPU and (E−8)/E
off-node. NIC GB/node: bytes each node sends through its InfiniBand links per update.
See `benchmarks/costmodel.py` for the formulas.

Not modelled (no GShard-specific constant was tuned): gating (fp32 softmax, top-2, load-balancing loss),
fairseq's dense one-hot dispatch/combine einsums (2·2·T·(k·T·c)·d FLOPs per MoE layer pass, i.e.
T·c/(4d) of the MoE layer's expert FLOPs), load imbalance and dropped tokens, memory-bound small expert
kernels, stragglers and contention between concurrent collectives."""


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.costmodel", description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--paper", action="store_true", help="the 12 configurations of DEMix Tables 2/9; writes results")
    mode.add_argument("--preset", help="a model preset (gpt3-small ... gpt3-xl) for one configuration")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--cluster", default="v100-dgx1", help="cluster preset: " + ", ".join(cluster_presets()))
    where.add_argument("--cluster-file", help="a cluster YAML (keys of ClusterSpec)")
    p.add_argument("--arch", choices=ARCHS, default="dense", help="with --preset")
    p.add_argument("--gpus", type=int, default=8, help="with --preset")
    p.add_argument("--experts", type=int, default=0, help="with --preset: DEMix domains (8) / GShard experts (= GPUs)")
    p.add_argument("--micro-batch", type=int, default=acc.PAPER_MICRO_BATCH)
    p.add_argument("--grad-accum", type=int, default=acc.PAPER_GRAD_ACCUM)
    p.add_argument("--grad-dtype", choices=sorted(DTYPE_BYTES), default="fp16")
    p.add_argument("--recompute", choices=RECOMPUTE, default="full")
    p.add_argument("--overlap", type=float, default=0.0, help="fraction of the all-reduce hidden by backward")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--efficiency-form", choices=EFFICIENCY_FORMS, default="saturating")
    p.add_argument("--out-dir", default=str(RESULTS_DIR), help="with --paper: where the .md/.json go")
    p.add_argument("--no-write", action="store_true", help="with --paper: print only")
    p.add_argument("--json", action="store_true", help="print JSON")
    return p


def _model(preset: str, arch: str, gpus: int, experts: int) -> ModelConfig:
    from launcher.config import load_run_config

    n = experts or {"dense": 0, "demix": acc.PAPER_DEMIX_EXPERTS, "gshard": gpus}[arch]
    return load_run_config(None, [f"model.preset={preset}", f"model.ffn.kind={arch}", f"model.ffn.num_experts={n}"]).model


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        cluster = load_cluster(args.cluster_file or args.cluster)
        opts = CostOptions(args.micro_batch, args.grad_accum, args.grad_dtype, "fp16", args.recompute, args.overlap, args.bucket_mb)
        if opts.problems() or args.gpus < 1:
            raise ConfigError(opts.problems() + ([f"--gpus={args.gpus}: must be >= 1"] if args.gpus < 1 else []), "options")
        if args.paper:
            report = paper_report(cluster, opts, args.efficiency_form)
            if args.json:
                print(json.dumps(report, indent=1))
            else:
                print(format_table(report["rows"]))
                print(f"\nfitted on Dense only: {_fitted_line(report['fitted'])}")
            if not args.no_write:
                command = "python -m benchmarks.costmodel " + shlex.join(argv)
                paths = write_paper_report(report, sensitivity(opts), command, Path(args.out_dir))
                print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
            return 0
        cfg = _model(args.preset, args.arch, args.gpus, args.experts)
        eff = cluster_efficiency(cluster, opts, args.efficiency_form)
        row = {"size": args.preset, **asdict(predict(cfg, args.gpus, cluster, eff, opts))}
        if args.json:
            print(json.dumps({"cluster": cluster.name, "efficiency_fit": asdict(eff), **row}, indent=1))
        else:
            print(format_table([row]))
            print(f"\ncluster {cluster.name}; {_fitted_line(asdict(eff))}")
        return 0
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
