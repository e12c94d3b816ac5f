"""Parameter and FLOPs accounting for Dense, DEMix, GShard and CSE GPTs, and device peaks for MFU.

Pure arithmetic on a `ModelConfig`: no model is built, so a 52B-parameter GShard count is instant. The
parameter count mirrors `model/gpt.py` exactly (tests check it against `GPT(cfg).parameters()`); the
FLOPs follow Narayanan et al. (2021), eq. (3), the formula behind DEMix Tables 2 and 9.

Symbols: B global sequences per update, s sequence length, l layers, h hidden size (d_model),
F FFN width (4h), V vocabulary, E experts, k experts per token (GShard top-k).

Checked against the running model (tests/model/test_accounting_flop_counter.py)
-------------------------------------------------------------
`torch.utils.flop_counter.FlopCounterMode` counts the matmuls (mm, addmm, bmm, the SDPA kernels) of a forward +
backward of the real `GPT`; it counts nothing elementwise. Sizes (4 heads, V padded to a multiple of 128):
l2-h64-s64-V500(512)-B4, l4-h128-s128-V1000(1024)-B2, l2-h256-s256-V300(384)-B2; Dense, DEMix (3 experts, each
running on part of the batch), GShard (E = 4, top-2, every other layer), CSE (3 clusters, last 2 layers); without
and with activation recomputation (parallel/activation_recompute.py). With the math SDPA kernel, full
recomputation and no dropped GShard route, counted / `flops_per_update` (vocab_size=cfg.padded_vocab_size()) is
1.000000 for Dense and DEMix in both conventions, 1.0004-1.0015 for GShard (exactly `router_flops`), 1.00002-1.0005
for CSE (exactly the dispatch projection). Every difference between counted and formula FLOPs:

* Logit layer (tied embedding): in the formula, 2·B·s·h·V per pass, 3 passes (the head is outside the recomputed
  blocks). The tied head is F.linear with the embedding's weight: its two backward matmuls are counted like any
  linear's; tying only adds an elementwise gradient sum. The model multiplies by the *padded* vocabulary: pass
  `vocab_size=cfg.padded_vocab_size(tp)` to count what runs; the default (unpadded V, as the paper) undercounts
  by 3·2·B·s·h·(V_pad - V): -1.1 % at h256/V300->384, -0.004 to -0.02 % at the paper's 50264 -> 50304.
* Attention QKᵀ and A·V: in the formula (4·B·s²·h per layer and pass), over the full s x s. The causal mask is
  elementwise; the counter, like eq. (3), ignores it (a causal-halved term would be -6.8 % at h = s = 256). Fused
  SDPA kernels (flash / memory-efficient on GPU, flash on CPU) recompute QKᵀ in their backward (5 matmuls for the
  math kernel's 4): +l·2·B·s²·h per update, +2.08 % (no recompute) / +1.61 % (recompute) at l4-h128-s128. Not in
  the formula: kernel-internal recomputation is hardware FLOPs, not model FLOPs.
* Softmax, scaling, masks, dropout, LayerNorms, GELU, residual adds, biases (the add in addmm), the cross-entropy,
  the token/position embedding lookups and their scatter-add backward, the optimizer step, gradient reduction:
  elementwise (O(1) FLOPs per element against O(h) for the matmuls), neither counted nor in eq. (3).
* Backward = 2 forwards: exact; every linear computes its input and weight gradients, the first layer's too (the
  embeddings need them).
* GShard gate x·W_gᵀ (float32): 2·B·s·h·E per expert layer and pass, reported separately as `router` /
  `router_flops(convention)` and left out of the totals as the paper does: +0.04-0.15 % at E = 4. Softmax, top-k
  argmax, Gumbel noise, cumsum slot assignment, the load-balancing loss: elementwise / integer, not counted.
  Dispatch and combine are index gathers / index_add in model/gshard.py and in DeepSpeed 0.19.8 (no one-hot
  einsum), so no matmul; DeepSpeed's two gating einsums "se,se->s" count 8·S·E per layer (+0.001 %), and
  parallel/gshard.py's no-grad gate for routing statistics 2·S·h·E per layer (+0.03 %).
* GShard capacity: the formula charges k expert FFNs per token. The plain layer (model/gshard.py) runs only the
  kept routes: at the training capacity factor 1.0, 44 of 1024 routes (4.3 %) were dropped at l4-h128-s128:
  -1.72 % (no recompute) / -1.76 % (recompute). The distributed layer (DeepSpeed) runs every expert on its
  whole capacity buffer, E·C rows with C = ceil(k·S/E · capacity_factor): at factor 1.0 that is k·S (the
  formula, however many routes are dropped); at 1.25 it is +25 % of the expert FFN term (+10 % in total at
  l4-h128-s128).
* DEMix: one expert per sequence, exactly Dense (1.000000 with 3 experts sharing a batch). CSE: one expert per
  sequence; its dispatch embedding mean_t(x)·M (2·B·h·P per CSE layer, forward only: detached) is not in the
  formula (+0.002-0.05 %); cdist to the centres did not count as a matmul at these sizes (B·K·P, negligible).
* Activation recomputation: with checkpoint early stop off the counter sees exactly the recompute convention (4
  passes of the layers, 3 of the logit layer). PyTorch's non-reentrant checkpoint stops recomputing by default once
  the last tensor the backward needs is rebuilt, so a block whose FFN ends in a plain MLP (Dense, the dense layers
  of GShard and CSE, a DEMix rank holding one expert) skips fc2: -2·B·s·h·F per such block, -6.45 % for Dense,
  -2.56 % GShard, -3.23 % CSE at l4-h128-s128. The recompute convention stays the paper's (eq. 3); it overstates
  what PyTorch executes by up to 1/12 of the layer term.
* Chunked LM head: the trainer computes logits and loss a chunk of tokens at a time under activation checkpointing
  (model/gpt.py `chunked_token_loss`) once a micro-batch has more tokens than a chunk holds (`head_recomputed`), and
  backward recomputes each chunk's logits: one more forward of the logit layer, 2·B·s·h·V per update. Hardware FLOPs
  (`FlopsReport.hardware`, HFU) count it; model FLOPs (MFU) and both conventions do not
  (tests/model/test_accounting_hfu.py counts it on the running model).

Totals as a default step executes them (fused SDPA, plain GShard layer at capacity factor 1.0, checkpoint early stop),
l4-h128-s128-V1000-B2, counted / formula: Dense 1.0208 / 0.9516 (no recompute / recompute), DEMix 1.0208 / 1.0161,
GShard 1.0003 / 0.9704, CSE 1.0209 / 0.9839; each equals the formula plus the terms above exactly.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from model.config import ModelConfig

FLOP_CONVENTIONS: tuple[str, ...] = ("recompute", "no_recompute")


# --------------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of a model, tied output head counted once.

    total = shared + expert; active = parameters one token passes through (shared + the k expert
    FFNs it is routed to in each expert layer). `embedding` (tokens + positions) is part of `shared`.
    """

    total: int
    active: int
    shared: int
    expert: int
    embedding: int
    per_expert_ffn: int  # one expert FFN of one layer
    num_experts: int
    expert_layers: int


def resolved_num_experts(cfg: ModelConfig, num_experts: int | None = None) -> int:
    """Experts per expert layer: the explicit argument, else `cfg.ffn.num_experts`, at least 1 (as GPT does).
    CSE builds `cse.max_clusters` expert slots when no count is given (model/cse.py `num_expert_slots`)."""
    if cfg.ffn.kind == "dense":
        return 1
    n = cfg.ffn.num_experts if num_experts is None else num_experts
    if cfg.ffn.kind == "cse" and n <= 0:
        return cfg.ffn.cse.max_clusters
    return max(1, n)


def experts_per_token(cfg: ModelConfig) -> int:
    """Expert FFNs each token passes through in an expert layer: top_k for GShard, one otherwise."""
    return cfg.ffn.gshard.top_k if cfg.ffn.kind == "gshard" else 1


def ffn_params(d_model: int, d_ffn: int) -> int:
    """One GELU MLP D -> F -> D with biases: 2·D·F + F + D."""
    return 2 * d_model * d_ffn + d_ffn + d_model


def block_shared_params(d_model: int) -> int:
    """A block without its FFN: two LayerNorms (4D) + qkv (3D² + 3D) + output projection (D² + D)."""
    return 4 * d_model * d_model + 4 * d_model + 4 * d_model


def gate_params(cfg: ModelConfig, num_experts: int) -> int:
    """The router of one expert layer: GShard's D x E linear gate without bias; DEMix and CSE have none
    (DEMix routes by domain label, CSE by distance to cluster centres kept as buffers)."""
    return cfg.d_model * num_experts if cfg.ffn.kind == "gshard" else 0


def param_counts(
    cfg: ModelConfig, num_experts: int | None = None, vocab_size: int | None = None
) -> ParamCounts:
    """Count parameters of the GPT `cfg` describes, holding every expert.

        embedding = V·D + s·D                         (tied output head: no extra parameters)
        per layer = 4D² + 8D + FFN(D, F) (+ D·E gate in GShard expert layers)
        FFN(D, F) = 2·D·F + F + D, repeated E times in expert layers
        final LayerNorm = 2D

    `vocab_size` defaults to the unpadded `cfg.vocab_size`; pass `cfg.padded_vocab_size(tp)` to count
    what `GPT(cfg, tensor_parallel=tp)` builds.
    """
    d, n_layers = cfg.d_model, cfg.n_layers
    v = cfg.vocab_size if vocab_size is None else vocab_size
    n_exp = resolved_num_experts(cfg, num_experts)
    expert_layers = len(cfg.moe_layer_ids())
    one_ffn = ffn_params(d, cfg.d_ffn)
    embedding = v * d + cfg.seq_len * d
    shared = (
        embedding
        + n_layers * block_shared_params(d)
        + (n_layers - expert_layers) * one_ffn
        + expert_layers * gate_params(cfg, n_exp)
        + 2 * d
    )
    expert = expert_layers * n_exp * one_ffn
    active = shared + expert_layers * min(experts_per_token(cfg), n_exp) * one_ffn
    return ParamCounts(
        total=shared + expert,
        active=active,
        shared=shared,
        expert=expert,
        embedding=embedding,
        per_expert_ffn=one_ffn,
        num_experts=n_exp if expert_layers else 0,
        expert_layers=expert_layers,
    )


# --------------------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlopsReport:
    """Model FLOPs of one optimizer update (matmuls only), in both conventions.

    recompute: the DEMix paper's convention (Narayanan et al. 2021 eq. 3, full activation recomputation).
    no_recompute: forward + backward only (3x forward), what most trainers log as "model FLOPs".
    router: the gate's matmuls (recompute convention), *not* included in the totals above; the paper
    leaves them out and they are < 0.2 % at its sizes.
    """

    global_batch: int
    seq_len: int
    recompute: int
    no_recompute: int
    router: int
    logit_forward: int = 0  # one forward of the logit layer, 2·B·s·h·V: what a chunked LM head recomputes

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq_len

    def get(self, convention: str) -> int:
        """FLOPs per update in the named convention."""
        if convention not in FLOP_CONVENTIONS:
            raise ValueError(f"FLOPs convention {convention!r}: choose one of {', '.join(FLOP_CONVENTIONS)}")
        return self.recompute if convention == "recompute" else self.no_recompute

    def router_flops(self, convention: str) -> int:
        """The gate's matmuls in the named convention: `router` is 4 passes of its forward, no_recompute 3."""
        return self.router // 4 * _passes(convention)[0]

    def hardware(self, layer_recompute: bool, head_recompute: bool) -> int:
        """FLOPs the hardware executes per update (HFU's numerator), as the trainer runs it:

            layers  4 forwards with activation recompute (recompute convention), else 3 (no_recompute)
            logits  3 forwards, plus 1 when the chunked LM head recomputes its forward in backward
                    (`head_recomputed`): 8·B·s·h·V instead of 6·B·s·h·V

        Model FLOPs (MFU) are `no_recompute`: neither recomputation is work the model needs."""
        layers_and_logits = self.recompute if layer_recompute else self.no_recompute
        return layers_and_logits + (self.logit_forward if head_recompute else 0)


def _passes(convention: str) -> tuple[int, int]:
    """(forward passes charged to the transformer layers, to the logit layer) in a convention."""
    if convention == "recompute":
        return 4, 3  # forward, recomputed forward, backward = 2 forwards; logits are not recomputed
    if convention == "no_recompute":
        return 3, 3
    raise ValueError(f"FLOPs convention {convention!r}: choose one of {', '.join(FLOP_CONVENTIONS)}")


def layer_forward_flops(cfg: ModelConfig, global_batch: int, seq_len: int, ffn_copies: int = 1) -> int:
    """Forward matmul FLOPs of one transformer layer over B sequences of s tokens (2 FLOPs per MAC):

        qkv + output projection   2·B·s·(3h² + h²)  = 8·B·s·h²
        scores QKᵀ and A·V        2 · 2·B·s²·h      = 4·B·s²·h
        FFN (per copy)            2·B·s·(2·h·F)     = 16·B·s·h²   for F = 4h

    i.e. 24·B·s·h² + 4·B·s²·h for a dense layer (Narayanan et al. 2021, §5.1); `ffn_copies` = experts
    each token passes through (top-k for GShard).
    """
    bs, h = global_batch * seq_len, cfg.d_model
    return 8 * bs * h * h + 4 * bs * seq_len * h + ffn_copies * 4 * bs * h * cfg.d_ffn


def logit_forward_flops(cfg: ModelConfig, global_batch: int, seq_len: int, vocab_size: int) -> int:
    """Forward FLOPs of the output (logit) layer: 2·B·s·h·V."""
    return 2 * global_batch * seq_len * cfg.d_model * vocab_size


def flops_per_update(
    cfg: ModelConfig,
    global_batch: int,
    seq_len: int | None = None,
    vocab_size: int | None = None,
    num_experts: int | None = None,
) -> FlopsReport:
    """FLOPs of one update of `global_batch` sequences (Narayanan et al. 2021, eq. 3), summed per layer.

    Backward costs twice the forward, so forward + backward = 3 forwards; activation recomputation adds a
    second forward of every transformer layer (4 forwards), but not of the logit layer. For a dense GPT:

        recompute:    F = 4·l·(24·B·s·h² + 4·B·s²·h) + 3·2·B·s·h·V = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))
        no_recompute: F = 3·l·(24·B·s·h² + 4·B·s²·h) + 3·2·B·s·h·V = 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))

    so the no-recompute layer term is 3/4 of the recompute one and the logit term 6·B·s·h·V is shared.
    DEMix and CSE run one expert per token: the same FLOPs as Dense. GShard runs k experts per token in
    each of its L_moe expert layers, adding (k − 1)·L_moe·(passes · 16·B·s·h²); with k = 2 and an expert
    layer every other layer (L_moe = l/2) that is 96·B·s·l·h²·(1/3) in the recompute convention; k is capped
    at E (a one-expert GShard layer is the dense FFN). `vocab_size` defaults to the unpadded vocabulary (the
    paper's V); the model multiplies by `cfg.padded_vocab_size(tp)` rows (see "Checked against the running model").
    """
    s = cfg.seq_len if seq_len is None else seq_len
    v = cfg.vocab_size if vocab_size is None else vocab_size
    if global_batch < 1 or s < 1 or v < 1:
        raise ValueError(f"need global_batch, seq_len, vocab_size >= 1, got {global_batch}, {s}, {v}")
    n_moe = len(cfg.moe_layer_ids())
    n_exp = resolved_num_experts(cfg, num_experts)
    k = min(experts_per_token(cfg), n_exp)  # a one-expert GShard layer runs its expert once per token
    layers_fwd = (cfg.n_layers - n_moe) * layer_forward_flops(
        cfg, global_batch, s
    ) + n_moe * layer_forward_flops(cfg, global_batch, s, ffn_copies=k)
    logit_fwd = logit_forward_flops(cfg, global_batch, s, v)
    totals = {}
    for conv in FLOP_CONVENTIONS:
        layer_passes, logit_passes = _passes(conv)
        totals[conv] = layer_passes * layers_fwd + logit_passes * logit_fwd
    router_fwd = n_moe * 2 * global_batch * s * gate_params(cfg, n_exp)
    return FlopsReport(
        global_batch=global_batch,
        seq_len=s,
        recompute=totals["recompute"],
        no_recompute=totals["no_recompute"],
        router=4 * router_fwd,
        logit_forward=logit_fwd,
    )


def head_recomputed(tokens_per_micro_batch: int, local_vocab: int, chunk_logits: int) -> bool:
    """Whether the trainer's LM head + loss (model/gpt.py `chunked_token_loss`, the `return_logits=False` path)
    recomputes the head's forward in backward: its chunks of rows = max(1, chunk_logits // V_local) tokens run under
    activation checkpointing when a micro-batch has more tokens than one chunk (B·s > rows); one chunk is one plain
    call. V_local is the head's vocabulary on one rank: the padded vocabulary / tensor_parallel."""
    return tokens_per_micro_batch > max(1, chunk_logits // local_vocab)


def tflops_per_gpu(flops_per_update: float, seconds_per_update: float, num_gpus: int) -> float:
    """Achieved TFLOP/s per GPU: F / (t · n_gpus) / 10¹²."""
    if seconds_per_update <= 0 or num_gpus < 1:
        raise ValueError(
            f"need seconds_per_update > 0 and num_gpus >= 1, got {seconds_per_update}, {num_gpus}"
        )
    return flops_per_update / (seconds_per_update * num_gpus) / 1e12


# --------------------------------------------------------------------------------------------------
# Device peaks and MFU
# --------------------------------------------------------------------------------------------------

PRECISION_ALIASES: dict[str, str] = {
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "tf32": "tf32",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "fp8": "fp8",
}


@dataclass(frozen=True)
class DeviceSpec:
    """Dense (no sparsity) peak TFLOP/s of one accelerator per precision; tensor-core peaks for the
    low precisions, the plain FP32 peak for fp32 (PyTorch does not use TF32 for matmuls by default)."""

    key: str
    label: str
    peaks: tuple[tuple[str, float], ...]  # (precision, TFLOP/s); empty for a CPU
    pattern: str  # regex matched against a torch device name (word-bounded, case-insensitive)
    memory_gb: float | None = None  # the common (largest) variant's memory, GiB; the dry run's default

    def peak(self, precision: str) -> float | None:
        """Peak TFLOP/s in `precision`, or None where the device has no such peak (e.g. V100 bf16, CPU)."""
        return dict(self.peaks).get(normalise_precision(precision))


# Ordered: more specific patterns first ("H100 PCIe" before "H100", "MI250X" before "MI250").
def _peaks(**tflops: float) -> tuple[tuple[str, float], ...]:
    return tuple(tflops.items())


# Ordered: more specific patterns first ("H100 PCIe" before "H100", "V100S" before "V100").
DEVICES: tuple[DeviceSpec, ...] = (
    DeviceSpec("v100-pcie", "V100 PCIe", _peaks(fp16=112.0, fp32=14.0), r"v100-?pcie", 32),
    DeviceSpec("v100s", "V100S PCIe", _peaks(fp16=130.0, fp32=16.4), r"v100s", 32),
    DeviceSpec("v100-sxm2", "V100 SXM2", _peaks(fp16=125.0, fp32=15.7), r"v100", 32),
    DeviceSpec("a100", "A100", _peaks(bf16=312.0, fp16=312.0, tf32=156.0, fp32=19.5), r"a100", 80),
    DeviceSpec(
        "h100-pcie",
        "H100 PCIe",
        _peaks(bf16=756.0, fp16=756.0, tf32=378.0, fp8=1513.0, fp32=51.0),
        r"h100[ -]pcie",
        80,
    ),
    DeviceSpec(
        "h100-nvl",
        "H100 NVL",
        _peaks(bf16=835.0, fp16=835.0, tf32=418.0, fp8=1670.0, fp32=60.0),
        r"h100[ -]nvl",
        94,
    ),
    DeviceSpec(
        "h100-sxm", "H100 SXM", _peaks(bf16=989.0, fp16=989.0, tf32=494.5, fp8=1979.0, fp32=67.0), r"h100", 80
    ),
    DeviceSpec(
        "h200", "H200", _peaks(bf16=989.0, fp16=989.0, tf32=494.5, fp8=1979.0, fp32=67.0), r"h200", 141
    ),
    DeviceSpec("l40s", "L40S", _peaks(bf16=362.0, fp16=362.0, tf32=183.0, fp8=733.0, fp32=91.6), r"l40s", 48),
    DeviceSpec("l4", "L4", _peaks(bf16=121.0, fp16=121.0, tf32=60.0, fp8=242.0, fp32=30.3), r"l4", 24),
    DeviceSpec("a10", "A10", _peaks(bf16=125.0, fp16=125.0, tf32=62.5, fp32=31.2), r"a10", 24),
    DeviceSpec(
        "rtx4090",
        "RTX 4090",
        _peaks(bf16=165.0, fp16=165.0, tf32=82.6, fp8=330.0, fp32=82.6),
        r"rtx ?4090",
        24,
    ),
    DeviceSpec("mi250x", "MI250X", _peaks(bf16=383.0, fp16=383.0, fp32=47.9), r"mi250x", 128),
    DeviceSpec(
        "mi300x",
        "MI300X",
        _peaks(bf16=1307.0, fp16=1307.0, tf32=653.7, fp8=2615.0, fp32=163.4),
        r"mi300x",
        192,
    ),
    DeviceSpec("cpu", "CPU", (), r"cpu"),
)
_DEVICE_ALIASES: dict[str, str] = {"v100": "v100-sxm2", "h100": "h100-sxm", "4090": "rtx4090"}


def normalise_precision(precision: str) -> str:
    """'bfloat16' -> 'bf16' etc.; raises ValueError for an unknown precision."""
    try:
        return PRECISION_ALIASES[precision.strip().lower()]
    except KeyError:
        raise ValueError(
            f"precision {precision!r}: choose one of {', '.join(sorted(set(PRECISION_ALIASES.values())))}"
        ) from None


def match_device_name(name: str) -> DeviceSpec | None:
    """The device a free-form name denotes: a table key ('h100-sxm', 'v100'), or a torch device name
    ('NVIDIA H100 80GB HBM3' -> H100 SXM, 'Tesla V100-SXM2-32GB' -> V100 SXM2). Patterns are
    word-bounded so 'A100' is not 'A10', 'A10G' is not 'A10' and 'L40S' is not 'L4'. None if unknown."""
    key = name.strip().lower()
    key = _DEVICE_ALIASES.get(key, key)
    for dev in DEVICES:
        if dev.key == key:
            return dev
    for dev in DEVICES:
        if re.search(rf"(?<![a-z0-9]){dev.pattern}(?![a-z0-9])", key):
            return dev
    return None


def lookup_device(name: str) -> DeviceSpec:
    """Like `match_device_name`, but raise ValueError naming the known devices when nothing matches."""
    dev = match_device_name(name)
    if dev is None:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(d.key for d in DEVICES)}")
    return dev


def peak_tflops(device: str | DeviceSpec, precision: str) -> float | None:
    """Dense peak TFLOP/s of `device` in `precision`; None for a CPU, an unknown device, or a precision the
    device has no tensor peak for."""
    dev = device if isinstance(device, DeviceSpec) else match_device_name(device)
    return None if dev is None else dev.peak(precision)


def mfu(achieved_tflops_per_gpu: float, device: str | DeviceSpec, precision: str) -> float | None:
    """Model FLOPs utilisation: achieved TFLOP/s per GPU / the device's dense peak (None without a peak)."""
    peak = peak_tflops(device, precision)
    return None if peak is None else achieved_tflops_per_gpu / peak


# --------------------------------------------------------------------------------------------------
# The paper's Tables 2 and 9
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PaperSetting:
    """One column of DEMix Tables 2/9: a model size, its GPU count, and the paper's reported figures
    (total parameters and TFLOPs/update per architecture, TFLOPs/GPU measured on V100s)."""

    size: str
    preset: str
    gpus: int
    total_params: tuple[tuple[str, float], ...]
    tflops_per_update: tuple[tuple[str, float], ...]
    tflops_per_gpu: tuple[tuple[str, float], ...]


PAPER_ARCHS: tuple[str, ...] = ("dense", "demix", "gshard")
PAPER_MICRO_BATCH, PAPER_GRAD_ACCUM, PAPER_SEQ_LEN, PAPER_VOCAB = 2, 8, 1024, 50264
PAPER_DEMIX_EXPERTS = 8
PAPER_DEVICE, PAPER_PRECISION = "v100-sxm2", "fp16"
PAPER_TABLE: tuple[PaperSetting, ...] = (
    PaperSetting(
        "125M",
        "gpt3-small",
        32,
        (("dense", 125e6), ("demix", 512e6), ("gshard", 1e9)),
        (("dense", 556), ("demix", 556), ("gshard", 675)),
        (("dense", 31), ("demix", 31), ("gshard", 15)),
    ),
    PaperSetting(
        "350M",
        "gpt3-medium",
        64,
        (("dense", 350e6), ("demix", 1.8e9), ("gshard", 6.7e9)),
        (("dense", 3279), ("demix", 3279), ("gshard", 4120)),
        (("dense", 37), ("demix", 37), ("gshard", 16)),
    ),
    PaperSetting(
        "760M",
        "gpt3-large",
        128,
        (("dense", 760e6), ("demix", 3.8e9), ("gshard", 29.5e9)),
        (("dense", 13637), ("demix", 13637), ("gshard", 17400)),
        (("dense", 45), ("demix", 48), ("gshard", 19)),
    ),
    PaperSetting(
        "1.3B",
        "gpt3-xl",
        128,
        (("dense", 1.3e9), ("demix", 7.0e9), ("gshard", 52.5e9)),
        (("dense", 23250), ("demix", 23250), ("gshard", 30000)),
        (("dense", 51), ("demix", 55), ("gshard", 13)),
    ),
)


def paper_num_experts(arch: str, gpus: int) -> int:
    """Experts per expert layer in the paper: none for Dense, one per domain (8) for DEMix, one per GPU for GShard."""
    return {"dense": 0, "demix": PAPER_DEMIX_EXPERTS, "gshard": gpus}[arch]


def accounting_row(
    cfg: ModelConfig, gpus: int, micro_batch: int, grad_accum: int, num_experts: int | None = None
) -> dict[str, float | int | str]:
    """Parameters and FLOPs of one configuration as a flat, JSON-ready dict (B = gpus x micro x accum)."""
    params = param_counts(cfg, num_experts)
    flops = flops_per_update(cfg, gpus * micro_batch * grad_accum, num_experts=num_experts)
    return {
        "arch": cfg.ffn.kind,
        "gpus": gpus,
        "experts": params.num_experts,
        "global_batch": flops.global_batch,
        "total_params": params.total,
        "active_params": params.active,
        "expert_params": params.expert,
        "tflops_per_update": flops.recompute / 1e12,
        "tflops_per_update_no_recompute": flops.no_recompute / 1e12,
        "router_tflops_per_update": flops.router / 1e12,
    }


def paper_row(setting: PaperSetting, cfg: ModelConfig) -> dict[str, float | int | str | None]:
    """Our row for one (size, arch) of Tables 2/9 beside the paper's figures; `cfg` is the size's preset
    with the arch's FFN kind and expert count already set. `paper_mfu` is None for a device without a known peak."""
    arch = cfg.ffn.kind
    ours = accounting_row(cfg, setting.gpus, PAPER_MICRO_BATCH, PAPER_GRAD_ACCUM)
    row: dict[str, float | int | str | None] = {"size": setting.size}
    row.update(ours)
    paper_params = dict(setting.total_params)[arch]
    paper_tflops = dict(setting.tflops_per_update)[arch]
    paper_tpg = dict(setting.tflops_per_gpu)[arch]
    row.update(
        paper_total_params=int(paper_params),
        paper_tflops_per_update=paper_tflops,
        paper_tflops_per_gpu=paper_tpg,
        paper_mfu=mfu(paper_tpg, PAPER_DEVICE, PAPER_PRECISION),
        params_rel_err=(float(ours["total_params"]) - paper_params) / paper_params,
        tflops_rel_err=(float(ours["tflops_per_update"]) - paper_tflops) / paper_tflops,
    )
    return row


def paper_rows(
    configs: Sequence[tuple[PaperSetting, ModelConfig]],
) -> list[dict[str, float | int | str | None]]:
    """Rows for every (setting, configured model) pair, in order."""
    return [paper_row(setting, cfg) for setting, cfg in configs]
