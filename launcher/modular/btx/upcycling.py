"""BTX upcycling (docs/btx.md, "Upcycling"): a DEMix checkpoint's domain experts become a GShard top-2 MoE, with a
new router per MoE layer (launcher/modular/btx/router.py) and the experts' mean as the FFN of the other layers."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from launcher.checkpoint import CheckpointError, Consolidated, check_checkpoint_out, save_consolidated
from launcher.checkpoint_data import check_checkpoint_data
from launcher.config import ConfigError, RunConfig
from launcher.expert_surgery import CkptLike, _load
from launcher.ffn_kinds import ffn_kind
from launcher.modular.btx.router import domain_ffn_inputs, fit_router
from launcher.modular.btx.run_sets import finetune_overrides
from launcher.modular.lineage import inherited_meta

LAYERS: dict[str, int] = {"every_other": 2, "all": 1}  # --layers -> model.ffn.gshard.moe_every
ROUTER_INITS: tuple[str, ...] = ("data", "zero")


def btx_config(cfg: RunConfig, layers: str = "every_other", experts_per_rank: int = 1) -> RunConfig:
    """The GShard run config of the upcycled model: the DEMix model's shape, `num_experts` = its domains, an MoE
    layer every `LAYERS[layers]` layers, the natural mixture (token routing needs no domain labels)."""
    if layers not in LAYERS:
        raise ValueError(f"layers={layers!r}: choose one of {', '.join(LAYERS)}")
    ffn = cfg.model.ffn
    gshard = replace(ffn.gshard, moe_every=LAYERS[layers], experts_per_rank=experts_per_rank)
    model = replace(cfg.model, ffn=replace(ffn, kind="gshard", gshard=gshard))
    return replace(
        cfg,
        model=model,
        data=replace(cfg.data, mixture="natural"),
        parallel=replace(cfg.parallel, allocation=None),
        train=replace(cfg.train, init_from=None, trainable="all"),
    )


def layout_problems(num_experts: int, experts_per_rank: int, world_size: int | None = None) -> list[str]:
    """Why E experts cannot be laid out `experts_per_rank` per rank (over `world_size` ranks, when given)."""
    if experts_per_rank < 1:
        return [f"--experts-per-rank={experts_per_rank}: must be >= 1"]
    if num_experts % experts_per_rank:
        divisors = [k for k in range(1, num_experts + 1) if num_experts % k == 0]
        return [
            f"{num_experts} experts (one per DEMix domain) are not divisible by --experts-per-rank="
            f"{experts_per_rank}: every rank holds the same number of experts; choose one of {divisors}"
        ]
    ep = num_experts // experts_per_rank
    if world_size is not None and (world_size < 1 or world_size % ep):
        return [
            f"{num_experts} experts / {experts_per_rank} per rank = {ep} expert-parallel ranks, which does not "
            f"divide --world-size={world_size}: choose experts_per_rank so that {num_experts} / experts_per_rank "
            f"divides {world_size}"
        ]
    return []


def average_coherence(state: dict[str, torch.Tensor], num_experts: int, layer: int) -> float:
    """||mean_j W_j|| / mean_j ||W_j|| over the fc1 weights of a layer's experts: 1 when the experts are equal (BTX's
    branches of one seed model early on), about 1/sqrt(E) when they are independent (uncorrelated) matrices."""
    W_EFD = torch.stack(
        [state[f"blocks.{layer}.ffn.experts.{j}.fc1.weight"].double() for j in range(num_experts)]
    )
    return float(W_EFD.mean(0).norm() / W_EFD.flatten(1).norm(dim=1).mean())


def upcycle_state(
    state: dict[str, torch.Tensor],
    num_experts: int,
    n_layers: int,
    moe_layers: Sequence[int],
    gates: dict[int, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """The GShard state dict from a DEMix one: MoE layers keep every expert under its name and get `gates[l]`
    (E x D) as `blocks.<l>.ffn.gate.weight`; other layers get the experts' mean as `blocks.<l>.ffn.mlp.*`; every
    other tensor is the same object (bit-identical)."""
    out: dict[str, torch.Tensor] = {}
    prefixes = [f"blocks.{l}.ffn.experts." for l in range(n_layers)]
    for k, v in state.items():
        if not any(k.startswith(p) for p in prefixes):
            out[k] = v
    for l in range(n_layers):
        pre = f"blocks.{l}.ffn."
        names = sorted({k[len(pre + "experts.0.") :] for k in state if k.startswith(pre + "experts.0.")})
        if not names:
            raise CheckpointError(
                f"layer {l} has no DEMix expert 0 ({pre}experts.0.*): not a DEMix state dict"
            )
        for name in names:
            experts = [state[f"{pre}experts.{j}.{name}"] for j in range(num_experts)]
            if l in moe_layers:
                out.update({f"{pre}experts.{j}.{name}": t for j, t in enumerate(experts)})
            else:  # BTX averages the parameters it does not turn into experts
                out[f"{pre}mlp.{name}"] = torch.stack(experts).mean(0)
        if l in moe_layers:
            out[f"{pre}gate.weight"] = gates[l]
    return out


def _option_problems(layers: str, router_init: str, router_entropy: float, blocks: int) -> list[str]:
    """Every problem with upcycle's options, together."""
    problems = []
    if layers not in LAYERS:
        problems.append(f"--layers={layers!r}: choose one of {', '.join(LAYERS)}")
    if router_init not in ROUTER_INITS:
        problems.append(f"--router-init={router_init!r}: choose one of {', '.join(ROUTER_INITS)}")
    if not 0.0 < router_entropy < 1.0:
        problems.append(f"--router-entropy={router_entropy}: a fraction of log E in (0, 1)")
    if blocks < 1:
        problems.append(f"--blocks={blocks}: must be >= 1")
    return problems


def _moe_layers(c: Consolidated, cfg: RunConfig, layers: str) -> list[int]:
    """The MoE layers of the upcycled config; ConfigError when `layers` puts none in this model."""
    moe_layers = cfg.model.moe_layer_ids()
    if not moe_layers:
        raise ConfigError(
            [
                f"--layers={layers} puts no MoE layer in a {c.cfg.model.n_layers}-layer model: use "
                "--layers all"
            ],
            "btx",
        )
    return moe_layers


def _router_gates(
    c: Consolidated,
    moe_layers: Sequence[int],
    router_init: str,
    data: str | None,
    tokenizer: str | None,
    blocks: int,
    router_entropy: float,
) -> tuple[dict[int, torch.Tensor], dict[str, dict[str, float]], str | None, str | None]:
    """Each MoE layer's new router (E x D), its statistics per layer (`data`), and the data and tokenizer used."""
    E, D = len(c.domains), c.cfg.model.d_model
    if router_init == "zero":
        return {l: torch.zeros(E, D) for l in moe_layers}, {}, data, tokenizer
    data = data or c.cfg.data.path
    tokenizer = tokenizer or c.cfg.data.tokenizer
    check_checkpoint_data(c, data, tokenizer)  # the tokens must be the checkpoint's tokenizer's
    means, xs = domain_ffn_inputs(c, data, tokenizer, moe_layers, blocks)
    gates, router = {}, {}
    for l in moe_layers:
        gates[l], router[str(l)] = fit_router(means[l], xs[l], router_entropy)
    return gates, router, data, tokenizer


def upcycle(
    ckpt: CkptLike,
    out: str | Path,
    *,
    layers: str = "every_other",
    router_init: str = "data",
    data: str | None = None,
    tokenizer: str | None = None,
    blocks: int = 16,
    router_entropy: float = 0.5,
    experts_per_rank: int = 1,
    world_size: int | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write the BTX-upcycled GShard checkpoint of DEMix checkpoint `ckpt` to `out` (docs/btx.md); returns a
    record of what was done: the MoE and averaged layers, the expert -> domain map, per-layer router statistics
    (`data`), the expert layout, and the `--set` overrides that start a finetune run from it."""
    t0 = time.perf_counter()
    problems = _option_problems(layers, router_init, router_entropy, blocks)
    if problems:
        raise ConfigError(problems, "btx")
    if not isinstance(ckpt, Consolidated):
        check_checkpoint_out(out, [ckpt], overwrite)
    c = _load(ckpt)
    if not ffn_kind(c.cfg).domain_experts:
        raise CheckpointError(
            f"BTX upcycles a DEMix checkpoint (one expert per domain in every layer), not a "
            f"{c.cfg.model.ffn.kind!r} one"
        )
    E = len(c.domains)
    bad = layout_problems(E, experts_per_rank, world_size)
    if bad:
        raise ConfigError(bad, "btx")
    cfg = btx_config(c.cfg, layers, experts_per_rank)
    moe_layers = _moe_layers(c, cfg, layers)
    gates, router, data, tokenizer = _router_gates(
        c, moe_layers, router_init, data, tokenizer, blocks, router_entropy
    )
    state = upcycle_state(c.state_dict, E, c.cfg.model.n_layers, moe_layers, gates)
    averaged = [l for l in range(c.cfg.model.n_layers) if l not in moe_layers]
    btx = {
        "source": str(ckpt) if not isinstance(ckpt, Consolidated) else None,
        "source_step": c.step,
        "layers": layers,
        "moe_layers": moe_layers,
        "averaged_layers": averaged,
        "average_coherence": {str(l): average_coherence(c.state_dict, E, l) for l in averaged},
        "router_init": router_init,
        "router_entropy": router_entropy if router_init == "data" else None,
        "router_data": (
            {"path": str(data), "tokenizer": tokenizer, "blocks": blocks} if router_init == "data" else None
        ),
        "router": router,
        "expert_domains": {str(j): d for j, d in enumerate(c.domains)},
    }
    extra = inherited_meta(c.meta, drop=("btx",))
    save_consolidated(out, state, cfg, list(c.domains), c.step, extra={**extra, "btx": btx})
    return {
        "out": str(out),
        **btx,
        "num_experts": E,
        "experts_per_rank": experts_per_rank,
        "ep_size": E // experts_per_rank,
        "finetune_sets": finetune_overrides(out),
        "seconds": round(time.perf_counter() - t0, 2),
    }
