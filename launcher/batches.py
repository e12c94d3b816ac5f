"""This rank's training batches: the sampler of its domains (`build_rank_sampler`) and the model inputs of a
micro-batch on the training device (`to_model_batch`), with the scored tokens per expert a step's gradient
scaling needs (`step_expert_tokens`). Used by the trainer's loop and its in-run evaluation (launcher/train.py)."""

from __future__ import annotations

from typing import Any

import torch

from data.blocks import BlockDataset
from data.sampler import DomainSampler, build_sampler
from launcher.ffn_kinds import ffn_kind
from launcher.plan import Plan


def build_rank_sampler(plan: Plan, rank: int, split: str = "train") -> DomainSampler:
    """This rank's sampler: its domains (DEMix) or every domain, sharded by data-parallel rank (baselines)."""
    cfg, cat = plan.cfg, plan.catalog
    domains, shard, shards = ffn_kind(cfg).rank_data(plan.topo, rank, len(cat.train_domains))
    datasets = {
        d: BlockDataset.from_prepared(
            cfg.data.path, cfg.data.tokenizer, cat.train_domains[d], split, cfg.model.seq_len
        )
        for d in domains
    }
    return build_sampler(
        cfg.data,
        datasets,
        domains,
        shard,
        shards,
        cfg.train.micro_batch,
        cfg.data.seed,
        cfg.train.grad_accum,
        domain_token_base=cat.vocab_size,
    )


def to_model_batch(b: dict[str, torch.Tensor], device: torch.device, plan: Plan) -> dict[str, torch.Tensor]:
    """Sampler batch -> model inputs. `domain_ids` index the data's domains (metrics); `expert_ids` what the
    model routes by (the same unless the experts come from an init checkpoint with another order). The
    routing ids stay on the host: a DEMix layer then finds each expert's rows without reading the device
    (model/demix.py), so a training step has no device-to-host synchronisation."""
    dom = b["domain_ids_B"]
    experts = torch.tensor(plan.expert_of_domain, dtype=torch.long)[dom]
    # host numbers: no device sync
    return {
        "tokens": to_device(b["tokens_BT"], device),
        "targets": to_device(b["targets_BT"], device),
        "domain_ids": to_device(dom, device),
        "expert_ids": experts,
        "loss_mask": to_device(b["loss_mask_BT"], device),
        "expert_tokens": expert_token_counts(experts, b["loss_mask_BT"]),
    }


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch tensor on the training device without blocking the host where the device is CUDA.

    A copy from pageable memory makes the host wait until the data is staged; from page-locked memory it is
    queued on the current stream. `pin_memory()` makes a new page-locked copy (the sampler's array is never
    the source, so it may be reused at once), and torch's caching host allocator keeps that block until the
    queued copy has run even after the pinned tensor is freed. Kernels that read the result are queued on the
    same stream, after the copy. Elsewhere (CPU) this is the plain `.to(device)` it always was."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def expert_token_counts(expert_ids_B: torch.Tensor, mask_BT: torch.Tensor) -> dict[int, float]:
    """Scored tokens per expert id in a micro-batch (host tensors in, host numbers out)."""
    out: dict[int, float] = {}
    for e, n in zip(expert_ids_B.tolist(), mask_BT.sum(1).tolist()):
        out[e] = out.get(e, 0.0) + n
    return out


def expert_ids_of(mb: dict[str, Any]) -> torch.Tensor:
    """The ids a micro-batch is routed by. A batch without them is an error, not a cue to route by its
    `domain_ids`: the two differ whenever the experts come in another order than the data's domains."""
    try:
        return mb["expert_ids"]
    except KeyError:
        raise KeyError(
            "micro-batch has no 'expert_ids' (the ids the model routes by; launcher.batches.to_model_batch sets "
            "them): a batch built by hand must set them too, its 'domain_ids' are not used in their place"
        ) from None


def step_expert_tokens(micro: list[dict[str, Any]]) -> tuple[dict[int, float], float]:
    """(scored tokens per expert id, all scored tokens) over a step's micro-batches on this rank."""
    per: dict[int, float] = {}
    for mb in micro:
        counts = mb.get("expert_tokens")
        if counts is None:  # a batch built by hand (tests): count from its tensors
            counts = expert_token_counts(expert_ids_of(mb).cpu(), mb["loss_mask"].cpu())
        for e, n in counts.items():
            per[e] = per.get(e, 0.0) + n
    return per, sum(per.values())
