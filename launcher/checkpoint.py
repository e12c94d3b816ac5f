"""Checkpoints: one layout that names domains and experts explicitly.

Two kinds, both directories written atomically (written to `<dir>.tmp-*`, then renamed into place):

* **Consolidated** (`save_consolidated` / `load_consolidated`): what evaluation on one process, adding and
  removing experts, and export read: the plain (TP=1) GPT with *all* experts, in shards. `model.pt` holds
  every tensor that is not an expert's; `experts/expert_<id>.pt` holds expert `<id>`'s tensors (DEMix and
  GShard; same names as in the plain model's state dict); `meta.json` holds the run config, the domain names in
  expert-id order (`domains[i]` is expert `i`'s domain), the step, the tokenizer description and the shard index.
  Shards let a distributed export write each expert from the rank that holds it, so no rank ever gathers
  the experts of other domains (at 128 GPUs that would be tens of GB per GPU), and let a run that starts
  from a checkpoint read only the experts it trains. Format 1 (one `model.pt` with everything) still loads.
* **Training state** (`save_training_state` / `load_training_state`, see launcher/state.py): every parameter's
  fp32 master and Adam moments by plain-model name (DeepSpeed's universal layout) plus schedule and RNG, for an
  exact resume on the same layout and a resume on any other; `launcher/zero_to_fp32.py` turns one into this format.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from data.atomic import commit_dir, staged_dir, write_json_atomic
from data.cli import check_output_dir, read_manifest_format
from data.readers import InputFileError, check_shape, read_json_object
from data.tokenizer import sha256_file
from launcher.config import RunConfig
from launcher.ffn_kinds import ffn_kind
from launcher.typed import from_dict, to_dict
from model.gpt import expert_of_key, split_by_expert

CONSOLIDATED_FORMAT = "demix-consolidated/2"
_READABLE_FORMATS = ("demix-consolidated/1", CONSOLIDATED_FORMAT)
SHARED_FILE = "model.pt"
# What readers of a consolidated meta.json index directly (data/readers.py shapes; "?" = optional); the rest of
# `config` is checked by the RunConfig types.
META_SHAPE = {
    "format": str,
    "domains": list,
    "step?": int,
    "shards?": {"experts?": dict},
    "config": {
        "model": {
            "n_layers": int,
            "d_model": int,
            "n_heads": int,
            "seq_len": int,
            "vocab_size": int,
            "ffn": {"kind": str, "num_experts": int},
        },
        "data": {"path": str, "tokenizer": str},
    },
}


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, or does not match what is asked of it."""


@dataclass
class Consolidated:
    """A loaded consolidated checkpoint."""

    cfg: RunConfig
    domains: list[str]
    state_dict: dict[str, torch.Tensor]
    step: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    def build_model(self, expert_ids: list[int] | None = None):
        """A plain GPT holding `expert_ids` (default all) with these weights."""
        from model.gpt import GPT

        rows = self.state_dict["wte.weight"].shape[0] if "wte.weight" in self.state_dict else None
        # the writer's padding
        model = GPT(self.cfg.model, expert_ids=expert_ids, init_seed=0, vocab_rows=rows)
        wanted = model.state_dict().keys()
        missing = [k for k in wanted if k not in self.state_dict]
        if missing:
            raise CheckpointError(
                f"checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}"
            )
        model.load_state_dict({k: self.state_dict[k] for k in wanted})
        return model


def weight_shape_problems(state: dict[str, torch.Tensor], cfg: RunConfig) -> list[str]:
    """What in `state` (a plain-model state dict, all experts or some) disagrees with the shapes `cfg.model`
    gives those tensors, in the model's order: `name: shape [..], the config's [..]`. The embedding may have more
    rows than `model.vocab_size` (a writer's padding), never fewer. The model is built on the meta device (no
    memory, no initialisation)."""
    from model.gpt import GPT

    with torch.device("meta"):
        rows = state["wte.weight"].shape[0] if isinstance(state.get("wte.weight"), torch.Tensor) else None
        model = GPT(cfg.model, init_seed=0, vocab_rows=max(rows or 0, cfg.model.vocab_size) if rows else None)
    out = []
    for name, want in model.state_dict().items():
        have = state.get(name)
        if not isinstance(have, torch.Tensor) or tuple(have.shape) == tuple(want.shape):
            continue
        out.append(f"{name}: shape {list(have.shape)}, the config's {list(want.shape)}")
    if rows is not None and rows < cfg.model.vocab_size:
        out.insert(
            0,
            f"wte.weight: shape [{rows}, {state['wte.weight'].shape[1]}], fewer rows than the config's "
            f"model.vocab_size={cfg.model.vocab_size}",
        )
    return out


def check_weight_shapes(state: dict[str, torch.Tensor], cfg: RunConfig, where: str | Path) -> None:
    """CheckpointError naming the first tensor of `state` whose shape is not the one `cfg` gives it (see
    `weight_shape_problems`): the one check every writer and reader of consolidated weights applies, so a
    parameter file that disagrees with its config is never written, evaluated or exported."""
    problems = weight_shape_problems(state, cfg)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(f"{where}: the weights do not match the config: {problems[0]}{more}")


def load_weights_only(path: Path) -> Any:
    """`torch.load` restricted to tensors and plain containers: a file from elsewhere (a run directory someone
    hands you) cannot run code. The project's only way to read a torch file. CheckpointError names the file
    when it is truncated, not a torch file, or holds anything but weights."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except Exception as e:  # UnpicklingError (a refused object), RuntimeError (truncated zip), EOFError, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{path} cannot be read as weights ({type(e).__name__}: {first[:200]}); it is damaged, "
            "or holds more than tensors and is refused: nothing in it was executed"
        ) from None


def expert_shard_name(expert: int) -> str:
    """Where expert `expert`'s tensors live inside a consolidated checkpoint directory."""
    return f"experts/expert_{expert:04d}.pt"


class _HashingWriter:
    """A file that hashes (sha256) what torch.save writes into it, so a checksum costs no second read."""

    def __init__(self, f: Any) -> None:
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data: Any) -> int:
        self.sha.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def save_hashed(obj: Any, path: Path) -> str:
    """torch.save `obj` to `path`; return the file's sha256 (hex), computed while writing. Through a Python file,
    not the path: torch's C++ writer loses the errno of a failed write ("unexpected pos"), a Python file raises the
    OSError (ENOSPC: data/atomic.py turns it into "no space left on device ...")."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        out = _HashingWriter(f)
        torch.save(obj, out)
    return out.sha.hexdigest()


# While a consolidated checkpoint is built (by several ranks: each expert's shard by its group's first rank), each
# shard's sha256 waits beside it in `<shard>.sha256`; `_write_meta` gathers them into meta.json's "sha256".
SUM_SUFFIX = ".sha256"


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    digest = save_hashed({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, path)
    path.with_name(path.name + SUM_SUFFIX).write_text(digest + "\n")


def verified_file(root: Path, meta: dict[str, Any], rel: str) -> Path:
    """`root/rel` after checking its bytes against the sha256 that `root/meta.json` recorded when the checkpoint
    was written (one read of the file; checkpoints written before checksums were recorded pass unchecked)."""
    path = root / rel
    sums = meta.get("sha256")
    want = sums.get(rel) if isinstance(sums, dict) else None
    if isinstance(want, str) and path.is_file() and sha256_file(path) != want:
        raise CheckpointError(
            f"{path} does not match the sha256 that {root / 'meta.json'} recorded when it was "
            "written: its bytes changed afterwards (a damaged copy or disk); restore it from a copy, "
            "or write the checkpoint again (a run's model/: python -m launcher.zero_to_fp32 RUN_DIR)"
        )
    return path


def write_shared_shard(tmp: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write the non-expert tensors into a checkpoint directory being built (see `finish_consolidated`)."""
    _save_tensors(tmp / SHARED_FILE, tensors)


def write_expert_shard(tmp: Path, expert: int, tensors: dict[str, torch.Tensor]) -> None:
    """Write one DEMix expert's tensors into a checkpoint directory being built."""
    _save_tensors(tmp / expert_shard_name(expert), tensors)


def sharded_experts(cfg: RunConfig) -> int:
    """How many experts a consolidated checkpoint of this config keeps in shards of their own: DEMix's domain
    experts and GShard's experts (one per GPU in training); none for dense and CSE (all in model.pt)."""
    return cfg.model.ffn.num_experts if ffn_kind(cfg).sharded_experts else 0


def _check_domain_names(cfg: RunConfig, domains: list[str]) -> None:
    if ffn_kind(cfg).domain_experts and len(domains) != cfg.model.ffn.num_experts:
        raise CheckpointError(f"{len(domains)} domain names for {cfg.model.ffn.num_experts} experts")


def finish_consolidated(
    tmp: Path,
    final: Path,
    cfg: RunConfig,
    domains: list[str],
    step: int = 0,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Check every shard is there, write meta.json with the shard index, and move `tmp` into place."""
    _write_meta(tmp, final, cfg, domains, step, extra)
    commit_dir(tmp, final)
    return final


def _write_meta(
    tmp: Path, final: Path, cfg: RunConfig, domains: list[str], step: int, extra: dict[str, Any] | None
) -> None:
    """Check every shard of the checkpoint being built in `tmp` is there; write its meta.json with the shard index."""
    _check_domain_names(cfg, domains)
    experts = {str(i): expert_shard_name(i) for i in range(sharded_experts(cfg))}
    missing = [f for f in [SHARED_FILE, *experts.values()] if not (tmp / f).is_file()]
    if missing:
        raise CheckpointError(f"consolidated checkpoint {final} is missing shards {missing}")
    sums = {}
    # a shard copied from another checkpoint has no sum beside it
    for rel in [
        SHARED_FILE,
        *experts.values(),
    ]:
        side = tmp / (rel + SUM_SUFFIX)
        sums[rel] = side.read_text().strip() if side.is_file() else sha256_file(tmp / rel)
        side.unlink(missing_ok=True)
    meta = {
        "format": CONSOLIDATED_FORMAT,
        "step": step,
        "domains": list(domains),
        "experts": {str(i): d for i, d in enumerate(domains)} if ffn_kind(cfg).domain_experts else {},
        "shards": {"shared": SHARED_FILE, "experts": experts},
        "config": to_dict(cfg),
        **(extra or {}),
        "sha256": sums,  # of every shard, checked by every load (`verified_file`)
    }
    write_json_atomic(tmp / "meta.json", meta)


def save_consolidated(
    path: str | Path,
    state_dict: dict[str, torch.Tensor],
    cfg: RunConfig,
    domains: list[str],
    step: int = 0,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write a consolidated checkpoint directory atomically, from a state dict with every tensor: staged beside
    `path` and published whole (data/atomic.py `staged_dir`); a failure (a full disk included) leaves nothing."""
    final = Path(path)
    _check_domain_names(cfg, domains)
    check_weight_shapes(state_dict, cfg, final)
    shared, experts = split_by_expert(state_dict) if sharded_experts(cfg) else (state_dict, {})
    with staged_dir(final, manifest="meta.json") as tmp:
        write_shared_shard(tmp, shared)
        for e, tensors in experts.items():
            write_expert_shard(tmp, e, tensors)
        _write_meta(tmp, final, cfg, domains, step, extra)
    return final


def check_checkpoint_out(
    out: str | Path, inputs: Iterable[str | Path] = (), overwrite: bool = False, flag: str = "--overwrite"
) -> None:
    """Refuse, before any work, an output path for a consolidated checkpoint that would replace something:
    an existing directory that is not a consolidated checkpoint is never replaced; an existing checkpoint,
    an input included, only with `overwrite` (the CLIs' `--overwrite`). A path that cannot become a directory (a
    file, a dangling symbolic link) is refused by the output rule, data/cli.py `check_output_dir`."""
    out = Path(out)
    if not out.is_dir():
        check_output_dir(out, _READABLE_FORMATS, (), manifest="meta.json")
    if not out.exists():
        return
    is_input = any(out.resolve() == Path(i).resolve() for i in inputs)
    if (
        not out.is_dir()
        or not (out / "meta.json").is_file()
        or read_manifest_format(out / "meta.json") not in _READABLE_FORMATS
    ):
        raise CheckpointError(
            f"--out {out} exists and is not a consolidated checkpoint; it is left alone: choose "
            "another output path"
        )
    if not overwrite:
        what = "is the input checkpoint" if is_input else "holds a consolidated checkpoint"
        raise CheckpointError(f"--out {out} {what}; choose another output path, or pass {flag} to replace it")


def read_meta(path: str | Path) -> dict[str, Any]:
    """meta.json of a consolidated checkpoint (config, domains, tokenizer fingerprint), without reading a tensor:
    what CLIs check their other inputs against before the expensive load."""
    return _read_meta(Path(path))


def _read_meta(root: Path) -> dict[str, Any]:
    if not (root / "meta.json").is_file() or not (root / SHARED_FILE).is_file():
        raise CheckpointError(
            f"{root} is not a consolidated checkpoint (needs meta.json and {SHARED_FILE}); a training run writes "
            "one into RUN_DIR/model when it finishes"
        )
    try:
        meta = read_json_object(root / "meta.json", what="consolidated checkpoint metadata")
        if meta.get("format") not in _READABLE_FORMATS:
            raise CheckpointError(
                f"{root}: format {meta.get('format')!r}, expected one of {_READABLE_FORMATS}"
            )
        check_shape(meta, META_SHAPE, root / "meta.json", "consolidated checkpoint metadata")
    except InputFileError as e:
        raise CheckpointError(str(e)) from None
    if not all(isinstance(d, str) for d in meta["domains"]):
        raise CheckpointError(f"{root / 'meta.json'}: domains {meta['domains']!r} are not all names")
    # every reader of meta["config"] sees a complete, type-checked config (defaults filled; errors name the file)
    meta["config"] = to_dict(from_dict(RunConfig, meta["config"], source=str(root / "meta.json")))
    return meta


def load_consolidated(path: str | Path, experts: Iterable[int] | None = None) -> Consolidated:
    """Read a consolidated checkpoint (weights only: safe on files from elsewhere). `experts` limits which
    DEMix experts' shards are read (default all), e.g. the ones a run starting from it trains."""
    root = Path(path)
    meta = _read_meta(root)
    cfg = from_dict(RunConfig, meta["config"], source=str(root / "meta.json"))
    want = None if experts is None else {int(e) for e in experts}
    state = load_weights_only(verified_file(root, meta, SHARED_FILE))
    if want is not None:  # format 1 keeps experts in the shared file
        state = {k: v for k, v in state.items() if expert_of_key(k) is None or expert_of_key(k) in want}
    for e, rel in meta.get("shards", {}).get("experts", {}).items():
        if want is not None and int(e) not in want:
            continue
        if not (root / rel).is_file():
            raise CheckpointError(f"{root}: expert shard {rel} listed in meta.json is missing")
        state.update(load_weights_only(verified_file(root, meta, rel)))
    check_weight_shapes(state, cfg, root)
    return Consolidated(
        cfg=cfg, domains=list(meta["domains"]), state_dict=state, step=int(meta.get("step", 0)), meta=meta
    )


def copy_expert_shards(src: str | Path, experts: Iterable[int], tmp: Path) -> None:
    """Copy experts' shards from checkpoint `src` into a directory being built (format 1: read and rewrite)."""
    root = Path(src)
    meta = _read_meta(root)
    index = meta.get("shards", {}).get("experts", {})
    for e in experts:
        if str(e) in index:
            (tmp / expert_shard_name(e)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(verified_file(root, meta, index[str(e)]), tmp / expert_shard_name(e))
        else:
            _, by_expert = split_by_expert(load_consolidated(root, experts=[e]).state_dict)
            write_expert_shard(tmp, e, by_expert.get(e, {}))
