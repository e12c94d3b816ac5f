"""Checkpoints: one layout that names domains and experts explicitly.

Two kinds, both directories written atomically (written to `<dir>.tmp-*`, then renamed into place):

* **Consolidated** (`save_consolidated` / `load_consolidated`): what evaluation on one process, adding and
  removing experts, and export read. `model.pt` is the plain (TP=1) GPT state dict with *all* experts,
  `meta.json` holds the run config, the domain names in expert-id order (`domains[i]` is expert `i`'s
  domain), the step and the tokenizer description.
* **Training state** (`save_training_state` / `load_training_state`, see launcher/train.py): per-rank model
  shard and optimizer partition plus data position and RNG, for exact resume on the same layout.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from launcher.config import RunConfig
from launcher.typed import from_dict, to_dict

CONSOLIDATED_FORMAT = "demix-consolidated/1"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, or does not match what is asked of it."""


def atomic_dir(final: Path) -> Path:
    """A fresh temporary sibling directory of `final`; pass it to `commit_dir` when complete."""
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))


def commit_dir(tmp: Path, final: Path) -> None:
    """Replace `final` by `tmp` (a killed writer leaves only a `.tmp-*` directory, never a half checkpoint)."""
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def write_json_atomic(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


@dataclass
class Consolidated:
    """A loaded consolidated checkpoint."""

    cfg: RunConfig
    domains: list[str]
    state_dict: dict[str, torch.Tensor]
    step: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    def build_model(self, expert_ids: Optional[list[int]] = None):
        """A plain GPT holding `expert_ids` (default all) with these weights."""
        from model.gpt import GPT

        rows = self.state_dict["wte.weight"].shape[0] if "wte.weight" in self.state_dict else None
        model = GPT(self.cfg.model, expert_ids=expert_ids, init_seed=0, vocab_rows=rows)  # the writer's padding
        wanted = model.state_dict().keys()
        missing = [k for k in wanted if k not in self.state_dict]
        if missing:
            raise CheckpointError(f"checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}")
        model.load_state_dict({k: self.state_dict[k] for k in wanted})
        return model


def save_consolidated(
    path: str | Path,
    state_dict: dict[str, torch.Tensor],
    cfg: RunConfig,
    domains: list[str],
    step: int = 0,
    extra: Optional[dict[str, Any]] = None,
) -> Path:
    """Write a consolidated checkpoint directory atomically."""
    final = Path(path)
    if cfg.model.ffn.kind == "demix" and len(domains) != cfg.model.ffn.num_experts:
        raise CheckpointError(f"{len(domains)} domain names for {cfg.model.ffn.num_experts} experts")
    tmp = atomic_dir(final)
    torch.save({k: v.detach().cpu().contiguous() for k, v in state_dict.items()}, tmp / "model.pt")
    meta = {
        "format": CONSOLIDATED_FORMAT,
        "step": step,
        "domains": list(domains),
        "experts": {str(i): d for i, d in enumerate(domains)} if cfg.model.ffn.kind == "demix" else {},
        "config": to_dict(cfg),
        **(extra or {}),
    }
    write_json_atomic(tmp / "meta.json", meta)
    commit_dir(tmp, final)
    return final


def load_consolidated(path: str | Path) -> Consolidated:
    """Read a consolidated checkpoint (weights only: safe on files from elsewhere)."""
    root = Path(path)
    if not (root / "meta.json").is_file() or not (root / "model.pt").is_file():
        raise CheckpointError(
            f"{root} is not a consolidated checkpoint (needs meta.json and model.pt); "
            "export one from a training run with `python -m launcher.export RUN_DIR`"
        )
    meta = json.loads((root / "meta.json").read_text())
    if meta.get("format") != CONSOLIDATED_FORMAT:
        raise CheckpointError(f"{root}: format {meta.get('format')!r}, expected {CONSOLIDATED_FORMAT!r}")
    cfg = from_dict(RunConfig, meta["config"], source=str(root / "meta.json"))
    state = torch.load(root / "model.pt", map_location="cpu", weights_only=True)
    return Consolidated(cfg=cfg, domains=list(meta["domains"]), state_dict=state, step=int(meta.get("step", 0)), meta=meta)
