"""Every DeepSpeed private name the project relies on, behind named functions: a DeepSpeed upgrade touches this file.

DeepSpeed's public API has no way to bind an expert group name to a group we made, to switch on its expert paths
without its MoE layer, to run its backward prologue for a dataclass output, or to read ZeRO's fragment mappings;
those reach into private globals and attributes, here and nowhere else (tests/parallel/test_ds_private.py checks
that the installed DeepSpeed still has every name in `PRIVATE_NAMES`, naming the missing one and the version, and
that no other file of the project uses one of them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

# (DeepSpeed module, class or None, private name): what this file uses. A class attribute set in __init__ (not on
# the class itself) is checked in the class's source.
PRIVATE_NAMES: tuple[tuple[str, str | None, str], ...] = (
    ("deepspeed.utils.groups", None, "_EXPERT_DATA_PARALLEL_GROUP"),
    ("deepspeed.utils.groups", None, "_EXPERT_DATA_PARALLEL_GROUP_RANKS"),
    ("deepspeed.utils.groups", None, "_EXPERT_PARALLEL_GROUP"),
    ("deepspeed.utils.groups", None, "_EXPERT_PARALLEL_GROUP_RANKS"),
    ("deepspeed.utils.groups", None, "_get_expert_data_parallel_group"),
    ("deepspeed.utils.groups", None, "_get_expert_parallel_group_ranks"),
    ("deepspeed.utils.groups", None, "_get_data_parallel_group"),
    ("deepspeed.utils.groups", None, "_get_sequence_data_parallel_group"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "_backward_prologue"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "_backward_prologue_per_tensor"),
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer", "_hp_optimizer_states_linked"),
    ("deepspeed.utils.mixed_precision_linkage", None, "_hp_mapping"),
    ("deepspeed.utils.mixed_precision_linkage", None, "_dp_group"),
    ("deepspeed.runtime.fp16.unfused_optimizer", "FP16_UnfusedOptimizer", "_skip_invalid_grad_norm"),
    ("deepspeed.runtime.fp16.unfused_optimizer", "FP16_UnfusedOptimizer", "_update_scale"),
    ("deepspeed.runtime.fp16.unfused_optimizer", "FP16_UnfusedOptimizer", "_global_grad_norm"),
)


def _ds_groups() -> Any:
    from deepspeed.utils import groups as ds_groups

    return ds_groups


# -- process groups (deepspeed/utils/groups.py's private registry) ---------------------------------------------------


def bind_expert_groups(
    name: str, edp_group: Any, edp_ranks: list[int], ep_group: Any, ep_ranks: list[int]
) -> None:
    """Bind expert group name `name` to our groups: its expert-data-parallel group (over which DeepSpeed reduces
    parameters tagged `group_name=name`) and its expert-parallel group."""
    g = _ds_groups()
    g._EXPERT_DATA_PARALLEL_GROUP[name] = edp_group
    g._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = list(edp_ranks)
    g._EXPERT_PARALLEL_GROUP[name] = ep_group
    g._EXPERT_PARALLEL_GROUP_RANKS[name] = list(ep_ranks)


def expert_data_parallel_group(name: str) -> Any:
    """The group DeepSpeed reduces expert parameters named `name` over."""
    return _ds_groups()._get_expert_data_parallel_group(name)


def expert_parallel_group_ranks(name: str) -> list[int]:
    """The ranks of DeepSpeed's expert-parallel group `name` (GShard's all-to-all)."""
    return list(_ds_groups()._get_expert_parallel_group_ranks(name))


def data_parallel_group() -> Any:
    """DeepSpeed's data-parallel group (what it divides expert sums by the size of)."""
    return _ds_groups()._get_data_parallel_group()


def sequence_data_parallel_group() -> Any:
    """DeepSpeed's sequence-data-parallel group (the one the engine reduces shared gradients over)."""
    return _ds_groups()._get_sequence_data_parallel_group()


def expert_group_size(name: str) -> int:
    """How many ranks DeepSpeed reduces expert parameters named `name` over."""
    return dist.get_world_size(expert_data_parallel_group(name))


# -- the engine ------------------------------------------------------------------------------------------------------


def moe_marker(num_experts: int, group_name: str) -> nn.Module:
    """A parameter-free module that makes DeepSpeed switch on its expert-parameter paths.

    The engine enables expert-group reduction (and hands the expert groups to ZeRO) only when the model contains a
    `deepspeed.moe.layer.MoE`. DEMix needs those paths but not that layer (no gate, no all-to-all), so
    parallel/demix_sync.py attaches this marker; the model itself stays plain PyTorch.
    """
    from deepspeed.moe.layer import MoE

    class DemixExpertGroups(MoE):
        def __init__(self) -> None:
            nn.Module.__init__(self)
            self.num_experts = num_experts
            self.expert_group_name = group_name

        def set_deepspeed_parallelism(self, *args: Any, **kwargs: Any) -> None:
            pass  # groups were registered from our topology (parallel/demix_sync.py)

        def forward(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError("the DEMix expert-group marker is not a layer")

    return DemixExpertGroups()


def backward_prologue_hooks(engine: Any) -> dict[str, Any]:
    """`register_output_backward_hooks`' keyword arguments that run the engine's backward prologue."""
    return {
        "preprocess_once_fn": engine._backward_prologue,
        "preprocess_per_tensor_fn": engine._backward_prologue_per_tensor,
    }


# -- ZeRO 1/2's fp32 fragments ---------------------------------------------------------------------------------------

_ABSENT = object()


def has_hp_mapping(p: torch.Tensor) -> bool:
    """Whether ZeRO linked `p` to fp32 fragments at all (the attribute exists, possibly None on this rank)."""
    return getattr(p, "_hp_mapping", _ABSENT) is not _ABSENT


def hp_mapping(p: torch.Tensor) -> Any:
    """ZeRO's fragment mapping of `p` on this rank (None: no fragment here)."""
    return getattr(p, "_hp_mapping", None)


def param_dp_group(p: torch.Tensor) -> Any:
    """The group ZeRO partitions `p` over."""
    return p._dp_group  # type: ignore[attr-defined]  # set by ZeRO on the parameters it partitions


def mark_hp_states_linked(optimizer: Any) -> None:
    """Tell a ZeRO 1/2 optimizer its parameters' optimizer-state fragments are linked (we linked them)."""
    optimizer._hp_optimizer_states_linked = True


# -- the fp16 optimizer at ZeRO 0 (parallel/overflow.py) -------------------------------------------------------------


def skip_invalid_grad_norm(optimizer: Any) -> Any:
    """FP16_UnfusedOptimizer's overflow path: skip the step and lower the loss scale."""
    return optimizer._skip_invalid_grad_norm()


def update_loss_scale(optimizer: Any, skip: bool) -> None:
    """FP16_UnfusedOptimizer's loss-scale update after a step (`skip`: the step overflowed)."""
    optimizer._update_scale(skip)


def set_global_grad_norm(optimizer: Any, norm: Any) -> None:
    """What `engine.get_global_grad_norm()` returns."""
    optimizer._global_grad_norm = norm
