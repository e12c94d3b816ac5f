"""Finding the training states in a run directory: which are complete (`complete_states`), which are damaged
(`state_damage`: sizes; `checksum_damage` and, across ranks, `verified_state`: sha256 checksums), which one a resume
uses (`resume_candidates`, `latest_checkpoint`), their meta.json (`read_state_meta`), and pruning old ones
(`prune_checkpoints`). Reads files and meta.json only, never a tensor; launcher/state.py writes and loads the states."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from data.readers import InputFileError, check_shape, read_json_object
from data.tokenizer import sha256_file
from launcher.checkpoint import CheckpointError
from parallel.universal import assign_writers

# meta.json's `format` of the training states launcher/state.py writes
TRAINING_FORMAT = "demix-training/2"
# A training state's folder name in RUN/checkpoints (the `latest` pointer holds one)
STEP_DIR = re.compile(r"step_\d{8}")


def complete_states(ckdir: Path) -> list[Path]:
    """The complete training states in `ckdir` (well-formed `step_<8 digits>` names with meta.json), oldest first."""
    return sorted(
        p for p in ckdir.glob("step_*") if STEP_DIR.fullmatch(p.name) and (p / "meta.json").is_file()
    )


def state_damage(ckpt: Path) -> str | None:
    """Why the training state `ckpt` cannot be resumed from (unreadable meta.json, another format, a file
    missing or of another size than when it was written: a truncated copy, a full disk), or None when intact.
    Cheap: sizes only (meta.json's `files`), no tensor is read."""
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
    except (OSError, ValueError) as e:
        return f"meta.json unreadable ({e})"
    if not isinstance(meta, dict):
        return "meta.json is not an object"
    if meta.get("format") != TRAINING_FORMAT:
        return None  # another format: not damaged; `read_state_meta` says how to continue from it
    files = meta.get("files")
    if not isinstance(files, dict) or not files:
        return "meta.json lists no files"
    for rel, size in files.items():
        path = ckpt / rel
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            return f"meta.json names a file outside the state: {rel[:80]!r}"
        if not path.is_file():
            return f"{rel} is missing"
        if path.stat().st_size != size:
            return f"{rel} has {path.stat().st_size} bytes, {size} when written"
    return None


def checksum_damage(ckpt: Path, rank: int = 0, world_size: int = 1) -> str | None:
    """Why `ckpt`'s files fail the sha256 checksums meta.json recorded when they were written (bytes changed in
    place at the same size, which `state_damage` cannot see), or None. Reads the files: with `world_size` > 1 only
    this rank's share of them (balanced by bytes, `assign_writers`), so that the ranks split the work
    (`verified_state`). A state written before checksums were recorded passes. Call after `state_damage`."""
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
        files, sums = meta["files"], meta.get("sha256")
    except (OSError, ValueError, TypeError, KeyError) as e:
        return f"meta.json unreadable ({e})"
    if sums is None:
        return None
    if not isinstance(sums, dict) or not isinstance(files, dict):
        return "meta.json's sha256 or files is not an object"
    share = assign_writers({rel: int(size) for rel, size in files.items()}, range(world_size))
    for rel in sorted(files):
        if share[rel] != rank:
            continue
        if not isinstance(sums.get(rel), str):
            return f"meta.json records no checksum for {rel}"
        if sha256_file(ckpt / rel) != sums[rel]:
            return f"{rel} does not match its checksum: its bytes changed after it was written"
    return None


def resume_candidates(run_dir: Path, checksums: bool = False) -> list[Path]:
    """The training states a resume may use, preferred first: the one `checkpoints/latest` names, if that is a
    well-formed name of an intact state in this directory; otherwise (a damaged pointer, or one naming a deleted,
    incomplete or damaged state, see `state_damage`) the newest intact state, with a warning, so a resume never
    restarts from step 0 over newer checkpoints; then the other intact states, newest first (the fall-backs when
    the first fails its checksums, `verified_state`). `checksums=True` also reads every file (`checksum_damage`,
    one process). If states exist but none is intact, a CheckpointError says so (nothing is overwritten). The
    pointer's contents never become a path unless they match `step_<8 digits>`."""
    ckdir = run_dir / "checkpoints"
    ptr = ckdir / "latest"
    complete = complete_states(ckdir)
    damage = {p: state_damage(p) or (checksum_damage(p) if checksums else None) for p in complete}
    for p, why in damage.items():
        if why:
            print(f"warning: training state {p} is damaged ({why}); skipped", file=sys.stderr)
    intact = [p for p in complete if not damage[p]]
    if complete and not intact:
        raise CheckpointError(
            f"no intact training state in {ckdir} (all {len(complete)} damaged, see the warnings); "
            "restore them, or start a new run directory"
        )
    newest_first = intact[::-1]
    if ptr.is_file():
        name = ptr.read_text(errors="replace").strip()
        if STEP_DIR.fullmatch(name) and (ckdir / name) in intact:
            return [ckdir / name] + [p for p in newest_first if p != ckdir / name]
        if intact:
            print(
                f"warning: {ptr} names {name[:80]!r}, not an intact training state here; resuming from the newest "
                f"intact one, {intact[-1].name}",
                file=sys.stderr,
            )
    return newest_first


def latest_checkpoint(run_dir: Path, checksums: bool = False) -> Path | None:
    """The training state to resume from (the first of `resume_candidates`), or None when there is none."""
    candidates = resume_candidates(run_dir, checksums)
    return candidates[0] if candidates else None


def verified_state(candidates: list[Path], rank: int, world_size: int, device: torch.device) -> Path | None:
    """The first of `candidates` whose every file matches its recorded checksum, read by all ranks together (each
    its share, `checksum_damage`), or None. A damaged one is skipped with a warning naming the file. Collective:
    every rank calls it with the same candidates and gets the same answer (one all-reduce per candidate tried)."""
    import torch.distributed as dist

    for ckpt in candidates:
        why = checksum_damage(ckpt, rank, world_size)
        flag = torch.tensor([0 if why is None else 1], dtype=torch.int64, device=device)
        dist.all_reduce(flag)
        if why is not None:
            print(f"warning: training state {ckpt} is damaged ({why}); skipped", file=sys.stderr)
        if int(flag.item()) == 0:  # setup, not the step: a host read is fine here
            return ckpt
    return None


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


STATE_META_SHAPE = {"format": str, "step": int, "layout": dict, "params": list, "files": dict, "config": dict}


def read_state_meta(ckpt: Path) -> dict[str, Any]:
    """meta.json of a training state; CheckpointError when it is missing, unreadable or of another format."""
    if not (ckpt / "meta.json").is_file():
        raise CheckpointError(
            f"{ckpt} is not a training state (no meta.json); give RUN/checkpoints/step_N or a run directory"
        )
    try:
        meta = read_json_object(ckpt / "meta.json", what="training state metadata")
        if meta.get("format") != TRAINING_FORMAT:
            raise CheckpointError(
                f"{ckpt} is a training state of an older format (one file per rank); resume it with "
                "the version that wrote it, or start a new run directory from its exported model "
                "(`--set train.init_from=RUN/model`)"
            )
        check_shape(meta, STATE_META_SHAPE, ckpt / "meta.json", "training state metadata")
    except InputFileError as e:
        raise CheckpointError(str(e)) from None
    return meta
