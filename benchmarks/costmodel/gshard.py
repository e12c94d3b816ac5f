"""GShard's work that is neither model FLOPs nor all-to-all volume (t_gshard): fairseq's one-hot dispatch/combine
einsums, the fp32 gating, capacity padding, the expert GEMMs' roofline and the fp32 master weights of `--fp16`.
Counted from the DEMix authors' fairseq fork; the derivation and sources are in docs/costmodel.md."""

from __future__ import annotations

import math
from dataclasses import dataclass

from benchmarks.costmodel.cluster import ClusterSpec
from benchmarks.costmodel.layout import params_per_gpu
from benchmarks.costmodel.options import CostOptions, Efficiency
from model import accounting as acc
from model.config import ModelConfig

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
    """Memory traffic of the element-wise routing work of one MoE layer and micro-batch (docs/costmodel.md):
    N·((31·g + 3)·f + 14) + S·E·(516·g·f + 110)."""
    n, se = tokens * num_experts * capacity, tokens * num_experts
    sec = n * (
        (SEC_BYTES_PER_GATE_CALL * gate_calls + SEC_BYTES_PER_FORWARD) * forward_passes + SEC_BYTES_BACKWARD
    )
    return float(sec + se * (SE_BYTES_PER_GATE_CALL * gate_calls * forward_passes + SE_BYTES_BACKWARD))


def _roofline_excess(
    flops: float, nbytes: float, matmul_flops_per_s: float, bytes_per_s: float | None
) -> float:
    """Seconds a kernel's memory time exceeds its compute time (0 when compute-bound or B unknown)."""
    return 0.0 if bytes_per_s is None else max(0.0, nbytes / bytes_per_s - flops / matmul_flops_per_s)


def state_kind(cfg: ModelConfig, opts: CostOptions) -> str:
    """The optimizer's state layout, a key of STATE_BYTES and OPTIMIZER_STEP_BYTES: GShard under fairseq's --fp16
    keeps fp32 master weights; everything else is memory-efficient fp16."""
    return (
        "fp32_master" if cfg.ffn.kind == "gshard" and opts.gshard_optimizer == "fp16" else "memory_efficient"
    )


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
    """The t_gshard components of one update on one GPU (docs/costmodel.md); all zero unless GShard and
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
    if state_kind(cfg, opts) == "fp32_master" and bw is not None:
        extra = OPTIMIZER_STEP_BYTES["fp32_master"] - OPTIMIZER_STEP_BYTES["memory_efficient"]
        master = extra * params_per_gpu(cfg, gpus) / bw
    return GShardTerms(dispatch, gating, padding, roofline, master)


GSHARD_TERM_KEYS: tuple[str, ...] = (
    "dispatch_combine_s",
    "gating_s",
    "capacity_padding_s",
    "expert_roofline_s",
    "fp32_master_s",
)
