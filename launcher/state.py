"""Training state: per-parameter files for exact resume on any layout, and the distributed consolidated export.

* `save_training_state` / `load_training_state`: every parameter's fp32 master weight and Adam moments, whole
  and by its name in the plain model (DeepSpeed's universal checkpoint layout, `zero/<name>/fp32.pt`, written
  straight from the running engine, each file by one of the ranks holding it, balanced by bytes), plus the
  schedule, loss scaler, buffers and each rank's RNG, in one directory rank 0 publishes atomically
  (`checkpoints/step_<n>`, then the `latest` pointer). Any layout loads
  it: another number of GPUs, domain allocation, ZeRO stage or batch shape (`layout_changes` says what
  changed); `check_resumable` names what cannot change (model, tensor parallelism, domains, tokenizer) before
  any process starts. Loads are weights-only (a run directory may come from someone else).
* `export_consolidated`: the plain single-process model with all experts, in the consolidated format of
  launcher/checkpoint.py, written by the ranks that hold each part (no rank gathers another's experts).
* `load_init_weights`: a new run's weights from a consolidated checkpoint (`train.init_from`).

Which states a run directory holds, whether they are intact, which one a resume uses and pruning:
launcher/state_discovery.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data.atomic import commit_dir, discard_on_failure, write_json_atomic, write_text_atomic
from data.tokenizer import sha256_file
from launcher.checkpoint import (
    CheckpointError,
    copy_expert_shards,
    finish_consolidated,
    load_consolidated,
    load_weights_only,
    save_hashed,
    write_expert_shard,
    write_shared_shard,
)
from launcher.config import ConfigError, RunConfig
from launcher.distributed import training_device
from launcher.ffn_kinds import ffn_kind
from launcher.nonfinite import NonFiniteError
from launcher.plan import Plan
from launcher.state_discovery import TRAINING_FORMAT, prune_checkpoints, read_state_meta, state_damage
from launcher.typed import to_dict
from parallel.universal import (
    FP32,
    MOMENTS,
    ParamStates,
    UniversalStateError,
    assign_writers,
    full_tensor_parallel,
    tensor_parallel_shard,
)


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
        raise ConfigError(
            [
                f"ranks {missing} do not see the run directory {run_dir} that rank 0 writes: put the run "
                "directory on a filesystem shared by every node (checkpoints and the export are written "
                "there by ranks of every node)"
            ],
            "the run directory",
        )


# What a training state must share with the run that resumes it; everything else in `layout_identity` (world
# size, allocation, ZeRO stage, batch shape, precision) may change, since the state is kept per parameter.
MUST_MATCH = ("model", "tensor_parallel", "domains", "expert_domains", "tokenizer", "tokenizer_sha256")


def layout_identity(plan: Plan) -> dict[str, Any]:
    """What a training state records about the run that wrote it (see MUST_MATCH for what must match)."""
    c = plan.cfg
    model = to_dict(c.model)
    # placement, not the model: num_experts (resolved) is
    model["ffn"]["gshard"].pop("experts_per_rank", None)
    return {
        "world_size": plan.topo.world_size,
        "tensor_parallel": plan.topo.tensor_parallel,
        "allocation": list(plan.topo.allocation),
        "zero_stage": c.parallel.zero_stage,
        "micro_batch": c.train.micro_batch,
        "grad_accum": c.train.grad_accum,
        "precision": c.train.precision,
        "global_batch": c.train.micro_batch * c.train.grad_accum * plan.topo.dp_size,
        "domains": list(plan.catalog.train_domains),
        "expert_domains": list(plan.expert_domains),
        "tokenizer": plan.catalog.tokenizer,
        "tokenizer_sha256": plan.catalog.tokenizer_sha256,
        "model": model,
    }


# Each rank's checksums while a state is written (`sha256/rank<r>.json`), gathered into meta.json, then removed.
SUMS_DIR = "sha256"


def check_resumable(ckpt: Path, plan: Plan) -> int:
    """The step to resume from. A CheckpointError naming every difference that cannot carry over (the model,
    tensor parallelism, the domains, the tokenizer) or every missing parameter file; differences that can
    (world size, allocation, ZeRO stage, batch shape, precision) are allowed (see `layout_changes`)."""
    meta = read_state_meta(ckpt)
    if (why := state_damage(ckpt)) is not None:
        raise CheckpointError(
            f"{ckpt} is damaged ({why}); resume from another state (`--resume auto` picks the newest "
            "intact one)"
        )
    want = layout_identity(plan)
    diff = [
        f"{k}: checkpoint {meta['layout'].get(k)!r}, this run {want[k]!r}"
        for k in MUST_MATCH
        if meta["layout"].get(k) != want[k]
    ]
    if diff:
        raise CheckpointError(
            f"{ckpt} was written for another model or data; resume with the same ones, or start a new "
            "run directory (`--resume never`) from its exported model:\n  " + "\n  ".join(diff)
        )
    missing = [n for n in meta.get("params", []) if not (ckpt / "zero" / n / f"{FP32}.pt").is_file()]
    if missing or not meta.get("params"):
        raise CheckpointError(
            f"{ckpt} is incomplete: no parameter files for {missing[:5] or 'any parameter'}"
        )
    return int(meta["step"])


def layout_changes(ckpt: Path, plan: Plan) -> list[str]:
    """One line per setting in which the resuming run differs from the one that wrote `ckpt` (allowed)."""
    old, new = read_state_meta(ckpt)["layout"], layout_identity(plan)
    keys = ("world_size", "allocation", "zero_stage", "micro_batch", "grad_accum", "precision")
    diff = [f"{k} {old.get(k)} -> {new[k]}" for k in keys if old.get(k) != new[k]]
    if not diff:
        return []
    out = [
        f"resuming {ckpt.name} on another layout ({', '.join(diff)}): weights, Adam moments, the learning-rate "
        "schedule and the step carry over exactly; each rank's data continues from that step in this layout's shards"
    ]
    if old.get("global_batch") != new["global_batch"]:
        out.append(
            f"the global batch changes from {old.get('global_batch')} to {new['global_batch']} sequences per "
            "step: keep micro_batch x grad_accum x data-parallel size to continue the same recipe"
        )
    return out


def _rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": _numpy_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


# A file's bytes as the writers are balanced: the tensor, plus what each file costs beyond it (torch.save's zip
# headers, a filesystem's per-file work), so that many small files count for something.
FILE_OVERHEAD_BYTES = 4096
# How many bytes of tensors a rank may hold in host memory waiting for its writer thread.
WRITE_AHEAD_BYTES = 1 << 30


class _BackgroundWrites:
    """`torch.save` on one background thread, so a rank's disk writes overlap the parameter walk's collectives
    (written inline, every rank would wait at the next all-reduce for the writer of the previous parameter, and
    the save would take the sum of all ranks' writes again). At most `budget` bytes of tensors wait in memory
    (`save` first waits for the oldest writes beyond that); leaving the block waits for every write, re-raising
    the first error. `written` maps each path to its size on disk, `digests` to its sha256."""

    def __init__(self, budget: int = WRITE_AHEAD_BYTES) -> None:
        self.budget, self.waiting = budget, 0
        self.pending: deque[tuple[Future, int, Path]] = deque()
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="state-writer")
        self.written: dict[Path, int] = {}
        self.digests: dict[Path, str] = {}

    def save(self, obj: Any, path: Path, nbytes: int) -> None:
        while self.pending and self.waiting + nbytes > self.budget:
            self._finish_oldest()
        self.pending.append((self.pool.submit(save_hashed, obj, path), nbytes, path))
        self.waiting += nbytes

    def _finish_oldest(self) -> None:
        future, nbytes, path = self.pending.popleft()
        self.waiting -= nbytes
        self.digests[path] = future.result()
        self.written[path] = path.stat().st_size

    def __enter__(self) -> _BackgroundWrites:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        try:
            while self.pending and exc_type is None:
                self._finish_oldest()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=exc_type is not None)


def _fingerprint(items: Iterable[Any]) -> int:
    """A 62-bit hash of `items` (their repr, in order): equal on two ranks iff they hold the same files."""
    return int.from_bytes(hashlib.sha256(repr(list(items)).encode()).digest()[:8], "little") >> 2


def _state_files(
    model: torch.nn.Module, names: dict[str, tuple[str, tuple[int, ...]]], states: ParamStates, tp: int
) -> dict[tuple[int, ...], dict[str, int]]:
    """The parameter files this rank's parameters give (`<plain name>/<key>`), with their bytes (fp32, whole: a
    TP shard times tp, plus FILE_OVERHEAD_BYTES per file, exp_avg's step.pt included), grouped by the ranks that
    hold them."""
    out: dict[tuple[int, ...], dict[str, int]] = {}
    for name, p in model.named_parameters():
        plain, holders = names[name]
        numel = p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1)
        for key in states.keys(p):
            extra = FILE_OVERHEAD_BYTES if key == MOMENTS[0] else 0  # step.pt goes with exp_avg
            out.setdefault(tuple(sorted(holders)), {})[f"{plain}/{key}"] = (
                4 * numel + FILE_OVERHEAD_BYTES + extra
            )
    return out


def plan_state_writers(
    files: dict[tuple[int, ...], dict[str, int]], world_size: int, rank: int, device: torch.device
) -> dict[str, int]:
    """Which rank writes each of this rank's parameter files (`_state_files`): the files of a group of ranks that
    alone hold them (a DEMix domain's experts, a GShard expert-data-parallel group's experts) are balanced over
    that group; then the files every rank holds (the shared parameters) over all ranks, starting from each rank's
    bytes of group files, so the totals balance (`assign_writers`: largest first onto the least-loaded rank).

    Computed from names and sizes alone, the same on every rank, with one small collective: an all-reduce of four
    integers per rank (its group-file bytes, and fingerprints of the files it holds, to check that the ranks
    agree; a mismatch raises UniversalStateError on every rank). Collective: every rank calls it."""
    import torch.distributed as dist

    everyone = tuple(range(world_size))
    shared = files.get(everyone, {})
    own = sorted((h, sorted(f.items())) for h, f in files.items() if h != everyone)
    writers: dict[str, int] = {}
    for holders, sizes in own:
        writers.update(assign_writers(dict(sizes), holders))
    mine = sum(size for _, sizes in own for name, size in sizes if writers[name] == rank)
    leader = min((h[0] for h, _ in own), default=-1)
    table = torch.zeros(world_size, 4, dtype=torch.int64, device=device)
    table[rank] = torch.tensor(
        [mine, _fingerprint(sorted(shared.items())), _fingerprint(own), leader], device=device
    )
    dist.all_reduce(table)
    rows = table.tolist()
    disagree = sorted(
        {r for r in everyone if rows[r][1] != rows[0][1]}
        | {r for r in everyone if rows[r][3] >= 0 and rows[r][2] != rows[rows[r][3]][2]}
    )
    if disagree:
        raise UniversalStateError(
            f"ranks {disagree} hold other parameters (names or shapes) than the ranks they "
            "share them with; no training state is written"
        )
    writers.update(assign_writers(shared, everyone, {r: rows[r][0] for r in everyone}))
    return writers


def _write_param_states(
    out: Path, bundle: Any, plan: Plan, rank: int, device: torch.device
) -> tuple[dict[Path, int], dict[Path, str], int]:
    """Every parameter's fp32 master and Adam moments, whole (TP-gathered, data-parallel-unpartitioned), as
    DeepSpeed's universal checkpoint lays them out: `zero/<plain-model name>/{fp32,exp_avg,exp_avg_sq,step}.pt`,
    each `{"param": tensor, "cat_dim": tensor-parallel dimension}` (`step.pt` beside exp_avg). Each file is written
    by one of the ranks holding the parameter (`plan_state_writers`, balanced by bytes); returns what this rank
    wrote (path -> bytes, path -> sha256) and how many of its files hold a NaN or an infinity (counted on the host
    copy while `train.stop_on_nonfinite` is on, launcher/nonfinite.py). Collective: every rank walks its parameters
    in order (ZeRO 1/2's all-reduce and the TP all-gather give every holder the whole tensor, so choosing the writer
    adds no traffic)."""
    model, tp = bundle.engine.module, plan.topo.tensor_parallel
    states = ParamStates(bundle.engine)
    names = ffn_kind(plan.cfg).state_names(model, plan.topo, rank)
    writers = plan_state_writers(_state_files(model, names, states, tp), plan.topo.world_size, rank, device)
    tp_group = bundle.groups.tp_group if tp > 1 else None
    adam_step = states.adam_step()
    check, nonfinite = plan.cfg.train.stop_on_nonfinite, 0
    with _BackgroundWrites() as writes:
        for name, p in model.named_parameters():
            plain = names[name][0]
            cat_dim = int(getattr(p, "partition_dim", 0)) if getattr(p, "tensor_model_parallel", False) else 0
            for key, value in states.get(p).items():
                value = full_tensor_parallel(value, p, tp_group)
                if writers[f"{plain}/{key}"] != rank:
                    continue
                host = value.to(
                    "cpu", copy=True
                ).contiguous()  # its own storage, not a view of the live master
                if check and not bool(torch.isfinite(host).all()):  # a host tensor: no device read
                    nonfinite += 1
                writes.save({"param": host, "cat_dim": cat_dim}, out / plain / f"{key}.pt", host.nbytes)
                if key == MOMENTS[0]:
                    writes.save(torch.tensor(adam_step), out / plain / "step.pt", 8)
    return writes.written, writes.digests, nonfinite


def _write_deepspeed_index(out: Path, bundle: Any, plan: Plan, step: int) -> dict[Path, str]:
    """The two small files that let DeepSpeed's own loader read the state as a universal checkpoint
    (`engine.load_checkpoint(RUN/checkpoints, tag="step_<n>")` with `"checkpoint": {"load_universal": true}`, ZeRO
    1/2, dense and DEMix: their engine parameter names are the plain ones): the model-states file it takes the
    step and schedule from, and `zero/optimizer_state.pt` with the optimizer's hyperparameters. Rank 0 writes them."""
    import deepspeed

    engine, c = bundle.engine, plan.cfg
    groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    optim, index = out / "zero" / "optimizer_state.pt", out / "mp_rank_00_model_states.pt"
    digests = {
        optim: save_hashed(
            {
                "param_groups": groups,
                "ds_version": deepspeed.__version__,
                "dynamic_loss_scale": c.train.precision == "fp16",
                "overflow": False,
                "clip_grad": c.train.clip_grad,
            },
            optim,
        )
    }
    digests[index] = save_hashed(
        {
            "module": {},
            "buffer_names": [],
            "param_shapes": [],
            "ds_version": deepspeed.__version__,
            "dp_world_size": plan.topo.dp_size,
            "mp_world_size": plan.topo.tensor_parallel,
            "global_steps": step,
            "global_samples": step * c.train.micro_batch * c.train.grad_accum * plan.topo.dp_size,
            "skipped_steps": 0,
            "lr_scheduler": bundle.scheduler.state_dict(),
        },
        index,
    )
    return digests


def staged_together(
    step_fn: Callable[[], None], staged: Path, final: Path, rank: int, world: int, device: torch.device
) -> None:
    """Run one rank's part `step_fn` of a collective save into the shared staging folder `staged`, then agree:
    every rank says (an all-reduce of one flag per rank) whether its part failed. On any failure every rank
    removes `staged` (idempotent) and raises (the failing rank its own error, a full disk as DiskFullError naming
    `final`; the others CheckpointError naming the failed ranks), so no staging folder is left and no rank waits
    at a barrier for a rank that gave up. A rank that dies outright (killed, a crash inside a collective) never
    reaches the all-reduce: the launcher ends the job, and the folder it leaves has the staging name
    `.step_<n>.tmp` that the next save of that step replaces."""
    import torch.distributed as dist

    failure: BaseException | None = None
    try:
        # a full disk named as DiskFullError; nothing removed yet: the other ranks may still be writing into
        # `staged`, and removing it under them would turn their writes into FileNotFoundError (below, after all agree)
        with discard_on_failure(final):
            step_fn()
    except Exception as e:  # noqa: BLE001 - reported to every rank, then raised below
        failure = e
    flags = torch.zeros(world, dtype=torch.int64, device=device)
    flags[rank] = int(failure is not None)
    dist.all_reduce(flags)
    failed = [r for r, f in enumerate(flags.tolist()) if f]
    if not failed:
        return
    shutil.rmtree(staged, ignore_errors=True)
    if failure is not None:
        raise failure
    raise CheckpointError(
        f"ranks {failed} could not write {final.name}; it was not saved (nothing staged is left)"
    )


def save_training_state(run_dir: Path, step: int, bundle: Any, plan: Plan, rank: int) -> Path:
    """Write the training state of `step` into `checkpoints/step_<n>`, published atomically by rank 0: per-parameter
    fp32 weights and Adam moments (`_write_param_states`, any layout can load them; the files spread over the
    ranks, meta.json's `param_bytes_by_rank` says how), the schedule, loss scaler and buffers (`trainer.pt`), and
    each rank's RNG (`rng/rank<r>.pt`). Collective. With `train.stop_on_nonfinite` a state any of whose parameter
    files holds a NaN or an infinity is discarded unpublished and NonFiniteError raised on every rank: the `latest`
    pointer keeps naming the last good state and nothing is pruned."""
    import torch.distributed as dist

    device = training_device()
    ckdir = run_dir / "checkpoints"
    final = ckdir / f"step_{step:08d}"
    tmp = ckdir / f".step_{step:08d}.tmp"
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    world = plan.topo.world_size
    written: dict[Path, int] = {}
    digests: dict[Path, str] = {}
    nonfinite = [0]

    def local_files() -> None:  # each rank's parameter files and RNG
        w, dg, nonfinite[0] = _write_param_states(tmp / "zero", bundle, plan, rank, device)
        written.update(w)
        digests.update(dg)
        rng = tmp / "rng" / f"rank{rank:05d}.pt"
        digests[rng] = save_hashed(_rng_state(), rng)

    staged_together(local_files, tmp, final, rank, world, device)
    table = torch.zeros(2, world, dtype=torch.int64, device=device)
    table[0, rank], table[1, rank] = sum(written.values()), nonfinite[0]
    dist.all_reduce(table)  # each rank's parameter-file bytes (for meta.json) and non-finite files
    by_rank, bad = table[0], int(table[1].sum())
    if bad:  # on every rank: the staged state is discarded unpublished (`latest` and pruning untouched)
        shutil.rmtree(tmp, ignore_errors=True)
        raise NonFiniteError(
            step, f"{bad} parameter file(s) of its training state hold NaN or infinite values"
        )

    def shared_files() -> None:  # rank 0's trainer.pt and DeepSpeed index; every rank's checksums
        if rank == 0:
            states, sched, model = ParamStates(bundle.engine), bundle.scheduler, bundle.engine.module
            params = {n for n, _ in model.named_parameters()}
            buffers = {
                k: v.detach().cpu()
                for k, v in model.state_dict().items()
                if k not in params and not k.endswith("_extra_state") and not k.startswith("ds_expert_groups")
            }
            digests[tmp / "trainer.pt"] = save_hashed(
                {
                    "step": step,
                    "adam_step": states.adam_step(),
                    "loss_scaler": states.loss_scaler_state(),
                    "scheduler": {"last_epoch": sched.last_epoch, "step_count": sched._step_count},
                    "buffers": buffers,
                },
                tmp / "trainer.pt",
            )
            digests.update(_write_deepspeed_index(tmp, bundle, plan, step))
        # Each rank's checksums (computed while writing) beside the files; rank 0 gathers them into meta.json.
        write_json_atomic(
            tmp / SUMS_DIR / f"rank{rank:05d}.json", {str(p.relative_to(tmp)): d for p, d in digests.items()}
        )

    staged_together(shared_files, tmp, final, rank, world, device)

    def publish() -> None:
        if rank != 0:
            return
        sums = {}
        for part in sorted((tmp / SUMS_DIR).glob("rank*.json")):
            sums.update(json.loads(part.read_text()))
        shutil.rmtree(tmp / SUMS_DIR)
        params = sorted(str(p.parent.relative_to(tmp / "zero")) for p in (tmp / "zero").rglob(f"{FP32}.pt"))
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        sha256 = {rel: sums.get(rel) or sha256_file(tmp / rel) for rel in files}
        write_json_atomic(
            tmp / "meta.json",
            {
                "format": TRAINING_FORMAT,
                "step": step,
                "layout": layout_identity(plan),
                "params": params,
                "vocab_size": plan.catalog.vocab_size,
                "files": files,
                "sha256": sha256,
                "param_bytes_by_rank": by_rank.tolist(),
                "config": to_dict(plan.cfg),
            },
        )
        commit_dir(tmp, final)
        write_text_atomic(ckdir / "latest", final.name + "\n")
        prune_checkpoints(ckdir, plan.cfg.train.keep_checkpoints)

    staged_together(publish, tmp, final, rank, world, device)  # also the closing barrier
    return final


def _numpy_rng_state() -> tuple:
    """numpy's global RNG state with its key array as a tensor (loadable weights-only)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)


def _restore_rng(ckpt: Path, meta: dict[str, Any], plan: Plan, rank: int, step: int) -> None:
    """This rank's RNG as saved when the layout is the same (an exact resume); otherwise seeded from
    (seed, step, rank), since another layout's ranks are other streams anyway."""
    path = ckpt / "rng" / f"rank{rank:05d}.pt"
    if meta["layout"].get("world_size") != plan.topo.world_size or not path.is_file():
        seed = plan.cfg.train.seed * 1_000_003 + step * 1009 + rank
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        return
    rng = load_weights_only(path)
    torch.set_rng_state(rng["torch"])
    if torch.cuda.is_available() and rng.get("cuda") is not None:  # dropout on the GPU resumes exactly
        torch.cuda.set_rng_state(rng["cuda"])
    random.setstate(rng["python"])
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def _restore_schedule(scheduler: Any, saved: dict[str, int]) -> None:
    """LambdaLR at the saved position, and the optimizer groups' learning rates to match (the number of groups
    may differ from the writer's: a rank holding more experts has more expert groups)."""
    scheduler.last_epoch, scheduler._step_count = int(saved["last_epoch"]), int(saved["step_count"])
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


def load_training_state(ckpt: Path, bundle: Any, plan: Plan, rank: int) -> int:
    """Restore weights, Adam moments, schedule, loss scaler, buffers and RNG from `ckpt` into this rank's engine,
    whatever layout wrote it (each rank reads the parameters it holds); returns the step. Collective."""
    meta = read_state_meta(ckpt)
    trainer = load_weights_only(ckpt / "trainer.pt")
    model, tp, tp_rank = bundle.engine.module, plan.topo.tensor_parallel, plan.topo.rank_info(rank).tp_rank
    states = ParamStates(bundle.engine)
    states.prepare_load(int(trainer["adam_step"]))
    names = ffn_kind(plan.cfg).state_names(model, plan.topo, rank)
    for name, p in model.named_parameters():
        folder = ckpt / "zero" / names[name][0]
        if not (folder / f"{FP32}.pt").is_file():
            raise CheckpointError(
                f"{ckpt} has no state for parameter {names[name][0]!r} (this rank's {name!r})"
            )
        values = {
            k: load_weights_only(folder / f"{k}.pt")["param"]
            for k in (FP32, *MOMENTS)
            if (folder / f"{k}.pt").is_file()
        }
        states.set(p, {k: tensor_parallel_shard(v, p, tp_rank, tp) for k, v in values.items()})
    states.finish_load()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name in trainer["buffers"]:
                buf.copy_(trainer["buffers"][name].to(buf.device, buf.dtype))
    _restore_schedule(bundle.scheduler, trainer["scheduler"])
    states.load_loss_scaler_state(trainer["loss_scaler"])
    step = int(trainer["step"])
    _restore_rng(ckpt, meta, plan, rank, step)
    return step


def load_init_weights(model: torch.nn.Module, cfg: RunConfig) -> None:
    """Copy the weights this (plain, not yet parallelised) model holds from `train.init_from` (reading only
    the expert shards this rank holds)."""
    own = model.state_dict()
    mine = model.expert_parameters().keys() if hasattr(model, "expert_parameters") else None
    state = load_consolidated(cfg.train.init_from, experts=mine).state_dict
    missing = [k for k in own if k not in state]
    if missing:
        raise CheckpointError(
            f"{cfg.train.init_from} lacks {len(missing)} tensors this model needs, e.g. {missing[:3]}"
        )
    wanted = {k: state[k] for k in own}
    rows = own["wte.weight"].shape[0]
    if wanted["wte.weight"].shape[0] != rows:  # another tensor-parallel size pads the vocabulary differently
        have = wanted["wte.weight"]
        n = min(rows, have.shape[0])  # every real token id is below both; only padding rows differ
        wanted["wte.weight"] = torch.cat([have[:n], own["wte.weight"][n:]]) if n < rows else have[:rows]
    model.load_state_dict(wanted)


def export_consolidated(bundle: Any, plan: Plan, rank: int, out: Path, step: int) -> Path | None:
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
    world = plan.topo.world_size

    def shards() -> None:  # the shared tensors (rank 0) and each writer's experts
        shared, experts, writer = kind.export_parts(model, plan.topo, bundle.groups, rank)
        shared = {k: v for k, v in shared.items() if not k.startswith("ds_expert_groups")}
        if writer:
            for e, tensors in experts.items():
                write_expert_shard(tmp, e, tensors)
        if rank == 0:
            write_shared_shard(tmp, shared)
            untrained = (
                sorted(set(range(len(domains))) - set(plan.expert_of_domain)) if kind.domain_experts else []
            )
            if untrained:  # experts of the init checkpoint this run left alone (e.g. DEMix-DAPT)
                copy_expert_shards(plan.cfg.train.init_from, untrained, tmp)

    staged_together(shards, tmp, out, rank, world, training_device())

    def publish() -> None:
        if rank == 0:
            finish_consolidated(
                tmp,
                out,
                plan.cfg,
                domains,
                step,
                extra={
                    "tokenizer": plan.catalog.tokenizer,
                    "vocab_size": plan.catalog.vocab_size,
                    "tokenizer_sha256": plan.catalog.tokenizer_sha256,
                    "bos_id": plan.catalog.bos_id,
                    "eod_id": plan.catalog.eod_id,
                    "train_tokens": step
                    * plan.cfg.train.micro_batch
                    * plan.cfg.train.grad_accum
                    * plan.topo.dp_size
                    * plan.cfg.model.seq_len,
                },
            )

    staged_together(publish, tmp, out, rank, world, training_device())  # also the closing barrier
    return out if rank == 0 else None
