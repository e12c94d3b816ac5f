"""Every FFN kind's forward and backward on the `meta` device, with real numbers: nothing is made on the host.

On a GPU a tensor made inside forward or backward without `device=` (`torch.tensor(...)`, `torch.rand(shape)`, a
`torch.distributions` draw from CPU parameters) lands on the CPU and the first step fails with a device mismatch;
on a CPU-only machine host and training device are one, so nothing shows. Here parameters and inputs live on a
simulated accelerator:

* an `OnMeta` tensor reports device `meta` and keeps its values in a CPU tensor, so data-dependent code (routing,
  `nonzero`, `.item()`, `.tolist()`) runs on real numbers, which neither plain meta tensors (no `nonzero`, no
  values to read) nor FakeTensorMode (data-dependent shapes and `.item()` raise) can do;
* every aten op goes through `_dispatch`, the backward's too (autograd runs the same ops): an op that mixes an
  OnMeta tensor with a host one fails with torch's meta message; a factory given the meta device (`device=x.device`,
  `x.new_*`, `*_like`) makes an OnMeta tensor; `.to`, `copy_` and host reads (`.item()`, `.tolist()`) cross
  between host and device, as on a GPU.

It is stricter than CUDA in one way: a 0-dim host tensor is rejected too (CUDA takes CPU scalars in elementwise
ops); nothing in forward or backward needs one. The routing alone is also run on plain meta tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, return_and_correct_aliasing

from model.batched import expert_log_likelihoods, next_token_log_probs, sequential_log_likelihoods
from model.config import SECOND_EXPERT_POLICIES, CSEConfig, FFNConfig, GShardConfig, ModelConfig
from model.cse import cse_layers
from model.gpt import GPT
from model.gshard import route_tokens

META = torch.device("meta")
aten = torch.ops.aten
_CROSSING = {aten._to_copy.default, aten.copy_.default, aten._local_scalar_dense.default}


class OnMeta(torch.Tensor):
    """A tensor on the simulated accelerator: device `meta`, values in the CPU tensor `_values`."""

    @staticmethod
    def __new__(cls, values: torch.Tensor) -> OnMeta:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            values.shape,
            strides=values.stride(),
            dtype=values.dtype,
            storage_offset=values.storage_offset(),
            device=META,
            requires_grad=values.requires_grad,
        )

    def __init__(self, values: torch.Tensor) -> None:
        self._values = values

    def __repr__(self) -> str:
        return f"OnMeta({self._values!r})"

    def tolist(self) -> Any:  # a host read, as on a GPU (torch refuses it for any subclass)
        return self._values.tolist()

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs)


def _map(fn: Callable[[Any], Any], x: Any) -> Any:
    """`fn` on every leaf of nested tuples, lists and dicts (aten arguments and results; lighter than pytree)."""
    if isinstance(x, (tuple, list)):
        return type(x)(_map(fn, v) for v in x)
    if isinstance(x, dict):
        return {k: _map(fn, v) for k, v in x.items()}
    return fn(x)


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _tensors(v)


def _unwrap(x: Any) -> Any:
    return x._values if isinstance(x, OnMeta) else x


def _wrap(x: Any) -> Any:
    if not isinstance(x, torch.Tensor) or isinstance(x, OnMeta):
        return x
    with torch.inference_mode(False):  # a view of a normal tensor stays normal in inference mode
        return OnMeta(x)


def _dispatch(func, args: tuple, kwargs: dict | None) -> Any:
    """Run `func` on the CPU values; reject host tensors meeting device ones; wrap results that are on the device."""
    kwargs = kwargs or {}
    tensors = list(_tensors((args, tuple(kwargs.values()))))
    on_device = any(isinstance(t, OnMeta) for t in tensors)
    host = [t for t in tensors if not isinstance(t, OnMeta)]
    if any(t.is_meta for t in host):
        raise RuntimeError(f"{func} got a plain meta tensor (no values): made outside simulated_meta()?")
    if on_device and host and func not in _CROSSING:
        raise RuntimeError(
            f"Tensor on device cpu is not on the expected device meta! ({func} with a host tensor of "
            f"shape {tuple(host[0].shape)})"
        )
    device = kwargs.get("device")
    if device is not None:
        kwargs = {**kwargs, "device": torch.device("cpu")}
    out = func(*_map(_unwrap, args), **_map(_unwrap, kwargs))
    to_device = torch.device(device).type == "meta" if device is not None else on_device
    if func is aten.copy_.default:
        to_device = isinstance(args[0], OnMeta)
    if func is aten._local_scalar_dense.default or not to_device:
        return out
    return return_and_correct_aliasing(func, args, kwargs, _map(_wrap, out))


class _Factories(TorchDispatchMode):
    """Sends factories without tensor arguments (`torch.zeros(..., device=meta)`) through `_dispatch` too."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs)


class _FromData(TorchFunctionMode):
    """`torch.tensor(data, device=meta)` copies its data to the device below the dispatcher's Python layer (a
    plain meta tensor, values lost): make it on the host and copy it through `_dispatch` instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if (
            func in (torch.tensor, torch.as_tensor)
            and device is not None
            and torch.device(device).type == "meta"
        ):
            requires_grad = kwargs.pop("requires_grad", False)
            return func(*args, **{**kwargs, "device": "cpu"}).to(META).requires_grad_(requires_grad)
        return func(*args, **kwargs)


@contextmanager
def simulated_meta() -> Iterator[None]:
    """Factories and host-to-device copies given the meta device make simulated-device tensors inside this."""
    with _FromData(), _Factories():
        yield


def to_simulated_meta(module: nn.Module) -> nn.Module:
    """Move every parameter and buffer of `module` onto the simulated device, in place."""
    moved: dict[
        int, tuple[torch.Tensor, torch.Tensor]
    ] = {}  # id -> (original, moved): shared tensors stay shared
    with simulated_meta():
        for m in module.modules():
            for table, move in (
                (m._parameters, lambda p: nn.Parameter(p.detach().to(META), p.requires_grad)),
                (m._buffers, lambda b: b.to(META)),
            ):
                for name, t in table.items():
                    if t is not None:
                        if id(t) not in moved:
                            moved[id(t)] = (t, move(t))
                        table[name] = moved[id(t)][1]
    return module


def values(t: torch.Tensor) -> torch.Tensor:
    """The CPU values of a simulated-device tensor."""
    assert isinstance(t, OnMeta) and t.device == META, (
        f"expected a device tensor, got {type(t).__name__} on {t.device}"
    )
    return t._values


# ---- the harness itself -------------------------------------------------------------------------------------


class _HostConstant(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tensor(1.0)


class _DeviceConstant(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tensor(1.0, device=x.device)


class _HostInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * torch.full(g.shape, 2.0)


@pytest.mark.parametrize(
    "planted",
    [
        lambda x: _HostConstant()(x),
        lambda x: x * torch.rand(x.shape),
        lambda x: x + torch.distributions.Gumbel(torch.tensor(0.0), torch.tensor(1.0)).rsample(x.shape),
        lambda x: torch.cat([x, torch.zeros(1, x.shape[1])]),
    ],
    ids=["host-scalar", "host-rand", "host-distribution", "host-cat"],
)
def test_harness_catches_a_host_tensor_in_forward(planted: Callable[[torch.Tensor], torch.Tensor]) -> None:
    with simulated_meta():
        x = torch.randn(2, 3).to(META)
        with pytest.raises(RuntimeError, match="not on the expected device meta"):
            planted(x)


def test_harness_catches_a_host_tensor_in_backward() -> None:
    with simulated_meta():
        x = torch.randn(2, 3).to(META).requires_grad_()
        y = _HostInBackward.apply(x).sum()
        with pytest.raises(RuntimeError, match="not on the expected device meta"):
            y.backward()


def test_harness_runs_device_code_on_real_values() -> None:
    """Device-placed constants, host reads and host <-> device copies pass, with the CPU's numbers."""
    x_cpu = torch.randn(4, 3, requires_grad=True)
    with simulated_meta():
        x = x_cpu.detach().to(META).requires_grad_()
        y = _DeviceConstant()(x) * x.new_full((), 3.0)
        y.sum().backward()
        assert y.device == META and x.grad.device == META and int((x > 0).sum()) == int((x_cpu > 0).sum())
        assert (x > 0).nonzero().tolist() == (x_cpu > 0).nonzero().tolist()
        back = y.cpu()
    (x_cpu + 1.0).mul(3.0).sum().backward()
    assert type(back) is torch.Tensor and torch.equal(back, (x_cpu.detach() + 1.0) * 3.0)
    assert torch.equal(values(x.grad), x_cpu.grad)


# ---- every FFN kind -----------------------------------------------------------------------------------------

B, T, V, D = 3, 8, 64, 16


def _cfg(kind: str, num_experts: int = 0, **gshard: Any) -> ModelConfig:
    return ModelConfig(
        n_layers=2,
        d_model=D,
        n_heads=2,
        seq_len=T,
        vocab_size=V,
        make_vocab_size_divisible_by=8,
        dropout=0.1,
        ffn=FFNConfig(
            kind=kind,
            num_experts=num_experts,
            gshard=GShardConfig(moe_every=1, min_capacity=1, **gshard),
            cse=CSEConfig(last_layers=1, projection_dim=4, max_clusters=3),
        ),
    )


# name -> (config, expert ids held, routing ids per sequence (None: none passed), routing ids on the device, clusters)
CASES: dict[str, tuple[ModelConfig, list[int] | None, list[int] | None, bool, int]] = {
    "dense": (_cfg("dense"), None, None, False, 0),
    "demix": (_cfg("demix", 3), None, [0, 2, 0], False, 0),  # ids on the host, as the trainer passes them
    "demix-device-ids": (_cfg("demix", 3), None, [2, 1, 2], True, 0),  # single-process evaluation
    "demix-one-expert": (_cfg("demix", 3), [1], [1, 1, 1], False, 0),  # a rank holding one domain's expert
    **{
        f"gshard-top2-{p}": (_cfg("gshard", 3, second_expert_policy=p), None, None, False, 0)
        for p in SECOND_EXPERT_POLICIES
    },
    "gshard-top2-capacity-drops": (
        _cfg("gshard", 4, capacity_factor=0.5, eval_capacity_factor=0.5),
        None,
        None,
        False,
        0,
    ),
    "gshard-top1": (_cfg("gshard", 3, top_k=1), None, None, False, 0),
    "gshard-one-expert": (_cfg("gshard", 1), None, None, False, 0),
    "cse-warmup": (_cfg("cse"), None, None, False, 0),  # before clustering: every sequence on expert 0
    "cse-clustered": (_cfg("cse"), None, None, False, 2),
}


def _build(name: str) -> tuple[GPT, dict[str, Any]]:
    cfg, experts, ids, ids_on_device, clusters = CASES[name]
    model = GPT(cfg, expert_ids=experts, init_seed=0)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    for layer in cse_layers(model) if clusters else []:  # centres at the first sequences: they route apart
        seen = []
        hook = layer.register_forward_pre_hook(lambda m, args, seen=seen: seen.append(m.embed(args[0])))
        with torch.no_grad():
            model.eval()(tokens)
        hook.remove()
        layer.set_clusters(seen[0][:clusters], torch.ones(clusters))
    mask = torch.ones(B, T)
    mask[:, 0] = 0.0  # a prepended domain token (+Domain-Token) is not scored
    batch = {
        "tokens_BT": tokens,
        "domain_ids_B": None if ids is None else torch.tensor(ids),
        "targets_BT": torch.roll(tokens, -1, 1),
        "loss_mask_BT": mask,
    }
    return model, batch


def _step(model: GPT, batch: dict[str, Any], training: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward (seeded: dropout, second-expert sampling) and backward of loss + aux; (loss, gradients)."""
    model.train(training)
    torch.manual_seed(3)
    out = model(batch["tokens_BT"], batch["domain_ids_B"], batch["targets_BT"], batch["loss_mask_BT"])
    loss = out.loss if out.aux_loss is None else out.loss + out.aux_loss
    loss.backward()
    for layer in cse_layers(model):
        layer.apply_centre_update()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", list(CASES))
def test_forward_backward_on_the_device(name: str, training: bool) -> None:
    """The model on the device computes the CPU's loss, gradients and cluster centres, with no host tensor."""
    ref, batch = _build(name)
    ref_loss, ref_grads = _step(ref, batch, training)
    model, _ = _build(name)
    to_simulated_meta(model)
    ids_on_device = CASES[name][3]
    with simulated_meta():
        dev = {k: v.to(META) for k, v in batch.items() if v is not None}
        if not ids_on_device:
            dev["domain_ids_B"] = batch["domain_ids_B"]
        loss, grads = _step(model, dev, training)
    assert grads.keys() == ref_grads.keys() and len(grads) == len(list(ref.parameters()))
    assert torch.allclose(values(loss), ref_loss, rtol=1e-5, atol=1e-6)
    for n, g in grads.items():
        assert torch.allclose(values(g), ref_grads[n], rtol=1e-4, atol=1e-6), n
    for layer, ref_layer in zip(cse_layers(model), cse_layers(ref)):
        assert torch.allclose(values(layer.centres_EP), ref_layer.centres_EP)


@pytest.mark.parametrize("name", ["dense", "demix", "gshard-top2-sampling", "cse-clustered"])
def test_batched_and_sequential_evaluation_on_the_device(name: str) -> None:
    """model/batched.py's per-expert log-likelihoods, its reference and generation's next-token step."""
    ref, batch = _build(name)
    ref.eval()
    tokens, targets = batch["tokens_BT"], batch["targets_BT"]
    want = [
        expert_log_likelihoods(ref, tokens, targets),
        sequential_log_likelihoods(ref, tokens, targets),
        next_token_log_probs(ref, tokens),
    ]
    model, _ = _build(name)
    to_simulated_meta(model).eval()
    with simulated_meta():
        x, y = tokens.to(META), targets.to(META)
        got = [
            expert_log_likelihoods(model, x, y),
            sequential_log_likelihoods(model, x, y),
            next_token_log_probs(model, x),
        ]
    for g, w in zip(got, want):
        assert torch.allclose(values(g), w, rtol=1e-5, atol=1e-5)


# ---- plain meta tensors, and the noise -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["demix", "gshard-top2-sampling", "gshard-top2-random"])
def test_training_step_on_plain_meta_tensors(name: str) -> None:
    """`model.to("meta")` with torch's own device checks (which let CPU scalars through, as CUDA does). Routing ids
    stay on the host, as the trainer passes them; GShard's expert rows come from torch's all-nonzero stand-in for
    `nonzero` on meta. CSE cannot run here: it reads its active cluster count and the routed clusters to the host
    (`int(num_active)`, `unique().tolist()`), which meta tensors cannot give; the simulated device covers it."""
    from torch.fx.experimental import _config as fx_config

    model, batch = _build(name)
    model.to(META)
    dev = {k: v if v is None or k == "domain_ids_B" else v.to(META) for k, v in batch.items()}
    with fx_config.patch(meta_nonzero_assume_all_nonzero=True):
        loss, grads = _step(model, dev, training=True)
    assert loss.device == META and len(grads) == len(list(model.parameters()))


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("policy", SECOND_EXPERT_POLICIES)
def test_routing_on_plain_meta_tensors(policy: str, training: bool, top_k: int) -> None:
    logits_SE = torch.randn(24, 4, device=META)
    r = route_tokens(logits_SE, top_k, 1.0, 4, policy, training)
    for t in (r.experts_KS, r.slots_KS, r.kept_KS, r.weights_KS, r.probs_SE, r.counts_E, r.l_aux):
        assert t.device == META


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_gumbel_noise_is_torch_distributions_draw_on_the_device(dtype: torch.dtype) -> None:
    """The same numbers as torch.distributions.Gumbel(0, 1).rsample (and so DeepSpeed's gumbel_rsample) from the
    same seed, in the logits' dtype and on their device."""
    from model.gshard import gumbel_noise

    torch.manual_seed(5)
    want = torch.distributions.Gumbel(torch.tensor(0.0, dtype=dtype), torch.tensor(1.0, dtype=dtype)).rsample(
        (64, 8)
    )
    torch.manual_seed(5)
    got = gumbel_noise(torch.empty(64, 8, dtype=dtype))
    assert got.dtype == dtype and torch.equal(got, want) and bool(torch.isfinite(got).all())
    on_meta = gumbel_noise(torch.empty(64, 8, dtype=dtype, device=META))
    assert on_meta.device == META and on_meta.dtype == dtype


@pytest.mark.parametrize(
    "name", ["demix", "demix-one-expert", "cse-clustered", "dense", "gshard-top2-sampling"]
)
def test_every_ffn_kind_trains_under_bf16_autocast(name: str) -> None:
    """ZeRO 0 with bf16 runs the model under torch.autocast (DeepSpeed's torch_autocast): the layers that scatter
    several experts' rows into one buffer must take the experts' bf16 outputs (they raised "Index put requires the
    source and destination dtypes match" for DEMix with several experts on a rank and for clustered CSE)."""
    ref, batch = _build(name)
    ref_loss, _ = _step(ref, batch, training=True)
    model, _ = _build(name)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grads = _step(model, batch, training=True)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
    assert loss.item() == pytest.approx(ref_loss.item(), rel=5e-2)
