"""Per-GPU memory of a training run, before it runs: model states by ZeRO stage, activations, buffers.

Pure arithmetic on parameter counts and shapes; the dry run builds each rank's model on the meta device for
the counts and prints the table against the GPU's memory.

Model states (Rajbhandari et al. 2020, ZeRO §3 and Figure 1, with DeepSpeed's multipliers so the figures
agree with `deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs`). For Ψ parameters
replicated on N data-parallel ranks, in bytes:

    16-bit mixed precision (fp16, bf16 at ZeRO >= 1):   P = 2Ψ, G = 2Ψ, O = 16Ψ (fp32 params 4 + fp32 grads 4
                                                        + Adam m, v 8)
    fp32 (and bf16 autocast at ZeRO 0, whose weights stay fp32):  P = 4Ψ, G = 4Ψ, O = 8Ψ
    ZeRO 0:  P + G + O          ZeRO 1:  P + G + O/N          ZeRO 2:  P + (G + O)/N      (eq. Z)

A DEMix rank holds shared parameters replicated over the whole data-parallel group and its domains' experts
replicated over the domain group only (R_e ranks): eq. Z applies to each part with its own N (ZeRO partitions
expert parameters over the expert-data-parallel group). GShard experts likewise over their expert-data-parallel
group.

Activations per transformer layer and micro-batch (Korthikanti et al. 2022, "Reducing Activation
Recomputation", §4.1 and Table 2; 16-bit activations, 1-byte dropout masks; s sequence, b micro-batch,
h hidden, a heads, t tensor parallel):

    no recompute:     s·b·h·(10 + 24/t + 5·a·s/(h·t))                                            (eq. A1)
    full recompute:   2·s·b·h (each layer's input) + one layer of eq. A1 while it is recomputed   (eq. A2)

fp32 activations are counted at twice eq. A1/A2. A GShard MoE layer sends each token to top_k experts: its
MLP part (19·s·b·h of the 34 in eq. A1 at t = 1: fc1 input 2, GeLU input 8, GeLU output 8, dropout mask 1)
counts top_k times. The output layer adds the logits, 16-bit and the fp32 copy the loss reads:
6·s·b·V/t bytes (V the padded vocabulary). ZeRO 1/2 also hold DeepSpeed's default reduce and all-gather
buckets (5e8 elements each, 16-bit or fp32 as the gradients).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from model.config import ModelConfig

GIB = 1024**3
DEEPSPEED_BUCKET_ELEMENTS = 500_000_000  # reduce_bucket_size and allgather_bucket_size defaults


@dataclass(frozen=True)
class RankParams:
    """One rank's parameters by how widely they are replicated (per tensor-parallel rank)."""

    shared: int  # replicated on every data-parallel rank
    expert: int  # this rank's experts
    dp_size: int  # N for the shared parameters
    expert_replicas: int  # N for the experts (DEMix: ranks of the domain group; GShard: expert-data-parallel)


def state_bytes_per_param(precision: str, zero_stage: int) -> tuple[int, int, int]:
    """(P, G, O) bytes per parameter for the precision DeepSpeed trains in (see the module docstring)."""
    sixteen_bit = precision == "fp16" or (precision == "bf16" and zero_stage > 0)
    return (2, 2, 16) if sixteen_bit else (4, 4, 8)


def model_state_bytes(p: RankParams, precision: str, zero_stage: int) -> dict[str, float]:
    """Params, grads and optimizer states on this rank, bytes (eq. Z on each part)."""
    P, G, O = state_bytes_per_param(precision, zero_stage)
    out = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    for psi, n in ((p.shared, p.dp_size), (p.expert, p.expert_replicas)):
        out["params"] += P * psi
        out["grads"] += G * psi / (n if zero_stage >= 2 else 1)
        out["optimizer"] += O * psi / (n if zero_stage >= 1 else 1)
    return out


def activation_bytes(m: ModelConfig, micro_batch: int, tensor_parallel: int, recompute: bool, precision: str,
                     vocab_padded: Optional[int] = None) -> float:
    """Activation memory of one micro-batch on one rank, bytes (eqs. A1, A2 and the logits)."""
    s, b, h, a, t = m.seq_len, micro_batch, m.d_model, m.n_heads, tensor_parallel
    scale = 2.0 if precision == "fp32" else 1.0
    dense_layer = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))  # eq. A1
    moe = set(m.moe_layer_ids()) if m.ffn.kind == "gshard" else set()
    extra_mlp = s * b * h * 19 / t * (m.ffn.gshard.top_k - 1) if moe else 0.0
    per_layer = [dense_layer + (extra_mlp if i in moe else 0.0) for i in range(m.n_layers)]
    layers = 2 * s * b * h * m.n_layers + max(per_layer) if recompute else sum(per_layer)  # eq. A2 / A1
    logits = 6 * s * b * (vocab_padded or m.padded_vocab_size(t)) / t
    return scale * layers + logits


def buffer_bytes(precision: str, zero_stage: int) -> float:
    """DeepSpeed's ZeRO 1/2 reduce and all-gather buckets at their defaults (none at ZeRO 0)."""
    if zero_stage == 0:
        return 0.0
    return 2 * DEEPSPEED_BUCKET_ELEMENTS * state_bytes_per_param(precision, zero_stage)[1]


def deepspeed_zero2_estimate(p: RankParams) -> float:
    """DeepSpeed's own ZeRO-2 model-state estimate (no offload) for this rank: its formula 2Ψ + 18Ψ/N applied
    to the shared part and to the experts with their own N (DeepSpeed's estimator knows no experts)."""
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    total = 0.0
    for psi, n in ((p.shared, p.dp_size), (p.expert, p.expert_replicas)):
        if psi:
            total += estimate_zero2_model_states_mem_needs(psi, num_gpus_per_node=n, num_nodes=1, cpu_offload=False)[1]
    return total


def memory_rows(p: RankParams, m: ModelConfig, micro_batch: int, tensor_parallel: int, precision: str,
                gpu_bytes: Optional[float]) -> list[dict]:
    """One row per ZeRO stage (0, 1, 2): model states, buffers, activations with and without recompute, totals,
    and whether each total fits `gpu_bytes` (None: unknown GPU, no verdict)."""
    rows = []
    for zero in (0, 1, 2):
        states = model_state_bytes(p, precision, zero)
        row = {"zero_stage": zero, **states, "model_states": sum(states.values()), "buffers": buffer_bytes(precision, zero)}
        for mode, recompute in (("no_recompute", False), ("recompute", True)):
            act = activation_bytes(m, micro_batch, tensor_parallel, recompute, precision)
            row[f"activations_{mode}"] = act
            row[f"total_{mode}"] = row["model_states"] + row["buffers"] + act
            row[f"fits_{mode}"] = None if gpu_bytes is None else row[f"total_{mode}"] <= gpu_bytes
        rows.append(row)
    if state_bytes_per_param(precision, 2) == (2, 2, 16):  # DeepSpeed's estimator is for 16-bit mixed precision
        rows[2]["deepspeed_estimate"] = deepspeed_zero2_estimate(p)
    return rows
