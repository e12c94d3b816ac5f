"""What a checkpoint derived from another (an expert added or removed, a BTX branch or upcycle) keeps of its
source's metadata: everything but what `save_consolidated` writes itself, i.e. the tokenizer fingerprint, bos/eod
ids, tokens seen and the lineage records of earlier edits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# meta.json keys written by launcher/checkpoint.py save_consolidated itself
SAVED_BY_CHECKPOINT = ("format", "step", "domains", "experts", "shards", "config")


def inherited_meta(meta: dict[str, Any], drop: Sequence[str] = ()) -> dict[str, Any]:
    """`meta` without the keys `save_consolidated` writes and without `drop` (records the new checkpoint replaces)."""
    return {k: v for k, v in meta.items() if k not in SAVED_BY_CHECKPOINT and k not in drop}
