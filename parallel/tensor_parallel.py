"""Megatron-style tensor parallelism (Shoeybi et al. 2019, §3), applied to the plain GPT from outside.

Shape legend: B batch, T tokens, D model dim, F ffn dim, H heads, K head dim, V vocabulary;
a trailing `l` marks the local shard of a tensor-parallel rank (Vl = V / tp, Fl = F / tp, Hl = H / tp).

`apply_tensor_parallel(model, tp_group)` takes a GPT built normally (full weights, the same seed on every rank
of the group) and swaps, in place, each layer for megatron-core's tensor-parallel one (qkv/fc1 column-parallel,
proj/fc2 row-parallel, the embedding, tied head and loss vocab-parallel), initialised by copying this rank's shard,
so that a TP=tp model computes what the TP=1 model computes. Every layer gets its `tp_group` explicitly:
megatron-core's `parallel_state` is never initialised or read. Every rank of a TP group must see the same batch
and call forward/backward the same number of times (the layers communicate inside them).

The design (layer map, communication, vocab-parallel cross-entropy, which parameters are sharded or replicated,
RNG and dropout, copying and saving a TP model): docs/tensor_parallel.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from megatron.core import ModelParallelConfig, tensor_parallel
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy
from megatron.core.tensor_parallel.layers import (
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.tensor_parallel.utils import VocabUtility
from torch.distributed import ProcessGroup

from model.config import ModelConfig
from model.gpt import GPT, Block
from model.gshard import GShardFFN
from model.mlp import MLP

# Attributes megatron-core uses to describe a parameter's tensor-parallel sharding.
TP_ATTRIBUTES: tuple[str, ...] = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "expert_tp",
    "is_qkv",
)
IGNORE_INDEX = -100  # as F.cross_entropy: targets equal to it score 0 (TokenCrossEntropy inherits this)


# ----------------------------------------------------------------------------------------------------
# Layout checks (pure)
# ----------------------------------------------------------------------------------------------------


def tensor_parallel_problems(cfg: ModelConfig, tp: int, vocab_size: int | None = None) -> list[str]:
    """Every reason a model of shape `cfg` (padded vocabulary `vocab_size`, default the one GPT(cfg,
    tensor_parallel=tp) pads to) cannot be split over `tp` tensor-parallel ranks. Never raises."""
    if tp < 1:
        return [f"tensor_parallel={tp}: must be >= 1"]
    out = []
    if cfg.n_heads % tp:
        out.append(
            f"model.n_heads={cfg.n_heads} is not divisible by tensor_parallel={tp}: "
            "each tensor-parallel rank must hold whole attention heads"
        )
    if cfg.d_ffn % tp:
        out.append(
            f"d_ffn={cfg.d_ffn} (model.ffn_mult={cfg.ffn_mult} x model.d_model={cfg.d_model}) "
            f"is not divisible by tensor_parallel={tp}"
        )
    vocab = cfg.padded_vocab_size(tp) if vocab_size is None else vocab_size
    if vocab % tp:
        out.append(
            f"padded vocabulary {vocab} is not divisible by tensor_parallel={tp}: build the model with "
            f"GPT(cfg, tensor_parallel={tp}), which pads model.vocab_size={cfg.vocab_size} to a multiple of "
            f"model.make_vocab_size_divisible_by x tp = {cfg.make_vocab_size_divisible_by * tp}"
        )
    return out


def check_tensor_parallel_layout(cfg: ModelConfig, tp: int, vocab_size: int | None = None) -> None:
    """Raise one ValueError naming every problem of `tensor_parallel_problems`."""
    problems = tensor_parallel_problems(cfg, tp, vocab_size)
    if problems:
        raise ValueError("cannot apply tensor parallelism:\n  - " + "\n  - ".join(problems))


# ----------------------------------------------------------------------------------------------------
# Layers: megatron-core's, returning a tensor as nn.Linear does (the bias is added inside)
# ----------------------------------------------------------------------------------------------------


def _cpu_autocast_operands(input_: torch.Tensor, weight: torch.Tensor, kwargs: dict) -> tuple:
    """Under CPU autocast, cast the matmul operands as autocast would for F.linear.

    megatron's linear autograd function is decorated for CUDA autocast only: on CPU its forward matmul is
    autocast to bf16 but its backward multiplies the bf16 output gradient by the saved fp32 weight and fails
    ("expected m1 and m2 to have the same dtype"). Casting outside the function keeps the cast in the graph
    (fp32 master gradients) and gives the function consistent operands."""
    if input_.device.type != "cpu" or not torch.is_autocast_enabled("cpu"):
        return input_, weight, kwargs
    dtype = torch.get_autocast_dtype("cpu")
    if kwargs.get("bias") is not None:
        kwargs = {**kwargs, "bias": kwargs["bias"].to(dtype)}
    return input_.to(dtype), weight.to(dtype), kwargs


class _ReturnsTensor:
    """Megatron's parallel linears return (output, bias); ours return the output like nn.Linear, and cast
    their operands under CPU autocast (megatron only handles CUDA autocast)."""

    def _forward_impl(self, input, weight, *args, **kwargs):  # noqa: A002 (megatron's signature)
        input, weight, kwargs = _cpu_autocast_operands(input, weight, kwargs)
        return super()._forward_impl(input, weight, *args, **kwargs)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        out, _ = super().forward(input_)  # type: ignore[misc]  # a mixin: megatron's linear, next in the MRO
        return out


class ColumnParallelLinear(_ReturnsTensor, tensor_parallel.ColumnParallelLinear):
    """Y_l = X W_l^T + b_l: output columns split over the TP group (gather_output=False)."""


class RowParallelLinear(_ReturnsTensor, tensor_parallel.RowParallelLinear):
    """Y = all_reduce(X_l W_l^T) + b: input already split over the TP group; bias added once, after the sum."""


class VocabParallelTiedLMHead(nn.Module):
    """Local-vocabulary logits from the vocab-parallel embedding's weight (Megatron's tied output layer):
    logits_BTVl = h_BTD @ W_emb_local^T, with h passed through copy_to_tensor_model_parallel_region so that
    dL/dh (a sum over the whole vocabulary) is all-reduced over the TP group in backward."""

    def __init__(self, embedding: tensor_parallel.VocabParallelEmbedding, tp_group: ProcessGroup) -> None:
        super().__init__()
        self.embedding = [embedding]  # a list: do not register the embedding twice as a submodule
        self.tp_group = tp_group

    def forward(self, h_BTD: torch.Tensor) -> torch.Tensor:
        h_BTD = copy_to_tensor_model_parallel_region(h_BTD, group=self.tp_group)
        return F.linear(h_BTD, self.embedding[0].weight)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """megatron-core's `_VocabParallelCrossEntropy` (no label smoothing) with an explicit group."""

    @staticmethod
    def forward(
        ctx, logits_BTVl: torch.Tensor, targets_BT: torch.Tensor, group: ProcessGroup
    ) -> torch.Tensor:
        # megatron's helpers work in place on float32 logits; copy so the caller's logits stay intact.
        logits_BTVl = logits_BTVl.detach().to(torch.float32, copy=True)
        logits_BTVl, max_BT = VocabParallelCrossEntropy.calculate_logits_max(logits_BTVl)
        dist.all_reduce(max_BT, op=dist.ReduceOp.MAX, group=group)
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            logits_BTVl.size(-1), group.rank(), group.size()
        )
        mask_BT, target_N, picked_BT, sum_exp_BT, exp_BTVl = (
            VocabParallelCrossEntropy.calculate_predicted_logits(logits_BTVl, targets_BT, max_BT, start, end)
        )
        both_2BT = torch.stack([picked_BT, sum_exp_BT])  # one all-reduce for both sums
        dist.all_reduce(both_2BT, op=dist.ReduceOp.SUM, group=group)
        softmax_BTVl, loss_BT = VocabParallelCrossEntropy.calculate_cross_entropy_loss(
            exp_BTVl, both_2BT[0], both_2BT[1]
        )
        ctx.save_for_backward(softmax_BTVl, mask_BT, target_N)
        return loss_BT

    @staticmethod
    def backward(ctx, grad_BT: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax_BTVl, mask_BT, target_N = ctx.saved_tensors
        grad_2d, arange_N, update_N, grad_BTVl = (
            VocabParallelCrossEntropy.prepare_gradient_calculation_operands(softmax_BTVl, mask_BT)
        )
        grad_BTVl = VocabParallelCrossEntropy.calculate_gradients(
            grad_2d, arange_N, target_N, update_N, grad_BTVl, grad_BT.contiguous()
        )
        return grad_BTVl, None, None


def vocab_parallel_cross_entropy(
    logits_BTVl: torch.Tensor, targets_BT: torch.Tensor, group: ProcessGroup
) -> torch.Tensor:
    """Per-token cross-entropy (float32, shape of `targets_BT`) from vocab-sharded logits."""
    return _VocabParallelCrossEntropy.apply(logits_BTVl, targets_BT, group)


class VocabParallelTokenCrossEntropy(nn.Module):
    """The vocab-parallel stand-in for model.gpt.TokenCrossEntropy: per-token loss B T, float32, 0 where
    the target is IGNORE_INDEX (as F.cross_entropy's default)."""

    def __init__(self, tp_group: ProcessGroup) -> None:
        super().__init__()
        self.tp_group = tp_group

    def forward(self, logits_BTVl: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        loss_BT = vocab_parallel_cross_entropy(logits_BTVl, targets_BT, self.tp_group)
        return loss_BT.masked_fill(targets_BT == IGNORE_INDEX, 0.0)


# ----------------------------------------------------------------------------------------------------
# Swapping layers in
# ----------------------------------------------------------------------------------------------------


def megatron_config(tp: int, params_dtype: torch.dtype = torch.float32) -> ModelParallelConfig:
    """The ModelParallelConfig for layers whose weights are copied in (no init, no RNG, CPU allocation)."""
    return ModelParallelConfig(
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,
        perform_initialization=False,
        params_dtype=params_dtype,
    )


def _no_init(weight: torch.Tensor) -> None:
    """megatron's init_method slot: unused (perform_initialization=False), the weights are copied in."""


def _shard(full: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    return full.chunk(group.size(), dim=dim)[group.rank()]


def _copy_in(new: nn.Parameter, full: torch.Tensor, dim: int | None, group: ProcessGroup) -> None:
    """Copy this rank's shard of `full` along `dim` (None: the whole tensor) into `new`, and carry over
    the old parameter's own attributes (e.g. expert tags set by parallel/) and requires_grad."""
    with torch.no_grad():
        new.copy_(full if dim is None else _shard(full, dim, group))
    for key, value in vars(full).items():
        if key not in TP_ATTRIBUTES:
            setattr(new, key, value)
    new.requires_grad_(full.requires_grad)


def _column_parallel(linear: nn.Linear, group: ProcessGroup) -> ColumnParallelLinear:
    new = ColumnParallelLinear(
        linear.in_features,
        linear.out_features,
        config=megatron_config(group.size(), linear.weight.dtype),
        init_method=_no_init,
        bias=linear.bias is not None,
        gather_output=False,
        skip_bias_add=False,
        tp_group=group,
    )
    # bias: set by megatron
    set_tensor_model_parallel_attributes(new.weight, is_parallel=True, dim=0, stride=1)
    _copy_in(new.weight, linear.weight, 0, group)
    if linear.bias is not None:
        _copy_in(new.bias, linear.bias, 0, group)
    return _finish(linear, new)


def _row_parallel(linear: nn.Linear, group: ProcessGroup) -> RowParallelLinear:
    new = RowParallelLinear(
        linear.in_features,
        linear.out_features,
        config=megatron_config(group.size(), linear.weight.dtype),
        init_method=_no_init,
        bias=linear.bias is not None,
        input_is_parallel=True,
        skip_bias_add=False,
        tp_group=group,
    )
    set_tensor_model_parallel_attributes(new.weight, is_parallel=True, dim=1, stride=1)
    _copy_in(new.weight, linear.weight, 1, group)
    if linear.bias is not None:
        _copy_in(new.bias, linear.bias, None, group)  # replicated, added after the all-reduce
    return _finish(linear, new)


_M = TypeVar("_M", bound=nn.Module)


def _finish(old: nn.Module, new: _M) -> _M:
    """Carry module-level markers (e.g. is_residual_projection) and the device over."""
    for key in ("is_residual_projection",):
        if hasattr(old, key):
            setattr(new, key, getattr(old, key))
    return new.to(device=next(old.parameters()).device)


def _vocab_parallel_embedding(
    emb: nn.Embedding, group: ProcessGroup
) -> tensor_parallel.VocabParallelEmbedding:
    new = tensor_parallel.VocabParallelEmbedding(
        emb.num_embeddings,
        emb.embedding_dim,
        init_method=_no_init,
        config=megatron_config(group.size(), emb.weight.dtype),
        tp_group=group,
    )
    set_tensor_model_parallel_attributes(new.weight, is_parallel=True, dim=0, stride=1)
    _copy_in(new.weight, emb.weight, 0, group)
    return new.to(device=emb.weight.device)


def apply_tensor_parallel(model: GPT, tp_group: ProcessGroup) -> GPT:
    """Shard `model` (full weights, identical on every rank of `tp_group`) over `tp_group`, in place.

    Every rank of the group must then see the same batch (tokens, domain ids, targets). Returns the model,
    whose logits are the local vocabulary shard (B T V/tp) and whose loss is the full-vocabulary loss."""
    tp = tp_group.size()
    check_tensor_parallel_layout(model.cfg, tp, model.vocab_size)
    if any(hasattr(p, "tensor_model_parallel") for p in model.parameters()):
        raise ValueError(
            "this model already carries tensor-parallel attributes: apply_tensor_parallel twice?"
        )
    for block in model.blocks:
        assert isinstance(block, Block)
        block.attn.qkv = _column_parallel(block.attn.qkv, tp_group)
        block.attn.proj = _row_parallel(block.attn.proj, tp_group)
    # GShard experts stay whole: DeepSpeed's MoE layer splits their *tokens* over the TP group (parallel/gshard.py).
    token_routed = {
        id(m) for ffn in model.modules() if isinstance(ffn, GShardFFN) for m in ffn.experts.values()
    }
    for module in list(model.modules()):
        if isinstance(module, MLP) and id(module) not in token_routed:  # the dense FFN and every DEMix expert
            module.fc1 = _column_parallel(module.fc1, tp_group)
            module.fc2 = _row_parallel(module.fc2, tp_group)
    model.wte = _vocab_parallel_embedding(model.wte, tp_group)
    model.lm_head = VocabParallelTiedLMHead(model.wte, tp_group)
    model.loss_fn = VocabParallelTokenCrossEntropy(tp_group)
    for p in model.parameters():
        set_defaults_if_not_set_tensor_model_parallel_attributes(p)  # replicated: tensor_model_parallel=False
    return model


# ----------------------------------------------------------------------------------------------------
# Full (TP=1-shaped) tensors from shards
# ----------------------------------------------------------------------------------------------------


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """True for a parameter sharded over the TP group (False for replicated ones)."""
    return bool(getattr(param, "tensor_model_parallel", False))


def _gather(t: torch.Tensor, param: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    if not is_tensor_parallel(param) or group.size() == 1:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(group.size())]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim)  # type: ignore[attr-defined]  # set by megatron-core


def _gather_named(
    items: list[tuple[str, torch.Tensor]],
    pick: Callable[[torch.Tensor], torch.Tensor | None],
    group: ProcessGroup,
) -> dict[str, torch.Tensor | None]:
    out: dict[str, torch.Tensor | None] = {}
    for name, param in items:  # the same order on every rank: collectives line up
        t = pick(param)
        out[name] = None if t is None else _gather(t, param, group)
    return out


def gather_tensors(items: list[tuple[str, torch.Tensor]], tp_group: ProcessGroup) -> dict[str, torch.Tensor]:
    """Named tensors (parameters or buffers, as `state_dict(keep_vars=True)` gives them) at full TP=1 shapes.
    A collective: every rank of the group must call it with the same names in the same order."""
    return _gather_named(items, lambda t: t, tp_group)  # type: ignore[return-value]


def gather_full_state_dict(model: nn.Module, tp_group: ProcessGroup) -> dict[str, torch.Tensor]:
    """The plain model's state dict (same names, full TP=1 shapes), on every rank of `tp_group`.
    A collective: every rank of the group must call it. Loads into a plain GPT with strict=True."""
    items = [(k, v) for k, v in model.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")]
    return gather_tensors(items, tp_group)
