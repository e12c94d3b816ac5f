"""parallel/universal.py's Adam state for a load, placed as torch places it: parameters on the `meta` device stand
for the accelerator, so a tensor made on the host while the parameter sits elsewhere shows on a CPU-only machine
(CUDA's fused AdamW reads `step` on the device and fails on a host one)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from parallel.universal import ParamStates

META = torch.device("meta")
SETTINGS = [{"fused": True}, {"capturable": True}, {}]  # fused: what parallel/engine.py uses on CUDA


def _meta_params(dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.empty(*shape, device=META, dtype=dtype)) for shape in ((3, 2), (4,))]


def _torch_loaded(params: list[torch.nn.Parameter], settings: dict[str, Any], step: int) -> list[dict]:
    """Where torch's own `load_state_dict` puts each state tensor (device, dtype), from a state saved on the host."""
    opt = torch.optim.AdamW(params, **settings)
    saved = {
        i: {"step": torch.tensor(float(step)), **{k: torch.zeros(p.shape) for k in ("exp_avg", "exp_avg_sq")}}
        for i, p in enumerate(params)
    }
    opt.load_state_dict({"state": saved, "param_groups": opt.state_dict()["param_groups"]})
    return [{k: (v.device, v.dtype) for k, v in opt.state[p].items()} for p in params]


def _placed(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[dict]:
    return [{k: (v.device, v.dtype) for k, v in opt.state[p].items()} for p in params]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: next(iter(s), "default"))
def test_zero0_load_places_the_state_as_torch_does(settings):
    """ZeRO 0, fp32 or bf16: the parameter is its own master, its state in torch's AdamW."""
    params = _meta_params()
    opt = torch.optim.AdamW(params, **settings)
    ParamStates(SimpleNamespace(optimizer=opt)).prepare_load(5)
    assert _placed(opt, params) == _torch_loaded(_meta_params(), settings, 5)
    if settings:  # the fused and capturable kernels read every state tensor on the parameter's device
        assert all(v.device == p.device for p in params for v in opt.state[p].values())
        assert all(opt.state[p]["step"].dtype == torch.float32 for p in params)
    else:  # the default (foreach) kernels keep `step` on the host, where its value can be read
        assert all(float(opt.state[p]["step"]) == 5 for p in params)


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: next(iter(s), "default"))
def test_zero0_fp16_load_places_the_state_of_the_fp32_copies(settings):
    """ZeRO 0, fp16 (DeepSpeed's FP16_UnfusedOptimizer): the state belongs to the fp32 copies the AdamW steps."""
    fp16, fp32 = _meta_params(torch.float16), _meta_params()
    inner = torch.optim.AdamW(fp32, **settings)
    wrapper = SimpleNamespace(fp16_groups=[fp16], fp32_groups=[fp32], optimizer=inner)
    ParamStates(SimpleNamespace(optimizer=wrapper)).prepare_load(2)
    assert _placed(inner, fp32) == _torch_loaded(_meta_params(), settings, 2)


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: next(iter(s), "default"))
def test_zero12_load_places_the_state_of_the_flat_partitions(settings):
    """ZeRO 1/2 (`DeepSpeedZeroOptimizer`): one state per flat fp32 partition, which AdamW steps."""
    flats = [
        torch.nn.Parameter(torch.empty(10, device=META)),
        torch.nn.Parameter(torch.empty(6, device=META)),
    ]
    inner = torch.optim.AdamW(
        [{"params": [flats[0]]}, {"params": [flats[1]], "weight_decay": 0.0}], **settings
    )
    zero = SimpleNamespace(single_partition_of_fp32_groups=flats, bit16_groups=[[], []], optimizer=inner)
    ParamStates(SimpleNamespace(optimizer=zero)).prepare_load(3)
    want = _torch_loaded([torch.nn.Parameter(torch.empty(f.shape, device=META)) for f in flats], settings, 3)
    assert _placed(inner, flats) == want
    assert zero._hp_optimizer_states_linked
