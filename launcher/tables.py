"""The one Markdown table writer of the project's reports (the demo, make bench, the cost model, the experiments)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str = "") -> list[str]:
    """A Markdown table's lines: the header, the rule, then one line per row (each cell as `str` gives it).

    `align` has one letter per column, `l` (the default for a column it does not reach) or `r` (`---:`)."""
    rule = "|" + "".join("---:|" if a == "r" else "---|" for a in align.ljust(len(header), "l"))
    return ["| " + " | ".join(header) + " |", rule] + ["| " + " | ".join(map(str, r)) + " |" for r in rows]
