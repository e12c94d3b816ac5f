"""A parameter's whole training state, whatever the ZeRO stage and precision: its fp32 master weight and Adam
moments at the parameter's own (tensor-parallel shard) shape, read and written one parameter at a time.

This is what makes a training state independent of the layout that wrote it (DeepSpeed's "universal
checkpoint" idea): saved per parameter name, it loads into any data-parallel size, domain layout or ZeRO stage.
Where the numbers live depends on the optimizer DeepSpeed built:

- ZeRO 1/2 (`DeepSpeedZeroOptimizer`): each rank holds a partition of one flat fp32 buffer per optimizer group,
  partitioned over the group's data-parallel ranks (the domain group for DEMix experts). DeepSpeed's fragment
  API (`safe_get_full_fp32_param`, `safe_get_full_optimizer_state`, and the `safe_set_*` twins) maps a parameter
  to its fragment; reading the whole tensor all-reduces over that group, so reads are collective and every rank
  of a group must read its parameters in the same order.
- ZeRO 0 with fp32 or bf16 autocast: the parameter is its own master, its moments are in torch's AdamW state.
- ZeRO 0 with fp16 (`FP16_UnfusedOptimizer` around our AdamW): an fp32 copy per parameter (`fp32_groups`),
  whose AdamW state holds the moments.

Frozen parameters (DEMix-DAPT) have no optimizer state: their value is the parameter itself.

Who writes which file of a training state (`assign_writers`): after those all-reduces (and the tensor-parallel
all-gather) every rank that holds a parameter has its whole value, so any of them can write its files; the
files are spread over those ranks by bytes, so a save's disk traffic is shared instead of falling on one rank.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from parallel import ds_private

MOMENTS = ("exp_avg", "exp_avg_sq")
FP32 = "fp32"


class UniversalStateError(RuntimeError):
    """The optimizer DeepSpeed built is not one whose state can be read per parameter."""


def _is_zero(optimizer: Any) -> bool:
    return hasattr(optimizer, "single_partition_of_fp32_groups") and hasattr(optimizer, "bit16_groups")


class ParamStates:
    """Per-parameter access to an engine's fp32 masters and Adam moments (see the module docstring)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.opt = engine.optimizer
        self.zero = _is_zero(self.opt)
        self._masters: dict[int, tuple[torch.Tensor, torch.optim.Optimizer]] = {}
        if self.zero:
            self._link_moments()
            return
        if hasattr(self.opt, "fp16_groups") and hasattr(self.opt, "fp32_groups"):  # fp16 at ZeRO 0
            for g16, g32 in zip(self.opt.fp16_groups, self.opt.fp32_groups):
                for lp, hp in zip(g16, g32):
                    self._masters[id(lp)] = (hp, self.opt.optimizer)
        elif isinstance(self.opt, torch.optim.Optimizer):
            for group in self.opt.param_groups:
                for p in group["params"]:
                    self._masters[id(p)] = (p, self.opt)
        else:
            raise UniversalStateError(f"cannot read per-parameter state from a {type(self.opt).__name__}")

    def get(self, p: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        """{"fp32": master weight, "exp_avg": ..., "exp_avg_sq": ...} of `p` (moments absent before the first
        step and for frozen parameters). At ZeRO 1/2 a collective over p's data-parallel group."""
        if self.zero and ds_private.has_hp_mapping(p):
            from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

            out = {FP32: safe_get_full_fp32_param(p)}
            if self._has_moments():
                for key in MOMENTS:
                    out[key] = safe_get_full_optimizer_state(p, key)
            return out
        if id(p) not in self._masters:  # frozen: not in any optimizer group
            return {FP32: p.detach().float()}
        master, opt = self._masters[id(p)]
        state = opt.state.get(master, {})
        return {FP32: master.detach().float(), **{k: state[k].detach() for k in MOMENTS if k in state}}

    def keys(self, p: torch.nn.Parameter) -> tuple[str, ...]:
        """The keys `get(p)` returns, found without a collective: the same on every rank that holds `p`."""
        if self.zero and ds_private.has_hp_mapping(p):
            return (FP32, *MOMENTS) if self._has_moments() else (FP32,)
        if id(p) not in self._masters:
            return (FP32,)
        master, opt = self._masters[id(p)]
        state = opt.state.get(master, {})
        return (FP32, *(k for k in MOMENTS if k in state))

    def _link_moments(self) -> None:
        """Point every parameter's fragment at its group's Adam state. DeepSpeed 0.19.8 links them once, right
        after the *first group's* first step, when the other groups have no state yet, and never again: their
        `safe_get_full_optimizer_state` then raises "exp_avg not found". Re-linking is cheap (views)."""
        from deepspeed.utils.mixed_precision_linkage import lazy_init_hp_params_optimizer_state

        inner = self.opt.optimizer
        for i, flat in enumerate(self.opt.single_partition_of_fp32_groups):
            if len(inner.state.get(flat, {})):
                lazy_init_hp_params_optimizer_state(self.opt.bit16_groups[i], flat, inner.state)

    def _has_moments(self) -> bool:
        return any(len(s) for s in self.opt.optimizer.state.values())

    def adam_step(self) -> int:
        """The optimizer's update count (AdamW's `step`, the same for every parameter); 0 before the first."""
        inner = (
            [self.opt.optimizer]
            if self.zero
            else list({id(o): o for _, o in self._masters.values()}.values())
        )
        for opt in inner:
            for state in opt.state.values():
                if "step" in state:
                    return int(state["step"])
        return 0

    def prepare_load(self, step: int) -> None:
        """Before `set`: give every optimizer group an Adam state (zeros, `step` updates done) so the moments
        have somewhere to go. ZeRO 1/2 then links each parameter to its fragment of that state."""
        if step <= 0:
            return
        if self.zero:
            inner = self.opt.optimizer
            for flat in self.opt.single_partition_of_fp32_groups:
                inner.state[flat] = _adam_state(flat, step, _group_of(inner, flat))
            self._link_moments()
            ds_private.mark_hp_states_linked(self.opt)
            return
        for master, opt in self._masters.values():
            opt.state[master] = _adam_state(master, step, _group_of(opt, master))

    def set(self, p: torch.nn.Parameter, values: dict[str, torch.Tensor]) -> None:
        """Write `values` (as `get` returns them, at p's shape) into p's master, moments and the parameter."""
        if self.zero and ds_private.has_hp_mapping(p):
            from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

            safe_set_full_fp32_param(p, values[FP32].to(p.device))
            for key in MOMENTS:
                if key in values and ds_private.hp_mapping(p) is not None:
                    safe_set_full_optimizer_state(p, values[key].to(p.device), key)
            return
        with torch.no_grad():
            p.copy_(values[FP32].to(p.device, p.dtype))
            if id(p) not in self._masters:
                return
            master, opt = self._masters[id(p)]
            master.copy_(values[FP32].to(master.device))
            for key in MOMENTS:
                if key in values and master in opt.state:
                    opt.state[master][key].copy_(values[key].to(master.device))

    def finish_load(self) -> None:
        """After every `set`: ZeRO 1/2 copy the fp32 masters into the (16-bit) parameters every rank uses; a
        collective over each group's data-parallel ranks."""
        if self.zero:
            self.opt.update_lp_params()

    def _scaler(self) -> Any:
        """Where the loss scale lives: `loss_scale_config` (DeepSpeed's fp16 optimizers at ZeRO 0), `loss_scaler`
        (ZeRO 1/2), or nowhere (fp32, bf16)."""
        for name in ("loss_scale_config", "loss_scaler"):
            scaler = getattr(self.opt, name, None)
            if scaler is not None and hasattr(scaler, "cur_scale"):
                return scaler
        return None

    def loss_scaler_state(self) -> dict[str, float]:
        """The fp16 dynamic loss scaler's counters (empty without fp16), for an exact resume."""
        scaler = self._scaler()
        if scaler is None:
            return {}
        return {
            k: float(getattr(scaler, k))
            for k in _SCALER_FIELDS
            if isinstance(getattr(scaler, k, None), (int, float)) and not isinstance(getattr(scaler, k), bool)
        }

    def load_loss_scaler_state(self, state: dict[str, float]) -> None:
        scaler = self._scaler()
        if scaler is None:
            return
        for k, v in state.items():
            if k in _SCALER_FIELDS and hasattr(scaler, k):
                setattr(scaler, k, type(getattr(scaler, k))(v))


_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def _group_of(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, Any]:
    """The param group of `opt` that holds `p`."""
    for group in opt.param_groups:
        if any(q is p for q in group["params"]):
            return group
    raise UniversalStateError(f"a {type(opt).__name__} without a param group holding the tensor to load")


def _adam_state(like: torch.Tensor, step: int, group: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """torch AdamW's per-parameter state after `step` updates, moments zero (to be overwritten), placed as torch's
    own `_init_group` and `load_state_dict` place it: moments where the parameter is, at its dtype; `step` a
    float32 on the parameter's device for the fused or capturable kernels (CUDA's fused AdamW reads it there),
    otherwise a scalar on the host."""
    from torch.optim.optimizer import _get_scalar_dtype

    if group.get("fused") or group.get("capturable"):
        count = torch.full((), float(step), dtype=_get_scalar_dtype(is_fused=True), device=like.device)
    else:
        count = torch.tensor(float(step), dtype=_get_scalar_dtype(), device="cpu")
    return {
        "step": count,
        "exp_avg": torch.zeros_like(like, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(like, memory_format=torch.preserve_format),
    }


def full_tensor_parallel(t: torch.Tensor, p: torch.nn.Parameter, tp_group: Any | None) -> torch.Tensor:
    """`t` (a value at p's shard shape) gathered over the tensor-parallel group to the plain model's shape.
    A collective over the TP group for sharded parameters. Without a TP group, `t` itself (detached, sharing
    its storage: copy before keeping it)."""
    from parallel.tensor_parallel import _gather

    return _gather(t, p, tp_group) if tp_group is not None else t.detach()


def assign_writers(
    sizes: Mapping[str, int], ranks: Sequence[int], load: Mapping[int, int] | None = None
) -> dict[str, int]:
    """Each file (name -> bytes) to one of `ranks`, balancing the bytes each rank writes: largest file first, each
    onto the rank with the fewest bytes so far (`load`: bytes a rank writes already; ties to the lower rank,
    equal sizes in name order). Greedy largest-first list scheduling (Graham's LPT). Pure and deterministic:
    every rank computes the same assignment from the same names and sizes, with no collective.

    Bound: each file goes to a least-loaded rank, so when the spread of `load` (max - min) is within the largest
    file, so is the spread of the result: max_r bytes_r - min_r bytes_r <= max_f size_f, hence
    max_r bytes_r <= mean_r bytes_r + max_f size_f."""
    start = load or {}
    heap = [(int(start.get(r, 0)), r) for r in sorted(set(ranks))]
    if not heap:
        raise ValueError("assign_writers needs at least one rank")
    heapq.heapify(heap)
    out: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        written, rank = heapq.heappop(heap)
        out[name] = rank
        heapq.heappush(heap, (written + int(sizes[name]), rank))
    return out


def tensor_parallel_shard(
    full: torch.Tensor, p: torch.nn.Parameter, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """This TP rank's slice of a plain-model tensor (megatron-core's contiguous chunks along partition_dim)."""
    if tp_size == 1 or not getattr(p, "tensor_model_parallel", False):
        return full
    return full.chunk(tp_size, dim=p.partition_dim)[tp_rank]  # type: ignore[attr-defined]  # set by megatron-core
