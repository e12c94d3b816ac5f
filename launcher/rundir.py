"""A run directory is one the launcher made: recognised by its marker, so a launch never replaces a user's files.

`launch --run-dir DIR` writes config.yaml, command.sh and deepspeed_config.json into DIR, and the ranks write
metrics.jsonl, checkpoints/ and model/. `check_run_dir` applies the project's one output rule
(data/cli.py `check_output_dir`) to it before any work: DIR is new or empty, or carries the marker
`demix_run.json` that `mark_run_dir` writes, or is a run directory of a version before the marker (a training
state in checkpoints/, or a metrics.jsonl that starts with the trainer's start record); otherwise any of those
names already there is someone else's file, and the launch is refused. The tokens it reads are never inside it.

Also here, for the launcher and the trainer alike: what a run says when it is interrupted (`interrupted_line`:
where its last checkpoint is and how to resume) and the machine-local cache of DeepSpeed's JIT-built ops that its
ranks share (`use_extensions_dir`: TORCH_EXTENSIONS_DIR defaults to the virtualenv's `torch_extensions`, the one
definition of that default; `op_build_notice`: the line printed before the first, slow, build).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable, Mapping, MutableMapping
from pathlib import Path

from data.atomic import write_json_atomic
from data.cli import check_output_dir

RUN_MARKER = "demix_run.json"
RUN_FORMAT = "demix-run/1"
# What a launch and its ranks write into a run directory.
RUN_FILES = (
    "config.yaml",
    "command.sh",
    "deepspeed_config.json",
    "metrics.jsonl",
    "checkpoints",
    "model",
    "wandb",
    "wandb_run_id",
)


def _older_run_dir(run_dir: Path) -> bool:
    """A run directory written before the marker existed (or by ranks started without the launcher): it holds a
    training state (`checkpoints/latest`, or `checkpoints/step_<n>/meta.json`), or its metrics.jsonl opens with the
    trainer's start record."""
    ckdir = run_dir / "checkpoints"
    if (ckdir / "latest").is_file() or any(ckdir.glob("step_*/meta.json")):
        return True
    try:
        with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
            first = json.loads(f.readline())
    except (OSError, ValueError):
        return False
    return isinstance(first, dict) and first.get("kind") == "start"


def check_run_dir(run_dir: Path, inputs: Iterable[Path] = (), what: str = "--run-dir") -> None:
    """OutputError unless `run_dir` may be written by a launch (see the module); `inputs` (the tokens) may not be
    it or hold it."""
    run_dir = Path(run_dir)
    if not (run_dir / RUN_MARKER).exists() and _older_run_dir(run_dir):
        return
    check_output_dir(run_dir, [RUN_FORMAT], RUN_FILES, inputs=inputs, manifest=RUN_MARKER, what=what)


def mark_run_dir(run_dir: Path) -> None:
    """Write the marker (once) that makes `run_dir` a run directory for later launches and resumes."""
    if not (Path(run_dir) / RUN_MARKER).is_file():
        write_json_atomic(
            Path(run_dir) / RUN_MARKER, {"format": RUN_FORMAT, "created_unix": int(time.time())}
        )


# Set by launcher.launch for the ranks it starts: it reports a Ctrl-C itself (once they have ended), they stay silent.
LAUNCHER_ENV = "DEMIX_LAUNCHER"


def out_dir_override(run_dir: str | None) -> list[str]:
    """The `--set` override that makes a run's config record its actual run directory (`--run-dir`) as
    `logging.out_dir` (none without one): the saved config.yaml and the exported model's config then name where
    the run is, not the config file's default."""
    return [f"logging.out_dir={json.dumps(str(run_dir))}"] if run_dir else []


def interrupted_line(run_dir: Path | None) -> str:
    """One line for a run stopped by Ctrl-C: where its last checkpoint is (or that none was written) and how to
    continue from it."""
    if run_dir is None:
        return "interrupted (before the run directory was known); nothing was written"
    from launcher.checkpoint import CheckpointError
    from launcher.state_discovery import latest_checkpoint

    try:
        ckpt = latest_checkpoint(Path(run_dir))
    except CheckpointError as e:
        return f"interrupted; no intact checkpoint in {run_dir} ({e})"
    if ckpt is None:
        return (
            f"interrupted; no checkpoint was written in {run_dir} yet (train.save_interval): the same command "
            "starts it again from step 0"
        )
    return (
        f"interrupted; the last checkpoint is {ckpt} (step {int(ckpt.name.split('_')[-1])}): run the same "
        "command again (`--resume auto`, the default, with the same --run-dir) to continue from it"
    )


# The op DeepSpeed JIT-builds for CPU ranks (deepspeed/comm/torch.py `build_shm_op`, at the process group's start):
# its shared-memory all-reduce; on GPUs the project builds no op. Its first build took ~100 s on 2 cores.
EXTENSIONS_ENV = "TORCH_EXTENSIONS_DIR"
SHM_OP = "deepspeed_shm_comm"
SHM_OP_BUILD_SECONDS = 100


def default_extensions_dir() -> Path | None:
    """Where JIT-built ops are cached when TORCH_EXTENSIONS_DIR is unset: `torch_extensions` inside the virtual
    environment that runs Python (the project's `.venv/torch_extensions`, which the Makefile exports too): per
    machine and per torch build, never shared. None outside a writable virtualenv (torch's own per-user default,
    ~/.cache/torch_extensions)."""
    prefix = Path(sys.prefix)
    if sys.prefix == sys.base_prefix or not os.access(prefix, os.W_OK):
        return None
    return prefix / "torch_extensions"


def use_extensions_dir(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Set TORCH_EXTENSIONS_DIR in `environ` (default: this process's) to `default_extensions_dir()` unless it
    is set already (an explicit value is kept); returns the value in effect (None: torch's default)."""
    environ = os.environ if environ is None else environ
    if not environ.get(EXTENSIONS_ENV):
        default = default_extensions_dir()
        if default is None:
            return None
        environ[EXTENSIONS_ENV] = str(default)
    return environ[EXTENSIONS_ENV]


def extensions_root(environ: Mapping[str, str] | None = None) -> Path:
    """The folder torch builds JIT ops in, one sub-folder per op: $TORCH_EXTENSIONS_DIR, or torch's default
    (torch/utils/cpp_extension.py `_get_build_directory`: <user cache>/torch_extensions/py<ver>_<accelerator>)."""
    environ = os.environ if environ is None else environ
    if environ.get(EXTENSIONS_ENV):
        return Path(environ[EXTENSIONS_ENV])
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    acc = (
        f"rocm{torch.version.hip.replace('.', '')}"
        if torch.version.hip is not None
        else f"cu{torch.version.cuda.replace('.', '')}"
        if torch.version.cuda is not None
        else "cpu"
    )
    ver = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{ver}_{acc}"


def clear_stale_build_lock(
    environ: Mapping[str, str] | None = None, op: str = SHM_OP, min_age_s: float = 60.0
) -> str | None:
    """Remove the `lock` a killed JIT build left in `op`'s build folder, and say so; None when there is none or a
    build may be under way. torch's FileBaton waits for that file to disappear, with no timeout: one build killed
    by a signal (a preempted job, a killed test) hangs every later run at the process group's start. The lock is
    stale when it is older than `min_age_s` (the builder writes build.ninja and starts ninja within seconds) and
    no process works in the folder (ninja and the compiler run there)."""
    folder = extensions_root(environ) / op
    lock = folder / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    if age < min_age_s or _busy(folder):
        return None
    lock.unlink(missing_ok=True)
    return f"removed {lock}: a build of {op} killed {age:.0f} s ago left it (nothing was building there)"


def _busy(folder: Path) -> bool:
    """Whether a process has its working directory in `folder` (ninja and the compiler during a JIT build)."""
    import psutil

    resolved = str(folder.resolve())
    for proc in psutil.process_iter(["cwd"]):
        cwd = proc.info.get("cwd")
        if cwd and (cwd == resolved or cwd.startswith(resolved + os.sep)):
            return True
    return False


def op_build_notice(
    op: str = SHM_OP, environ: Mapping[str, str] | None = None, seconds: int = SHM_OP_BUILD_SECONDS
) -> str | None:
    """The line to print before DeepSpeed builds `op`, or None when the cache already holds the built library
    (`<root>/<op>/<op>.so`, what torch loads instead of building)."""
    root = extensions_root(environ)
    if (root / op / f"{op}.so").is_file():
        return None
    return f"building DeepSpeed's {op} (first launch only, about {seconds} s; cached in {root})"
