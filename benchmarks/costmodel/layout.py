"""What each GPU holds and hands to each collective per update: DEMix's domain groups, the parameters per GPU,
the gradient all-reduce plan, GShard's all-to-all volume, and the same bytes keyed as the trainer's `comm/` metrics
(or taken from a run's measurements). docs/costmodel.md, "Gradient bytes per update"."""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.costmodel.options import DTYPE_BYTES, CostOptions
from model import accounting as acc
from model.config import ModelConfig


def demix_groups(cfg: ModelConfig, gpus: int) -> tuple[int, int]:
    """(ranks per domain group, domains per rank) of DEMix on `gpus` ranks: G domains on n ranks give groups of
    n/G ranks (n a multiple of G) or, with more domains than ranks (G a multiple of n), G/n domains on each rank,
    each domain's group being that one rank (parallel/topology.py)."""
    n = acc.resolved_num_experts(cfg)
    if gpus % n == 0:
        return gpus // n, 1
    if n % gpus == 0:
        return 1, n // gpus
    raise ValueError(
        f"DEMix: {gpus} GPUs cannot be split evenly among {n} domains (nor {n} domains among {gpus} GPUs)"
    )


def params_per_gpu(cfg: ModelConfig, gpus: int) -> int:
    """Parameters one GPU holds: Dense all; DEMix the shared ones + its domain's expert in every layer;
    GShard the shared ones + its E/n experts (at least one) in every expert layer."""
    p = acc.param_counts(cfg)
    if cfg.ffn.kind == "dense" or not p.num_experts:
        return p.total
    one = p.expert // p.num_experts  # one expert in every expert layer
    if cfg.ffn.kind == "gshard":
        return p.shared + one * max(1, p.num_experts // gpus)
    return p.shared + one


def allreduce_plan(cfg: ModelConfig, gpus: int, grad_bytes: int) -> list[tuple[float, int]]:
    """(bytes per rank, group size) of each gradient all-reduce of one update (docs/costmodel.md, "Gradient bytes
    per update")."""
    params = acc.param_counts(cfg)
    kind = cfg.ffn.kind
    if kind == "dense":
        return [(params.total * grad_bytes, gpus)]
    if kind == "demix":
        per_domain = params.expert // params.num_experts
        group, per_rank = demix_groups(cfg, gpus)
        return [(params.shared * grad_bytes, gpus), (per_domain * per_rank * grad_bytes, group)]
    if kind == "gshard":
        n_exp = params.num_experts
        if n_exp % gpus and gpus % n_exp:
            raise ValueError(f"GShard: {n_exp} experts cannot be spread evenly over {gpus} GPUs")
        # each rank's experts over the max(1, gpus/E) ranks holding the same ones (one rank: no time)
        local = params.expert // n_exp * max(1, n_exp // gpus)
        return [(params.shared * grad_bytes, gpus), (local * grad_bytes, max(1, gpus // n_exp))]
    raise ValueError(f"ffn kind {kind!r} is not modelled (dense, demix, gshard)")


def alltoall_volume(cfg: ModelConfig, opts: CostOptions) -> tuple[float, int]:
    """(bytes per GPU per all-to-all, all-to-alls per update) for GShard; (0, 0) otherwise.

    V = c · k · (micro_batch · seq_len) · d · act_bytes
    count = L_moe · (2 + 2 + [2 if recompute]) · grad_accum
    """
    if cfg.ffn.kind != "gshard":
        return 0.0, 0
    gs = cfg.ffn.gshard
    tokens = opts.micro_batch * cfg.seq_len
    volume = gs.capacity_factor * gs.top_k * tokens * cfg.d_model * DTYPE_BYTES[opts.act_dtype]
    per_layer = 6 if opts.recompute == "full" else 4
    return volume, len(cfg.moe_layer_ids()) * per_layer * opts.grad_accum


NORM_BYTES = 8  # parallel/engine.py:global_grad_norm all-reduces one float64 over the data-parallel group


def _ranks_name(ranks: Sequence[int], gpus: int) -> str:
    """The trainer's metric name of a group (parallel/comm_stats.py) as rank 0 sees it."""
    return "data_parallel" if len(ranks) == gpus else "ranks_" + "_".join(map(str, ranks))


def comm_bytes_per_update(cfg: ModelConfig, gpus: int, opts: CostOptions) -> dict[str, float]:
    """Bytes rank 0 hands to each collective per update, keyed `<group>/<op>` as the trainer's
    `comm/<group>/<op>/bytes` metrics (ZeRO stage 0, no tensor parallelism; `cfg.vocab_size` padded as the
    model builds it). `allreduce_plan` and `alltoall_volume` plus the 8-byte all-reduce of the global gradient
    norm; DEMix's domain group is the trainer's `expert` group; GShard's groups follow DeepSpeed's layout
    (expert-parallel ranks 0..E-1, expert-data-parallel ranks 0, E, 2E, ...; a group of rank 0 alone is `local`:
    DeepSpeed calls the all-reduce, nothing moves). tests/multirank/test_comm_measured.py checks
    this against the running trainer at 8 and 16 ranks."""
    grad_bytes = DTYPE_BYTES[opts.grad_dtype]
    out: dict[str, float] = {}
    for i, (nbytes, p) in enumerate(allreduce_plan(cfg, gpus, grad_bytes)):
        if i == 0 or p == gpus:  # the world (one rank alone: everything is its data-parallel all-reduce)
            name = "data_parallel"
        elif cfg.ffn.kind == "demix":
            name = "expert"
        elif p == 1:  # GShard, one rank per expert-data-parallel group
            name = "local"
        else:  # GShard's replicated experts: expert-data-parallel group of rank 0
            name = _ranks_name(range(0, gpus, acc.resolved_num_experts(cfg)), gpus)
        out[f"{name}/all_reduce"] = out.get(f"{name}/all_reduce", 0.0) + nbytes
    out["data_parallel/all_reduce"] += NORM_BYTES
    volume, count = alltoall_volume(cfg, opts)
    ep = min(gpus, acc.resolved_num_experts(cfg))
    if count and ep > 1:  # DeepSpeed exchanges nothing in a one-rank expert-parallel group
        out[f"{_ranks_name(range(ep), gpus)}/all_to_all_single"] = volume * count
    return out


def plan_from_measured(
    cfg: ModelConfig, gpus: int, opts: CostOptions, measured: dict[str, float]
) -> tuple[list[tuple[float, int]], float, int]:
    """`allreduce_plan` and `alltoall_volume` with the bytes a running trainer measured (`measured`: bytes per
    update keyed `<group>/<op>`, as `comm_bytes_per_update` and the sweep's `comm_bytes`) in place of the
    formulas: each measured group keeps its size from the layout, the all-to-all count stays structural
    (layers x passes x accumulation), its volume is the measured bytes / count. A group the layout does not
    explain is an error naming it."""
    modelled = comm_bytes_per_update(cfg, gpus, opts)
    unknown = sorted(set(measured) - set(modelled))
    if unknown:
        raise ValueError(
            f"measured collectives {', '.join(unknown)} are not in the cost model's plan "
            f"({', '.join(sorted(modelled))}) for {cfg.ffn.kind} on {gpus} GPUs"
        )
    sizes = {"data_parallel": gpus, "local": 1}
    if cfg.ffn.kind == "demix":
        sizes["expert"] = demix_groups(cfg, gpus)[0]
    elif cfg.ffn.kind == "gshard":
        n_exp = acc.resolved_num_experts(cfg)
        sizes[_ranks_name(range(0, gpus, n_exp), gpus)] = max(1, gpus // n_exp)
    plan = [
        (nbytes - (NORM_BYTES if key == "data_parallel/all_reduce" else 0), sizes[key.split("/")[0]])
        for key, nbytes in measured.items()
        if key.endswith("/all_reduce")
    ]
    _, count = alltoall_volume(cfg, opts)
    a2a = sum(v for k, v in measured.items() if k.endswith("/all_to_all_single"))
    return plan, (a2a / count if count else 0.0), count
