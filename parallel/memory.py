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

Activations, traced (the default, `estimate_activations`): this rank's GPT as training runs it (its experts, FFN
kind with GShard's layers swapped for DeepSpeed's MoE layer as parallel/gshard.py does, recompute, the precision's
parameter dtype or autocast, micro-batch, sequence length, the chunked loss) is built on the meta device, its
parameters become tensors of torch's FakeTensorMode, and one forward+backward runs under `PeakBytes`
(parallel/peak_memory.py; the accounting of torch's MemTracker, which experiments/memory_estimate.py measures
against): every tensor's storage is counted as a device would hold it, nothing is allocated. Gradients are
preallocated (as after the first micro-batch), so

    activations = peak(total) - params - grads       (MemTracker's ACT + TEMP + OTH + BUFFER at the peak)

Data-dependent shapes are planned, not observed: a DEMix layer's rows per local domain are B / (its domains);
DeepSpeed's GShard layer pads every expert's buffer to its capacity C whatever the routing. Tensor parallel > 1,
GShard layouts whose rank does not hold every expert (DeepSpeed's all-to-all needs the expert-parallel process
group) and any trace that fails fall back to the formula below, and the result says which was used and why.

Activations by formula (the fallback), per transformer layer and micro-batch (Korthikanti et al. 2022, "Reducing
Activation Recomputation", §4.1 and Table 2; 16-bit activations, 1-byte dropout masks; s sequence, b micro-batch,
h hidden, a heads, t tensor parallel):

    no recompute:     s·b·h·(10 + 24/t + 5·a·s/(h·t))                                            (eq. A1)
    full recompute:   2·s·b·h (each layer's input) + one layer of eq. A1 while it is recomputed   (eq. A2)

fp32 activations are counted at twice eq. A1/A2. A GShard MoE layer sends each token to top_k experts: its
MLP part (19·s·b·h of the 34 in eq. A1 at t = 1: fc1 input 2, GeLU input 8, GeLU output 8, dropout mask 1)
counts top_k times. The output layer adds the logits, 16-bit and the fp32 copy the loss reads:
6·s·b·V/t bytes (V the padded vocabulary). Gradient reduction adds its buckets (`buffer_bytes`: sized by
parallel/grad_reduce.py's `bucket_elements`, one or two of them, 16-bit or fp32 as the gradients).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model.config import ModelConfig
from model.ffn import ffn_traits
from parallel.peak_memory import PlannedRouting, count_peak, measure_peak, routing_share

if TYPE_CHECKING:
    from model.gpt import GPT

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


def model_state_bytes(
    p: RankParams, precision: str, zero_stage: int, grad_reduce_dtype: str | None = None
) -> dict[str, float]:
    """Params, grads and optimizer states on this rank, bytes (eq. Z on each part). bf16 at ZeRO 2 with
    `train.grad_reduce_dtype: fp32` keeps its gradient partition in fp32 (DeepSpeed's `grad_accum_dtype`, set by
    parallel/ds_config.py `deepspeed_config`): 4 bytes per partitioned gradient instead of 2."""
    P, G, O = state_bytes_per_param(precision, zero_stage)
    if precision == "bf16" and zero_stage == 2 and grad_reduce_dtype == "fp32":
        G = 4
    out = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    for psi, n in ((p.shared, p.dp_size), (p.expert, p.expert_replicas)):
        out["params"] += P * psi
        out["grads"] += G * psi / (n if zero_stage >= 2 else 1)
        out["optimizer"] += O * psi / (n if zero_stage >= 1 else 1)
    return out


def activation_bytes(
    m: ModelConfig,
    micro_batch: int,
    tensor_parallel: int,
    recompute: bool,
    precision: str,
    vocab_padded: int | None = None,
) -> float:
    """Activation memory of one micro-batch on one rank, bytes (eqs. A1, A2 and the logits)."""
    s, b, h, a, t = m.seq_len, micro_batch, m.d_model, m.n_heads, tensor_parallel
    scale = 2.0 if precision == "fp32" else 1.0
    dense_layer = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))  # eq. A1
    moe = set(m.moe_layer_ids()) if ffn_traits(m.ffn.kind).deepspeed_moe else set()
    extra_mlp = s * b * h * 19 / t * (m.ffn.gshard.top_k - 1) if moe else 0.0
    per_layer = [dense_layer + (extra_mlp if i in moe else 0.0) for i in range(m.n_layers)]
    layers = 2 * s * b * h * m.n_layers + max(per_layer) if recompute else sum(per_layer)  # eq. A2 / A1
    logits = 6 * s * b * (vocab_padded or m.padded_vocab_size(t)) / t
    return scale * layers + logits


def trace_dtypes(precision: str, zero_stage: int) -> tuple[torch.dtype, torch.dtype | None]:
    """(parameter dtype, autocast dtype) of training as parallel/ds_config.py's DeepSpeed config runs it: bf16 at
    ZeRO 0 is torch autocast over fp32 weights; otherwise DeepSpeed casts the parameters themselves."""
    from parallel.precision import AUTOCAST_DTYPES

    half = AUTOCAST_DTYPES.get(precision)
    if half is torch.bfloat16 and zero_stage == 0:
        return torch.float32, torch.bfloat16
    return half or torch.float32, None


def rank_batch(m: ModelConfig, micro_batch: int) -> dict:
    """A training micro-batch (tokens, targets, loss mask); fake when built under FakeTensorMode."""
    B, T = micro_batch, m.seq_len
    return {
        "tokens_BT": torch.randint(0, m.vocab_size, (B, T)),
        "targets_BT": torch.randint(0, m.vocab_size, (B, T)),
        "loss_mask_BT": torch.ones(B, T),
    }


def rank_domain_ids(m: ModelConfig, micro_batch: int, expert_ids: Sequence[int] | None) -> dict:
    """DEMix's domain ids, on the host as the trainer passes them: the micro-batch spread evenly over the rank's
    domains ({} for other kinds)."""
    if not ffn_traits(m.ffn.kind).domain_routed:
        return {}
    ids = sorted(expert_ids) if expert_ids else list(range(max(1, m.ffn.num_experts)))
    return {"domain_ids_B": torch.tensor([ids[i * len(ids) // micro_batch] for i in range(micro_batch)])}


def trace_peak(
    m: ModelConfig,
    micro_batch: int,
    expert_ids: Sequence[int] | None,
    recompute: bool,
    dtype: torch.dtype = torch.bfloat16,
    autocast: torch.dtype | None = None,
    loss_chunk_logits: int | None = None,
    memtracker: bool = False,
    preallocate_grads: bool = True,
) -> dict[str, int]:
    """`count_peak` (or with `memtracker`, torch's MemTracker: `measure_peak`) of this rank's GPT under
    FakeTensorMode (nothing allocated), routing planned; `preallocate_grads=False` measures a first micro-batch
    (gradients created by backward)."""
    return trace_peaks(
        m,
        micro_batch,
        expert_ids,
        (recompute,),
        dtype,
        autocast,
        loss_chunk_logits,
        memtracker,
        preallocate_grads,
    )[recompute]


def trace_peaks(
    m: ModelConfig,
    micro_batch: int,
    expert_ids: Sequence[int] | None,
    recompute: Sequence[bool] = (False, True),
    dtype: torch.dtype = torch.bfloat16,
    autocast: torch.dtype | None = None,
    loss_chunk_logits: int | None = None,
    memtracker: bool = False,
    preallocate_grads: bool = True,
) -> dict[bool, dict[str, int]]:
    """`trace_peak` for each recompute mode in turn (False before True) on one build of the model: recompute is
    applied from outside (parallel/activation_recompute.py), so the same model serves both, and a gpt3-xl trace
    pays for one build and one set of gradients instead of two."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from parallel.activation_recompute import apply_activation_recompute

    domains = rank_domain_ids(m, micro_batch, expert_ids)  # real host tensors, made before the fake mode
    measure = measure_peak if memtracker else count_peak
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    out: dict[bool, dict[str, int]] = {}
    try:
        model, fake = training_model_on_meta(m, expert_ids), FakeTensorMode(allow_non_fake_inputs=True)
        _materialise(model, fake)
        with fake, PlannedRouting(routing_share(m, expert_ids)):
            if loss_chunk_logits is not None:
                model.loss_chunk_logits = loss_chunk_logits
            for mode in sorted(set(recompute)):
                if mode:
                    apply_activation_recompute(model)
                out[mode] = measure(
                    model, {**rank_batch(m, micro_batch), **domains}, autocast, preallocate_grads
                )
                if not preallocate_grads:  # the next mode measures a first micro-batch too
                    for p in model.parameters():
                        p.grad = None
    finally:
        torch.set_default_dtype(old)
    return out


def training_model_on_meta(m: ModelConfig, expert_ids: Sequence[int] | None) -> GPT:
    """This rank's GPT with the layers training runs (`with_training_layers`), on the meta device: no
    initialisation work (built under FakeTensorMode, its random init was a third of a gpt3-xl trace's time)."""
    import warnings

    from model.gpt import GPT

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # load_state_dict between meta tensors is a no-op and says so
        return with_training_layers(GPT(m, expert_ids=expert_ids, init_seed=0), m)


def with_training_layers(model: GPT, m: ModelConfig) -> GPT:
    """`model` (a GPT holding every expert it has) with the layers training runs, in place: a GShard model's plain
    top-k layers become DeepSpeed's MoE layer, as `parallel.gshard.apply_gshard` does, at expert-parallel size 1
    (tracing needs every expert on the rank). That layer, not the plain one, holds training's activations
    (capacity-padded E x C buffers, the fp32 gate input)."""
    if not ffn_traits(m.ffn.kind).deepspeed_moe or max(1, m.ffn.num_experts) == 1:
        return model
    from model.gshard import GShardFFN
    from parallel.gshard import DistributedGShardFFN, GShardLayout

    E = m.ffn.num_experts
    layout = GShardLayout(
        num_experts=E,
        ep_size=1,
        experts_per_rank=E,
        ep_ranks=(0,),
        edp_ranks=(0,),
        local_experts=tuple(range(E)),
    )
    for block in model.blocks:
        if isinstance(block.ffn, GShardFFN):
            block.ffn = DistributedGShardFFN(block.ffn, m, layout)
    return model


def _materialise(model: torch.nn.Module, fake: TorchDispatchMode) -> None:
    """Meta parameters become `fake`'s tensors (nothing allocated; outside PlannedRouting, which would run an op on
    all-meta inputs for real); buffers become real zeros, as a fresh model's: they are small and some are read on
    the host (CSE's cluster count)."""
    done: dict[int, torch.nn.Parameter] = {}
    with fake:
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is not None:
                    if id(p) not in done:
                        done[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="cpu"), p.requires_grad)
                    module._parameters[name] = done[id(p)]
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = torch.zeros(b.shape, dtype=b.dtype)


def depth_unit(m: ModelConfig) -> int | None:
    """Layers per repeating group of the model's blocks, from which of them are expert layers
    (`moe_layer_ids`): 1 when all or none are (dense, DEMix), `moe_every` for GShard when it divides the depth;
    None where the pattern does not repeat (CSE clusters only its last layers)."""
    L, experts = m.n_layers, set(m.moe_layer_ids())
    for unit in range(1, L + 1):
        if L % unit == 0 and all((i in experts) == (i % unit in experts) for i in range(L)):
            return unit if unit < L else None
    return None


def traced_depths(m: ModelConfig) -> tuple[int, int] | None:
    """The two shallower depths the dry run traces instead of the whole model (None: trace it whole)."""
    unit = depth_unit(m)
    if unit is None or m.n_layers <= 4 * unit:
        return None
    return 2 * unit, 4 * unit


@lru_cache(maxsize=64)
def _cached_traces(
    m: ModelConfig,
    micro_batch: int,
    expert_ids: tuple[int, ...] | None,
    dtype: torch.dtype,
    autocast: torch.dtype | None,
) -> dict[bool, int]:
    """Activation bytes by recompute mode. A deep model is traced at two shallower depths `traced_depths` and
    extrapolated linearly over its depth, each phase of the step on its own: at the forward's peak and at the
    backward's, each group of identical blocks adds the same bytes (its saved activations, or with recompute its
    saved input, plus under autocast its cached low-precision weights), while the embedding's, the head's, the
    loss's and one block's recomputation do not depend on the depth. The answer is the larger phase, so a deep
    model whose peak moves from the backward to the forward (recompute under autocast) is still exact
    (`tests/parallel/test_memory.py` compares with the whole trace); a gpt3-xl trace costs 6 layers, not 24."""

    def trace(model: ModelConfig) -> dict[bool, dict[str, int]]:
        return trace_peaks(model, micro_batch, expert_ids, (False, True), dtype, autocast)

    depths = traced_depths(m)
    if depths is None:
        return {r: t["activations"] for r, t in trace(m).items()}
    (lo, hi), L = depths, m.n_layers
    small, large = trace(replace(m, n_layers=lo)), trace(replace(m, n_layers=hi))
    return {
        r: round(
            max(
                small[r][ph] + (large[r][ph] - small[r][ph]) * (L - lo) / (hi - lo)
                for ph in ("forward", "backward")
            )
        )
        for r in small
    }


def trace_fallback_reason(
    m: ModelConfig, expert_ids: Sequence[int] | None, tensor_parallel: int
) -> str | None:
    """Why this rank's activations cannot be traced in one process (None: they can)."""
    if tensor_parallel > 1:
        return f"tensor_parallel={tensor_parallel}: the tensor-parallel layers need their process group"
    if (
        ffn_traits(m.ffn.kind).deepspeed_moe
        and expert_ids is not None
        and len(expert_ids) < max(1, m.ffn.num_experts)
    ):
        return (
            f"ffn=gshard with {len(expert_ids)} of {m.ffn.num_experts} experts on this rank: the layer is "
            "DeepSpeed's MoE, whose all-to-all needs the expert-parallel process group"
        )
    return None


@dataclass(frozen=True)
class ActivationEstimate:
    """Activation bytes of one micro-batch by (ZeRO stage, recompute), and how they were obtained."""

    method: str  # "traced" or "formula"
    reason: str | None  # why the formula was used
    seconds: float
    bytes: dict[tuple[int, bool], float]

    def __call__(self, zero_stage: int, recompute: bool) -> float:
        return self.bytes[(zero_stage, recompute)]


def estimate_activations(
    m: ModelConfig,
    micro_batch: int,
    tensor_parallel: int,
    precision: str,
    expert_ids: Sequence[int] | None = None,
    stages: Sequence[int] = (0, 1, 2),
) -> ActivationEstimate:
    """Traced activations for every ZeRO stage and recompute mode (one trace per distinct precision setup, cached),
    else the formula (eqs. A1/A2) with the reason."""
    start = time.perf_counter()
    ids = tuple(sorted(expert_ids)) if expert_ids is not None else None
    reason = trace_fallback_reason(m, ids, tensor_parallel)
    out: dict[tuple[int, bool], float] = {}
    if reason is None:
        try:
            for zero in stages:
                for recompute, act in _cached_traces(
                    m, micro_batch, ids, *trace_dtypes(precision, zero)
                ).items():
                    out[(zero, recompute)] = float(act)
        except Exception as e:  # noqa: BLE001 - any trace failure falls back, and says why
            reason = f"tracing failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if reason is not None:
        out = {
            (z, r): activation_bytes(m, micro_batch, tensor_parallel, r, precision)
            for z in stages
            for r in (False, True)
        }
    return ActivationEstimate("formula" if reason else "traced", reason, time.perf_counter() - start, out)


def buffer_bytes(
    precision: str,
    zero_stage: int,
    params: RankParams | None = None,
    grad_reduce: str = "overlap",
    bucket_override: int | None = None,
    grad_reduce_dtype: str | None = None,
) -> float:
    """The gradient-reduction buffers the engine allocates on this rank, bytes, for n = parallel/grad_reduce.py's
    `bucket_elements(P, N_dp)` (P = `params`' shared + expert parameters) and G bytes per gradient:

        ZeRO 1/2   n·G, twice with overlap_comm (DeepSpeed double-buffers its contiguous reduce bucket; the engine
                   keeps it off when one bucket holds the whole rank, n >= P), + 4n when bf16 is reduced in fp32
                   (each reduction casts its bucket). The all-gather of the updated parameters writes in place
                   (all_gather_into_tensor): no all-gather bucket.
        ZeRO 0     overlap: the flat copies of the buckets in flight, at most min(2n, P)·G (OverlappedGradReduce);
                   after_backward: DeepSpeed flattens one bucket of at most 5e8 gradients at a time, min(P, 5e8)·G.

    Without `params` DeepSpeed's default buckets (2 x 5e8 elements at ZeRO 1/2, ZeRO 0 not counted). Assumes every
    rank holds parameters of the same shapes; DEMix with unequal domains per rank gets one bucket of P at ZeRO 1/2
    (parallel/grad_reduce.py `plan_grad_reduce`)."""
    G = state_bytes_per_param(precision, zero_stage)[1]
    if params is None:
        return 0.0 if zero_stage == 0 else 2 * DEEPSPEED_BUCKET_ELEMENTS * G
    from parallel.grad_reduce import bucket_elements

    total = params.shared + params.expert
    n = bucket_elements(total, params.dp_size, bucket_override)
    overlap = grad_reduce == "overlap"
    if zero_stage == 0:
        return float(min(2 * n, total) if overlap else min(total, DEEPSPEED_BUCKET_ELEMENTS)) * G
    fp32_cast = 4 * n if precision == "bf16" and grad_reduce_dtype == "fp32" else 0
    return float((2 if overlap and n < total else 1) * n * G + fp32_cast)


def deepspeed_zero2_estimate(p: RankParams) -> float:
    """DeepSpeed's own ZeRO-2 model-state estimate (no offload) for this rank: its formula 2Ψ + 18Ψ/N applied
    to the shared part and to the experts with their own N (DeepSpeed's estimator knows no experts)."""
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    total = 0.0
    for psi, n in ((p.shared, p.dp_size), (p.expert, p.expert_replicas)):
        if psi:
            total += estimate_zero2_model_states_mem_needs(
                psi, num_gpus_per_node=n, num_nodes=1, cpu_offload=False
            )[1]
    return total


def memory_rows(
    p: RankParams,
    m: ModelConfig,
    micro_batch: int,
    tensor_parallel: int,
    precision: str,
    gpu_bytes: float | None,
    activations: Callable[[int, bool], float] | None = None,
    grad_reduce: str = "overlap",
    bucket_override: int | None = None,
    grad_reduce_dtype: str | None = None,
) -> list[dict]:
    """One row per ZeRO stage (0, 1, 2): model states, buffers, activations with and without recompute, totals,
    and whether each total fits `gpu_bytes` (None: unknown GPU, no verdict). `activations(zero_stage, recompute)`
    gives the activation bytes (an `ActivationEstimate`); by default the formula. `grad_reduce`, `bucket_override`
    and `grad_reduce_dtype` are the run's `parallel.grad_reduce`, `parallel.bucket_elements` and
    `train.grad_reduce_dtype` (buffers and, for bf16 reduced in fp32 at ZeRO 2, the gradient partition)."""
    rows = []
    for zero in (0, 1, 2):
        states = model_state_bytes(p, precision, zero, grad_reduce_dtype)
        buffers = buffer_bytes(precision, zero, p, grad_reduce, bucket_override, grad_reduce_dtype)
        model_states = sum(states.values())
        row: dict[str, float | bool | None] = {
            "zero_stage": zero,
            **states,
            "model_states": model_states,
            "buffers": buffers,
        }
        for mode, recompute in (("no_recompute", False), ("recompute", True)):
            act = (
                activations(zero, recompute)
                if activations is not None
                else activation_bytes(m, micro_batch, tensor_parallel, recompute, precision)
            )
            total = model_states + buffers + act
            row[f"activations_{mode}"] = act
            row[f"total_{mode}"] = total
            row[f"fits_{mode}"] = None if gpu_bytes is None else total <= gpu_bytes
        rows.append(row)
    # DeepSpeed's estimator is for 16-bit mixed precision
    if state_bytes_per_param(precision, 2) == (
        2,
        2,
        16,
    ):
        rows[2]["deepspeed_estimate"] = deepspeed_zero2_estimate(p)
    return rows
