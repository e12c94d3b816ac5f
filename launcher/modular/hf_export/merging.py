"""A DEMix checkpoint as one dense model: one domain's expert with the shared weights, or a merged model (a
single-expert model standing for a mixture): every expert tensor is the weighted average W = sum_j w_j W_j with w
the domain posterior of the target domain (the cached prior of §5.1 from a file, estimated on its development data,
or given). This averages parameters, an approximation of the output mixture (eq. 6), exact only when the experts
agree."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from launcher.checkpoint import CheckpointError, Consolidated
from launcher.ffn_kinds import ffn_kind
from model import mixture as mx

_EXPERT_PARAMS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


def expert_weights(
    c: Consolidated, domain: str | None = None, weights: dict[str, float] | None = None
) -> list[float]:
    """Weights over the checkpoint's experts: one-hot on `domain`, or `weights` by name (normalised to sum 1)."""
    if (domain is None) == (weights is None):
        raise CheckpointError("give exactly one of a domain or merge weights")
    if domain is not None:
        if domain not in c.domains:
            raise CheckpointError(f"no expert for {domain!r}; experts: {', '.join(c.domains)}")
        return [1.0 if d == domain else 0.0 for d in c.domains]
    return merge_weights_over(c.domains, weights)


def merge_weights_over(domains: Sequence[str], weights: dict[str, float]) -> list[float]:
    """`weights` by expert name as a normalised list over `domains` (mixture_weights' rule: finite, >= 0, sum > 0);
    CheckpointError for a name that is not an expert or weights that are not a mixture."""
    unknown = [d for d in weights if d not in domains]
    if unknown:
        raise CheckpointError(
            f"merge weights {weights}: {unknown} are not experts of the checkpoint ({list(domains)})"
        )
    try:
        return mx.mixture_weights(
            [weights.get(d, 0.0) for d in domains], f"merge weights over {list(domains)}"
        )
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def dense_state_dict(c: Consolidated, weights_E: Sequence[float] | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint as a dense model's state dict (our names): shared tensors unchanged, each DEMix layer's FFN
    the weighted sum of its experts, sum_j w_j W_j (one-hot: one domain's expert, bit-exact)."""
    kind = ffn_kind(c.cfg)
    if not kind.has_experts:
        return dict(c.state_dict)
    if not kind.domain_experts:
        raise CheckpointError(f"export supports dense and DEMix checkpoints, not {kind.name!r}")
    if weights_E is None or len(weights_E) != len(c.domains):
        raise CheckpointError(f"need {len(c.domains)} expert weights, got {weights_E}")
    out = {k: v for k, v in c.state_dict.items() if ".ffn.experts." not in k}
    for layer in range(c.cfg.model.n_layers):
        for name in _EXPERT_PARAMS:
            parts = [
                (w, c.state_dict[f"blocks.{layer}.ffn.experts.{j}.{name}"])
                for j, w in enumerate(weights_E)
                if w
            ]
            if len(parts) == 1 and parts[0][0] == 1.0:
                merged = parts[0][1].clone()
            else:
                merged = sum(w * t.double() for w, t in parts).to(parts[0][1].dtype)
            out[f"blocks.{layer}.ffn.mlp.{name}"] = merged
    return out


def dense_model(c: Consolidated, weights_E: Sequence[float] | None = None) -> torch.nn.Module:
    """Our own GPT (dense FFN) holding `dense_state_dict`: the reference the export must reproduce."""
    from model.gpt import GPT

    cfg = replace(c.cfg.model, ffn=replace(c.cfg.model.ffn, kind="dense", num_experts=0))
    model = GPT(cfg, init_seed=0)
    model.load_state_dict(dense_state_dict(c, weights_E))
    return model.eval()


def merge_weights_from_data(
    c: Consolidated, domain: str, data: str | None, tokenizer: str | None, dev_blocks: int
) -> mx.CachedPrior:
    """The target domain's cached prior over the experts, estimated on its development blocks (§5.1)."""
    from launcher.modular.experts.editing import estimate_domain_prior

    return estimate_domain_prior(c, domain, data, tokenizer, "valid", dev_blocks)
