"""Branch-Train-MiX (Sukhbaatar et al. 2024) from a DEMix checkpoint: upcycle the domain experts into a GShard
top-2 MoE, then finetune it (the MiX stage) through the same trainer, on DeepSpeed's MoE layer.

    python -m launcher.modular.btx CKPT --out DIR [--layers every_other|all] [--router-init data|zero]
        [--data TOKENS_ROOT] [--tokenizer TOK] [--blocks 16] [--router-entropy 0.5] [--experts-per-rank K]
        [--world-size N] [--overwrite]
    python -m launcher.launch --config configs/btx/finetune.yaml --nproc 4 --set train.init_from=DIR ...

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
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from data.catalog import read_token_manifest
from data.cli import cli_main
from launcher.checkpoint import (CheckpointError, Consolidated, check_checkpoint_out, load_consolidated, read_meta,
                                 save_consolidated)
from launcher.config import ConfigError, RunConfig
from launcher.evaluation.evaluate import block_inputs, check_checkpoint_data, load_blocks
from launcher.ffn_kinds import ffn_kind

LAYERS: dict[str, int] = {"every_other": 2, "all": 1}  # --layers -> model.ffn.gshard.moe_every
ROUTER_INITS: tuple[str, ...] = ("data", "zero")
_META_OWN = ("format", "step", "domains", "experts", "shards", "config")  # written by save_consolidated itself
CkptLike = Union[str, Path, Consolidated]


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
    return replace(cfg, model=model, data=replace(cfg.data, mixture="natural"),
                   parallel=replace(cfg.parallel, allocation=None),
                   train=replace(cfg.train, init_from=None, trainable="all"))


def layout_problems(num_experts: int, experts_per_rank: int, world_size: Optional[int] = None) -> list[str]:
    """Why E experts cannot be laid out `experts_per_rank` per rank (over `world_size` ranks, when given)."""
    if experts_per_rank < 1:
        return [f"--experts-per-rank={experts_per_rank}: must be >= 1"]
    if num_experts % experts_per_rank:
        divisors = [k for k in range(1, num_experts + 1) if num_experts % k == 0]
        return [f"{num_experts} experts (one per DEMix domain) are not divisible by --experts-per-rank="
                f"{experts_per_rank}: every rank holds the same number of experts; choose one of {divisors}"]
    ep = num_experts // experts_per_rank
    if world_size is not None and (world_size < 1 or world_size % ep):
        return [f"{num_experts} experts / {experts_per_rank} per rank = {ep} expert-parallel ranks, which does not "
                f"divide --world-size={world_size}: choose experts_per_rank so that {num_experts} / experts_per_rank "
                f"divides {world_size}"]
    return []


def average_coherence(state: dict[str, torch.Tensor], num_experts: int, layer: int) -> float:
    """||mean_j W_j|| / mean_j ||W_j|| over the fc1 weights of a layer's experts: 1 when the experts are equal (BTX's
    branches of one seed model early on), about 1/sqrt(E) when they are independent (uncorrelated) matrices."""
    W_EFD = torch.stack([state[f"blocks.{layer}.ffn.experts.{j}.fc1.weight"].double() for j in range(num_experts)])
    return float(W_EFD.mean(0).norm() / W_EFD.flatten(1).norm(dim=1).mean())


def upcycle_state(state: dict[str, torch.Tensor], num_experts: int, n_layers: int, moe_layers: Sequence[int],
                  gates: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
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
        names = sorted({k[len(pre + "experts.0."):] for k in state if k.startswith(pre + "experts.0.")})
        if not names:
            raise CheckpointError(f"layer {l} has no DEMix expert 0 ({pre}experts.0.*): not a DEMix state dict")
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
def domain_ffn_inputs(c: Consolidated, data: str, tokenizer: str, layers: Sequence[int], blocks: int = 16,
                      sample_tokens: int = 1024, batch_size: int = 4, seed: int = 0
                      ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """FFN inputs (the `ln2` outputs the gate reads) of the DEMix model routed to expert g on domain g's first
    `blocks` training blocks, for every g: ({layer: mean_GD}, {layer: x_GND}), the mean over all their tokens
    (float64) and N token rows sampled uniformly (the same N for every domain, at most `sample_tokens`)."""
    model = c.build_model().eval()
    available = read_token_manifest(Path(data) / tokenizer / "manifest.json")["domains"]
    missing = [d for d in c.domains if d not in available]
    if missing:
        raise CheckpointError(f"--router-init data needs every expert's domain in {data}/{tokenizer}; missing "
                              f"{missing} (domains there: {', '.join(available)}); use --router-init zero or "
                              "other data")
    captured: dict[int, list[torch.Tensor]] = {}
    hooks = [model.blocks[l].ln2.register_forward_hook(
        lambda _m, _i, out, l=l: captured.setdefault(l, []).append(out.reshape(-1, out.shape[-1]).float()))
        for l in layers]
    means: dict[int, list[torch.Tensor]] = {l: [] for l in layers}
    rows: dict[int, list[torch.Tensor]] = {l: [] for l in layers}
    gen = torch.Generator().manual_seed(seed)
    try:
        for g, dom in enumerate(c.domains):
            arr = load_blocks(data, tokenizer, dom, "train", c.cfg.model.seq_len, blocks)
            if not len(arr):
                raise CheckpointError(f"{dom}/train in {data}/{tokenizer} has no block of "
                                      f"{c.cfg.model.seq_len}+1 tokens")
            tokens_NT = block_inputs(arr)[0]
            captured.clear()
            for s in range(0, len(tokens_NT), batch_size):
                x_BT = tokens_NT[s:s + batch_size]
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
    return ({l: torch.stack(means[l]) for l in layers}, {l: torch.stack([r[:n] for r in rows[l]]) for l in layers})


def _mean_entropy(z_SE: torch.Tensor, scale: float) -> float:
    logp_SE = torch.log_softmax(scale * z_SE, dim=1)
    return float(-(logp_SE.exp() * logp_SE).sum(1).mean())


def fit_router(mean_GD: torch.Tensor, x_GND: torch.Tensor, router_entropy: float = 0.5
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
    stats = {"scale": scale, "entropy_fraction": _mean_entropy(z_SE, scale) / math.log(G),
             "own_top1": float((top2_S2[:, 0] == own_S).double().mean()),
             "own_top2": float((top2_S2 == own_S[:, None]).any(1).double().mean()),
             "own_prob": float(p_SE.gather(1, own_S[:, None]).mean())}
    return (scale * u_GD).float(), stats


# ----------------------------------------------------------------------------------------------------
# Upcycling
# ----------------------------------------------------------------------------------------------------


def _load(ckpt: CkptLike) -> Consolidated:
    return ckpt if isinstance(ckpt, Consolidated) else load_consolidated(ckpt)


def upcycle(ckpt: CkptLike, out: Union[str, Path], *, layers: str = "every_other", router_init: str = "data",
            data: Optional[str] = None, tokenizer: Optional[str] = None, blocks: int = 16,
            router_entropy: float = 0.5, experts_per_rank: int = 1, world_size: Optional[int] = None,
            overwrite: bool = False) -> dict[str, Any]:
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
        raise CheckpointError(f"BTX upcycles a DEMix checkpoint (one expert per domain in every layer), not a "
                              f"{c.cfg.model.ffn.kind!r} one")
    E = len(c.domains)
    bad = layout_problems(E, experts_per_rank, world_size)
    if bad:
        raise ConfigError(bad, "btx")
    cfg = btx_config(c.cfg, layers, experts_per_rank)
    moe_layers = cfg.model.moe_layer_ids()
    if not moe_layers:
        raise ConfigError([f"--layers={layers} puts no MoE layer in a {c.cfg.model.n_layers}-layer model: use "
                           "--layers all"], "btx")
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
    btx = {"source": str(ckpt) if not isinstance(ckpt, Consolidated) else None, "source_step": c.step,
           "layers": layers, "moe_layers": moe_layers,
           "averaged_layers": averaged,
           "average_coherence": {str(l): average_coherence(c.state_dict, E, l) for l in averaged},
           "router_init": router_init, "router_entropy": router_entropy if router_init == "data" else None,
           "router_data": ({"path": str(data), "tokenizer": tokenizer, "blocks": blocks}
                           if router_init == "data" else None),
           "router": router, "expert_domains": {str(j): d for j, d in enumerate(c.domains)}}
    extra = {k: v for k, v in c.meta.items() if k not in _META_OWN and k != "btx"}
    save_consolidated(out, state, cfg, list(c.domains), c.step, extra={**extra, "btx": btx})
    return {"out": str(out), **btx, "num_experts": E, "experts_per_rank": experts_per_rank,
            "ep_size": E // experts_per_rank, "finetune_sets": finetune_overrides(out),
            "seconds": round(time.perf_counter() - t0, 2)}


def finetune_overrides(ckpt: Union[str, Path]) -> list[str]:
    """`--set` values that make a run config (e.g. configs/btx/finetune.yaml) start from upcycled checkpoint `ckpt`:
    its model shape, GShard expert count and MoE placement, its data, and `train.init_from`. The expert placement
    (`model.ffn.gshard.experts_per_rank`) is left to the run: it depends on the number of ranks."""
    meta = read_meta(ckpt)
    m, d = meta["config"]["model"], meta["config"]["data"]
    keys = ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size", "ffn_mult", "make_vocab_size_divisible_by")
    return ([f"model.{k}={m[k]}" for k in keys]
            + [f"model.ffn.kind={m['ffn']['kind']}", f"model.ffn.num_experts={m['ffn']['num_experts']}",
               f"model.ffn.gshard.moe_every={m['ffn']['gshard']['moe_every']}",
               f"data.path={d['path']}", f"data.tokenizer={d['tokenizer']}",
               f"train.init_from={Path(ckpt).resolve()}"])


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a consolidated DEMix checkpoint (RUN_DIR/model)")
    p.add_argument("--out", required=True, help="where to write the GShard checkpoint (must not exist)")
    p.add_argument("--layers", choices=tuple(LAYERS), default="every_other",
                   help="MoE layers: every_other (GShard's moe_every=2, the rest averaged) or all (BTX)")
    p.add_argument("--router-init", choices=ROUTER_INITS, default="data",
                   help="data: rows from each domain's mean FFN input; zero: uniform routing probabilities")
    p.add_argument("--data", help="prepared tokens root for --router-init data (default: the checkpoint's data.path)")
    p.add_argument("--tokenizer", help="tokenizer directory name (default: the checkpoint's)")
    p.add_argument("--blocks", type=int, default=16, help="training blocks per domain for --router-init data")
    p.add_argument("--router-entropy", type=float, default=0.5,
                   help="target mean routing entropy, as a fraction of log E (--router-init data)")
    p.add_argument("--experts-per-rank", type=int, default=1,
                   help="default expert placement written into the config (E / this = expert-parallel ranks)")
    p.add_argument("--world-size", type=int, help="also check that the expert layout fits this many ranks")
    p.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint at --out")
    return p.parse_args(argv)


@cli_main
def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        rec = upcycle(args.checkpoint, args.out, layers=args.layers, router_init=args.router_init, data=args.data,
                      tokenizer=args.tokenizer, blocks=args.blocks, router_entropy=args.router_entropy,
                      experts_per_rank=args.experts_per_rank, world_size=args.world_size, overwrite=args.overwrite)
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(rec, indent=1))
    low = {l: round(r, 3) for l, r in rec["average_coherence"].items() if r < (1 + rec["num_experts"] ** -0.5) / 2}
    if low:
        print(f"note: the experts of averaged layers {low} (||mean|| / mean ||expert||; 1 = equal, "
              f"{rec['num_experts'] ** -0.5:.3f} = unrelated) look independently initialised: their average keeps "
              "little of any of them; --layers all averages nothing", file=sys.stderr)
    sets = " ".join(f"--set {shlex.quote(s)}" for s in rec["finetune_sets"])
    print(f"finetune (MiX): python -m launcher.launch --config configs/btx/finetune.yaml --nproc N "
          f"--set model.ffn.gshard.experts_per_rank=K {sets}   # {rec['num_experts']} / K must divide N",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
