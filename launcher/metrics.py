"""One metrics record per log interval: the source of the JSONL file, the progress bar and wandb.

Only rank 0 writes. wandb is never required: offline by default (files under the run directory), online
only when configured, and any failure to start it is reported once and ignored.

`<run>/metrics.jsonl` holds one JSON object per line, told apart by `kind` (written by launcher/train.py):

* `start` - at every (re)start: `step` (the first to run), `world_size` (ranks), `device`, `topology`, `notes`,
  `resumed_from`.
* `train` - every `logging.log_interval` steps and at the last: `step`, `loss` (mean token loss over every rank's
  scored tokens of the interval), `loss/<domain>`, `lr`, `grad_norm`, `aux_loss` (GShard), routing statistics,
  `peak_mem_gb` (max over ranks), `comm/<group>/<op>/{bytes,calls,seconds}` per update, and the interval's speed:
  `step_time_s` (seconds per optimizer update), `tokens_per_s` - GLOBAL: the tokens of the whole global batch
  (micro_batch x grad_accum x data-parallel ranks x seq_len) per second, all ranks together - and
  `tokens_per_s_per_gpu` = `tokens_per_s` / `world_size` (of the latest `start` record; added here, by
  `with_per_gpu_rate`), `tflops_per_gpu` (FLOPs the hardware executes, recompute included, per rank),
  `tflops_per_gpu_recompute` / `tflops_per_gpu_no_recompute` (model FLOPs in the two conventions, per rank),
  `mfu` / `hfu` (null where the device's peak is unknown, e.g. the CPU). "Per GPU" means per rank.
* `eval` - `val_loss/<domain>` and `val_ppl/<domain>` at `train.eval_interval` and at the end.
* the FFN kind's own records (e.g. `cse`: clustering events).

Every record also has `time` (Unix seconds). `python -m launcher.report` summarises run directories from it.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from data.atomic import write_text_atomic
from launcher.config import RunConfig
from launcher.typed import to_dict


def peak_memory_gb() -> float:
    """Peak accelerator memory on this rank, or the process's peak RSS on CPU, in GB."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # ru_maxrss is KiB on Linux


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


class MetricsLogger:
    """Writes `metrics.jsonl` (one JSON object per line), drives a tqdm bar, mirrors to wandb."""

    def __init__(
        self, run_dir: Path, cfg: RunConfig, is_main: bool, total_steps: int, start_step: int = 0
    ) -> None:
        self.is_main = is_main
        self.world_size: int | None = None  # from the latest `start` record (`with_per_gpu_rate`)
        self.path = run_dir / "metrics.jsonl"
        self.bar = None
        self.wandb = None
        if not is_main:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if start_step > 0:  # a resume: the steps after the checkpoint are run again
            drop_replayed_records(self.path, start_step)
        self.file = open(self.path, "a", buffering=1)
        if cfg.logging.progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_steps, initial=start_step, desc="train", dynamic_ncols=True, file=sys.stderr
            )
        if cfg.logging.wandb_mode != "disabled":
            self.wandb = _start_wandb(run_dir, cfg)

    def log(self, record: dict[str, Any]) -> None:
        if not self.is_main:
            return
        if record.get("kind") == "start" and isinstance(record.get("world_size"), int):
            self.world_size = record["world_size"]
        record = with_per_gpu_rate({k: _jsonable(v) for k, v in record.items()}, self.world_size)
        record.setdefault("time", time.time())
        self.file.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            try:
                self.wandb.log(
                    {k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record.get("step")
                )
            except Exception as e:  # never let logging kill a run
                print(f"[metrics] wandb.log failed, disabling wandb: {e}", file=sys.stderr)
                self.wandb = None

    def progress(self, step: int, record: dict[str, Any]) -> None:
        if self.bar is None:
            return
        self.bar.n = step
        post = {"loss": f"{record.get('loss', float('nan')):.3f}"}
        if record.get("tokens_per_s"):
            post["tok/s"] = f"{record['tokens_per_s']:.0f}"
        if record.get("tflops_per_gpu"):
            post["TFLOP/s/gpu"] = f"{record['tflops_per_gpu']:.3g}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if not self.is_main:
            return
        if self.bar is not None:
            self.bar.close()
        self.file.close()
        if self.wandb is not None:
            try:
                self.wandb.finish()
            except Exception:
                pass


def with_per_gpu_rate(record: dict[str, Any], world_size: int | None) -> dict[str, Any]:
    """`record` with `tokens_per_s_per_gpu` (= the global `tokens_per_s` / `world_size`) right after
    `tokens_per_s`; unchanged without a world size, without a numeric `tokens_per_s`, or when it has one already."""
    tps = record.get("tokens_per_s")
    if (
        not world_size
        or isinstance(tps, bool)
        or not isinstance(tps, (int, float))
        or "tokens_per_s_per_gpu" in record
    ):
        return record
    out: dict[str, Any] = {}
    for k, v in record.items():
        out[k] = v
        if k == "tokens_per_s":
            out["tokens_per_s_per_gpu"] = v / world_size
    return out


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def drop_replayed_records(path: Path, start_step: int) -> int:
    """Before a run resumes at `start_step`, remove the records of later steps (written after the checkpoint by
    the run that died), so the file holds one record per step; `start` records stay. Atomic. Returns the count
    dropped."""
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    keep = []
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by the kill
        if rec.get("kind") == "start" or not isinstance(rec.get("step"), int) or rec["step"] <= start_step:
            keep.append(line)
    if len(keep) != len(lines):
        write_text_atomic(path, "".join(line + "\n" for line in keep))
    return len(lines) - len(keep)


WANDB_ID_FILE = "wandb_run_id"


def _start_wandb(run_dir: Path, cfg: RunConfig) -> Any | None:
    """Start (or, in a run directory that has one, continue) the run's wandb run: the id is kept in
    `run_dir/wandb_run_id`, so a resumed training run logs into the same wandb run."""
    try:
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        id_file = run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        run = wandb.init(
            project=cfg.logging.wandb_project,
            entity=cfg.logging.wandb_entity,
            group=cfg.logging.wandb_group,
            tags=list(cfg.logging.wandb_tags) or None,
            mode=cfg.logging.wandb_mode,
            dir=str(run_dir),
            config=to_dict(cfg),
            name=run_dir.name,
            id=run_id,
            resume="allow",
            reinit=True,
        )
        if not id_file.is_file():
            write_text_atomic(id_file, run_id + "\n")
        return run
    except Exception as e:
        print(f"[metrics] wandb could not start ({e}); continuing without it", file=sys.stderr)
        return None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
