"""Branch-Train-MiX (Sukhbaatar et al. 2024): branch a dense seed model into a DEMix one, upcycle a DEMix
checkpoint's domain experts into a GShard top-2 MoE, then finetune it (the MiX stage) through the same trainer, on
DeepSpeed's MoE layer.

    python -m launcher.modular.btx branch DENSE --out DIR [--domains a,b,...] [--overwrite]
    python -m launcher.launch --config configs/demo/demix.yaml --nproc N --set train.init_from=DIR ...   # Train
    python -m launcher.modular.btx [upcycle] CKPT --out DIR [--layers every_other|all] [--router-init data|zero]
        [--data TOKENS_ROOT] [--tokenizer TOK] [--blocks 16] [--router-entropy 0.5] [--experts-per-rank K]
        [--world-size N] [--overwrite]
    python -m launcher.launch --config configs/btx/finetune.yaml --nproc 4 --set train.init_from=DIR ...  # MiX

Shape legend: G domains (= E experts: expert j is domain j's FFN), E experts, L layers, D model dim, N token rows
sampled per domain, S token rows.

A DEMix model is BTX's branch-and-train stage already done: every FFN layer holds one expert FFN per training
domain (DEMix §3) and attention, layer norms and embeddings are shared, i.e. the branches are the DEMix model
routed to each domain. MiX (BTX §3) puts each branch's FFN into a token-routed MoE layer and averages the
remaining parameters:

    FF_MoE^l(x) = sum_{i in top-k(W^l x)} softmax_i(W^l x) FF_i^l(x)        (k = 2, renormalised over the top-2)

`upcycle` writes a consolidated checkpoint of the project's GShard kind (model/gshard.py, `model.ffn.kind=gshard`):

* MoE layers (`--layers every_other`: the GShard baseline's placement `moe_every=2`, layers 1, 3, ...; `all`:
  `moe_every=1`, BTX's choice of every layer): expert j = domain j's FFN of that layer, bit for bit
  (`blocks.<l>.ffn.experts.<j>.*` keeps its name), and a new router `blocks.<l>.ffn.gate.weight` (E x D).
* Other layers: the dense FFN `blocks.<l>.ffn.mlp.*` = the mean of the layer's domain experts (BTX averages every
  non-MoE parameter over the branches; here those are the only per-domain ones).
* Everything else (embeddings, attention, layer norms) is shared by the DEMix branches and copied bit for bit.

Averaging assumes what BTX's branches have: one initialisation (every branch is a copy of the seed model), so
their FFNs stay close enough to average. This project's DEMix experts are initialised independently
(GPT.reset_parameters draws each tensor from the seed and its name, so expert j's init differs from expert k's):
after training, the experts of a layer are nearly uncorrelated matrices and their mean keeps about 1/sqrt(E) of
their norm (`average_coherence` in the record: 0.36 and 0.44 in the two averaged layers of the `make reproduce`
DEMix, 1/sqrt(8) = 0.35), i.e. an averaged layer is close to losing its FFN. `--layers all` averages nothing. The
numbers of both layouts before and after finetuning are in benchmarks/results/btx_compare.md.

Router initialisation (the only new parameter):

* `zero`: W = 0, p = softmax(0) = 1/E for every token. Note what top-2 does with that tie: argmax picks the lowest
  ids (torch.argmax, also in DeepSpeed's `top2gating`), so at step 0 every token's first choice is expert 0 and,
  with capacity factor 1, most first routes are dropped (C = 2S/E slots); the gate's gradient (through the combine
  weights) and the load-balancing loss's are what break the tie.
* `data` (default): row j from the mean FFN input of domain j's tokens. The FFN inputs x (the `ln2` outputs that the
  gate reads) are taken from the DEMix model routed to expert j on domain j's first `blocks` training blocks, i.e. the
  hidden states branch j produced for its own data in training; one pass per domain gives every layer, so the
  router of a layer does not depend on `--layers`. (The upcycled model's own lower layers, averaged or mixed, give
  somewhat different states; they do not exist before the router does.) With mu_j the mean over domain j's tokens:

      c_j = mu_j - (1/G) sum_g mu_g,   u_j = c_j / ||c_j||,   W_j = s u_j

  The means are centred first: softmax is shift-invariant, so the component all domains share (LayerNorm outputs
  have a large common mean direction) carries no routing information, but normalising the raw means would scale it
  by a different 1/||mu_j|| per row and add a domain-independent bias between experts. The scale s is set per layer
  by bisection so that the mean routing entropy over the sampled tokens of all domains is `router_entropy` x log E
  (default 0.5: exp(H) = sqrt(E) effective experts, 2.8 of 8): confident, so top-2 mostly picks the domain's own
  expert and a neighbour, but not one-hot (s -> infinity), which would saturate the softmax and starve the other
  experts of gate gradient. The entropy of softmax(s z) decreases monotonically in s, so the bisection is exact.
  On the `make reproduce` DEMix this sends 84-86 % of a domain's tokens to its own expert first in layers 1-3 and
  44 % in layer 0 (its input is the embedding and one attention layer). The upcycled model still starts well above
  DEMix (in-domain perplexity 346 vs 161 with `--layers all`): a token routed to different domains' experts in
  consecutive layers meets FFNs that were trained apart; a sharper router starts worse, not better (results file).

The output keeps the source's metadata (tokenizer fingerprint, bos/eod ids, tokens seen, step) and adds `btx`
(source, layers, router statistics per layer), so that `train.init_from` of a GShard run accepts it
(launcher/plan.py: same model shape, same tokenizer). Its config's expert placement (`experts_per_rank`) is only a
default: a finetune run may change it (the expert count E may not).

Branching (BTX §2.1, `branch`): every branch starts as a copy of one trained dense seed model. `branch` writes the
DEMix checkpoint of that starting point, in the format a DEMix run's `model/` folder has:

    experts.j.<name> of layer l  =  mlp.<name> of layer l of the dense model, for every domain j   (bit for bit)

and every other tensor (embeddings, attention, layer norms) is the dense one. Routed to any expert, or mixed with
any weights summing to 1, it computes exactly the dense model's function; `upcycle` of it gives, with any router,
the dense FFN in every MoE layer and the same FFN as their mean in averaged layers (coherence 1). Its config is the
dense run's with `model.ffn.kind=demix`, one expert per domain and `data.mixture=by_domain`, i.e. the run config of
a DEMix run over those domains with the dense run's recipe; expert j is `domains[j]`, the order a DEMix run's
catalog gives them (the dense run's training domains by default, `data.domains` when another list is named).
`demix_overrides` gives the `--set` values that start a DEMix run (the Train stage: each expert trains on its own
domain, everything else on all) from it. Its meta keeps the dense source's (tokenizer, tokens seen, step) and adds
`branch` (source, its step, "branched from dense").
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from data.argtypes import open_unit, positive_int
from data.catalog import DataError, load_catalog, read_token_manifest
from data.cli import cli_main, exit_process
from launcher.checkpoint import (
    CheckpointError,
    Consolidated,
    check_checkpoint_out,
    read_meta,
    save_consolidated,
)
from launcher.checkpoint_data import block_inputs, check_checkpoint_data, load_blocks
from launcher.config import ConfigError, RunConfig
from launcher.expert_surgery import EXPERT_KEY, CkptLike, _load
from launcher.ffn_kinds import ffn_kind
from launcher.typed import from_dict

LAYERS: dict[str, int] = {"every_other": 2, "all": 1}  # --layers -> model.ffn.gshard.moe_every
ROUTER_INITS: tuple[str, ...] = ("data", "zero")
_META_OWN = (
    "format",
    "step",
    "domains",
    "experts",
    "shards",
    "config",
)  # written by save_consolidated itself
_SHAPE_KEYS = (
    "n_layers",
    "d_model",
    "n_heads",
    "seq_len",
    "vocab_size",
    "ffn_mult",
    "make_vocab_size_divisible_by",
)


# ----------------------------------------------------------------------------------------------------
# Config and weights
# ----------------------------------------------------------------------------------------------------


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


def layout_problems(num_experts: int, experts_per_rank: int, world_size: Optional[int] = None) -> list[str]:
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


# ----------------------------------------------------------------------------------------------------
# Router initialisation from data
# ----------------------------------------------------------------------------------------------------


@torch.no_grad()
def domain_ffn_inputs(
    c: Consolidated,
    data: str,
    tokenizer: str,
    layers: Sequence[int],
    blocks: int = 16,
    sample_tokens: int = 1024,
    batch_size: int = 4,
    seed: int = 0,
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """FFN inputs (the `ln2` outputs the gate reads) of the DEMix model routed to expert g on domain g's first
    `blocks` training blocks, for every g: ({layer: mean_GD}, {layer: x_GND}), the mean over all their tokens
    (float64) and N token rows sampled uniformly (the same N for every domain, at most `sample_tokens`)."""
    model = c.build_model().eval()
    available = read_token_manifest(Path(data) / tokenizer / "manifest.json")["domains"]
    missing = [d for d in c.domains if d not in available]
    if missing:
        raise CheckpointError(
            f"--router-init data needs every expert's domain in {data}/{tokenizer}; missing "
            f"{missing} (domains there: {', '.join(available)}); use --router-init zero or "
            "other data"
        )
    captured: dict[int, list[torch.Tensor]] = {}
    hooks = [
        model.blocks[l].ln2.register_forward_hook(
            lambda _m, _i, out, l=l: captured.setdefault(l, []).append(out.reshape(-1, out.shape[-1]).float())
        )
        for l in layers
    ]
    means: dict[int, list[torch.Tensor]] = {l: [] for l in layers}
    rows: dict[int, list[torch.Tensor]] = {l: [] for l in layers}
    gen = torch.Generator().manual_seed(seed)
    try:
        for g, dom in enumerate(c.domains):
            arr = load_blocks(data, tokenizer, dom, "train", c.cfg.model.seq_len, blocks)
            if not len(arr):
                raise CheckpointError(
                    f"{dom}/train in {data}/{tokenizer} has no block of {c.cfg.model.seq_len}+1 tokens"
                )
            tokens_NT = block_inputs(arr)[0]
            captured.clear()
            for s in range(0, len(tokens_NT), batch_size):
                x_BT = tokens_NT[s : s + batch_size]
                model(x_BT, torch.full((x_BT.shape[0],), g, dtype=torch.long), return_logits=False)
            for l in layers:
                x_SD = torch.cat(captured[l])
                means[l].append(x_SD.double().mean(0))
                pick = torch.randperm(x_SD.shape[0], generator=gen)[:sample_tokens]
                rows[l].append(x_SD[pick])
    finally:
        for h in hooks:
            h.remove()
    n = min(r.shape[0] for r in rows[layers[0]]) if layers else 0
    return (
        {l: torch.stack(means[l]) for l in layers},
        {l: torch.stack([r[:n] for r in rows[l]]) for l in layers},
    )


def _mean_entropy(z_SE: torch.Tensor, scale: float) -> float:
    logp_SE = torch.log_softmax(scale * z_SE, dim=1)
    return float(-(logp_SE.exp() * logp_SE).sum(1).mean())


def fit_router(
    mean_GD: torch.Tensor, x_GND: torch.Tensor, router_entropy: float = 0.5
) -> tuple[torch.Tensor, dict[str, float]]:
    """W_ED = s u with u_j the centred, normalised domain mean (module docstring) and s such that the mean routing
    entropy of the sampled tokens is `router_entropy` x log E. Returns (W float32, statistics on those tokens:
    scale, entropy fraction, how often domain j's tokens pick expert j first / among the top 2, mean p_own)."""
    G, N, D = x_GND.shape
    if G == 1:  # one expert: routing is the identity whatever the gate
        ones = {"own_top1": 1.0, "own_top2": 1.0, "own_prob": 1.0}
        return torch.zeros(1, D), {"scale": 0.0, "entropy_fraction": 0.0, **ones}
    c_GD = mean_GD.double() - mean_GD.double().mean(0, keepdim=True)
    u_GD = c_GD / c_GD.norm(dim=1, keepdim=True).clamp_min(1e-12)
    z_SE = x_GND.reshape(G * N, D).double() @ u_GD.T  # unit-scale logits; row g*N + n is domain g's token n
    target = router_entropy * math.log(G)
    lo, hi = -12.0, 12.0  # log s; H(s) falls from log E (s = 0) towards 0
    if _mean_entropy(z_SE, math.exp(hi)) > target:
        lo = hi  # cannot get that confident (tied logits): take the largest scale tried
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _mean_entropy(z_SE, math.exp(mid)) > target else (lo, mid)
    scale = math.exp((lo + hi) / 2)
    p_SE = torch.softmax(scale * z_SE, dim=1)
    own_S = torch.arange(G).repeat_interleave(N)
    top2_S2 = p_SE.topk(min(2, G), dim=1).indices
    stats = {
        "scale": scale,
        "entropy_fraction": _mean_entropy(z_SE, scale) / math.log(G),
        "own_top1": float((top2_S2[:, 0] == own_S).double().mean()),
        "own_top2": float((top2_S2 == own_S[:, None]).any(1).double().mean()),
        "own_prob": float(p_SE.gather(1, own_S[:, None]).mean()),
    }
    return (scale * u_GD).float(), stats


# ----------------------------------------------------------------------------------------------------
# Upcycling
# ----------------------------------------------------------------------------------------------------


def upcycle(
    ckpt: CkptLike,
    out: Union[str, Path],
    *,
    layers: str = "every_other",
    router_init: str = "data",
    data: Optional[str] = None,
    tokenizer: Optional[str] = None,
    blocks: int = 16,
    router_entropy: float = 0.5,
    experts_per_rank: int = 1,
    world_size: Optional[int] = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write the BTX-upcycled GShard checkpoint of DEMix checkpoint `ckpt` to `out` (module docstring); returns a
    record of what was done: the MoE and averaged layers, the expert -> domain map, per-layer router statistics
    (`data`), the expert layout, and the `--set` overrides that start a finetune run from it."""
    t0 = time.perf_counter()
    problems = []
    if layers not in LAYERS:
        problems.append(f"--layers={layers!r}: choose one of {', '.join(LAYERS)}")
    if router_init not in ROUTER_INITS:
        problems.append(f"--router-init={router_init!r}: choose one of {', '.join(ROUTER_INITS)}")
    if not 0.0 < router_entropy < 1.0:
        problems.append(f"--router-entropy={router_entropy}: a fraction of log E in (0, 1)")
    if blocks < 1:
        problems.append(f"--blocks={blocks}: must be >= 1")
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
    moe_layers = cfg.model.moe_layer_ids()
    if not moe_layers:
        raise ConfigError(
            [
                f"--layers={layers} puts no MoE layer in a {c.cfg.model.n_layers}-layer model: use "
                "--layers all"
            ],
            "btx",
        )
    D = c.cfg.model.d_model
    router: dict[str, dict[str, float]] = {}
    if router_init == "zero":
        gates = {l: torch.zeros(E, D) for l in moe_layers}
    else:
        data = data or c.cfg.data.path
        tokenizer = tokenizer or c.cfg.data.tokenizer
        check_checkpoint_data(c, data, tokenizer)  # the tokens must be the checkpoint's tokenizer's
        means, xs = domain_ffn_inputs(c, data, tokenizer, moe_layers, blocks)
        gates = {}
        for l in moe_layers:
            gates[l], router[str(l)] = fit_router(means[l], xs[l], router_entropy)
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
    extra = {k: v for k, v in c.meta.items() if k not in _META_OWN and k != "btx"}
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


def finetune_overrides(ckpt: Union[str, Path]) -> list[str]:
    """`--set` values that make a run config (e.g. configs/btx/finetune.yaml) start from upcycled checkpoint `ckpt`:
    its model shape, GShard expert count and MoE placement, its data, and `train.init_from`. The expert placement
    (`model.ffn.gshard.experts_per_rank`) is left to the run: it depends on the number of ranks."""
    meta = read_meta(ckpt)
    m = meta["config"]["model"]
    return _start_from_sets(
        ckpt,
        meta,
        [
            f"model.ffn.kind={m['ffn']['kind']}",
            f"model.ffn.num_experts={m['ffn']['num_experts']}",
            f"model.ffn.gshard.moe_every={m['ffn']['gshard']['moe_every']}",
        ],
    )


def _start_from_sets(ckpt: Union[str, Path], meta: dict[str, Any], ffn_sets: list[str]) -> list[str]:
    """`--set` values for a run starting from `ckpt` (meta `meta`): its model shape, then `ffn_sets`, then its data
    and `train.init_from`."""
    m, d = meta["config"]["model"], meta["config"]["data"]
    return (
        [f"model.{k}={m[k]}" for k in _SHAPE_KEYS]
        + ffn_sets
        + [
            f"data.path={d['path']}",
            f"data.tokenizer={d['tokenizer']}",
            f"train.init_from={Path(ckpt).resolve()}",
        ]
    )


# ----------------------------------------------------------------------------------------------------
# Branching a dense seed model (BTX §2.1)
# ----------------------------------------------------------------------------------------------------

_DENSE_FFN_KEY = re.compile(
    r"^(blocks\.(\d+)\.ffn\.)mlp\.(.+)$"
)  # blocks.<l>.ffn.mlp.<name> (model/mlp.py DenseFFN)


def branch_source_problems(cfg: RunConfig) -> list[str]:
    """Why a checkpoint of run config `cfg` cannot be branched: it must be a plain dense model (no experts of any
    kind, no domain tokens in its inputs)."""
    name = cfg.model.ffn.kind
    if ffn_kind(cfg).domain_experts:
        return [
            f"it is a {name!r} checkpoint: its experts are branches already; upcycle it directly "
            "(`python -m launcher.modular.btx CKPT --out DIR`)"
        ]
    if ffn_kind(cfg).has_experts:
        return [
            f"it is a {name!r} checkpoint (experts of its own, not one FFN per layer): branch the dense "
            "checkpoint of a `model.ffn.kind=dense` run"
        ]
    if cfg.data.mixture == "domain_token":
        return [
            "it is a +Domain-Token model (data.mixture=domain_token: a domain token before every block, rows for "
            "them in its embedding), which a DEMix run never feeds: branch a dense model trained with the "
            "natural or balanced mixture"
        ]
    return []


def branch_domains(
    cfg: RunConfig, trained: Sequence[str], domains: Optional[Sequence[str]] = None
) -> list[str]:
    """The experts' domains in expert-id order: `domains` as given (each must be a domain of the dense run's data,
    `data.path`/`data.tokenizer`), else the dense run's training domains `trained` (its meta's order, the catalog's)."""
    if domains is None:
        if not trained:
            raise CheckpointError(
                "the dense checkpoint's meta.json lists no training domains: name the experts' "
                "domains with --domains"
            )
        return list(trained)
    domains = list(domains)
    if not domains:
        raise CheckpointError(
            "--domains is empty: name at least one domain, or leave it out for the dense run's "
            f"training domains ({', '.join(trained)})"
        )
    dup = sorted({d for d in domains if domains.count(d) > 1})
    if dup:
        raise CheckpointError(f"--domains names {dup} more than once: one expert per domain")
    manifest = Path(cfg.data.path) / cfg.data.tokenizer / "manifest.json"
    try:
        known, where = list(read_token_manifest(manifest)["domains"]), f"the dense run's data ({manifest})"
    except DataError:
        known, where = list(trained), f"the dense run's training domains ({manifest} is unreadable)"
    unknown = [d for d in domains if d not in known]
    if unknown:
        raise CheckpointError(
            f"--domains {unknown}: not a domain of {where}; known: {', '.join(known)}. Prepare "
            "data for it first (python -m data.prepare), or choose among these"
        )
    return domains


def catalog_domains(cfg: RunConfig, trained: Sequence[str]) -> list[str]:
    """The training domains, in order, that a run of `cfg` reads (launcher/plan.py's catalog: `data.domains`, else the
    data's non-novel domains sorted by name); `trained` (the checkpoint's list) when the data cannot be read."""
    try:
        return list(load_catalog(cfg.data.path, cfg.data.tokenizer, cfg.data.domains).train_domains)
    except DataError:
        return list(trained)


def branch_config(cfg: RunConfig, domains: Sequence[str], trained: Sequence[str]) -> RunConfig:
    """The DEMix run config of the branched model: the dense run's shape and recipe with `kind=demix`, one expert per
    domain, the by-domain mixture (each expert trains on its own domain, DEMix §3), no init checkpoint. `data.domains`
    stays the dense run's when its catalog gives exactly `domains` in this order, else lists `domains`: a DEMix run of
    this config numbers its domains as the experts are numbered (`domains[j]` is expert j)."""
    ffn = replace(cfg.model.ffn, kind="demix", num_experts=len(domains))
    listed = cfg.data.domains if catalog_domains(cfg, trained) == list(domains) else list(domains)
    return replace(
        cfg,
        model=replace(cfg.model, ffn=ffn),
        data=replace(cfg.data, mixture="by_domain", domains=listed),
        parallel=replace(cfg.parallel, allocation=None),
        train=replace(cfg.train, init_from=None, trainable="all"),
    )


def branch_state(state: dict[str, torch.Tensor], num_experts: int, n_layers: int) -> dict[str, torch.Tensor]:
    """The DEMix state dict of `num_experts` branches of a dense one: `blocks.<l>.ffn.mlp.<name>` becomes
    `blocks.<l>.ffn.experts.<j>.<name>` (surgery.EXPERT_KEY) for every j, each the same tensor object; every other
    tensor is kept (the same object: bit-identical)."""
    if any(EXPERT_KEY.match(k) for k in state):
        raise CheckpointError(
            "the state dict already has expert tensors (blocks.<l>.ffn.experts.<j>.*): not dense"
        )
    out: dict[str, torch.Tensor] = {}
    layers = set()
    for k, v in state.items():
        m = _DENSE_FFN_KEY.match(k)
        if m is None:
            out[k] = v
            continue
        layers.add(int(m.group(2)))
        out.update({f"{m.group(1)}experts.{j}.{m.group(3)}": v for j in range(num_experts)})
    missing = sorted(set(range(n_layers)) - layers)
    if missing:
        raise CheckpointError(
            f"layers {missing} have no dense FFN (blocks.<l>.ffn.mlp.*): not a dense state dict"
        )
    return out


def branch(
    dense_ckpt: CkptLike,
    out: Union[str, Path],
    domains: Optional[Sequence[str]] = None,
    *,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write the DEMix checkpoint whose every expert, in every layer, is dense checkpoint `dense_ckpt`'s FFN of that
    layer (BTX's branch step; module docstring) to `out`; returns a record: source, domains, the `--set` values that
    start a DEMix run from it (`demix_sets`). `domains` (default: the dense run's training domains) orders the
    experts. Refuses (CheckpointError) a source with experts or domain tokens, an unknown domain and an existing
    `out` (unless `overwrite` and it holds a consolidated checkpoint: check_checkpoint_out)."""
    t0 = time.perf_counter()
    if isinstance(dense_ckpt, Consolidated):
        meta, cfg, source = dense_ckpt.meta, dense_ckpt.cfg, None
    else:  # every refusal below reads meta.json only, before any tensor
        check_checkpoint_out(out, [dense_ckpt], overwrite)
        meta, source = read_meta(dense_ckpt), str(Path(dense_ckpt).resolve())
        cfg = from_dict(RunConfig, meta["config"], source=f"{dense_ckpt}/meta.json")
    bad = branch_source_problems(cfg)
    if bad:
        raise CheckpointError(
            f"branching needs a dense checkpoint (one FFN per layer) to copy into every expert; "
            f"{source or 'the checkpoint'}: {bad[0]}"
        )
    names = branch_domains(cfg, meta["domains"], domains)
    c = _load(dense_ckpt)
    state = branch_state(c.state_dict, len(names), c.cfg.model.n_layers)
    rec = {
        "source": source,
        "source_step": c.step,
        "method": "branched from dense: every expert of every layer is "
        "a copy of the dense model's FFN of that layer (BTX branch)",
        "expert_domains": {str(j): d for j, d in enumerate(names)},
    }
    extra = {k: v for k, v in c.meta.items() if k not in _META_OWN and k not in ("btx", "branch")}
    save_consolidated(
        out, state, branch_config(c.cfg, names, c.domains), names, c.step, extra={**extra, "branch": rec}
    )
    return {
        "out": str(out),
        **rec,
        "domains": names,
        "num_experts": len(names),
        "demix_sets": demix_overrides(out),
        "seconds": round(time.perf_counter() - t0, 2),
    }


def demix_overrides(ckpt: Union[str, Path]) -> list[str]:
    """`--set` values that make a DEMix run config (e.g. configs/demo/demix.yaml) train the experts of DEMix checkpoint
    `ckpt` (a branched one) on their domains: its model shape and expert count, the by-domain mixture over its experts'
    domains in its order (`data.domains`; null: the data's training domains, which are then the experts'), its data
    and `train.init_from`."""
    meta = read_meta(ckpt)
    m, d = meta["config"]["model"], meta["config"]["data"]
    if not ffn_kind(m["ffn"]["kind"]).domain_experts:
        raise CheckpointError(
            f"{ckpt} is a {m['ffn']['kind']!r} checkpoint; a DEMix run starts from a DEMix one "
            "(branch a dense checkpoint first: python -m launcher.modular.btx branch DENSE "
            "--out DIR)"
        )
    listed = "null" if d.get("domains") is None else json.dumps(list(d["domains"]))
    return _start_from_sets(
        ckpt,
        meta,
        [
            f"model.ffn.kind={m['ffn']['kind']}",
            f"model.ffn.num_experts={len(meta['domains'])}",
            "data.mixture=by_domain",
            f"data.domains={listed}",
        ],
    )


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The upcycle command's arguments (`[upcycle] CKPT --out DIR ...`)."""
    p = argparse.ArgumentParser(
        prog="python -m launcher.modular.btx [upcycle]",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", help="a consolidated DEMix checkpoint (RUN_DIR/model)")
    p.add_argument("--out", required=True, help="where to write the GShard checkpoint (must not exist)")
    p.add_argument(
        "--layers",
        choices=tuple(LAYERS),
        default="every_other",
        help="MoE layers: every_other (GShard's moe_every=2, the rest averaged) or all (BTX)",
    )
    p.add_argument(
        "--router-init",
        choices=ROUTER_INITS,
        default="data",
        help="data: rows from each domain's mean FFN input; zero: uniform routing probabilities",
    )
    p.add_argument(
        "--data", help="prepared tokens root for --router-init data (default: the checkpoint's data.path)"
    )
    p.add_argument("--tokenizer", help="tokenizer directory name (default: the checkpoint's)")
    p.add_argument(
        "--blocks", type=positive_int, default=16, help="training blocks per domain for --router-init data"
    )
    p.add_argument(
        "--router-entropy",
        type=open_unit,
        default=0.5,
        help="target mean routing entropy, as a fraction of log E (--router-init data)",
    )
    p.add_argument(
        "--experts-per-rank",
        type=positive_int,
        default=1,
        help="default expert placement written into the config (E / this = expert-parallel ranks)",
    )
    p.add_argument(
        "--world-size", type=positive_int, help="also check that the expert layout fits this many ranks"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint at --out")
    return p.parse_args(argv)


def parse_branch_args(argv: Sequence[str]) -> argparse.Namespace:
    """The branch command's arguments (`branch DENSE --out DIR [--domains a,b]`)."""
    p = argparse.ArgumentParser(
        prog="python -m launcher.modular.btx branch",
        description="Branch a dense checkpoint into a DEMix one whose every expert is a copy "
        "of the dense FFN of its layer (BTX's branch step).",
    )
    p.add_argument(
        "checkpoint", help="a consolidated dense checkpoint (RUN_DIR/model of a model.ffn.kind=dense run)"
    )
    p.add_argument("--out", required=True, help="where to write the DEMix checkpoint (must not exist)")
    p.add_argument(
        "--domains",
        help="comma-separated expert domains, in expert-id order (default: the dense run's training domains)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint at --out")
    return p.parse_args(argv)


def _branch_main(argv: Sequence[str]) -> int:
    args = parse_branch_args(argv)
    domains = None if args.domains is None else [d.strip() for d in args.domains.split(",") if d.strip()]
    try:
        rec = branch(args.checkpoint, args.out, domains, overwrite=args.overwrite)
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(rec, indent=1))
    sets = " ".join(f"--set {shlex.quote(s)}" for s in rec["demix_sets"])
    print(
        f"train the branches (DEMix): python -m launcher.launch --config configs/demo/demix.yaml --nproc N {sets}",
        file=sys.stderr,
    )
    return 0


@cli_main
def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["branch"]:  # a checkpoint folder named `branch` is ./branch
        return _branch_main(argv[1:])
    args = parse_args(argv[1:] if argv[:1] == ["upcycle"] else argv)
    try:
        rec = upcycle(
            args.checkpoint,
            args.out,
            layers=args.layers,
            router_init=args.router_init,
            data=args.data,
            tokenizer=args.tokenizer,
            blocks=args.blocks,
            router_entropy=args.router_entropy,
            experts_per_rank=args.experts_per_rank,
            world_size=args.world_size,
            overwrite=args.overwrite,
        )
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(rec, indent=1))
    low = {
        l: round(r, 3)
        for l, r in rec["average_coherence"].items()
        if r < (1 + rec["num_experts"] ** -0.5) / 2
    }
    if low:
        print(
            f"note: the experts of averaged layers {low} (||mean|| / mean ||expert||; 1 = equal, "
            f"{rec['num_experts'] ** -0.5:.3f} = unrelated) look independently initialised: their average keeps "
            "little of any of them; --layers all averages nothing, and `branch` gives experts of one seed",
            file=sys.stderr,
        )
    sets = " ".join(f"--set {shlex.quote(s)}" for s in rec["finetune_sets"])
    print(
        f"finetune (MiX): python -m launcher.launch --config configs/btx/finetune.yaml --nproc N "
        f"--set model.ffn.gshard.experts_per_rank=K {sets}   # {rec['num_experts']} / K must divide N",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    exit_process(main())
