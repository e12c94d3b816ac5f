"""parallel/demix_sync.py's `SYNC_TABLE` as the tests read it: the rows of one run (`sync_rows`) and the table as
the module's docstring prints it (`sync_table`)."""

from __future__ import annotations

from parallel.demix_sync import SYNC_TABLE, SyncRow


def sync_rows(zero: int, kind: str) -> list[SyncRow]:
    """The rows that hold for one run (ZeRO stage, FFN kind)."""
    return [r for r in SYNC_TABLE if zero in r.zero and (r.kinds == ("all",) or kind in r.kinds)]


def sync_table() -> str:
    """`SYNC_TABLE` as the module docstring prints it (tests/parallel/test_demix_sync.py keeps the two equal)."""
    head = ("ZeRO", "kinds", "gradients", "collective", "group", "per step", "where", "scale")
    cells = [head] + [
        (
            "all" if r.zero == (0, 1, 2) else ", ".join(map(str, r.zero)),
            ", ".join(r.kinds),
            r.gradients,
            r.collective,
            r.group,
            r.per_step,
            r.where,
            r.scale,
        )
        for r in SYNC_TABLE
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]

    def line(c: tuple[str, ...]) -> str:
        return "| " + " | ".join(x.ljust(w) for x, w in zip(c, widths)) + " |"

    return "\n".join(
        [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(c) for c in cells[1:]]
    )
