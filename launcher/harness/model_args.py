"""The model_args of lm-eval's model `demix` (docs/harness.md), checked against the checkpoint's meta.json before a
tensor is read: `parse_model_args` gives them as one `DemixArgs`, every refusal a ValueError naming the argument."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from data.argtypes import positive_int, unit_left_open
from launcher.checkpoint import read_meta
from launcher.ffn_kinds import ffn_kind
from launcher.harness.windows import WINDOWS
from model import mixture as mx

MODES: tuple[str, ...] = ("cached", "updating", "uniform", "naive", "average")
KNOWN = (
    "checkpoint, data, mode, posterior, cached_estimator, cached_blocks, decay, expert, topk, exclude_experts, "
    "batch_size, windows, dev_split, max_gen_toks"
)


@dataclass(frozen=True)
class DemixArgs:
    """The checked model_args (`exclude`: the experts never read; `batch_size`: windows per batched pass)."""

    checkpoint: str
    data: str | None
    mode: str | None
    posterior: str
    cached_estimator: str
    cached_blocks: int
    decay: float
    expert: str | None
    topk: int
    exclude: list[str]
    batch_size: int
    windows: str
    dev_split: str
    max_gen_toks: int


def say(*a: Any) -> None:
    print("[demix-harness]", *a, file=sys.stderr, flush=True)


def expert_names(value: Any) -> list[str]:
    """`a;b` (model_args cannot hold commas), a list, or None -> names."""
    if value is None or value == "":
        return []
    if isinstance(value, (list, tuple)):
        return [str(v).strip() for v in value if str(v).strip()]
    return [v.strip() for v in str(value).split(";") if v.strip()]


def batch_size_arg(value: Any) -> int:
    """lm-eval passes an int, a numeric string, or 'auto' / 'auto:N' (taken as the default 4)."""
    if value is None or (isinstance(value, str) and value.startswith("auto")):
        return 4
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"demix model_args: batch_size={value!r} is not a number") from None
    if n < 1:
        raise ValueError(f"demix model_args: batch_size={n}: must be >= 1")
    return n


def parse_model_args(
    checkpoint: str,
    data: str | None = None,
    mode: str | None = None,
    posterior: str = "prefix",
    cached_estimator: str = "mean",
    cached_blocks: Any = mx.CACHED_PRIOR_BLOCKS,
    decay: Any = mx.UPDATING_DECAY,
    expert: str | None = None,
    topk: Any = 0,
    exclude_experts: Any = None,
    batch_size: Any = 4,
    windows: str = "blocks",
    dev_split: str = "valid",
    max_gen_toks: Any = 256,
    device: str | None = None,
    **unknown: Any,
) -> DemixArgs:
    """The model_args of `DemixLM`, checked in this order: names, the checkpoint (meta.json only), the excluded
    experts, the choices, one expert, top-k, the numbers; a mode without meaning for a dense model and lm-eval's
    --device are noted on stderr and ignored."""
    if unknown:
        raise ValueError(f"demix model_args: unknown {', '.join(sorted(unknown))}; known: {KNOWN}")
    if not checkpoint:
        raise ValueError("demix model_args: checkpoint=DIR (a consolidated checkpoint) is required")
    meta = read_meta(checkpoint)  # everything below is checked before a tensor is read
    kind = meta["config"]["model"]["ffn"]["kind"]
    is_demix = ffn_kind(kind).domain_experts
    if meta["config"].get("data", {}).get("mixture") == "domain_token":
        raise ValueError(
            f"{checkpoint}: a +Domain-Token model reads a domain token before every document; "
            "the harness model does not support it"
        )
    exclude = expert_names(exclude_experts)
    kept = _kept_experts(checkpoint, kind, is_demix, list(meta["domains"]), exclude)
    _check_choices(mode, posterior, cached_estimator, windows)
    if expert is not None:
        _check_expert(checkpoint, kind, is_demix, expert, kept, exclude, mode)
    if not is_demix and mode not in (None, "naive"):
        say(f"{checkpoint} is a {kind} checkpoint: mode={mode} ignored (one model, no mixture)")
    topk = int(topk or 0)
    if topk < 0 or (topk and (not is_demix or expert is not None or (mode or "cached") != "cached")):
        raise ValueError(
            f"demix model_args: topk={topk}: top-k mixes the experts of highest cached prior; "
            "it needs a DEMix checkpoint, mode=cached and no expert"
        )
    cached_blocks = positive_int.parse(cached_blocks, "demix model_args: cached_blocks")
    decay = unit_left_open.parse(decay, "demix model_args: decay")
    max_gen_toks = positive_int.parse(max_gen_toks, "demix model_args: max_gen_toks")
    if device not in (None, "cpu"):
        say(
            f"device={device} ignored: the project's evaluation functions build their inputs on the CPU, "
            "so the model runs there"
        )
    return DemixArgs(
        checkpoint=str(checkpoint),
        data=data,
        mode=mode,
        posterior=posterior,
        cached_estimator=cached_estimator,
        cached_blocks=int(cached_blocks),
        decay=float(decay),
        expert=None if expert is None else str(expert),
        topk=topk,
        exclude=exclude,
        batch_size=batch_size_arg(batch_size),
        windows=windows,
        dev_split=dev_split,
        max_gen_toks=int(max_gen_toks),
    )


def _kept_experts(
    checkpoint: str, kind: str, is_demix: bool, domains: list[str], exclude: list[str]
) -> list[str]:
    """The experts left once `exclude` is taken out (refused: excluding from a dense model, a name that is no
    expert, or every expert)."""
    if exclude and not is_demix:
        raise ValueError(
            f"demix model_args: exclude_experts={';'.join(exclude)}: {checkpoint} is a {kind} "
            "checkpoint, it has no experts"
        )
    unknown_ex = [e for e in exclude if e not in domains]
    if unknown_ex:
        raise ValueError(
            f"demix model_args: exclude_experts {unknown_ex} are not experts of {checkpoint}; "
            f"experts: {', '.join(domains)}"
        )
    kept = [d for d in domains if d not in exclude]
    if is_demix and not kept:
        raise ValueError(f"demix model_args: excluding {exclude} leaves no expert")
    return kept


def _check_choices(mode: str | None, posterior: str, cached_estimator: str, windows: str) -> None:
    if mode is not None and mode not in MODES:
        raise ValueError(f"demix model_args: mode={mode!r}: choose one of {', '.join(MODES)}")
    if posterior not in mx.POSTERIORS:
        raise ValueError(
            f"demix model_args: posterior={posterior!r}: choose one of {', '.join(mx.POSTERIORS)}"
        )
    if cached_estimator not in mx.CACHED_ESTIMATORS:
        raise ValueError(
            f"demix model_args: cached_estimator={cached_estimator!r}: choose one of "
            f"{', '.join(mx.CACHED_ESTIMATORS)}"
        )
    if windows not in WINDOWS:
        raise ValueError(f"demix model_args: windows={windows!r}: choose one of {', '.join(WINDOWS)}")


def _check_expert(
    checkpoint: str,
    kind: str,
    is_demix: bool,
    expert: Any,
    kept: list[str],
    exclude: list[str],
    mode: str | None,
) -> None:
    """expert=NAME: a kept expert of a DEMix checkpoint, without a mode."""
    if not is_demix:
        raise ValueError(
            f"demix model_args: expert={expert}: {checkpoint} is a {kind} checkpoint, it has no experts"
        )
    if str(expert) not in kept:
        raise ValueError(
            f"demix model_args: expert={expert!r} is not an expert of {checkpoint}"
            + (" (excluded)" if str(expert) in exclude else "")
            + f"; experts: {', '.join(kept)}"
        )
    if mode is not None:
        raise ValueError(
            f"demix model_args: give expert=NAME (one expert) or mode={mode} (a mixture), not both"
        )
