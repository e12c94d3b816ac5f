"""Scoring anonymisation against a labelled set (`python -m data.anonymise --evaluate FILE`): span-level
precision and recall of `find_spans`, or of another copy of data/anonymise.py (`--baseline`)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Mapping

from data.anonymise_pass import Span
from data.anonymise_patterns import CATEGORIES, TOKENS
from data.anonymise_pipeline import find_spans
from data.cli import import_module_file
from data.readers import utf8_lines

SpanLike = Span | tuple[int, int, str]
_TOKEN = re.compile("|".join(re.escape(t) for t in TOKENS.values()))


def load_labelled(path: str | os.PathLike) -> list[dict]:
    """Read a labelled JSONL file: one `{"text": str, "spans": [{"start", "end", "category"}, ...]}` per line.

    Raises ValueError naming `file:line` for a malformed line (not UTF-8, with its byte offset; bad JSON, a span
    outside the text, overlapping spans, an unknown category) and OSError for an unreadable file."""
    records = []
    for n, line in utf8_lines(path):  # decoded one at a time: a non-UTF-8 line is named, with its byte offset
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            r = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{where}: not JSON ({e})") from None
        if (
            not isinstance(r, dict)
            or not isinstance(r.get("text"), str)
            or not isinstance(r.get("spans"), list)
        ):
            raise ValueError(f'{where}: expected {{"text": str, "spans": [...]}}')
        last = 0
        for s in sorted(r["spans"], key=lambda s: s.get("start", -1) if isinstance(s, dict) else -1):
            ok = isinstance(s, dict) and all(type(s.get(k)) is int for k in ("start", "end"))
            if (
                not ok
                or not last <= s["start"] < s["end"] <= len(r["text"])
                or s.get("category") not in TOKENS
            ):
                raise ValueError(
                    f"{where}: bad or overlapping span {s!r} (start < end within the text, "
                    f"category one of {', '.join(CATEGORIES)})"
                )
            last = s["end"]
        records.append(r)
    return records


def spans_from_output(text: str, anonymised: str) -> list[Span]:
    """The input ranges an anonymiser replaced, recovered from its output alone by aligning the text around
    each dummy token (for evaluating another version of this module, which may have no `find_spans`)."""
    parts = _TOKEN.split(anonymised)
    cats = [m.group(0)[1:-1] for m in _TOKEN.finditer(anonymised)]
    if not cats:
        return []
    m = re.fullmatch("(.*?)".join(re.escape(p) for p in parts), text, re.DOTALL)
    if m is None:
        raise ValueError(f"cannot align the anonymised output with its input: {text[:80]!r}")
    return [Span(m.start(i + 1), m.end(i + 1), c) for i, c in enumerate(cats) if m.group(i + 1) != TOKENS[c]]


def _overlaps(a: SpanLike, b: SpanLike) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[2] == b[2]


def evaluate_spans(
    records: Iterable[Mapping],
    find: Callable[[str], Iterable[SpanLike]] = find_spans,
    errors: list[tuple[str, str, str]] | None = None,
) -> dict[str, dict[str, float]]:
    """Span-level precision and recall of `find` against gold spans, per category and `"overall"` (micro).

    A gold span is *found* when some predicted span of the same category overlaps it (shares a character); a
    predicted span is *correct* when it overlaps some gold span of the same category. precision = correct /
    predicted, recall = found / gold (1.0 when the denominator is 0). Each row: gold, found, predicted, correct,
    precision, recall. With `errors`, appends ("missed" | "spurious", category, span text) for each failure."""
    n = {c: [0, 0, 0, 0] for c in CATEGORIES}  # gold, found, predicted, correct
    for r in records:
        text = r["text"]
        gold = [(s["start"], s["end"], s["category"]) for s in r["spans"]]
        pred = [tuple(p) for p in find(text)]
        for g in gold:
            hit = any(_overlaps(g, p) for p in pred)
            n[g[2]][0] += 1
            n[g[2]][1] += hit
            if not hit and errors is not None:
                errors.append(("missed", g[2], text[g[0] : g[1]]))
        for p in pred:
            hit = any(_overlaps(p, g) for g in gold)
            n[p[2]][2] += 1
            n[p[2]][3] += hit
            if not hit and errors is not None:
                errors.append(("spurious", p[2], text[p[0] : p[1]]))
    n["overall"] = [sum(v[i] for v in n.values()) for i in range(4)]
    return {
        c: {
            "gold": g,
            "found": f,
            "predicted": p,
            "correct": k,
            "precision": k / p if p else 1.0,
            "recall": f / g if g else 1.0,
        }
        for c, (g, f, p, k) in n.items()
    }


def format_table(result: Mapping[str, Mapping[str, float]]) -> str:
    """The `evaluate_spans` result as a Markdown table."""
    rows = [
        "| category | gold | found | predicted | correct | precision | recall |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c, v in result.items():
        rows.append(
            f"| {c} | {v['gold']} | {v['found']} | {v['predicted']} | {v['correct']} | "
            f"{v['precision']:.3f} | {v['recall']:.3f} |"
        )
    return "\n".join(rows)


def _load_anonymiser(path: str) -> Callable[[str], str]:
    """`anonymise(text).text` of another copy of this module (e.g. `git show REV:data/anonymise.py > F.py`)."""
    mod = import_module_file(path, "--baseline", "_anonymise_baseline")
    if not callable(getattr(mod, "anonymise", None)):
        raise ValueError(f"--baseline {path}: has no anonymise(text) function")
    return lambda text: mod.anonymise(text).text
