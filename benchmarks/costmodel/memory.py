"""Peak memory per GPU of the paper's fairseq training: model states, activations and GShard's saved routing
tensors. docs/costmodel.md, "Memory and micro-batch"."""

from __future__ import annotations

from benchmarks.costmodel.gshard import SAVED_SEC_BYTES, STATE_BYTES, gshard_capacity, state_kind
from benchmarks.costmodel.layout import params_per_gpu
from benchmarks.costmodel.options import CostOptions
from model import accounting as acc
from model.config import ModelConfig


def memory_bytes(cfg: ModelConfig, gpus: int, opts: CostOptions, recompute: bool) -> float:
    """Peak memory per GPU, bytes: model states (12 or 20 B/param, see STATE_BYTES) + activations
    (`parallel.memory.activation_bytes`, fp16) + GShard's saved routing tensors (4 B per (s, e, c) per MoE
    layer kept, one layer when recomputing).

    This is the paper's fairseq training, like the rest of this model, not this framework's: the formula
    (Korthikanti et al.) counts what fairseq keeps, its unfused attention's s x s scores, softmax and dropout
    mask, and the whole-vocabulary fp32 logits of an unchunked loss, where this framework runs fused attention,
    a chunked loss and DeepSpeed's MoE layer. The memory of this framework's runs (the dry run's fit verdict) is
    `parallel.memory.estimate_activations`, traced from the model itself; experiments/results/memory_estimate.md
    shows how far the formula is from it."""
    from parallel.memory import activation_bytes

    states = params_per_gpu(cfg, gpus) * STATE_BYTES[state_kind(cfg, opts)]
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
