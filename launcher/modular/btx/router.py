"""BTX's router initialisation from data (docs/btx.md, "Router initialisation"): each domain's mean FFN input,
centred and normalised, scaled so that the mean routing entropy is a chosen fraction of log E.

Shape legend: G domains (= E experts: expert j is domain j's FFN), E experts, D model dim, N token rows sampled per
domain, S token rows."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch

from data.catalog import read_token_manifest
from launcher.checkpoint import CheckpointError, Consolidated
from launcher.checkpoint_data import block_inputs, load_blocks


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
    """W_ED = s u with u_j the centred, normalised domain mean (docs/btx.md) and s such that the mean routing
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
