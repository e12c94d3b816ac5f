"""An owner's router vector (FlexOlmo-style routing without joint data, docs/modular.md "Routing without joint
data"): the mean, over the owner's own training tokens, of the first DEMix layer's FFN input f(x) (model/batched.py
`shared_trunk_features`). f reads only the shared weights - frozen and bit-identical to the anchor in every owner's
model and in the merged one - so an owner computes locally what the merged model computes at inference, and ships
the vector with its expert. The merge records the vectors in meta.json (launcher/router_vectors.py, whose format,
builder and reader this module re-exports); evaluation mixes with them (modes router, router_posterior;
model/mixture.py router eqs. R1-R4).

    rec = router_vector(owner_model, "runs/data/tokens", "gpt2", "cooking")    # {"vector", "tokens", ...}
    meta_entry = router_vectors_meta({"cooking": rec, ...})                    # meta.json "router_vectors"
    r_ED = router_matrix(consolidated.meta, consolidated.domains)              # E x D, expert j = domains[j]
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from launcher.checkpoint_data import block_inputs, check_token_ids, data_manifest, load_blocks
from launcher.router_vectors import ROUTER_FORMAT, ROUTER_REPRESENTATION, router_matrix, router_vectors_meta
from model.batched import shared_trunk_features

__all__ = [
    "ROUTER_FORMAT",
    "ROUTER_REPRESENTATION",
    "ROUTER_BATCH_BLOCKS",
    "router_matrix",
    "router_vector",
    "router_vectors_meta",
]

ROUTER_BATCH_BLOCKS = 4  # blocks per trunk pass: fixed, so the same data gives the same vector on any caller


def _cpu_fp32(model: torch.nn.Module) -> torch.nn.Module:
    """`model` itself when it is on the CPU in fp32, else a CPU fp32 copy (the caller's model is not moved)."""
    params = list(model.parameters())
    if all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params):
        return model
    return copy.deepcopy(model).to(device="cpu", dtype=torch.float32)


@torch.no_grad()
def router_vector(
    model: torch.nn.Module,
    tokens_root: str | Path,
    tokenizer: str,
    domain: str,
    split: str = "train",
    max_blocks: int = 64,
    seq_len: int | None = None,
) -> dict[str, Any]:
    """r = the mean of f(x)_t (`shared_trunk_features`) over the scored positions of the first `max_blocks` blocks
    of `seq_len` tokens (default: the model's context) of `domain`'s `split`, in float64 from fp32 features on
    the CPU, eval mode (no dropout), no autocast, blocks in stream order ROUTER_BATCH_BLOCKS at a time: the same
    data and shared weights give the same vector. Returns {"vector": [float] * D, "tokens": positions averaged,
    "representation": ROUTER_REPRESENTATION, "split": split, "blocks": blocks read}. ValueError when the data has
    no such block or ids beyond the model's vocabulary, or the model has no DEMix layer."""
    T = int(seq_len or model.cfg.seq_len)
    if T > model.cfg.seq_len:
        raise ValueError(f"seq_len={T} is beyond the model's context ({model.cfg.seq_len} tokens)")
    manifest = data_manifest(tokens_root, tokenizer)
    check_token_ids(manifest, model.wte.weight.shape[0], str(Path(tokens_root) / tokenizer / "manifest.json"))
    if domain not in manifest["domains"]:
        raise ValueError(
            f"domain {domain!r} is not in {tokens_root}/{tokenizer} (domains: {', '.join(manifest['domains'])})"
        )
    blocks = load_blocks(tokens_root, tokenizer, domain, split, T, max_blocks)
    if not len(blocks):
        raise ValueError(
            f"{domain}/{split} in {tokens_root}/{tokenizer} has no block of {T}+1 tokens: no router vector "
            f"(domains there: {', '.join(manifest['domains'])})"
        )
    tokens_NT, _, mask_NT = block_inputs(blocks)
    m = _cpu_fp32(model)
    was_training = m.training
    m.eval()
    try:
        total_D, n = None, 0.0
        with torch.autocast("cpu", enabled=False):
            for s in range(0, len(tokens_NT), ROUTER_BATCH_BLOCKS):
                f_BTD = shared_trunk_features(m, tokens_NT[s : s + ROUTER_BATCH_BLOCKS]).double()
                w_BT = mask_NT[s : s + ROUTER_BATCH_BLOCKS].double()
                part_D = (f_BTD * w_BT[..., None]).sum(dim=(0, 1))
                total_D = part_D if total_D is None else total_D + part_D
                n += float(w_BT.sum())
    finally:
        m.train(was_training)
    return {
        "vector": (total_D / n).tolist(),
        "tokens": int(n),
        "representation": ROUTER_REPRESENTATION,
        "split": split,
        "blocks": int(len(blocks)),
    }
