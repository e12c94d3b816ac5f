"""A cluster cost model for Dense, DEMix and GShard training, checked against DEMix Tables 2 and 9.

    python -m benchmarks.costmodel --paper [--cluster v100-dgx1 | --cluster-file my.yaml]
    python -m benchmarks.costmodel --preset gpt3-xl --arch demix --gpus 128 --cluster a100-dgx

The step time of one optimizer update is modelled as

    t_step = t_compute + t_allreduce_exposed + t_alltoall + t_gshard

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
                last micro-batch), see `allreduce_seconds`. The part left on the critical path
                (`exposed_allreduce_seconds`): with `grad_reduce: fixed` (the paper fit's default)
                (1 - overlap)·t_allreduce, `overlap` a what-if fraction (default 0, none); with this trainer's
                `parallel.grad_reduce` (`trainer_cost_options`) derived from how it reduces: "after_backward"
                all of it, "overlap" max(t_last_bucket, t_allreduce - t_backward), the buckets issued while the
                last micro-batch's backward runs, the last one (the first layers' gradients) after it.
    t_alltoall  GShard's token exchange, on the critical path (never overlapped), see `alltoall_seconds`.
    t_gshard    GShard's work that is neither model FLOPs nor all-to-all volume (below); 0 for Dense/DEMix.

Gradient bytes per update (grad_bytes = 2 for the paper's fairseq fp16 gradients):
    Dense   all parameters over all n ranks.
    DEMix   shared parameters over all n ranks, then each domain's expert parameters over its n/G ranks
            (G domains; the G groups run concurrently, placed on consecutive ranks, so a group of
            n/G <= gpus_per_node stays inside one node).
    GShard  shared (non-expert, gates included) parameters over all n ranks; each rank's experts over its
            expert-data-parallel group (the n/E ranks holding the same expert). With one expert per GPU that
            group has one rank: DeepSpeed still calls the all-reduce, which moves nothing (bytes, no time).
    DEMix with more domains than ranks (G a multiple of n) puts G/n domains on each rank, each domain's
    group that one rank: likewise bytes, no time.

GShard all-to-all volume (per GPU, per all-to-all):
    V = c · k · T · d · act_bytes             T = micro_batch · seq_len tokens, k = top_k, d = d_model,
                                              c = capacity factor (buffers are padded to capacity)
    count = L_moe · (2 forward [dispatch + combine] + 2 backward + 2 recompute if recomputing) · accum
Of V, a fraction (E-1)/E leaves the GPU and (E-g)/E leaves the node when the E expert ranks span nodes
of g GPUs.

GShard terms (t_gshard, function `gshard_terms`; `CostOptions.gshard_overheads="none"` / `--gshard-overheads
none` gives the all-to-all-only model). No constant in them is fitted: they are counted from the code and
priced with the Dense-fitted e_max or the datasheet bandwidth. Source: the DEMix authors' fairseq fork, github.com/kernelmachine/demix —
`demix/train.sh` (the `gshard` branch: `--fp16 --fp16-no-flatten-grads --moe-freq 2 --moe-expert-count
$NUM_GPUS --moe-gating-use-fp32 --moe-second-expert-policy all --max-sentences 2 --update-freq 8`, while
Dense/DEMix use `--memory-efficient-fp16`), `fairseq/modules/moe/{top2gate,moe_layer}.py` (the same code
as upstream fairseq/fairscale MoE, GShard Algorithm 2 of Lepikhin et al. 2020). Per MoE layer and
micro-batch of S = micro_batch · seq_len tokens on a GPU, E experts, k = 2:

    C = k · ceil(c · S / E)                   capacity (fairseq `top2gating`, training: `2 * ceil(S/E)`);
                                              N = S · E · C elements of the (s, e, c) routing tensors
                                              (N = 2·S² when E divides S: independent of E)
    f = forward passes (2 with recompute, 1 without); all terms are × L_moe · grad_accum per update

  dispatch_combine_s  the one-hot einsums, done as dense fp16 matmuls against the mostly-zero (S, E·C)
                      tensors (`torch.mm(dispatch_mask.view(E*C, S), x)` = einsum sec,sm->ecm and
                      `combine_weights.view(S, E*C).mm(expert_out)` = sec,ecm->sm):
                          FLOPs = 2·N·d · (2·f + 3)
                      forward: dispatch + combine; backward: dispatch w.r.t. x only (the mask carries no
                      gradient), combine w.r.t. both operands. Large GEMMs (E·C = 2S rows, inner S or d):
                      they run at e_max, the fitted matmul efficiency (the h_half/h part of e(h) is the
                      transformer's element-wise work, which these matmuls do not have).
  gating_s            memory-bound routing work (fp32 with --moe-gating-use-fp32), at the device's HBM
                      bandwidth B (V100: 900 GB/s; nominal, so a lower bound on time):
                          bytes = N · ((31·g + 3) · f + 14) + S · E · (516 · g · f + 110)
                      31 B per (s,e,c) element and gate call: two fp32 outer products "se,sc->sec" (write
                      4 + 4), their sum (r 8, w 4), `.bool()` (r 4, w 1), `.to(fp16)` (r 4, w 2); 3 B: the
                      dispatch mask to fp16 (r 1, w 2); backward 14 B: fp16->fp32 gradient (r 2, w 4) and
                      the two outer products' backward (r 4 + 4). The (S, E) part (≈ 40 fp32/int64
                      element-wise passes: softmax, entropy, argmax, one-hots, cumsums, masks, overflow
                      statistics; ≈ 516 B forward, ≈ 110 B backward per (s, e)) is an approximate count of
                      `top2gating`. g = `gate_calls` forward evaluations of the gate per MoE layer: 2 by
                      default, because the fork's `MOELayer.forward` calls `self.gate(...)` twice (the first
                      result is overwritten; upstream fairseq calls it once: `--gate-calls 1`). The gate
                      projection itself (2·S·d·E FLOPs, g·f forward + 2 backward GEMMs) is fp16 (fairseq casts
                      only the logits to fp32), at max(FLOPs/(P·e_max), bytes/B).
  capacity_padding_s  experts compute all E·C buffer rows whether or not tokens filled them: the
                      E·C − k·S rows beyond the k·S that F already counts cost 4·d·F_ffn·(f + 2) FLOPs each
                      at e(h). fairseq's C = 2·ceil(S/E) makes this 0 when E divides S (all paper rows), and
                      a fixed-size buffer also means load imbalance costs no time (only dropped tokens).
  expert_roofline_s   each local expert multiplies R = ep·C rows (ep = all-to-all group); for its 2
                      linears x (f forward + 2 backward) GEMMs, the excess max(0, bytes/B − FLOPs/(P·e_max)),
                      bytes = 2·(R·d + d·F_ffn + R·F_ffn). With one expert per GPU R = 2S = 4096 rows, twice
                      the Dense FFN's, so the paper's expert GEMMs are compute-bound and this is 0 (it
                      matters for many experts per GPU or tiny micro-batches).
  fp32_master_s       GShard ran with `--fp16` (FP16Optimizer: fp32 master weights and fp32 gradient copies)
                      where the fit's Dense rows ran `--memory-efficient-fp16`; the optimizer step moves
                      ≈ 60 instead of ≈ 32 B per parameter (fused Adam; grad copy 6, unscale 8, clip 12,
                      Adam 28, param copy-back 6 vs unscale 4, clip 6, Adam 22): 28 B/param × the GPU's
                      parameters / B.

Memory and micro-batch (`memory_bytes`, column mem GiB): model states (fp16 params + fp16 grads + fp32
Adam m, v = 12 B/param with --memory-efficient-fp16; + fp32 master params and grads = 20 B/param with
--fp16, GShard's) of the parameters a GPU holds (Dense all; DEMix shared + its domain's expert; GShard
shared + its expert), activations as `parallel/memory.py` (Korthikanti et al. 2022; GShard MLP rows
counted k times) and GShard's saved routing tensors (4 B per (s,e,c): fp16 combine weights and dispatch
mask). With `recompute=none` and `on_oom="recompute"` (default), a configuration that does not fit the
GPU's memory at the given micro-batch is predicted with activation recomputation (fairseq's
`--checkpoint-activations`, keeping the paper's stated 2 x 8 batch): column recompute shows what ran.
e(h) was fitted at micro-batch 2 only, so the model has no evidence on how e changes with the
micro-batch and does not guess (`--micro-batch` changes only the all-to-all, routing and memory terms).
The reference train.sh passes no `--checkpoint-activations` for any architecture (fairseq's default is off),
so recompute='none' is what its commands execute; the default stays 'full' (the paper's FLOPs convention
and this model's earlier default) and the --paper report shows GShard under both.

Known omissions (they show up as residual error, see the --paper report): GShard kernel-launch and Python
overheads of its many small routing ops, the load-balancing loss beyond the gating count, stragglers,
NCCL protocol/channel effects, contention between concurrent collectives, checkpoint saving and
validation, and the optimizer step beyond what e(h) absorbs.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Optional, Sequence

from pydantic import StrictInt
from pydantic.dataclasses import dataclass as pydantic_dataclass

from data.argtypes import nonneg_int, positive_float, positive_int, unit_closed
from data.readers import InputFileError, read_yaml
from launcher.typed import ConfigError, build_lenient
from model import accounting as acc
from model.config import CONFIG, Float, ModelConfig
from parallel.config import ParallelConfig, TrainConfig

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_DIR = ROOT / "configs" / "clusters"
RESULTS_DIR = ROOT / "benchmarks" / "results"
ARCHS: tuple[str, ...] = ("dense", "demix", "gshard")
EFFICIENCY_FORMS: tuple[str, ...] = ("saturating", "constant")
RECOMPUTE: tuple[str, ...] = ("full", "none")
GSHARD_OVERHEADS: tuple[str, ...] = ("fairseq", "none")
OPTIMIZERS: tuple[str, ...] = ("fp16", "memory_efficient_fp16")  # fairseq --fp16 / --memory-efficient-fp16
ON_OOM: tuple[str, ...] = ("recompute", "ignore")
DTYPE_BYTES: dict[str, int] = {"fp16": 2, "bf16": 2, "fp32": 4}
GRAD_REDUCE: tuple[str, ...] = ("fixed", "overlap", "after_backward")  # CostOptions.grad_reduce

# HBM bandwidth per GPU, GB/s (vendor datasheets; the largest-memory variant where model/accounting's device
# table lists that memory). Used only by the memory-bound GShard terms; a cluster YAML may override it.
HBM_GBYTES_PER_S: dict[str, float] = {
    "v100-sxm2": 900.0,
    "v100-pcie": 900.0,
    "v100s": 1134.0,
    "a100": 2039.0,
    "h100-sxm": 3350.0,
    "h100-pcie": 2000.0,
    "h100-nvl": 3900.0,
    "h200": 4800.0,
    "l40s": 864.0,
    "l4": 300.0,
    "a10": 600.0,
    "rtx4090": 1008.0,
    "mi250x": 3277.0,
    "mi300x": 5300.0,
}


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
    memory_gbytes_per_s: Optional[Float] = None  # HBM bandwidth per GPU; None = HBM_GBYTES_PER_S[device]
    gpu_memory_gib: Optional[Float] = None  # memory per GPU; None = model/accounting's device table
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
            out.append(
                f"device={self.device!r}: unknown; set peak_tflops or use one of {', '.join(d.key for d in acc.DEVICES)}"
            )
        elif self.peak_tflops is None and acc.peak_tflops(self.device, self.precision) is None:
            out.append(
                f"device={self.device!r} has no {self.precision} peak in model/accounting: set peak_tflops"
            )
        if (self.efficiency_max is None) != (self.efficiency_h_half is None):
            out.append("efficiency_max and efficiency_h_half: give both or neither")
        if self.efficiency_max is not None and not 0 < self.efficiency_max <= 1:
            out.append(f"efficiency_max={self.efficiency_max}: must be in (0, 1]")
        if self.efficiency_h_half is not None and self.efficiency_h_half < 0:
            out.append(f"efficiency_h_half={self.efficiency_h_half}: must be >= 0")
        for name in ("memory_gbytes_per_s", "gpu_memory_gib"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                out.append(f"{name}={getattr(self, name)}: must be > 0")
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
    def hbm_bytes_per_s(self) -> Optional[float]:
        """GPU memory bandwidth, bytes/s; None for a device we know no figure for (memory-bound terms are
        then left out)."""
        if self.memory_gbytes_per_s is not None:
            return self.memory_gbytes_per_s * 1e9
        dev = acc.match_device_name(self.device)
        gbps = HBM_GBYTES_PER_S.get(dev.key) if dev is not None else None
        return None if gbps is None else gbps * 1e9

    @property
    def gpu_memory_bytes(self) -> Optional[float]:
        """Memory per GPU, bytes; None when unknown (no fits/doesn't-fit verdict)."""
        if self.gpu_memory_gib is not None:
            return self.gpu_memory_gib * 2**30
        dev = acc.match_device_name(self.device)
        return None if dev is None or dev.memory_gb is None else dev.memory_gb * 2**30

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
        raise ConfigError(
            [f"no cluster file {str(path)!r}; presets: {', '.join(cluster_presets())}"], "cluster"
        )
    try:
        raw = read_yaml(path)
    except InputFileError as e:
        raise ConfigError([str(e)], str(path)) from None
    return cluster_from_dict(raw, str(path))


# --------------------------------------------------------------------------------------------------
# Collectives (alpha-beta model)
# --------------------------------------------------------------------------------------------------


def ring_allreduce_seconds(
    nbytes: float, p: int, bytes_per_s: float, latency_s: float, messages: int = 1
) -> float:
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
    overlap: float = (
        0.0  # grad_reduce "fixed": fraction of the gradient all-reduce hidden behind backward; 0 = none
    )
    bucket_mb: float = 25.0  # gradient bucket (PyTorch DDP / fairseq default), each pays the latency
    # "fixed": `overlap` and `bucket_mb` as given (the paper fit); "overlap" / "after_backward": this trainer's
    # parallel.grad_reduce, its bucket rule (parallel/engine.py bucket_elements, or `bucket_elements`) and the hidden
    # part derived (`exposed_allreduce_seconds`)
    grad_reduce: str = "fixed"
    bucket_elements: Optional[int] = None  # the trainer's parallel.bucket_elements (None: the rule)
    gshard_overheads: str = (
        "fairseq"  # t_gshard: the fairseq MoE's einsums, gating, padding, ...; "none": left out
    )
    gate_calls: int = 2  # forward gate evaluations per MoE layer (the DEMix fork calls self.gate twice)
    gshard_optimizer: str = (
        "fp16"  # fairseq --fp16 (fp32 master weights, the reference GShard) or memory_efficient_fp16
    )
    on_oom: str = "recompute"  # recompute='none' and it does not fit the GPU: "recompute" it, or "ignore"

    def problems(self) -> list[str]:
        out = []
        if self.gate_calls < 1:
            out.append(f"gate_calls={self.gate_calls}: must be >= 1")
        for name, choices in (
            ("gshard_overheads", GSHARD_OVERHEADS),
            ("gshard_optimizer", OPTIMIZERS),
            ("on_oom", ON_OOM),
        ):
            if getattr(self, name) not in choices:
                out.append(f"{name}={getattr(self, name)!r}: choose one of {', '.join(choices)}")
        for name in ("grad_dtype", "act_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                out.append(f"{name}={getattr(self, name)!r}: choose one of {', '.join(DTYPE_BYTES)}")
        if self.recompute not in RECOMPUTE:
            out.append(f"recompute={self.recompute!r}: choose one of {', '.join(RECOMPUTE)}")
        if not 0.0 <= self.overlap <= 1.0:
            out.append(f"overlap={self.overlap}: must be in [0, 1]")
        if self.grad_reduce not in GRAD_REDUCE:
            out.append(f"grad_reduce={self.grad_reduce!r}: choose one of {', '.join(GRAD_REDUCE)}")
        if self.bucket_elements is not None and self.bucket_elements < 1:
            out.append(f"bucket_elements={self.bucket_elements}: must be >= 1")
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
    dispatch_combine_s: float  # GShard one-hot dispatch/combine matmuls (t_gshard terms: 0 for Dense/DEMix)
    gating_s: float  # GShard routing: memory-bound (s,e,c) and (s,e) tensors + the gate projection
    capacity_padding_s: float  # expert FLOPs on capacity rows beyond the k·S tokens F counts
    expert_roofline_s: float  # expert GEMMs' memory time beyond their compute time
    fp32_master_s: float  # FP16Optimizer's extra optimizer traffic over memory-efficient fp16
    gshard_s: float  # the sum of the five terms above
    memory_gib: float  # estimated peak memory per GPU (model states + activations), GiB
    recompute: str  # what was predicted: 'full' or 'none' ('full' also when forced by memory)
    tflops_per_gpu: float  # recompute convention (the paper's Tables 2/9)
    tflops_per_gpu_no_recompute: float  # forward + backward only (3 forwards)
    comm_share: float  # exposed communication / step time
    allreduce_bytes: float  # gradient bytes each rank all-reduces (over groups of > 1 rank)
    alltoall_bytes: float  # bytes each GPU hands to all-to-all per update (its own slice included)
    internode_bytes: float  # bytes each node sends through its NICs per update (all-reduce + all-to-all)
    bytes_from: str = (
        "formulas"  # 'measured' when priced on a run's measured bytes (`predict(measured_bytes=)`)
    )


def demix_groups(cfg: ModelConfig, gpus: int) -> tuple[int, int]:
    """(ranks per domain group, domains per rank) of DEMix on `gpus` ranks: G domains on n ranks give groups of
    n/G ranks (n a multiple of G) or, with more domains than ranks (G a multiple of n), G/n domains on each rank,
    each domain's group being that one rank (parallel/topology.py)."""
    n = acc.resolved_num_experts(cfg)
    if gpus % n == 0:
        return gpus // n, 1
    if n % gpus == 0:
        return 1, n // gpus
    raise ValueError(
        f"DEMix: {gpus} GPUs cannot be split evenly among {n} domains (nor {n} domains among {gpus} GPUs)"
    )


def allreduce_plan(cfg: ModelConfig, gpus: int, grad_bytes: int) -> list[tuple[float, int]]:
    """(bytes per rank, group size) of each gradient all-reduce of one update (see module docstring)."""
    params = acc.param_counts(cfg)
    kind = cfg.ffn.kind
    if kind == "dense":
        return [(params.total * grad_bytes, gpus)]
    if kind == "demix":
        per_domain = params.expert // params.num_experts
        group, per_rank = demix_groups(cfg, gpus)
        return [(params.shared * grad_bytes, gpus), (per_domain * per_rank * grad_bytes, group)]
    if kind == "gshard":
        n_exp = params.num_experts
        if n_exp % gpus and gpus % n_exp:
            raise ValueError(f"GShard: {n_exp} experts cannot be spread evenly over {gpus} GPUs")
        # each rank's experts over the max(1, gpus/E) ranks holding the same ones (one rank: no time)
        local = params.expert // n_exp * max(1, n_exp // gpus)
        return [(params.shared * grad_bytes, gpus), (local * grad_bytes, max(1, gpus // n_exp))]
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


NORM_BYTES = 8  # parallel/engine.py:global_grad_norm all-reduces one float64 over the data-parallel group


def _ranks_name(ranks: Sequence[int], gpus: int) -> str:
    """The trainer's metric name of a group (parallel/comm_stats.py) as rank 0 sees it."""
    return "data_parallel" if len(ranks) == gpus else "ranks_" + "_".join(map(str, ranks))


def comm_bytes_per_update(cfg: ModelConfig, gpus: int, opts: CostOptions) -> dict[str, float]:
    """Bytes rank 0 hands to each collective per update, keyed `<group>/<op>` as the trainer's
    `comm/<group>/<op>/bytes` metrics (ZeRO stage 0, no tensor parallelism; `cfg.vocab_size` padded as the
    model builds it). `allreduce_plan` and `alltoall_volume` plus the 8-byte all-reduce of the global gradient
    norm; DEMix's domain group is the trainer's `expert` group; GShard's groups follow DeepSpeed's layout
    (expert-parallel ranks 0..E-1, expert-data-parallel ranks 0, E, 2E, ...; a group of rank 0 alone is `local`:
    DeepSpeed calls the all-reduce, nothing moves). tests/test_comm_measured.py checks
    this against the running trainer at 8 and 16 ranks."""
    grad_bytes = DTYPE_BYTES[opts.grad_dtype]
    out: dict[str, float] = {}
    for i, (nbytes, p) in enumerate(allreduce_plan(cfg, gpus, grad_bytes)):
        if i == 0 or p == gpus:  # the world (one rank alone: everything is its data-parallel all-reduce)
            name = "data_parallel"
        elif cfg.ffn.kind == "demix":
            name = "expert"
        elif p == 1:  # GShard, one rank per expert-data-parallel group
            name = "local"
        else:  # GShard's replicated experts: expert-data-parallel group of rank 0
            name = _ranks_name(range(0, gpus, acc.resolved_num_experts(cfg)), gpus)
        out[f"{name}/all_reduce"] = out.get(f"{name}/all_reduce", 0.0) + nbytes
    out["data_parallel/all_reduce"] += NORM_BYTES
    volume, count = alltoall_volume(cfg, opts)
    ep = min(gpus, acc.resolved_num_experts(cfg))
    if count and ep > 1:  # DeepSpeed exchanges nothing in a one-rank expert-parallel group
        out[f"{_ranks_name(range(ep), gpus)}/all_to_all_single"] = volume * count
    return out


def plan_from_measured(
    cfg: ModelConfig, gpus: int, opts: CostOptions, measured: dict[str, float]
) -> tuple[list[tuple[float, int]], float, int]:
    """`allreduce_plan` and `alltoall_volume` with the bytes a running trainer measured (`measured`: bytes per
    update keyed `<group>/<op>`, as `comm_bytes_per_update` and the sweep's `comm_bytes`) in place of the
    formulas: each measured group keeps its size from the layout, the all-to-all count stays structural
    (layers x passes x accumulation), its volume is the measured bytes / count. A group the layout does not
    explain is an error naming it."""
    modelled = comm_bytes_per_update(cfg, gpus, opts)
    unknown = sorted(set(measured) - set(modelled))
    if unknown:
        raise ValueError(
            f"measured collectives {', '.join(unknown)} are not in the cost model's plan "
            f"({', '.join(sorted(modelled))}) for {cfg.ffn.kind} on {gpus} GPUs"
        )
    sizes = {"data_parallel": gpus, "local": 1}
    if cfg.ffn.kind == "demix":
        sizes["expert"] = demix_groups(cfg, gpus)[0]
    elif cfg.ffn.kind == "gshard":
        n_exp = acc.resolved_num_experts(cfg)
        sizes[_ranks_name(range(0, gpus, n_exp), gpus)] = max(1, gpus // n_exp)
    plan = [
        (nbytes - (NORM_BYTES if key == "data_parallel/all_reduce" else 0), sizes[key.split("/")[0]])
        for key, nbytes in measured.items()
        if key.endswith("/all_reduce")
    ]
    _, count = alltoall_volume(cfg, opts)
    a2a = sum(v for k, v in measured.items() if k.endswith("/all_to_all_single"))
    return plan, (a2a / count if count else 0.0), count


# --------------------------------------------------------------------------------------------------
# GShard terms beyond all-to-all volume, and memory (see the module docstring for sources)
# --------------------------------------------------------------------------------------------------

# Bytes moved per element of the (s, e, c) routing tensors (fp32 gating, fp16 activations), per gate call in
# the forward, per MoE-layer forward, and in the backward; and per (s, e) element (approximate).
SEC_BYTES_PER_GATE_CALL = 4 + 4 + 12 + 5 + 6  # 2 outer products, their sum, .bool(), .to(fp16)
SEC_BYTES_PER_FORWARD = 3  # dispatch mask .to(fp16)
SEC_BYTES_BACKWARD = 6 + 8  # fp16 -> fp32 gradient, the 2 outer products' backward
SE_BYTES_PER_GATE_CALL = 516  # ≈ 40 element-wise passes over (S, E) fp32/int64 tensors in top2gating
SE_BYTES_BACKWARD = 110
SAVED_SEC_BYTES = 4  # fp16 combine weights + fp16 dispatch mask kept for the backward, per (s, e, c)
# Optimizer-step bytes per parameter (fused Adam): FP16Optimizer (--fp16) vs memory-efficient fp16.
OPTIMIZER_STEP_BYTES = {"fp32_master": 60, "memory_efficient": 32}
# Model-state bytes per parameter: fp16 params + fp16 grads + fp32 Adam m, v (+ fp32 master params, grads).
STATE_BYTES = {"fp32_master": 20, "memory_efficient": 12}


def gshard_capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float = 1.0) -> int:
    """Expert capacity in training, fairseq's `top2gating`: C = k · ceil(c · S / E) (c = 1: 2·ceil(S/E))."""
    return top_k * math.ceil(capacity_factor * tokens / num_experts)


def dispatch_combine_flops(
    tokens: int, num_experts: int, capacity: int, d_model: int, forward_passes: int
) -> int:
    """FLOPs of the one-hot dispatch (sec,sm->ecm) and combine (sec,ecm->sm) matmuls of one MoE layer and
    micro-batch: 2·N·d per matmul, N = S·E·C; forward 2 matmuls per pass, backward 3 (dispatch w.r.t. the
    input only, combine w.r.t. both operands): 2·N·d·(2·f + 3)."""
    n = tokens * num_experts * capacity
    return 2 * n * d_model * (2 * forward_passes + 3)


def gating_bytes(tokens: int, num_experts: int, capacity: int, forward_passes: int, gate_calls: int) -> float:
    """Memory traffic of the element-wise routing work of one MoE layer and micro-batch (module docstring):
    N·((31·g + 3)·f + 14) + S·E·(516·g·f + 110)."""
    n, se = tokens * num_experts * capacity, tokens * num_experts
    sec = n * (
        (SEC_BYTES_PER_GATE_CALL * gate_calls + SEC_BYTES_PER_FORWARD) * forward_passes + SEC_BYTES_BACKWARD
    )
    return float(sec + se * (SE_BYTES_PER_GATE_CALL * gate_calls * forward_passes + SE_BYTES_BACKWARD))


def _roofline_excess(
    flops: float, nbytes: float, matmul_flops_per_s: float, bytes_per_s: Optional[float]
) -> float:
    """Seconds a kernel's memory time exceeds its compute time (0 when compute-bound or B unknown)."""
    return 0.0 if bytes_per_s is None else max(0.0, nbytes / bytes_per_s - flops / matmul_flops_per_s)


def params_per_gpu(cfg: ModelConfig, gpus: int) -> int:
    """Parameters one GPU holds: Dense all; DEMix the shared ones + its domain's expert in every layer;
    GShard the shared ones + its E/n experts (at least one) in every expert layer."""
    p = acc.param_counts(cfg)
    if cfg.ffn.kind == "dense" or not p.num_experts:
        return p.total
    one = p.expert // p.num_experts  # one expert in every expert layer
    if cfg.ffn.kind == "gshard":
        return p.shared + one * max(1, p.num_experts // gpus)
    return p.shared + one


def _state_kind(cfg: ModelConfig, opts: CostOptions) -> str:
    return (
        "fp32_master" if cfg.ffn.kind == "gshard" and opts.gshard_optimizer == "fp16" else "memory_efficient"
    )


def memory_bytes(cfg: ModelConfig, gpus: int, opts: CostOptions, recompute: bool) -> float:
    """Peak memory per GPU, bytes: model states (12 or 20 B/param, see STATE_BYTES) + activations
    (`parallel.memory.activation_bytes`, fp16) + GShard's saved routing tensors (4 B per (s, e, c) per MoE
    layer kept, one layer when recomputing).

    This is the paper's fairseq training, like the rest of this model, not this framework's: the formula
    (Korthikanti et al.) counts what fairseq keeps, its unfused attention's s x s scores, softmax and dropout
    mask, and the whole-vocabulary fp32 logits of an unchunked loss, where this framework runs fused attention,
    a chunked loss and DeepSpeed's MoE layer. The memory of this framework's runs (the dry run's fit verdict) is
    `parallel.memory.estimate_activations`, traced from the model itself; benchmarks/results/memory_estimate.md
    shows how far the formula is from it."""
    from parallel.memory import activation_bytes

    states = params_per_gpu(cfg, gpus) * STATE_BYTES[_state_kind(cfg, opts)]
    act = activation_bytes(cfg, opts.micro_batch, 1, recompute, "fp16")
    if cfg.ffn.kind == "gshard":
        tokens, n_exp = opts.micro_batch * cfg.seq_len, acc.resolved_num_experts(cfg)
        n = (
            tokens
            * n_exp
            * gshard_capacity(tokens, n_exp, cfg.ffn.gshard.top_k, cfg.ffn.gshard.capacity_factor)
        )
        act += SAVED_SEC_BYTES * n * (1 if recompute else len(cfg.moe_layer_ids()))
    return float(states + act)


@dataclass(frozen=True)
class GShardTerms:
    """Seconds per update of GShard work that is neither model FLOPs nor all-to-all volume."""

    dispatch_combine_s: float = 0.0
    gating_s: float = 0.0
    capacity_padding_s: float = 0.0
    expert_roofline_s: float = 0.0
    fp32_master_s: float = 0.0

    @property
    def total(self) -> float:
        return (
            self.dispatch_combine_s
            + self.gating_s
            + self.capacity_padding_s
            + self.expert_roofline_s
            + self.fp32_master_s
        )


def gshard_terms(
    cfg: ModelConfig, gpus: int, cluster: ClusterSpec, eff: Efficiency, opts: CostOptions, recompute: bool
) -> GShardTerms:
    """The t_gshard components of one update on one GPU (module docstring); all zero unless GShard and
    `opts.gshard_overheads` is "fairseq". Matmuls run at e_max (the padded expert rows at e(h): they are FFN
    work like F's); memory-bound work at the cluster's HBM bandwidth (left out when it is unknown)."""
    if cfg.ffn.kind != "gshard" or opts.gshard_overheads == "none":
        return GShardTerms()
    gs, d, d_ffn = cfg.ffn.gshard, cfg.d_model, cfg.d_ffn
    n_exp, n_moe = acc.resolved_num_experts(cfg), len(cfg.moe_layer_ids())
    tokens = opts.micro_batch * cfg.seq_len
    cap = gshard_capacity(tokens, n_exp, gs.top_k, gs.capacity_factor)
    fwd = 2 if recompute else 1
    per_update = n_moe * opts.grad_accum  # MoE layer x micro-batch instances per update
    peak = cluster.peak * 1e12
    matmul = peak * eff.e_max
    bw = cluster.hbm_bytes_per_s

    dispatch = per_update * dispatch_combine_flops(tokens, n_exp, cap, d, fwd) / matmul

    gating = 0.0
    if bw is not None:
        gating += per_update * gating_bytes(tokens, n_exp, cap, fwd, opts.gate_calls) / bw
    gate_flops, gate_bytes = 2.0 * tokens * d * n_exp, 2.0 * (tokens * d + d * n_exp + tokens * n_exp)
    gate_gemm = max(gate_flops / matmul, gate_bytes / bw if bw is not None else 0.0)
    gating += per_update * (opts.gate_calls * fwd + 2) * gate_gemm

    padded_rows = max(0, n_exp * cap - gs.top_k * tokens)
    padding = per_update * (fwd + 2) * 4.0 * d * d_ffn * padded_rows / (peak * eff.at(d))

    ep = min(gpus, n_exp)
    rows, local = ep * cap, max(1, n_exp // gpus)
    gemm_flops, gemm_bytes = 2.0 * rows * d * d_ffn, 2.0 * (rows * d + d * d_ffn + rows * d_ffn)
    roofline = per_update * local * 2 * (fwd + 2) * _roofline_excess(gemm_flops, gemm_bytes, matmul, bw)

    master = 0.0
    if _state_kind(cfg, opts) == "fp32_master" and bw is not None:
        extra = OPTIMIZER_STEP_BYTES["fp32_master"] - OPTIMIZER_STEP_BYTES["memory_efficient"]
        master = extra * params_per_gpu(cfg, gpus) / bw
    return GShardTerms(dispatch, gating, padding, roofline, master)


def predict(
    cfg: ModelConfig,
    gpus: int,
    cluster: ClusterSpec,
    eff: Efficiency,
    opts: CostOptions = CostOptions(),
    measured_bytes: Optional[dict[str, float]] = None,
) -> Prediction:
    """Predicted step time and TFLOPs/GPU of one update of `cfg` data-parallel over `gpus` GPUs. With
    `measured_bytes` (a run's bytes per update and group, `plan_from_measured`) the communication is priced on
    the bytes the trainer handed to its collectives instead of the byte formulas."""
    problems = opts.problems()
    if problems:
        raise ConfigError(problems, "cost options")
    recompute = opts.recompute == "full"
    memory = memory_bytes(cfg, gpus, opts, recompute)
    limit = cluster.gpu_memory_bytes
    if not recompute and opts.on_oom == "recompute" and limit is not None and memory > limit:
        recompute, opts = True, replace(opts, recompute="full")  # --checkpoint-activations keeps micro-batch
        memory = memory_bytes(cfg, gpus, opts, recompute)
    flops = acc.flops_per_update(cfg, gpus * opts.micro_batch * opts.grad_accum)
    executed = flops.get("recompute" if recompute else "no_recompute")
    e = eff.at(cfg.d_model)
    compute = executed / (gpus * cluster.peak * 1e12 * e)
    bucket = trainer_bucket_bytes(cfg, gpus, opts) if opts.grad_reduce != "fixed" else opts.bucket_mb * 2**20
    if measured_bytes is None:
        plan = allreduce_plan(cfg, gpus, DTYPE_BYTES[opts.grad_dtype])
        volume, count = alltoall_volume(cfg, opts)
    else:
        plan, volume, count = plan_from_measured(cfg, gpus, opts, measured_bytes)
    allreduce = sum(allreduce_seconds(nbytes, p, cluster, bucket) for nbytes, p in plan)
    ep_group = min(gpus, acc.resolved_num_experts(cfg)) if count else 1
    alltoall = count * alltoall_seconds(volume, ep_group, cluster)
    last_bucket = max(
        (allreduce_seconds(min(nbytes, bucket), p, cluster, bucket) for nbytes, p in plan), default=0.0
    )
    backward = compute / opts.grad_accum * (3 / 4 if recompute else 2 / 3)  # the last micro-batch's backward
    exposed = exposed_allreduce_seconds(allreduce, last_bucket, backward, opts) + alltoall
    terms = gshard_terms(cfg, gpus, cluster, eff, opts, recompute)
    step = compute + exposed + terms.total
    g = cluster.gpus_per_node
    internode = sum(allreduce_internode_bytes(nbytes, p, g) for nbytes, p in plan)
    internode += count * alltoall_internode_bytes(volume, ep_group, g)
    return Prediction(
        arch=cfg.ffn.kind,
        gpus=gpus,
        d_model=cfg.d_model,
        tflops_per_update=flops.recompute / 1e12,
        efficiency=e,
        compute_s=compute,
        allreduce_s=allreduce,
        alltoall_s=alltoall,
        step_s=step,
        dispatch_combine_s=terms.dispatch_combine_s,
        gating_s=terms.gating_s,
        capacity_padding_s=terms.capacity_padding_s,
        expert_roofline_s=terms.expert_roofline_s,
        fp32_master_s=terms.fp32_master_s,
        gshard_s=terms.total,
        memory_gib=memory / 2**30,
        recompute="full" if recompute else "none",
        tflops_per_gpu=flops.recompute / (gpus * step) / 1e12,
        tflops_per_gpu_no_recompute=flops.no_recompute / (gpus * step) / 1e12,
        comm_share=exposed / step,
        allreduce_bytes=sum(nbytes for nbytes, p in plan if p > 1),
        alltoall_bytes=volume * count,
        internode_bytes=internode,
        bytes_from="formulas" if measured_bytes is None else "measured",
    )


def exposed_allreduce_seconds(
    allreduce_s: float, last_bucket_s: float, backward_s: float, opts: CostOptions
) -> float:
    """The gradient all-reduce time left on the critical path of an update:

        fixed           (1 - overlap) · t_allreduce                   a what-if fraction (the paper fit: 0)
        after_backward  t_allreduce                                   reduced once the backward has finished
        overlap         max(t_last, t_allreduce - t_backward)         bucket by bucket during the backward

    With `parallel.grad_reduce: overlap` (ZeRO 0's hooks, ZeRO 1/2's overlap_comm) a bucket is issued as soon as the
    backward of the accumulation boundary has finished its gradients; earlier micro-batches only accumulate, so only
    that one backward (t_backward: 2/3 of a micro-batch's compute, 3/4 with the recomputed forward) can hide the
    all-reduce, and the last bucket, whose gradients (the embeddings and first layers) the backward finishes last, runs
    after it (t_last). A single bucket (a model smaller than the bucket rule's size) is all last bucket: nothing hides.
    Optimistic by the backward's time to fill the first bucket."""
    if opts.grad_reduce == "fixed":
        return (1 - opts.overlap) * allreduce_s
    if opts.grad_reduce == "after_backward":
        return allreduce_s
    return min(allreduce_s, max(last_bucket_s, allreduce_s - backward_s))


def trainer_bucket_bytes(cfg: ModelConfig, gpus: int, opts: CostOptions) -> float:
    """The trainer's gradient bucket in bytes: parallel/engine.py's `bucket_elements` for the parameters a GPU holds
    (or `opts.bucket_elements`), in the gradient dtype."""
    from parallel.grad_reduce import bucket_elements

    return (
        bucket_elements(params_per_gpu(cfg, gpus), gpus, opts.bucket_elements) * DTYPE_BYTES[opts.grad_dtype]
    )


def trainer_cost_options(train: TrainConfig, parallel: ParallelConfig, **changes: Any) -> CostOptions:
    """CostOptions for a run of this trainer: its micro-batch, accumulation, recompute, the dtype it reduces gradients
    in (bf16 at ZeRO 0 trains by autocast over fp32 weights; `train.grad_reduce_dtype: fp32` reduces bf16 in fp32)
    and how it reduces them (`parallel.grad_reduce`, `parallel.bucket_elements`); `changes` override any field."""
    grad = train.precision
    if train.precision == "bf16" and (parallel.zero_stage == 0 or train.grad_reduce_dtype == "fp32"):
        grad = "fp32"
    base = dict(
        micro_batch=train.micro_batch,
        grad_accum=train.grad_accum,
        grad_dtype=grad,
        act_dtype=train.precision,
        recompute="full" if train.activation_checkpointing == "full" else "none",
        grad_reduce=parallel.grad_reduce,
        bucket_elements=parallel.bucket_elements,
    )
    return CostOptions(**{**base, **changes})


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


def paper_report(cluster: ClusterSpec, opts: CostOptions = CostOptions(), form: str = "saturating") -> dict:
    """Fit on Dense, predict all 12 configurations, and compare with the paper (JSON-ready)."""
    points = paper_points()
    eff = fit_efficiency(points, cluster, opts, form)
    rows = []
    for pt in points:
        pred = predict(pt.cfg, pt.gpus, cluster, eff, opts)
        err = (pred.tflops_per_gpu - pt.measured_tflops_per_gpu) / pt.measured_tflops_per_gpu
        rows.append(
            {
                "size": pt.size,
                **asdict(pred),
                "paper_tflops_per_gpu": pt.measured_tflops_per_gpu,
                "rel_err": err,
            }
        )
    mean_abs = {a: sum(abs(r["rel_err"]) for r in rows if r["arch"] == a) / 4 for a in ARCHS}
    return {
        "cluster": asdict(cluster),
        "options": asdict(opts),
        "fitted": {**asdict(eff), "fitted_on_archs": ["dense"]},
        "rows": rows,
        "mean_abs_rel_err": mean_abs,
    }


def before_options(opts: CostOptions) -> CostOptions:
    """The earlier, all-to-all-only model: no t_gshard terms and no memory fallback."""
    return replace(opts, gshard_overheads="none", on_oom="ignore")


GSHARD_TERM_KEYS: tuple[str, ...] = (
    "dispatch_combine_s",
    "gating_s",
    "capacity_padding_s",
    "expert_roofline_s",
    "fp32_master_s",
)


def gshard_comparison(
    cluster: ClusterSpec, opts: CostOptions = CostOptions(), form: str = "saturating"
) -> list[dict]:
    """Each GShard point before (all-to-all only) and after the t_gshard terms, for `opts` and for
    recompute='none' (what the reference train.sh runs: no --checkpoint-activations), each refitted on Dense
    only; with the step time the paper's TFLOPs/GPU implies and what-ifs for the notes."""
    variants = {"": opts, "none_": replace(opts, recompute="none")}
    reports = {}
    for prefix, o in variants.items():
        reports[prefix + "before"] = paper_report(cluster, before_options(o), form)
        reports[prefix + "after"] = paper_report(cluster, o, form)
    out = []
    for i, r in enumerate(reports["after"]["rows"]):
        if r["arch"] != "gshard":
            continue
        row = {
            "size": r["size"],
            "gpus": r["gpus"],
            "paper_tflops_per_gpu": r["paper_tflops_per_gpu"],
            "paper_step_s": r["tflops_per_update"] / (r["gpus"] * r["paper_tflops_per_gpu"]),
        }
        for name, rep_ in reports.items():
            x = rep_["rows"][i]
            row.update(
                {
                    f"{name}_tflops_per_gpu": x["tflops_per_gpu"],
                    f"{name}_rel_err": x["rel_err"],
                    f"{name}_step_s": x["step_s"],
                    f"{name}_alltoall_s": x["alltoall_s"],
                }
            )
            if name.endswith("after"):
                row.update({f"{name}_{k}": x[k] for k in GSHARD_TERM_KEYS})
                row.update({f"{name}_memory_gib": x["memory_gib"], f"{name}_recompute": x["recompute"]})
        out.append(row)
    return out


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------

_COLUMNS = (
    ("size", "size"),
    ("arch", "arch"),
    ("GPUs", "gpus"),
    ("TFLOPs/upd", "tflops_per_update"),
    ("e(h)", "efficiency"),
    ("compute s", "compute_s"),
    ("all-reduce s", "allreduce_s"),
    ("all-to-all s", "alltoall_s"),
    ("dispatch/combine s", "dispatch_combine_s"),
    ("gating s", "gating_s"),
    ("padding s", "capacity_padding_s"),
    ("expert roofline s", "expert_roofline_s"),
    ("fp32 master s", "fp32_master_s"),
    ("NIC GB/node", "internode_bytes"),
    ("mem GiB", "memory_gib"),
    ("recompute", "recompute"),
    ("step s", "step_s"),
    ("comm share", "comm_share"),
    ("pred TFLOPs/GPU", "tflops_per_gpu"),
    ("paper", "paper_tflops_per_gpu"),
    ("error", "rel_err"),
)


def _cell(key: str, value: object) -> str:
    if key in ("comm_share", "efficiency"):
        return f"{100 * float(value):.1f}%"
    if key == "rel_err":
        return f"{100 * float(value):+.1f}%"
    if key == "internode_bytes":
        return f"{float(value) / 1e9:.2f}"
    if key == "memory_gib":
        return f"{float(value):.1f}"
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
        return "\n".join(
            ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(b) + " |" for b in body]
        )
    widths = [max(len(c) for c in col) for col in zip(header, *body)]
    fmt = lambda cells: "  ".join(
        c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
    )  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(b) for b in body])


def _fitted_line(fit: dict) -> str:
    if fit["form"] == "constant":
        return f"e = {fit['e_max']:.4f} (one constant), fitted on {fit['fitted_on']}"
    return f"e(h) = {fit['e_max']:.4f} · h / (h + {fit['h_half']:.1f}), fitted on {fit['fitted_on']}"


def sensitivity(opts: CostOptions) -> list[dict]:
    """Mean |error| per arch under alternative assumptions (each refitted on Dense only), and each DEMix and
    GShard point's error; GShard also before the t_gshard terms (`before_options`)."""
    out = []
    variants = [
        (c, f, o, r)
        for c in ("v100-dgx1", "v100-dgx1-4ib")
        for f in EFFICIENCY_FORMS
        for o in (0.0, 1.0)
        for r in ("full",)
    ]
    variants += [(c, "saturating", 0.0, "none") for c in ("v100-dgx1", "v100-dgx1-4ib")]
    for cluster_name, form, overlap, recompute in variants:
        o = CostOptions(**{**asdict(opts), "overlap": overlap, "recompute": recompute})
        rep = paper_report(load_cluster(cluster_name), o, form)
        before = paper_report(load_cluster(cluster_name), before_options(o), form)
        out.append(
            {
                "cluster": cluster_name,
                "efficiency_form": form,
                "overlap": overlap,
                "recompute": recompute,
                **{f"{a}_mean_abs_err": rep["mean_abs_rel_err"][a] for a in ARCHS},
                **{f"{r['size']}_{r['arch']}_err": r["rel_err"] for r in rep["rows"] if r["arch"] != "dense"},
                **{
                    f"{r['size']}_gshard_err_before": r["rel_err"]
                    for r in before["rows"]
                    if r["arch"] == "gshard"
                },
                "gshard_mean_abs_err_before": before["mean_abs_rel_err"]["gshard"],
            }
        )
    return out


# --max-update per size in the reference demix/train.sh (gpt3_small/medium/large/xl), "about 48 hours" each.
REFERENCE_MAX_UPDATES: dict[str, int] = {"125M": 300_000, "350M": 120_000, "760M": 65_000, "1.3B": 50_000}
REFERENCE_HOURS = 48.0


def gshard_what_ifs(
    cluster: ClusterSpec, opts: CostOptions = CostOptions(), form: str = "saturating"
) -> dict:
    """Numbers for the report's GShard notes (none of them is fitted to a GShard row):
    the 1.3B GShard's memory at micro-batch 2 without recompute, its prediction at micro-batch 1 x 16
    accumulation (recompute none, e(h) unchanged: the fit has no micro-batch information), and every GShard
    point without its all-to-all (the public fork builds each MOELayer with `group=dist.new_group([rank])`,
    a one-rank expert group, which would make the all-to-all a local copy)."""
    none = replace(opts, recompute="none")
    eff_none = fit_efficiency(paper_points(), cluster, none, form)
    xl = next(pt for pt in paper_points() if pt.size == "1.3B" and pt.arch == "gshard")
    mb1 = replace(none, micro_batch=1, grad_accum=opts.grad_accum * opts.micro_batch)  # same global batch
    pred_mb1 = predict(xl.cfg, xl.gpus, cluster, eff_none, mb1)
    no_a2a = {}
    for label, o in (("", opts), ("none_", none)):
        rep = paper_report(cluster, o, form)
        for r in rep["rows"]:
            if r["arch"] == "gshard":
                tpg = r["tflops_per_update"] / (r["gpus"] * (r["step_s"] - r["alltoall_s"]))
                no_a2a[f"{label}{r['size']}"] = {
                    "tflops_per_gpu": tpg,
                    "rel_err": tpg / r["paper_tflops_per_gpu"] - 1,
                }
    limit = cluster.gpu_memory_bytes
    too_big = [
        f"{pt.size} {pt.arch}"
        for pt in paper_points()
        if limit is not None and memory_bytes(pt.cfg, pt.gpus, none, False) > limit
    ]
    xl_dense = next(pt for pt in paper_points() if pt.size == "1.3B" and pt.arch == "dense")
    wall = {
        pt.size: acc.flops_per_update(pt.cfg, pt.gpus * opts.micro_batch * opts.grad_accum).recompute
        * REFERENCE_MAX_UPDATES[pt.size]
        / (pt.gpus * REFERENCE_HOURS * 3600)
        / 1e12
        for pt in paper_points()
        if pt.arch == "dense"
    }
    return {
        "dense_tflops_per_gpu_from_max_updates_over_48h": wall,
        "not_fitting_without_recompute": too_big,
        "xl_params_per_gpu": params_per_gpu(xl.cfg, xl.gpus),
        "xl_dense_memory_gib_no_recompute": memory_bytes(xl_dense.cfg, xl_dense.gpus, none, False) / 2**30,
        "xl_memory_gib_no_recompute": memory_bytes(xl.cfg, xl.gpus, none, False) / 2**30,
        "xl_memory_gib_recompute": memory_bytes(xl.cfg, xl.gpus, opts, True) / 2**30,
        "xl_memory_gib_mb1_no_recompute": memory_bytes(xl.cfg, xl.gpus, mb1, False) / 2**30,
        "gpu_memory_gib": None if limit is None else limit / 2**30,
        "xl_mb1": {
            "micro_batch": mb1.micro_batch,
            "grad_accum": mb1.grad_accum,
            "recompute": pred_mb1.recompute,
            "step_s": pred_mb1.step_s,
            "tflops_per_gpu": pred_mb1.tflops_per_gpu,
            "rel_err": pred_mb1.tflops_per_gpu / xl.measured_tflops_per_gpu - 1,
        },
        "no_alltoall": no_a2a,
    }


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _gshard_section(cmp: list[dict], what: dict, opts: dict) -> list[str]:
    """The GShard before/after table and the honest accounting of what is left."""
    rc = opts["recompute"]
    lines = [
        "## GShard: before / after the t_gshard terms",
        "",
        "Before: the all-to-all-only model (`--gshard-overheads none`). After: + dispatch/combine einsums, gating, "
        "capacity padding, expert roofline, fp32 master weights (and, with recompute none, the memory fallback). "
        f"Main table: recompute {rc}. Right: recompute none, what the reference `demix/train.sh` runs (no "
        "`--checkpoint-activations`); each refitted on Dense only.",
        "",
        f"| size | paper TFLOPs/GPU | before ({rc}) | after ({rc}) | t_gshard s: dispatch/combine + gating + padding + roofline + fp32 master "
        "| after step s / paper-implied step s | before (none) | after (none) | mem GiB, recompute (none) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in cmp:
        terms = " + ".join(f"{r['after_' + k]:.3f}" for k in GSHARD_TERM_KEYS)
        lines.append(
            f"| {r['size']} | {r['paper_tflops_per_gpu']:g} | {r['before_tflops_per_gpu']:.1f} ({_pct(r['before_rel_err'])}) "
            f"| {r['after_tflops_per_gpu']:.1f} ({_pct(r['after_rel_err'])}) | {terms} "
            f"| {r['after_step_s']:.2f} / {r['paper_step_s']:.2f} "
            f"| {r['none_before_tflops_per_gpu']:.1f} ({_pct(r['none_before_rel_err'])}) "
            f"| {r['none_after_tflops_per_gpu']:.1f} ({_pct(r['none_after_rel_err'])}) "
            f"| {r['none_after_memory_gib']:.1f}, {r['none_after_recompute']} |"
        )
    xl = next(r for r in cmp if r["size"] == "1.3B")
    small = [r for r in cmp if r["size"] != "1.3B"]
    gap = xl["paper_step_s"] - xl["after_step_s"]
    gap_none = xl["paper_step_s"] - xl["none_after_step_s"]
    mb1 = what["xl_mb1"]
    gpu = what["gpu_memory_gib"]
    xl_params = what["xl_params_per_gpu"]
    wall = ", ".join(f"{v:.0f}" for v in what["dense_tflops_per_gpu_from_max_updates_over_48h"].values())
    routing = ", ".join(f"{r['after_dispatch_combine_s'] + r['after_gating_s']:.2f}" for r in cmp)
    a2a = ", ".join(f"{r['after_alltoall_s']:.2f}" for r in cmp)
    no_a2a = ", ".join(
        f"{v['tflops_per_gpu']:.1f}" for k, v in what["no_alltoall"].items() if not k.startswith("none_")
    )
    after_small = ", ".join(_pct(r["after_rel_err"]) for r in small)
    if all(r["before_rel_err"] < 0 for r in small):
        slow_line = (
            f"- With recompute {rc} (main table) the 125M-760M points were already predicted too slow; the terms add "
            f"time, so they move further below the paper ({after_small}). An under-prediction cannot be fixed by "
            "adding justified costs; what is off is an assumption shared with the all-to-all (the inter-node "
            "bandwidth) or the recompute setting (next point). No GShard constant was tuned."
        )
    else:
        slow_line = (
            f"- With recompute {rc} (main table) the terms move 125M-760M from "
            f"{', '.join(_pct(r['before_rel_err']) for r in small)} to {after_small}. No GShard constant was tuned."
        )
    explained = abs(xl["after_rel_err"]) <= 0.2 or abs(xl["none_after_rel_err"]) <= 0.2
    gpu_txt = "unknown GPU memory" if gpu is None else f"{gpu:g} GiB per GPU"
    lines += [
        "",
        "What the terms do and do not explain:",
        "",
        f"- The terms are small next to the all-to-all: {routing} s per update (dispatch/combine + gating, "
        f"125M ... 1.3B) against an all-to-all of {a2a} s. "
        "Capacity padding and the expert roofline are 0 for every paper row: fairseq's C = 2·ceil(S/E) fills "
        "E·C = 2S = 4096 rows exactly (E divides S = 2048), and a 4096-row expert GEMM is compute-bound on a V100.",
        slow_line,
        f"- With recompute none (the reference scripts' setting) the same terms bring 125M-760M to "
        f"{', '.join(_pct(r['none_after_rel_err']) for r in small)} (from "
        f"{', '.join(_pct(r['none_before_rel_err']) for r in small)}); Dense and DEMix fit as well under either "
        "setting (sensitivity table), so the Dense rows cannot tell the two apart.",
        f"- Memory: at micro-batch 2 without recompute the 1.3B GShard needs ≈ {what['xl_memory_gib_no_recompute']:.1f} GiB per "
        f"GPU ({gpu_txt}): 20 B/param of --fp16 model states for its {xl_params / 1e9:.2f}B per-GPU parameters "
        f"plus activations, against ≈ {what['xl_dense_memory_gib_no_recompute']:.1f} GiB for the Dense 1.3B "
        f"(--memory-efficient-fp16, 12 B/param). Rows that do not fit without recompute: "
        f"{', '.join(what['not_fitting_without_recompute']) or 'none'}; so the stated 2 x 8 batch cannot run as "
        "scripted there, and with recompute none it is predicted with "
        f"--checkpoint-activations ({_pct(xl['none_before_rel_err'])} → {_pct(xl['none_after_rel_err'])}). "
        f"Micro-batch 1 x 16 would fit ({what['xl_memory_gib_mb1_no_recompute']:.1f} GiB) and predicts "
        f"{mb1['tflops_per_gpu']:.1f} TFLOPs/GPU ({_pct(mb1['rel_err'])}) with e(h) unchanged: the fit has no micro-batch "
        "information, so a smaller micro-batch's lower GEMM efficiency is not modelled.",
        f"- The 1.3B point is {'only partly' if explained else 'not'} explained. The paper's "
        f"{xl['paper_tflops_per_gpu']:g} TFLOPs/GPU implies {xl['paper_step_s']:.1f} s per update; the "
        f"model gives {xl['after_step_s']:.1f} s (recompute {rc}) or {xl['none_after_step_s']:.1f} s (none, recomputed for memory), "
        f"{gap:.1f} s / {gap_none:.1f} s short, while the same model is within "
        f"{max(abs(r['none_after_rel_err']) for r in small) * 100:.0f}% (none) of the 760M GShard on the same 128 GPUs. Its "
        f"all-to-all volume is only 2048/1536 = 1.33x the 760M's; closing the gap would need its all-to-all to take "
        f"≈ {1 + gap / xl['after_alltoall_s']:.1f}x the modelled time (recompute {rc}), i.e. a slower effective network than "
        "the 760M run's (another cluster or placement), or a configuration other than Table 9's (micro-batch, optimizer "
        "offload, a slower partition), or time outside the step: Tables 2/9 may be wall-clock averages over the ~48 h "
        f"budget (train.sh's --max-update x TFLOPs/update / (GPUs x 48 h) gives {wall} TFLOPs/GPU for Dense vs 31, 37, 45, "
        "51), and the 1.3B GShard saves a 52.5B-parameter model with fp32 Adam states every 2,000 updates and validates "
        "every 500. None of these is documented for the GShard runs, so none is modelled.",
        "- The public fork (kernelmachine/demix, `fairseq/modules/transformer_layer.py`) builds each MOELayer with "
        "`group=dist.new_group([ddp_rank])`, a one-rank expert group, which would make every all-to-all a local copy. "
        "Without the all-to-all the model predicts "
        f"{no_a2a} TFLOPs/GPU (125M ... 1.3B; recompute {rc}), far above the paper, so the paper's runs "
        "evidently exchanged tokens (as its text says); the all-to-all stays in the model.",
    ]
    return lines


def write_paper_report(
    report: dict,
    sens: list[dict],
    command: str,
    out_dir: Path,
    gshard: Optional[tuple[list[dict], dict]] = None,
) -> tuple[Path, Path]:
    """benchmarks/results/costmodel_paper.{md,json}; `gshard` = (gshard_comparison, gshard_what_ifs)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "costmodel_paper.json", out_dir / "costmodel_paper.md"
    extra = {} if gshard is None else {"gshard_before_after": gshard[0], "gshard_what_ifs": gshard[1]}
    json_path.write_text(
        json.dumps({"command": command, **report, "sensitivity": sens, **extra}, indent=1) + "\n"
    )
    c = report["cluster"]
    lines = [
        "# Cluster cost model vs DEMix Tables 2/9 (V100 TFLOPs/GPU)",
        "",
        f"Command: `{command}`",
        "",
        f"Cluster `{c['name']}`: {c['description']}",
        "",
        f"Fitted (Dense rows only; DEMix and GShard are predictions): {_fitted_line(report['fitted'])}.",
        "",
        f"Options: {report['options']}",
        "",
        format_table(report["rows"], markdown=True),
        "",
        "Mean |error|: " + ", ".join(f"{a} {100 * v:.1f}%" for a, v in report["mean_abs_rel_err"].items()),
        "",
    ]
    if gshard is not None:
        lines += _gshard_section(gshard[0], gshard[1], report["options"]) + [""]
    lines += [
        "## Sensitivity (each variant refitted on Dense only)",
        "",
        "Mean |error| per arch (gshard: before → after the t_gshard terms), then each GShard point's error "
        "before → after.",
        "",
        "| cluster | e(h) form | overlap | recompute | dense | demix | gshard | GShard 125M / 350M / 760M / 1.3B |",
        "|---|---|---|---|---|---|---|---|",
    ]
    sizes = ("125M", "350M", "760M", "1.3B")
    lines += [
        f"| {s['cluster']} | {s['efficiency_form']} | {s['overlap']:.0%} | {s['recompute']} | "
        + f"{100 * s['dense_mean_abs_err']:.1f}% | {100 * s['demix_mean_abs_err']:.1f}% | "
        + f"{100 * s['gshard_mean_abs_err_before']:.1f}% → {100 * s['gshard_mean_abs_err']:.1f}% | "
        + " / ".join(
            f"{100 * s[f'{z}_gshard_err_before']:+.0f}% → {100 * s[f'{z}_gshard_err']:+.0f}%" for z in sizes
        )
        + " |"
        for s in sens
    ]
    md_path.write_text("\n".join(lines) + "\n\n" + REPORT_NOTES + "\n")
    return md_path, json_path


REPORT_NOTES = """## Model
t_step = F/(n·P·e(h)) + (1 − overlap)·t_allreduce + t_alltoall + t_gshard, P = 125 TFLOP/s (V100 fp16).
Ring all-reduce 2(p−1)/p·S/bw + m·2(p−1)·α; hierarchical (NVLink reduce-scatter, inter-node all-reduce
of the shard, NVLink all-gather) when a group spans nodes; m = 25 MB gradient buckets.
Gradients (fp16): Dense all params over n; DEMix shared over n + each domain's experts over n/8
(inside one node when n/8 <= 8); GShard shared over n, experts not reduced (one expert per GPU).
GShard all-to-all per GPU: c·k·(2·1024)·d·2 bytes, 6 per MoE layer per micro-batch (dispatch+combine in
forward, backward and recomputed forward; 4 without recompute), pairwise-exchange cost with (E−1)/E
off-GPU and (E−8)/E off-node. NIC GB/node: bytes each node sends through its InfiniBand links per update.

t_gshard (GShard only; sources: kernelmachine/demix `demix/train.sh` and `fairseq/modules/moe/`), per MoE
layer and micro-batch, S = 2048 tokens, C = 2·ceil(S/E), N = S·E·C = 2·S², f = forward passes:
- dispatch/combine: the one-hot einsums sec,sm->ecm and sec,ecm->sm run as dense fp16 matmuls,
  2·N·d·(2f + 3) FLOPs at e_max (the fitted matmul efficiency).
- gating: fp32 routing tensors (--moe-gating-use-fp32), N·((31·g + 3)·f + 14) + S·E·(516·g·f + 110) bytes at
  900 GB/s, g = 2 gate evaluations per forward (the fork calls `self.gate` twice), + the fp16 gate GEMM.
- capacity padding: expert FLOPs on the E·C − 2S rows beyond the tokens (0 here: E divides S).
- expert roofline: expert GEMMs' memory time beyond compute time (0 here: 4096-row GEMMs are compute-bound).
- fp32 master: --fp16 (FP16Optimizer) moves ≈ 28 B/param more per optimizer step than the Dense rows'
  --memory-efficient-fp16.
mem GiB: 12 B/param (memory-efficient fp16) or 20 B/param (GShard's --fp16) of model states for the
parameters a GPU holds + activations (parallel/memory.py) + GShard's saved routing tensors; recompute: what
was predicted (recompute none falls back to recomputation when a configuration does not fit 32 GiB).
See `benchmarks/costmodel.py` for the formulas and their sources. No constant was fitted on a GShard or
DEMix row: e(h) is fitted on the four Dense rows, everything else is counted from code or datasheets.

Not modelled: kernel-launch and Python overheads of the routing's many small ops, stragglers,
contention between concurrent collectives, NCCL protocol effects, and time outside the step
(checkpointing, validation)."""


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.costmodel", description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--paper", action="store_true", help="the 12 configurations of DEMix Tables 2/9; writes results"
    )
    mode.add_argument("--preset", help="a model preset (gpt3-small ... gpt3-xl) for one configuration")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--cluster", default="v100-dgx1", help="cluster preset: " + ", ".join(cluster_presets())
    )
    where.add_argument("--cluster-file", help="a cluster YAML (keys of ClusterSpec)")
    p.add_argument("--arch", choices=ARCHS, default="dense", help="with --preset")
    p.add_argument("--gpus", type=positive_int, default=8, help="with --preset")
    p.add_argument(
        "--experts",
        type=nonneg_int,
        default=0,
        help="with --preset: DEMix domains (8) / GShard experts (= GPUs)",
    )
    p.add_argument("--micro-batch", type=positive_int, default=acc.PAPER_MICRO_BATCH)
    p.add_argument("--grad-accum", type=positive_int, default=acc.PAPER_GRAD_ACCUM)
    p.add_argument("--grad-dtype", choices=sorted(DTYPE_BYTES), default="fp16")
    p.add_argument("--recompute", choices=RECOMPUTE, default="full")
    p.add_argument(
        "--overlap", type=unit_closed, default=0.0, help="fraction of the all-reduce hidden by backward"
    )
    p.add_argument("--bucket-mb", type=positive_float, default=25.0)
    p.add_argument(
        "--gshard-overheads",
        choices=GSHARD_OVERHEADS,
        default="fairseq",
        help="t_gshard terms of fairseq's MoE layer; none = the all-to-all-only model",
    )
    p.add_argument(
        "--gate-calls",
        type=positive_int,
        default=2,
        help="GShard gate evaluations per MoE-layer forward (fork: 2)",
    )
    p.add_argument(
        "--gshard-optimizer",
        choices=OPTIMIZERS,
        default="fp16",
        help="GShard's fairseq optimizer wrapper (the reference ran --fp16: fp32 master weights)",
    )
    p.add_argument(
        "--on-oom",
        choices=ON_OOM,
        default="recompute",
        help="with --recompute none, a configuration that does not fit the GPU is recomputed or not",
    )
    p.add_argument("--efficiency-form", choices=EFFICIENCY_FORMS, default="saturating")
    p.add_argument("--out-dir", default=str(RESULTS_DIR), help="with --paper: where the .md/.json go")
    p.add_argument("--no-write", action="store_true", help="with --paper: print only")
    p.add_argument("--json", action="store_true", help="print JSON")
    return p


def _model(preset: str, arch: str, gpus: int, experts: int) -> ModelConfig:
    from launcher.config import load_run_config

    n = experts or {"dense": 0, "demix": acc.PAPER_DEMIX_EXPERTS, "gshard": gpus}[arch]
    return load_run_config(
        None, [f"model.preset={preset}", f"model.ffn.kind={arch}", f"model.ffn.num_experts={n}"]
    ).model


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        cluster = load_cluster(args.cluster_file or args.cluster)
        opts = CostOptions(
            micro_batch=args.micro_batch,
            grad_accum=args.grad_accum,
            grad_dtype=args.grad_dtype,
            act_dtype="fp16",
            recompute=args.recompute,
            overlap=args.overlap,
            bucket_mb=args.bucket_mb,
            gshard_overheads=args.gshard_overheads,
            gate_calls=args.gate_calls,
            gshard_optimizer=args.gshard_optimizer,
            on_oom=args.on_oom,
        )
        if opts.problems() or args.gpus < 1:
            raise ConfigError(
                opts.problems() + ([f"--gpus={args.gpus}: must be >= 1"] if args.gpus < 1 else []), "options"
            )
        if args.paper:
            report = paper_report(cluster, opts, args.efficiency_form)
            if args.json:
                print(json.dumps(report, indent=1))
            else:
                print(format_table(report["rows"]))
                print(f"\nfitted on Dense only: {_fitted_line(report['fitted'])}")
            if not args.no_write:
                command = "python -m benchmarks.costmodel " + shlex.join(argv)
                gshard = (
                    gshard_comparison(cluster, opts, args.efficiency_form),
                    gshard_what_ifs(cluster, opts, args.efficiency_form),
                )
                paths = write_paper_report(report, sensitivity(opts), command, Path(args.out_dir), gshard)
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
