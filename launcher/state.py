"""Training state: per-rank shards for exact resume, and the distributed consolidated export.

* `save_training_state` / `load_training_state`: each rank's model shard, optimizer partition, scheduler and
  RNG states (torch, CUDA, Python, numpy), written into one directory that rank 0 publishes atomically
  (`checkpoints/step_<n>`, then the `latest` pointer). `check_resumable` names every layout difference
  before any process starts; loads are weights-only (a run directory may come from someone else).
* `export_consolidated`: the plain single-process model with all experts, in the consolidated format of
  launcher/checkpoint.py, written by the ranks that hold each part (no rank gathers another's experts).
* `load_init_weights`: a new run's weights from a consolidated checkpoint (`train.init_from`).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from data.atomic import atomic_path, commit_dir, write_json_atomic, write_text_atomic
from launcher.checkpoint import (CheckpointError, copy_expert_shards, finish_consolidated, load_consolidated,
                                 write_expert_shard, write_shared_shard)
from launcher.config import ConfigError, RunConfig
from launcher.ffn_kinds import ffn_kind
from launcher.plan import Plan
from launcher.typed import to_dict


def check_shared_run_dir(run_dir: Path, rank: int, world_size: int, device: torch.device) -> None:
    """Every rank must see the run directory rank 0 writes: training-state shards go into a directory rank 0
    creates and the export's expert shards into rank 0's export directory. Checked once at start-up (rank 0
    writes a random token, every rank reads it back), so a node without the shared filesystem stops the run
    before training with the ranks that cannot see it named, instead of failing at the first checkpoint.
    Collective: every rank calls it."""
    import torch.distributed as dist

    fresh = int.from_bytes(os.urandom(7), "little") if rank == 0 else 0  # never a stale file's token
    token = torch.tensor([fresh], dtype=torch.int64, device=device)
    dist.broadcast(token, 0)
    path = run_dir / ".shared_fs_check"
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, str(int(token)))
    dist.barrier()
    try:
        seen = path.read_text().strip() == str(int(token))
    except OSError:
        seen = False
    blind = torch.zeros(world_size, dtype=torch.int64, device=device)
    blind[rank] = 0 if seen else 1
    dist.all_reduce(blind)
    missing = [r for r, b in enumerate(blind.tolist()) if b]
    if missing:
        raise ConfigError([f"ranks {missing} do not see the run directory {run_dir} that rank 0 writes: put the run "
                           "directory on a filesystem shared by every node (checkpoints and the export are written "
                           "there by ranks of every node)"], "the run directory")


def layout_identity(plan: Plan) -> dict[str, Any]:
    """What must match for a training-state checkpoint to resume."""
    c = plan.cfg
    return {"world_size": plan.topo.world_size, "tensor_parallel": plan.topo.tensor_parallel,
            "allocation": list(plan.topo.allocation), "ffn": c.model.ffn.kind, "num_experts": c.model.ffn.num_experts,
            "zero_stage": c.parallel.zero_stage, "micro_batch": c.train.micro_batch, "grad_accum": c.train.grad_accum,
            "domains": list(plan.catalog.train_domains), "model": [c.model.n_layers, c.model.d_model, c.model.seq_len]}


STEP_DIR = re.compile(r"step_\d{8}")


def complete_states(ckdir: Path) -> list[Path]:
    """The complete training states in `ckdir` (well-formed `step_<8 digits>` names with meta.json), oldest first."""
    return sorted(p for p in ckdir.glob("step_*") if STEP_DIR.fullmatch(p.name) and (p / "meta.json").is_file())


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    """The training state to resume from: the one `checkpoints/latest` names, if that is a well-formed name of a
    complete state in this directory; otherwise (a damaged pointer, or one naming a deleted or incomplete state)
    the newest complete state, with a warning, so a resume never restarts from step 0 over newer checkpoints.
    The pointer's contents never become a path unless they match `step_<8 digits>`."""
    ckdir = run_dir / "checkpoints"
    ptr = ckdir / "latest"
    complete = complete_states(ckdir)
    if ptr.is_file():
        name = ptr.read_text().strip()
        if STEP_DIR.fullmatch(name) and (ckdir / name) in complete:
            return ckdir / name
        if complete:
            print(f"warning: {ptr} names {name[:80]!r}, not a complete training state here; resuming from the newest "
                  f"complete one, {complete[-1].name}", file=sys.stderr)
    return complete[-1] if complete else None


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
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    state = {"model": bundle.engine.module.state_dict(), "optimizer": bundle.engine.optimizer.state_dict(),
             "scheduler": bundle.scheduler.state_dict(), "step": step,
             "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": _numpy_rng_state(),
                     "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}}
    with atomic_path(tmp / f"rank{rank:05d}.pt") as part:
        torch.save(state, part)
    dist.barrier()
    if rank == 0:
        write_json_atomic(tmp / "meta.json", {"step": step, "layout": layout_identity(plan), "config": to_dict(plan.cfg)})
        commit_dir(tmp, final)
        write_text_atomic(ckdir / "latest", final.name + "\n")
        prune_checkpoints(ckdir, plan.cfg.train.keep_checkpoints)
    dist.barrier()
    return final


def prune_checkpoints(ckdir: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete training states (0: keep all); never the one `latest` names.
    Returns what was deleted. Called by rank 0 after the `latest` pointer moved, so a crash here loses nothing."""
    if keep <= 0:
        return []
    latest = (ckdir / "latest").read_text().strip() if (ckdir / "latest").is_file() else None
    done = complete_states(ckdir)
    old = [p for p in done[:-keep] if p.name != latest]
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return old


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
    """Restore this rank's model, optimizer, scheduler and RNG states from `ckpt`; returns its step."""
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



def load_init_weights(model: torch.nn.Module, cfg: RunConfig) -> None:
    """Copy the weights this (plain, not yet parallelised) model holds from `train.init_from` (reading only
    the expert shards this rank holds)."""
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



def export_consolidated(bundle: Any, plan: Plan, rank: int, out: Path, step: int) -> Optional[Path]:
    """The plain, single-process model with all experts, written as a sharded consolidated checkpoint.

    Every rank calls it. Tensor-parallel shards are gathered inside each TP group; rank 0 writes the shared
    tensors; the first rank of each DEMix domain group (tp rank 0), or of each GShard expert-data-parallel
    group, writes its own experts' shards. No rank ever receives another rank's expert, so per-GPU memory
    stays at the rank's own weights (at 128 GPUs, gathering all experts everywhere would need tens of GB per
    GPU). Experts of a `train.init_from` checkpoint that this run does not train are copied over from it.
    Assumes a filesystem shared by all ranks."""
    import torch.distributed as dist

    model = bundle.engine.module
    kind = ffn_kind(plan.cfg)
    tmp = out.parent / f".{out.name}.tmp-export"
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    domains = list(plan.expert_domains or plan.catalog.train_domains)
    shared, experts, writer = kind.export_parts(model, plan.topo, bundle.groups, rank)
    shared = {k: v for k, v in shared.items() if not k.startswith("ds_expert_groups")}
    if writer:
        for e, tensors in experts.items():
            write_expert_shard(tmp, e, tensors)
    if rank == 0:
        write_shared_shard(tmp, shared)
        untrained = sorted(set(range(len(domains))) - set(plan.expert_of_domain)) if kind.domain_experts else []
        if untrained:  # experts of the init checkpoint this run left alone (e.g. DEMix-DAPT)
            copy_expert_shards(plan.cfg.train.init_from, untrained, tmp)
    del shared, experts
    dist.barrier()
    if rank == 0:
        finish_consolidated(tmp, out, plan.cfg, domains, step,
                            extra={"tokenizer": plan.catalog.tokenizer, "vocab_size": plan.catalog.vocab_size})
    dist.barrier()
    return out if rank == 0 else None
