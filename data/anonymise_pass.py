"""One anonymisation pass (data/anonymise.py): the partly anonymised text, where each replacement goes, and, for
`find_spans`, the range of the input behind every dummy token."""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable, Iterable
from typing import NamedTuple

from data.anonymise_patterns import TOKENS
from data.anonymise_prescreen import _Shape


class Span(NamedTuple):
    """One replaced range of the *input* text, `text[start:end]`, and its category."""

    start: int
    end: int
    category: str


class _Pass:
    """One anonymisation pass: the partly anonymised text and per-category counts; when `track`, also the input
    range of every token so far, kept as sorted (token start, token end, index into `spans`) in the current text."""

    def __init__(self, text: str, track: bool) -> None:
        self.text, self.track = text, track
        self.counts: dict[str, int] = {}
        self.spans: list[Span | None] = []  # None: absorbed by a later, wider match
        self._tokens: list[tuple[int, int, int]] = []
        self._starts: list[int] = []
        self._shape: _Shape | None = None

    def _to_input(self, s: int, e: int) -> tuple[int, int]:
        """Map the range [s, e) of the current text to the input; a range touching a token covers its input."""
        i = bisect.bisect_right(self._starts, s) - 1  # last token starting at or before s
        if i >= 0:
            _, te, k = self._tokens[i]
            s = self.spans[k].start if s < te else s - te + self.spans[k].end
        j = bisect.bisect_left(self._starts, e) - 1  # last token starting before e
        if j >= 0:
            _, te, k = self._tokens[j]
            e = self.spans[k].end if e <= te else e - te + self.spans[k].end
        return s, e

    def _record(self, cat: str, replaced: list[tuple[int, int]], token_len: int) -> None:
        old, tokens, i, shift = self._tokens, [], 0, 0
        for s, e in replaced:
            span = Span(*self._to_input(s, e), cat)
            while i < len(old) and old[i][1] <= s:
                tokens.append((old[i][0] + shift, old[i][1] + shift, old[i][2]))
                i += 1
            while i < len(old) and old[i][0] < e:  # an earlier token inside this match: its span is absorbed
                self.spans[old[i][2]] = None
                i += 1
            tokens.append((s + shift, s + shift + token_len, len(self.spans)))
            self.spans.append(span)
            shift += token_len - (e - s)
        tokens.extend((a + shift, b + shift, k) for a, b, k in old[i:])
        self._tokens, self._starts = tokens, [t[0] for t in tokens]

    def shape(self) -> _Shape:
        """The byte shape of the current text (made again only after a step changed the text)."""
        if self._shape is None or self._shape.text is not self.text:
            self._shape = _Shape(self.text)
        return self._shape

    def run(
        self,
        cat: str,
        pattern: re.Pattern,
        accept: Callable[[re.Match], bool] = lambda m: True,
        matches: Iterable[re.Match] | None = None,
    ) -> None:
        """Replace each accepted match of `pattern` (only its `v` or `v2` group when set) by the category's token.

        `matches`, when given, must be what `pattern.finditer(self.text)` yields (found with fewer regex attempts)."""
        groups = [g for g in ("v", "v2") if g in pattern.groupindex]
        replaced = []
        for m in pattern.finditer(self.text) if matches is None else matches:
            if accept(m):
                replaced.append(
                    next((m.span(g) for g in groups if m.group(g) is not None), m.span())
                    if groups
                    else m.span()
                )
        self.replace(cat, replaced)

    def replace(self, cat: str, replaced: list[tuple[int, int]]) -> None:
        """Replace each range of `replaced` (ascending, disjoint) in the current text by the category's token."""
        if not replaced:
            return
        token, text = TOKENS[cat], self.text
        pieces, last = [], 0
        for start, end in replaced:
            pieces += (text[last:start], token)
            last = end
        pieces.append(text[last:])
        self.text = "".join(pieces)
        if self._shape is not None and self._shape.text is text:
            self._shape = self._shape.spliced(self.text, replaced, token)
        self.counts[cat] = self.counts.get(cat, 0) + len(replaced)
        if self.track:
            self._record(cat, replaced, len(token))
