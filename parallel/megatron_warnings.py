"""megatron-core warns "Transformer Engine and Apex are not installed" from each module with a fallback (4 per
process, so 8-24 lines a run): the project uses neither (its tensor-parallel layers and token reader work without
them). Filtered once, at import, by that message only: every other warning, megatron-core's included, still shows.
Imported first by the `parallel` and `launcher` packages (their `__init__`), so every entry point in them (and every
module of theirs that imports megatron-core) has it before megatron-core is imported."""

from __future__ import annotations

import warnings

MESSAGE = "Transformer Engine and Apex are not installed"


def quiet_megatron() -> None:
    """Ignore megatron-core's missing Transformer Engine/Apex UserWarning in this process (idempotent: `warnings`
    keeps one copy of an identical filter)."""
    warnings.filterwarnings("ignore", message=MESSAGE, category=UserWarning)


quiet_megatron()
