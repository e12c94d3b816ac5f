"""One trainer for every variant: dense (natural mix), dense-balanced, +domain-token, DEMix, GShard.

    python -m launcher.train --config configs/demo/demix.yaml --run-dir runs/x [--set train.steps=50]

Usually started through `python -m launcher.launch` (the deepspeed launcher, N local processes or a
hostfile); started bare it runs as a single process. Everything that can be checked (config, data,
layout, resume compatibility) is checked before any process group or model exists.

The loop (`train`) reads top to bottom: batch -> forward -> loss (+aux) -> backward -> step -> metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch

from data.catalog import Catalog, DataError, load_catalog
from launcher.checkpoint import CheckpointError, commit_dir, write_json_atomic
from launcher.config import ConfigError, RunConfig, load_run_config
from launcher.metrics import MetricsLogger, device_name, peak_memory_gb
from launcher.typed import to_dict
from model.accounting import flops_per_update, mfu, tflops_per_gpu
from parallel.topology import Topology, build_topology, model_sharding_problems


# ----------------------------------------------------------------------------------------------------
# Pre-flight: resolve and validate everything, no processes, no model.
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    cfg: RunConfig  # resolved: expert count, vocabulary
    catalog: Catalog
    topo: Topology
    expert_domains: tuple[str, ...] = ()  # expert id -> domain name (DEMix); from train.init_from when given
    notes: tuple[str, ...] = ()  # allowed but worth announcing (e.g. unequal data per domain)

    @property
    def expert_of_domain(self) -> list[int]:
        """Data domain id (position in catalog.train_domains) -> expert id of the model."""
        if not self.expert_domains:
            return list(range(len(self.catalog.train_domains)))
        return [self.expert_domains.index(d) for d in self.catalog.train_domains]


def init_checkpoint_problems(cfg: RunConfig, catalog: Catalog) -> tuple[list[str], tuple[str, ...]]:
    """Checks of `train.init_from` against this run (reads only its meta.json); returns (problems, expert domains)."""
    path = Path(cfg.train.init_from)
    if not (path / "meta.json").is_file():
        return [f"train.init_from={str(path)!r}: not a consolidated checkpoint (no meta.json)"], ()
    meta = json.loads((path / "meta.json").read_text())
    m = meta["config"]["model"]
    out = []
    for key in ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size", "ffn_mult"):
        if m.get(key) != getattr(cfg.model, key):
            out.append(f"train.init_from: model.{key} is {m.get(key)} in the checkpoint, {getattr(cfg.model, key)} here")
    if m["ffn"]["kind"] != cfg.model.ffn.kind:
        out.append(f"train.init_from: a {m['ffn']['kind']!r} checkpoint cannot start a {cfg.model.ffn.kind!r} run")
    domains = tuple(meta["domains"]) if cfg.model.ffn.kind == "demix" else ()
    missing = [d for d in catalog.train_domains if domains and d not in domains]
    if missing:
        out.append(f"train.init_from has no expert for {missing} (experts: {', '.join(domains)}); add one first with "
                   "`python -m launcher.experts add`")
    return out, domains


def resolve(cfg: RunConfig, catalog: Catalog, world_size: int, expert_domains: Sequence[str] = ()) -> RunConfig:
    """Fill what the config leaves to the data and the layout: DEMix experts = training domains (or the
    init checkpoint's experts), GShard experts = GPUs x experts per rank (one expert per GPU, DEMix §A.5)."""
    ffn = cfg.model.ffn
    if ffn.kind == "demix" and ffn.num_experts == 0:
        ffn = replace(ffn, num_experts=len(expert_domains or catalog.train_domains))
    if ffn.kind == "cse" and ffn.num_experts == 0:
        ffn = replace(ffn, num_experts=ffn.cse.max_clusters)  # expert slots, activated at clustering (model/cse.py)
    if ffn.kind == "gshard" and ffn.num_experts == 0:
        from parallel.gshard import resolve_num_experts

        ffn = replace(ffn, num_experts=resolve_num_experts(cfg.model, world_size))
    return replace(cfg, model=replace(cfg.model, ffn=ffn))


def plan_problems(cfg: RunConfig, catalog: Catalog, world_size: int, expert_domains: Sequence[str] = ()) -> list[str]:
    """Cross-component checks, all reported at once."""
    out = []
    n_experts_wanted = len(expert_domains or catalog.train_domains)
    kind, mixture = cfg.model.ffn.kind, cfg.data.mixture
    if kind == "demix" and mixture != "by_domain":
        out.append(f"model.ffn.kind=demix trains each expert on its own domain: set data.mixture=by_domain (not {mixture!r})")
    if kind != "demix" and mixture == "by_domain" and len(catalog.train_domains) > 1:
        out.append(f"data.mixture=by_domain gives each rank one domain; for kind={kind!r} use natural, balanced or domain_token")
    if kind == "demix" and cfg.model.ffn.num_experts != n_experts_wanted:
        out.append(
            f"model.ffn.num_experts={cfg.model.ffn.num_experts} but the run needs {n_experts_wanted} experts "
            f"({', '.join(expert_domains or catalog.train_domains)}); set it to 0 to derive it"
        )
    if cfg.train.trainable == "experts" and kind not in ("demix", "gshard", "cse"):
        out.append(f"train.trainable=experts needs an expert model, not {kind!r}")
    need = catalog.total_vocab_size(mixture == "domain_token")
    have = cfg.model.padded_vocab_size(cfg.parallel.tensor_parallel)
    if need > have:
        out.append(f"model.vocab_size={cfg.model.vocab_size} (padded {have}) is smaller than the {need} token ids the "
                   f"{catalog.tokenizer} data uses{' with domain tokens' if mixture == 'domain_token' else ''}")
    out += model_sharding_problems(cfg.model.n_heads, cfg.model.d_ffn, cfg.parallel.tensor_parallel)
    if kind == "gshard":
        from parallel.gshard import gshard_layout_problems

        out += gshard_layout_problems(cfg.model, world_size, cfg.parallel.tensor_parallel)
    if cfg.parallel.allocation is not None and kind != "demix":
        out.append("parallel.allocation applies to DEMix only (ranks per domain)")
    min_tokens = cfg.model.seq_len + 1
    for d in catalog.train_domains:
        for split in ("train", "valid"):
            if catalog.tokens(d, split) < min_tokens:
                out.append(f"domain {d!r} has {catalog.tokens(d, split)} {split} tokens, fewer than one block of {min_tokens}")
    return out


def make_plan(cfg: RunConfig, world_size: int, check_local_device: bool = False) -> Plan:
    """Resolve and validate a run for `world_size` ranks; raise ConfigError listing every problem
    (the config's own, the data's and the layout's, together). `check_local_device`: this machine's device
    is the training device (a local launch, or a rank itself), so its precision support is checked too."""
    problems = cfg.problems()
    if check_local_device and not problems:
        from parallel.precision import local_precision_problems

        problems += local_precision_problems(cfg.train.precision)
    try:
        catalog = load_catalog(cfg.data.path, cfg.data.tokenizer, cfg.data.domains)
    except DataError as e:
        problems.append(str(e))
        problems += model_sharding_problems(cfg.model.n_heads, cfg.model.d_ffn, cfg.parallel.tensor_parallel)
        raise ConfigError(problems, "run") from None
    if problems:  # a broken config would make the data/layout checks below misleading
        problems += model_sharding_problems(cfg.model.n_heads, cfg.model.d_ffn, cfg.parallel.tensor_parallel)
        raise ConfigError(problems, "run")
    expert_domains: tuple[str, ...] = ()
    if cfg.train.init_from:
        problems, expert_domains = init_checkpoint_problems(cfg, catalog)
    cfg = resolve(cfg, catalog, world_size, expert_domains)
    problems += plan_problems(cfg, catalog, world_size, expert_domains)
    num_domains = len(catalog.train_domains) if cfg.model.ffn.kind == "demix" else 1
    try:
        topo = build_topology(world_size, cfg.parallel.tensor_parallel, num_domains, cfg.parallel.allocation,
                              list(catalog.train_domains) if num_domains > 1 else ["all"])
    except ValueError as e:
        problems += getattr(e, "problems", [str(e)])
        topo = None
    if problems:
        raise ConfigError(problems, "run")
    from parallel.topology import unequal_data_note

    note = unequal_data_note(topo) if cfg.model.ffn.kind == "demix" else None
    return Plan(cfg, catalog, topo, expert_domains, notes=(note,) if note else ())


# ----------------------------------------------------------------------------------------------------
# Distributed set-up
# ----------------------------------------------------------------------------------------------------


def _ensure_env() -> None:
    """A bare `python -m launcher.train` is a world of one: give DeepSpeed the env a launcher would."""
    if "RANK" in os.environ:
        return
    from launcher.launch import free_port

    port = free_port()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def start_distributed() -> tuple[int, int]:
    import deepspeed
    import torch.distributed as dist

    _ensure_env()
    if torch.cuda.is_available():  # before the first NCCL communicator exists, so each rank binds its own GPU
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


def training_device() -> torch.device:
    """The one device this rank trains on; every tensor that meets a collective is made here."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# ----------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------


def build_rank_sampler(plan: Plan, rank: int, split: str = "train"):
    """This rank's sampler: its domains (DEMix) or every domain, sharded by data-parallel rank (baselines)."""
    from data.blocks import BlockDataset
    from data.sampler import build_sampler

    cfg, cat, info = plan.cfg, plan.catalog, plan.topo.rank_info(rank)
    if cfg.model.ffn.kind == "demix":
        domains, shard, shards = list(info.domains), info.shard_index, info.num_shards
    else:
        domains, shard, shards = list(range(len(cat.train_domains))), info.dp_rank, plan.topo.dp_size
    datasets = {d: BlockDataset.from_prepared(cfg.data.path, cfg.data.tokenizer, cat.train_domains[d], split, cfg.model.seq_len)
                for d in domains}
    return build_sampler(cfg.data, datasets, domains, shard, shards, cfg.train.micro_batch, cfg.data.seed,
                         cfg.train.grad_accum, domain_token_base=cat.vocab_size)


def to_model_batch(b: dict[str, torch.Tensor], device: torch.device, plan: Plan) -> dict[str, torch.Tensor]:
    """Sampler batch -> model inputs. `domain_ids` index the data's domains (metrics); `expert_ids` what the
    model routes by (the same unless the experts come from an init checkpoint with another order)."""
    dom = b["domain_ids_B"]
    experts = torch.tensor(plan.expert_of_domain, dtype=torch.long)[dom]
    return {"tokens": b["tokens_BT"].to(device), "targets": b["targets_BT"].to(device), "domain_ids": dom.to(device),
            "expert_ids": experts.to(device), "loss_mask": b["loss_mask_BT"].to(device),
            "expert_tokens": expert_token_counts(experts, b["loss_mask_BT"])}  # host numbers: no device sync


def expert_token_counts(expert_ids_B: torch.Tensor, mask_BT: torch.Tensor) -> dict[int, float]:
    """Scored tokens per expert id in a micro-batch (host tensors in, host numbers out)."""
    out: dict[int, float] = {}
    for e, n in zip(expert_ids_B.tolist(), mask_BT.sum(1).tolist()):
        out[e] = out.get(e, 0.0) + n
    return out


def step_expert_tokens(micro: list[dict[str, Any]]) -> tuple[dict[int, float], float]:
    """(scored tokens per expert id, all scored tokens) over a step's micro-batches on this rank."""
    per: dict[int, float] = {}
    for mb in micro:
        counts = mb.get("expert_tokens")
        if counts is None:  # a batch built by hand (tests): count from its tensors
            counts = expert_token_counts(mb.get("expert_ids", mb["domain_ids"]).cpu(), mb["loss_mask"].cpu())
        for e, n in counts.items():
            per[e] = per.get(e, 0.0) + n
    return per, sum(per.values())


# ----------------------------------------------------------------------------------------------------
# Training state: per-rank shards for exact resume
# ----------------------------------------------------------------------------------------------------


def layout_identity(plan: Plan) -> dict[str, Any]:
    """What must match for a training-state checkpoint to resume."""
    c = plan.cfg
    return {"world_size": plan.topo.world_size, "tensor_parallel": plan.topo.tensor_parallel,
            "allocation": list(plan.topo.allocation), "ffn": c.model.ffn.kind, "num_experts": c.model.ffn.num_experts,
            "zero_stage": c.parallel.zero_stage, "micro_batch": c.train.micro_batch, "grad_accum": c.train.grad_accum,
            "domains": list(plan.catalog.train_domains), "model": [c.model.n_layers, c.model.d_model, c.model.seq_len]}


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    ptr = run_dir / "checkpoints" / "latest"
    if not ptr.is_file():
        return None
    path = run_dir / "checkpoints" / ptr.read_text().strip()
    return path if (path / "meta.json").is_file() else None


def check_resumable(ckpt: Path, plan: Plan) -> int:
    """The step to resume from; a CheckpointError naming every mismatch if the layout differs."""
    meta = json.loads((ckpt / "meta.json").read_text())
    want = layout_identity(plan)
    diff = [f"{k}: checkpoint {meta['layout'].get(k)!r}, this run {v!r}" for k, v in want.items() if meta["layout"].get(k) != v]
    if diff:
        raise CheckpointError(f"{ckpt} was written by a different layout; resume with the same one, or start a new run "
                              "directory (`--resume never`) from an exported model:\n  " + "\n  ".join(diff))
    missing = [r for r in range(want["world_size"]) if not (ckpt / f"rank{r:05d}.pt").is_file()]
    if missing:
        raise CheckpointError(f"{ckpt} lacks the shards of ranks {missing}")
    return int(meta["step"])


def save_training_state(run_dir: Path, step: int, bundle: Any, plan: Plan, rank: int) -> Path:
    """Every rank writes its shard into one temporary directory; rank 0 publishes it atomically."""
    import torch.distributed as dist

    ckdir = run_dir / "checkpoints"
    final = ckdir / f"step_{step:08d}"
    tmp = ckdir / f".step_{step:08d}.tmp"
    if rank == 0:
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    state = {"model": bundle.engine.module.state_dict(), "optimizer": bundle.engine.optimizer.state_dict(),
             "scheduler": bundle.scheduler.state_dict(), "step": step,
             "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": _numpy_rng_state(),
                     "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}}
    torch.save(state, tmp / f"rank{rank:05d}.pt.part")
    os.replace(tmp / f"rank{rank:05d}.pt.part", tmp / f"rank{rank:05d}.pt")
    dist.barrier()
    if rank == 0:
        write_json_atomic(tmp / "meta.json", {"step": step, "layout": layout_identity(plan), "config": to_dict(plan.cfg)})
        commit_dir(tmp, final)
        (ckdir / "latest.part").write_text(final.name + "\n")
        os.replace(ckdir / "latest.part", ckdir / "latest")
    dist.barrier()
    return final


def _numpy_rng_state() -> tuple:
    """numpy's global RNG state with its key array as a tensor (loadable weights-only)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)


def _load_rank_state(path: Path) -> dict[str, Any]:
    """A per-rank training-state file, weights-only (a run directory may come from someone else): tensors,
    plain containers, and the few DeepSpeed value classes its optimizer state dicts hold."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    with torch.serialization.safe_globals([LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]):
        return torch.load(path, map_location="cpu", weights_only=True)


def load_training_state(ckpt: Path, bundle: Any, plan: Plan, rank: int) -> int:
    state = _load_rank_state(ckpt / f"rank{rank:05d}.pt")
    bundle.engine.module.load_state_dict(state["model"])
    if plan.cfg.parallel.zero_stage == 0:
        bundle.engine.optimizer.load_state_dict(state["optimizer"])
    else:
        dp_rank, dp = plan.topo.rank_info(rank).dp_rank, plan.topo.dp_size
        shards = [state["optimizer"] if i == dp_rank else None for i in range(dp)]
        bundle.engine.optimizer.load_state_dict(shards, load_optimizer_states=True, load_from_fp32_weights=True)
    bundle.scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    if torch.cuda.is_available() and state["rng"].get("cuda") is not None:  # dropout on the GPU resumes exactly
        torch.cuda.set_rng_state(state["rng"]["cuda"])
    random.setstate(state["rng"]["python"])
    name, keys, pos, has_gauss, cached = state["rng"]["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    return int(state["step"])


# ----------------------------------------------------------------------------------------------------
# Metrics, evaluation, export
# ----------------------------------------------------------------------------------------------------


def domain_loss_sums(token_loss_BT: torch.Tensor, mask_BT: torch.Tensor, domain_ids_B: torch.Tensor, n: int) -> torch.Tensor:
    """[2, n]: summed token loss and token count per domain id, on the loss's device (no host sync)."""
    out = torch.zeros(2, n, dtype=torch.float64, device=token_loss_BT.device)
    dom = domain_ids_B.to(out.device)
    out[0].index_add_(0, dom, (token_loss_BT * mask_BT).sum(1).double())
    out[1].index_add_(0, dom, mask_BT.sum(1).double())
    return out


def reduce_domain_sums(sums: torch.Tensor, bundle: Any) -> torch.Tensor:
    """Sum over ranks; tensor-parallel replicas of the same batch count once."""
    import torch.distributed as dist

    sums = sums.clone() if bundle.groups.tp_rank == 0 else torch.zeros_like(sums)
    dist.all_reduce(sums)
    return sums


@torch.no_grad()
def evaluate(bundle: Any, plan: Plan, rank: int, device: torch.device) -> dict[str, float]:
    """Validation loss per training domain: each rank scores the first `eval_batches` micro-batches of its
    domains' validation blocks (disjoint shards within a domain group), summed over ranks."""
    cfg = plan.cfg
    sampler = build_rank_sampler(plan, rank, "valid")
    model = bundle.engine.module
    was_training = model.training
    model.eval()
    n = len(plan.catalog.train_domains)
    sums = torch.zeros(2, n, dtype=torch.float64, device=device)
    for i in range(cfg.train.eval_batches):
        b = to_model_batch(sampler.batch(i // cfg.train.grad_accum, i % cfg.train.grad_accum), device, plan)
        out = model(b["tokens"], b["expert_ids"], targets_BT=b["targets"], loss_mask_BT=b["loss_mask"], return_logits=False)
        sums += domain_loss_sums(out.token_loss, b["loss_mask"], b["domain_ids"], n)
    model.train(was_training)
    sums = reduce_domain_sums(sums, bundle)
    out = {}
    for d, name in enumerate(plan.catalog.train_domains):
        if sums[1, d] > 0:
            loss = float(sums[0, d] / sums[1, d])
            out[f"val_loss/{name}"] = loss
            out[f"val_ppl/{name}"] = float(np.exp(min(loss, 50.0)))
    return out


def load_init_weights(model: torch.nn.Module, cfg: RunConfig) -> None:
    """Copy the weights this (plain, not yet parallelised) model holds from `train.init_from` (reading only
    the expert shards this rank holds)."""
    from launcher.checkpoint import load_consolidated

    own = model.state_dict()
    mine = model.expert_parameters().keys() if hasattr(model, "expert_parameters") else None
    state = load_consolidated(cfg.train.init_from, experts=mine).state_dict
    missing = [k for k in own if k not in state]
    if missing:
        raise CheckpointError(f"{cfg.train.init_from} lacks {len(missing)} tensors this model needs, e.g. {missing[:3]}")
    wanted = {k: state[k] for k in own}
    rows = own["wte.weight"].shape[0]
    if wanted["wte.weight"].shape[0] != rows:  # another tensor-parallel size pads the vocabulary differently
        have = wanted["wte.weight"]
        n = min(rows, have.shape[0])  # every real token id is below both; only padding rows differ
        wanted["wte.weight"] = torch.cat([have[:n], own["wte.weight"][n:]]) if n < rows else have[:rows]
    model.load_state_dict(wanted)


def freeze_all_but_experts(model: torch.nn.Module) -> None:
    """requires_grad only on expert parameters (DEMix-DAPT trains the new expert alone, DEMix §6)."""
    experts = {id(p) for ps in model.expert_parameters().values() for p in ps}
    for p in model.parameters():
        p.requires_grad_(id(p) in experts)


def export_consolidated(bundle: Any, plan: Plan, rank: int, out: Path, step: int) -> Optional[Path]:
    """The plain, single-process model with all experts, written as a sharded consolidated checkpoint.

    Every rank calls it. Tensor-parallel shards are gathered inside each TP group; rank 0 writes the shared
    tensors; the first rank of each DEMix domain group (tp rank 0), or of each GShard expert-data-parallel
    group, writes its own experts' shards. No rank ever receives another rank's expert, so per-GPU memory
    stays at the rank's own weights (at 128 GPUs, gathering all experts everywhere would need tens of GB per
    GPU). Experts of a `train.init_from` checkpoint that this run does not train are copied over from it.
    Assumes a filesystem shared by all ranks."""
    import torch.distributed as dist

    from launcher.checkpoint import (copy_expert_shards, finish_consolidated, split_by_expert, write_expert_shard,
                                     write_shared_shard)

    model = bundle.engine.module
    kind = plan.cfg.model.ffn.kind
    tmp = out.parent / f".{out.name}.tmp-export"
    if rank == 0:
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    domains = list(plan.expert_domains or plan.catalog.train_domains)
    if kind == "gshard":
        from parallel.gshard import gshard_export_parts

        shared, experts, writer = gshard_export_parts(model, bundle.groups)
    else:
        if plan.topo.tensor_parallel > 1:
            from parallel.tensor_parallel import gather_full_state_dict

            full = gather_full_state_dict(model, bundle.groups.tp_group)
        else:
            full = {k: v.detach() for k, v in model.state_dict().items()}
        full = {k: v for k, v in full.items() if not k.endswith("_extra_state")}
        shared, experts = split_by_expert(full) if kind == "demix" else (full, {})
        info = plan.topo.rank_info(rank)
        writer = info.tp_rank == 0 and info.shard_index == 0  # the first rank of its domain group(s)
    shared = {k: v for k, v in shared.items() if not k.startswith("ds_expert_groups")}
    if writer:
        for e, tensors in experts.items():
            write_expert_shard(tmp, e, tensors)
    if rank == 0:
        write_shared_shard(tmp, shared)
        untrained = sorted(set(range(len(domains))) - set(plan.expert_of_domain)) if kind == "demix" else []
        if untrained:  # experts of the init checkpoint this run left alone (e.g. DEMix-DAPT)
            copy_expert_shards(plan.cfg.train.init_from, untrained, tmp)
    del shared, experts
    dist.barrier()
    if rank == 0:
        finish_consolidated(tmp, out, plan.cfg, domains, step,
                            extra={"tokenizer": plan.catalog.tokenizer, "vocab_size": plan.catalog.vocab_size})
    dist.barrier()
    return out if rank == 0 else None


def throughput_record(plan: Plan, seconds: float, steps: int) -> dict[str, Any]:
    """tokens/s, TFLOPs/GPU in both conventions (labelled), MFU against the device's peak."""
    cfg, topo = plan.cfg, plan.topo
    global_batch = cfg.train.micro_batch * cfg.train.grad_accum * topo.dp_size
    rep = flops_per_update(cfg.model, global_batch, vocab_size=cfg.model.vocab_size)
    per_update = seconds / max(1, steps)
    rec = {"tokens_per_s": global_batch * cfg.model.seq_len / per_update, "step_time_s": per_update}
    for conv in ("recompute", "no_recompute"):
        rec[f"tflops_per_gpu_{conv}"] = tflops_per_gpu(rep.get(conv), per_update, topo.world_size)
    conv = "recompute" if cfg.train.activation_checkpointing == "full" else "no_recompute"
    rec["tflops_per_gpu"] = rec[f"tflops_per_gpu_{conv}"]
    rec["mfu"] = mfu(rec["tflops_per_gpu"], device_name(), cfg.train.precision)
    return rec


# ----------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------


def train(plan: Plan, run_dir: Path, resume: str = "auto") -> dict[str, Any]:
    """Train `plan` on this process's rank; returns the final validation metrics (all ranks)."""
    from model.gpt import GPT
    from parallel.engine import build_engine
    from parallel.groups import ProcessGroups

    cfg = plan.cfg
    ckpt = latest_checkpoint(run_dir) if resume == "auto" else (Path(resume) if resume not in ("never", "auto") else None)
    start = check_resumable(ckpt, plan) if ckpt is not None else 0  # before any expensive work
    rank, world = start_distributed()
    if world != plan.topo.world_size:
        raise ConfigError([f"planned for {plan.topo.world_size} ranks, launched with {world}"], "launch")
    device = training_device()
    torch.manual_seed(cfg.train.seed)
    groups = ProcessGroups.create(plan.topo)
    info = plan.topo.rank_info(rank)
    expert_ids = None
    if cfg.model.ffn.kind == "demix":
        expert_ids = [plan.expert_of_domain[d] for d in info.domains]
    elif cfg.model.ffn.kind == "gshard":  # build only this rank's experts (init is per parameter name)
        from parallel.gshard import gshard_layout_for

        expert_ids = list(gshard_layout_for(cfg, plan.topo, rank).local_experts)
    model = GPT(cfg.model, expert_ids=expert_ids, tensor_parallel=cfg.parallel.tensor_parallel, init_seed=cfg.train.seed)
    if cfg.train.init_from:
        load_init_weights(model, cfg)
    if cfg.train.trainable == "experts":
        freeze_all_but_experts(model)
    if cfg.train.activation_checkpointing == "full":
        from parallel.checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(model)
    bundle = build_engine(model, cfg, groups)
    if ckpt is not None:
        start = load_training_state(ckpt, bundle, plan, rank)
    sampler = build_rank_sampler(plan, rank)
    cse = None
    if cfg.model.ffn.kind == "cse":  # warm-up, then cluster sequence embeddings and copy the FFN (CSE Alg. 1)
        from parallel.cse import CSEController

        cse = CSEController(bundle.engine.module, cfg, groups, optimizer=bundle.engine.optimizer,
                            domain_names=plan.catalog.train_domains)
    log = MetricsLogger(run_dir, cfg, rank == 0, cfg.train.steps, start)
    if rank == 0:
        log.log({"kind": "start", "step": start, "resumed_from": str(ckpt) if ckpt else None, "world_size": world,
                 "device": device_name(), "topology": plan.topo.describe(), "notes": list(plan.notes)})
        for note in plan.notes:
            print(f"note: {note}", file=sys.stderr)
    n_dom = len(plan.catalog.train_domains)
    window_t, window_steps, sums = time.perf_counter(), 0, torch.zeros(2, n_dom, dtype=torch.float64, device=device)
    kill_at = int(os.environ.get("DEMIX_TEST_KILL_AT_STEP", "-1"))  # test hook: SIGKILL mid-run
    for step in range(start, cfg.train.steps):
        micro = [to_model_batch(sampler.batch(step, m), device, plan) for m in range(cfg.train.grad_accum)]
        out = train_step(bundle, cfg, micro, n_dom)
        sums += out["domain_sums"]
        window_steps += 1
        done = step + 1
        if cse is not None:
            crec = cse.after_step(done, lambda i, s=done: to_model_batch(
                sampler.batch(s + i // cfg.train.grad_accum, i % cfg.train.grad_accum), device, plan))
            if crec is not None:
                log.log({"kind": "cse", "step": done, **crec})
        if done % cfg.logging.log_interval == 0 or done == cfg.train.steps:
            rec = {"kind": "train", "step": done, **step_record(out, bundle, plan, sums, window_t, window_steps)}
            log.log(rec)
            log.progress(done, rec)
            window_t, window_steps, sums = time.perf_counter(), 0, torch.zeros_like(sums)
        if cfg.train.eval_interval and done % cfg.train.eval_interval == 0 and done < cfg.train.steps:
            log.log({"kind": "eval", "step": done, **evaluate(bundle, plan, rank, device)})
        if cfg.train.save_interval and done % cfg.train.save_interval == 0 and done < cfg.train.steps:
            save_training_state(run_dir, done, bundle, plan, rank)
        if done == kill_at and rank == 0:
            os.kill(os.getpid(), 9)
    final = evaluate(bundle, plan, rank, device)
    log.log({"kind": "eval", "step": cfg.train.steps, **final})
    if start < cfg.train.steps:
        save_training_state(run_dir, cfg.train.steps, bundle, plan, rank)
    export_consolidated(bundle, plan, rank, run_dir / "model", cfg.train.steps)
    log.close()
    return final


def train_step(bundle: Any, cfg: RunConfig, micro: list[dict[str, torch.Tensor]], n_domains: int) -> dict[str, Any]:
    """One optimizer update over `grad_accum` micro-batches: forward, loss (+aux), backward, (clip), step.

    Everything it returns stays on the training device (no host sync inside the step); `step_record`
    brings values to the host at log intervals."""
    from parallel.engine import backward_loss_factor, clip_grads_, global_grad_norm, loss_scale

    engine = bundle.engine
    device = next(engine.module.parameters()).device
    factor = backward_loss_factor(engine)  # fp16 at ZeRO 0: the loss scale DeepSpeed would not apply
    if bundle.expert_scale is not None:  # each expert's gradient = the mean over its domain's tokens
        bundle.expert_scale.set_step_tokens(*step_expert_tokens(micro))
    sums = torch.zeros(2, n_domains, dtype=torch.float64, device=device)
    aux_total: Optional[torch.Tensor] = None
    stats: dict[str, torch.Tensor] = {}
    for i, mb in enumerate(micro):
        out = engine(mb["tokens"], mb.get("expert_ids", mb["domain_ids"]), targets_BT=mb["targets"],
                     loss_mask_BT=mb["loss_mask"], return_logits=False)
        loss = out.loss if out.aux_loss is None else out.loss + out.aux_loss
        engine.backward(loss * factor if factor != 1.0 else loss)
        sums += domain_loss_sums(out.token_loss.detach(), mb["loss_mask"], mb["domain_ids"], n_domains)
        if out.aux_loss is not None:
            aux = out.aux_loss.detach().double() / len(micro)
            aux_total = aux if aux_total is None else aux_total + aux
        for k, v in out.ffn_stats.items():
            if v.numel() == 1 or k.endswith("_E"):  # scalars and per-expert vectors (e.g. expert_load_E)
                v = v.detach().double() / len(micro)
                stats[k] = v if k not in stats else stats[k] + v
        if i < len(micro) - 1:
            engine.step()  # a no-op update: DeepSpeed counts micro-steps to find the accumulation boundary
    norm = None
    if cfg.parallel.zero_stage == 0:  # DeepSpeed would average per-rank norms here; use the true global norm
        # fp16: the gradients still carry the loss scale; clipping the scaled gradients by the unscaled norm's
        # coefficient is the same as clipping the unscaled ones (the optimizer unscales afterwards).
        norm = global_grad_norm(engine.module, bundle.groups) / loss_scale(engine)
        if cfg.train.clip_grad > 0:
            clip_grads_(engine.module, cfg.train.clip_grad, norm)
    engine.step()
    if norm is None:
        gn = engine.get_global_grad_norm()
        norm = gn if isinstance(gn, torch.Tensor) else torch.tensor(float("nan") if gn is None else float(gn))
    return {"domain_sums": sums, "grad_norm": norm, "aux_loss": aux_total, "stats": stats}


def step_record(out: dict, bundle: Any, plan: Plan, sums: torch.Tensor, t0: float, steps: int) -> dict[str, Any]:
    """The per-interval training record: loss (overall and per domain), lr, grad norm, throughput, memory."""
    import torch.distributed as dist

    total = reduce_domain_sums(sums, bundle)
    rec: dict[str, Any] = {"loss": float(total[0].sum() / total[1].sum().clamp_min(1))}
    for d, name in enumerate(plan.catalog.train_domains):
        if total[1, d] > 0:
            rec[f"loss/{name}"] = float(total[0, d] / total[1, d])
    rec["lr"] = bundle.scheduler.get_last_lr()[0]
    rec["grad_norm"] = float(out["grad_norm"])
    if out.get("aux_loss") is not None:
        rec["aux_loss"] = float(out["aux_loss"])
    for k, v in out.get("stats", {}).items():
        rec[k] = v.tolist() if isinstance(v, torch.Tensor) else v
    mem = torch.tensor([peak_memory_gb()], device=sums.device)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    rec["peak_mem_gb"] = float(mem)
    rec.update(throughput_record(plan, time.perf_counter() - t0, steps))
    return rec


# ----------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="run YAML (configs/...)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    p.add_argument("--run-dir", help="output directory (default: logging.out_dir)")
    p.add_argument("--resume", default="auto", help="auto (latest checkpoint in the run dir), never, or a checkpoint path")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_run_config(args.config, args.overrides, check=False)
        plan = make_plan(cfg, int(os.environ.get("WORLD_SIZE", "1")), check_local_device=True)
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir or plan.cfg.logging.out_dir)
    try:
        final = train(plan, run_dir, args.resume)
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"run_dir": str(run_dir), **final}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
