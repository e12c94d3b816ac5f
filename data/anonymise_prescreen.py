"""Pre-screens of anonymisation. Most steps find nothing in most documents, and a regex that cannot jump to a
literal first character tries every position of the text (10-40 ns a character, more than GPT-2 encoding leaves
us). So `_anonymise` (data/anonymise_pipeline.py)
  1. tests a byte *shape* of the text (`_Shape`: same length, so offsets agree; lower-cased, each digit 0-9 is
     b"0", each non-ASCII character b"?") with substring tests and byte regexes that start with a literal (~1 ns
     a character);
  2. runs a step only when the current text holds what every *accepted* match of it needs (with no accepted
     match a step changes nothing, whatever it rejects);
  3. runs the costly steps only where a match can be: `pattern.match` at candidate starts (`_matches_at`) or
     `finditer` in windows around an anchor (an `@`, a `.com/`) that hold every character a match there reads.
     Each finder says why it yields exactly `pattern.finditer(text)`.
A text whose shape is not exact (a decimal digit other than 0-9; İ ı ſ K, which case-insensitive patterns take
for i, i, s, k and `str.lower` turns into ASCII) goes through `_anonymise_reference`, the same steps unscreened.
tests/data/test_anonymise.py compares the two pipelines and pins outputs at every pre-screen's boundary.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from data.anonymise_patterns import _EMAIL, _MAIL_PROVIDERS, _PROFILE_URL, _email_ok

_SHAPE = bytes.maketrans(b"123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ", b"000000000abcdefghijklmnopqrstuvwxyz")
_SHAPE_SPACE = b" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f?"  # the shape bytes that may stand for a `\s` character
_SP = rb"[\s\x1c-\x1f?]"
_FOLD_HAZARDS = "\u0130\u0131\u017f\u212a"
_NON_ASCII_DIGIT = re.compile(r"[^\D0-9]")
# a digit-run start that begins 7 digits separated only by ` ().-/`: an *anchor*. Every card number, SSN and
# phone number that can be accepted has one: the first digit of its number (nothing but `+(` before it in the match).
# After the anchor's first digit, each group that is set names a *kind* of number that can start there: a card number
# (`_CARD`: 4 digits, then 9+ more or 4-4-4 / 6-4 groups) and an SSN start at an anchor (their look-behinds allow no
# digit before), and so do a NANP number's first digit (`1-`/`+1 ` then `(555) `/`555-`, or `(555) `/`555-` alone,
# then `123-4567`) and a labelled SSN's (no digit or `-` before it).
_RUN7 = re.compile(
    rb"0(?<!00)(?=" + rb"[ ().\-/]*0" * 6 + rb")"
    rb"(?=(?P<card>000(?:0{9}|[ \-]0000[ \-]0000|[ \-]000000[ \-]0000))?)"
    rb"(?=(?P<nanp>(?:[ .\-]?(?:\(000\) ?|000[ .\-])|00\) ?|00[ .\-])000[ .\-]0000)?)"
    rb"(?=(?P<ssn_labelled>00(?P<sep>[ \-]?)00(?P=sep)0000(?![0\-]|\.0))?)"
    rb"(?=(?P<ssn>00-00-0000)?)"
)
# each `/` of the lower-cased shape that ends `facebook.com/` or `fb.com/`, another `.com/`, `t.me/`, `wa.me/`,
# `doubleclick.net/` or `u/`; the empty group that is set names which
_SLASH = re.compile(
    rb"/(?<=[meut]/)(?:(?:(?<=facebook\.com/)|(?<=fb\.com/))(?P<fb_host>)|(?<=\.com/)(?P<com>)"
    rb"|(?<=t\.me/)(?P<t_me>)|(?<=wa\.me/)(?P<wa_me>)|(?<=doubleclick\.net/)(?P<doubleclick>)"
    rb"|(?<=u/)(?P<u>))"
)
_SLASH_ENDS = {"fb_host": 4, "com": 4, "t_me": 4, "wa_me": 5, "doubleclick": 15, "u": 1}


def _screenable(text: str) -> bool:
    """Whether the shape of `text` is exact: no decimal digit but 0-9 and none of İ ı ſ K."""
    if text.isascii():
        return True
    # fast whole-text checks; neither repertoire holds a character >= U+0130
    for codec in (
        "latin-1",
        "cp1252",
    ):
        try:
            text.encode(codec)
            return True
        except UnicodeEncodeError:
            pass
    return not any(c in text for c in _FOLD_HAZARDS) and _NON_ASCII_DIGIT.search(text) is None


class _Shape:
    """`text` as lower-cased ASCII bytes of the same length (`b`, also `low`): each digit 0-9 becomes b"0", each
    non-ASCII character b"?". For a `_screenable` text, a word of ASCII letters and punctuation (not `?`) is in it
    iff it is in `text.lower()`, and b"0" stands for exactly the characters `\\d` matches."""

    __slots__ = ("text", "b", "_anchors", "_anchor_matches", "_kinds", "_slashes")

    def __init__(self, text: str, b: bytes | None = None) -> None:
        self.text = text
        self.b = text.encode("ascii", "replace").translate(_SHAPE) if b is None else b
        self._anchors: list[int] | None = None
        self._anchor_matches: list[re.Match] = []
        self._kinds: dict[str, list[int]] | None = None
        self._slashes: dict[str, list[int]] | None = None

    def spliced(self, text: str, replaced: list[tuple[int, int]], token: str) -> _Shape:
        """The shape of `text`: this one with each range of `replaced` turned into `token` (ASCII, no digit)."""
        parts, last, tok = [], 0, token.lower().encode()
        for s, e in replaced:
            parts += (self.b[last:s], tok)
            last = e
        parts.append(self.b[last:])
        return _Shape(text, b"".join(parts))

    @property
    def low(self) -> bytes:
        """The shape itself, named so where a test relies on it being lower-cased."""
        return self.b

    @property
    def anchors(self) -> list[int]:
        """The anchors (`_RUN7`), ascending."""
        if self._anchors is None:
            self._scan_anchors()
        return self._anchors

    def _scan_anchors(self) -> None:
        self._anchor_matches = list(_RUN7.finditer(self.b)) if b"0" in self.b else []
        self._anchors = [m.start() for m in self._anchor_matches]

    @property
    def slashes(self) -> dict[str, list[int]]:
        """Where the lower-cased shape has `.com/` (`com`; in `facebook.com/` or `fb.com/` also `fb_host`), `t.me/`
        (`t_me`), `wa.me/` (`wa_me`), `doubleclick.net/` and `u/`: the offset of their first character."""
        if self._slashes is None:
            k: dict[str, list[int]] = {n: [] for n in ("com", "t_me", "wa_me", "doubleclick", "fb_host", "u")}
            for m in _SLASH.finditer(self.low) if b"/" in self.low else ():
                kind = m.lastgroup
                k[kind].append(m.start() - _SLASH_ENDS[kind])
            k["com"] = sorted(k["com"] + k["fb_host"])
            self._slashes = k
        return self._slashes

    def kind(self, name: str) -> list[int]:
        """The anchors where a `card` number, a `nanp` number, a labelled SSN (`ssn_labelled`) or an `ssn` can
        start (`_RUN7`'s groups)."""
        if self._kinds is None:
            kinds: dict[str, list[int]] = {"card": [], "nanp": [], "ssn_labelled": [], "ssn": []}
            if self._anchors is None:
                self._scan_anchors()
            for m in self._anchor_matches:
                if m.lastindex:
                    for kind, found in kinds.items():
                        if m.group(kind) is not None:
                            found.append(m.start())
            self._kinds = kinds
        return self._kinds[name]


def _matches_at(pattern: re.Pattern, text: str, starts: Iterable[int]) -> Iterator[re.Match]:
    """`pattern.finditer(text)` when the ascending `starts` hold every position where `pattern.match` succeeds:
    finditer yields the first such position at or after the end of its previous match, and so does this."""
    end = 0
    for s in starts:
        if s >= end and (m := pattern.match(text, s)) is not None:
            end = m.end()
            yield m


def _occurrences(hay: str | bytes, needle: str | bytes) -> list[int]:
    out, i = [], hay.find(needle)
    while i >= 0:
        out.append(i)
        i = hay.find(needle, i + 1)
    return out


# the shape bytes as `L` (local-part characters `[A-Za-z0-9._%+-]`), `@` (`@` and `:`) and `.` (the rest: stop bytes)
_EMAIL_MASK = bytes(
    ord("L")
    if chr(c).isascii() and (chr(c).isalnum() or chr(c) in "._%+-")
    else ord("@")
    if chr(c) in "@:"
    else ord(".")
    for c in range(256)
)


_EMAIL_WINDOWS: dict[str | tuple[int, str], tuple[tuple[int, int], ...]] = {}  # see `_email_spans`
_EMAIL_WINDOWS_MAX = 4096


def _email_spans(sh: _Shape) -> list[tuple[int, int]]:
    """The ranges `run("EMAIL", _EMAIL, _email_ok)` replaces, from windows: a match holds the first `@` after its
    start, at most 64 local-part characters (`[A-Za-z0-9._%+-]`) after that start; it holds no stop character
    (`_EMAIL_MASK`; `:` is not one) and reads at most up to the first one after the `@` (`\\b`, `(?!\\.x|:\\S)`
    read one character beyond a `.` or `:`). What a window yields depends on its characters and the two before it
    (the look-behinds) only, and `_email_ok` on the match only, so the accepted ranges are kept per window (the same
    addresses recur: a changelog's maintainers), in a dict emptied when it is full."""
    text, pos, spans, n = sh.text, 0, [], len(sh.text)
    mask, find, memo = sh.b.translate(_EMAIL_MASK), text.find, _EMAIL_WINDOWS
    while (a := find("@", pos)) >= 0:
        lo = a - 64 if a - 64 > pos else pos
        # the local-part run before the `@`
        lo = max(lo, mask.rfind(b".", lo, a) + 1, mask.rfind(b"@", lo, a) + 1)
        pos = mask.find(b".", a) + 1 or n  # just past the first stop byte
        key = text[lo - 2 : pos] if lo >= 2 else (lo, text[:pos])
        found = memo.get(key)
        if found is None:
            found = tuple(
                (m.start() - lo, m.end() - lo) for m in _EMAIL.finditer(text, lo, pos) if _email_ok(m)
            )
            if len(memo) >= _EMAIL_WINDOWS_MAX:
                memo.clear()
            memo[key] = found
        for s, e in found:
            spans.append((lo + s, lo + e))
    return spans


# `_EMAIL_OBFUSCATED` needs one of: `[(at)]`-style brackets, ` AT ... DOT `, ` at gmail.com` or ` at gmail dot com`,
# `%40`
_OBF_AT = (
    re.compile(  # in the lower-cased shape, `at` after a bracket or a space: before a closing bracket, or
        # ` at PROVIDER` and `.` or ` dot `
        rb"at(?<=[\[({<\s\x1c-\x1f?]at)(?:"
        + _SP
        + rb"*[\])}>]|"
        + _SP
        + rb"+(?:"
        + _MAIL_PROVIDERS.encode()
        + rb")(?:\.|"
        + _SP
        + rb"+dot"
        + _SP
        + rb"))"
    )
)
_OBF_UPPER_AT = re.compile(r"AT(?<=\sAT)\s")  # in the text: `_OBFUSCATION_HINT`'s ` AT `
_SHAPE_SPACE_SET = frozenset(_SHAPE_SPACE)


def _obfuscated_possible(sh: _Shape) -> bool:
    """Whether the text holds the part of an `_EMAIL_OBFUSCATED` match after its local part (see above)."""
    if "%" in sh.text and "%40" in sh.text:
        return True
    if "DOT" in sh.text and _OBF_UPPER_AT.search(sh.text):
        return True
    low = sh.low
    for m in _OBF_AT.finditer(low):
        if m.group()[-1] not in b"])}>":  # ` at gmail.` / ` at gmail dot `
            return True
        j = m.start() - 1  # `at)`: an opening bracket before it, maybe after spaces (`format)` is not one)
        while j >= 0 and low[j] in _SHAPE_SPACE_SET:
            j -= 1
        if j >= 0 and low[j] in b"[({<":
            return True
    return False


# `dart_id`, `dc_rdid`, `dcuid`, `dclid`
_DART_KEY = re.compile(rb"d(?:art[_\-]?id|c(?:[_\-]?rdid|[_\-]?uid|lid))")
_DART_HINTS = (b"dart", b"dc_", b"dc-", b"dclid", b"dcrdid", b"dcuid")
_FB_ID_HINT = re.compile(rb"fb[_\-]?(?:user)?[_\-]?id")  # `fbid=`, `fb_user_id:`


# in the lower-cased shape: `NINO`, `NI number`, `NI no`
_NINO_LABEL = re.compile(rb"ni(?:no|" + _SP + rb"+n)")
_NINO_DIGITS = re.compile(rb"00 ?00 ?00 ?[a-d](?![a-z0-9])")  # how what `_NINO_LABELLED` replaces ends
_PHONE_PLUS = re.compile(r"\+(?<![\w.+/-]\+)(?=\d)")  # where `_PHONE`'s international form can start
_PHONE_00 = re.compile(r"00(?<![\w.+/-]00)(?=[1-9])")


def _phone_starts(sh: _Shape) -> list[int]:
    """Where `_PHONE` can match, when some match of it can be accepted (else nothing). An accepted match has 8+
    digits: a NANP number, which starts at its first digit (an anchor) or at the `+`/`(` before it, or one whose
    `+` or `00` is at or just before an anchor. International matches start at `+` or `00` and a digit, and the
    rejected ones count too, as `finditer` goes on after their end."""
    nanp, text = sh.kind("nanp"), sh.text
    if not nanp and not any(sh.b[d - 1 : d] == b"+" or text.startswith("00", d) for d in sh.anchors):
        return []
    starts = set(nanp)
    starts.update(d - 1 for d in nanp if d)
    starts.update(m.start() for m in _PHONE_PLUS.finditer(text))
    starts.update(m.start() for m in _PHONE_00.finditer(text))
    return sorted(starts)


# the shape bytes that can lie between a phone label's start and its number's first digit: letters (é is b"?"),
# spaces, `.#:=` and the number's `+(`; at most 25 of them are not spaces (`contact number: is +(`)
_LABEL_ZONE = bytes(
    ord("Z") if bytes([c]).isalpha() or c in _SHAPE_SPACE or c in b".#:=+(" else ord("|") for c in range(256)
)
_LABEL_NON_SPACE = 26
# in the lower-cased shape, where a label word of `_PHONE_LABELLED` can start (é is b"?"; a byte-wise \b holds
# wherever the text's \b does, as a non-ASCII character is a non-word b"?")
_LABEL_WORD = re.compile(rb"\b(?:t[e?]l|phone|ph|mob|cell|fax|whats|hotline|contact|call|ring|dial|text)")


def _labelled_phone_starts(sh: _Shape) -> list[int]:
    """An accepted `_PHONE_LABELLED` match has 7-15 digits, so its number's first digit `d` is an anchor and its
    label starts in the run of label characters (`_LABEL_ZONE`) that ends at `d`, after the last 26 non-space
    characters. Matches with fewer digits, which are not looked for, cannot hold the start of another match (no
    label word starts inside a label, a number or an extension), so leaving them out changes no other match."""
    b, low, starts = sh.b, sh.low, []
    zone = b.translate(_LABEL_ZONE) if sh.anchors else b""
    for d in sh.anchors:
        lo = max(0, d - 64)
        cut = zone.rfind(b"|", lo, d)
        if cut >= 0:
            lo = cut + 1
        else:
            w = 64
            while lo > 0 and len(b[lo:d].translate(None, _SHAPE_SPACE)) < _LABEL_NON_SPACE:
                w *= 4
                lo = max(0, d - w)
                cut = zone.rfind(b"|", lo, d)
                if cut >= 0:
                    lo = cut + 1
                    break
        if _LABEL_WORD.search(low, lo, d):  # rare: look for every start only then
            starts += [m.start() for m in _LABEL_WORD.finditer(low, lo, d)]
    return sorted(starts)


_URL_STOP = re.compile(rb"[^A-Za-z0-9_.:/\-]")
_URL_CHARS = bytes(
    ord("U") if chr(c).isascii() and (chr(c).isalnum() or chr(c) in "_.:/-") else ord("|") for c in range(256)
)


# `github.com/name/x` in the lower-cased shape (at its `.com/`): `name` is the longest run of name characters
# (`[a-z0-9_.-]`), starts and ends with `[a-z0-9_]`, has at most 100 characters, and an ASCII `[a-z0-9_.-]` follows
# the `/` after it
_GITHUB_REPO_LINK = re.compile(rb"(?<=github)\.com/[a-z0-9_](?:[a-z0-9_.\-]{0,98}[a-z0-9_])?/[a-z0-9_.\-]")


def _github_repo_link(sh: _Shape, c: int) -> bool:
    """Whether `.com/` at `c` is in a `_GITHUB_REPO_LINK` (`github.com/org/repo`). A `_PROFILE_URL` match holding
    this `.com/` has host github.com and, its name being greedy, exactly that `name`: `_profile_ok` rejects it."""
    return _GITHUB_REPO_LINK.match(sh.low, c) is not None


def _profile_matches(sh: _Shape, anchors: list[int]) -> Iterator[re.Match]:
    """`_PROFILE_URL` in windows: a match holds `.com/` or `t.me/` (`anchors`) at most 24 characters after its
    start (`https://mobile.instagram.com/`), lies in a run of URL characters (`[A-Za-z0-9_.:/-]`) and reads at most
    one character beyond that run, so each window holds such a run. A window whose only anchor is a
    `_github_repo_link` is skipped: the one match it can hold (a match goes past its anchor) is rejected."""
    text, low, pos, n = sh.text, sh.low, 0, len(sh.text)
    for i, c in enumerate(anchors):
        if c < pos:
            continue
        stop = _URL_STOP.search(low, c)
        hi = stop.end() if stop else n
        if (i + 1 == len(anchors) or anchors[i + 1] >= hi) and _github_repo_link(sh, c):
            pos = hi
            continue
        lo = max(pos, c - 24)
        lo += sh.b[lo:c].translate(_URL_CHARS).rfind(b"|") + 1  # the run of URL characters holding `c`
        yield from _PROFILE_URL.finditer(text, lo, hi)
        pos = hi
