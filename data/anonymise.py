"""Anonymisation of user-identifiable strings (DEMix Appendix A.2, Table 8).

The paper replaces e-mail addresses, DART ids, Facebook user ids, phone numbers, credit-card numbers, US social
security numbers and user handles with dummy tokens. Its regexes live on regex101 links that are not
reachable offline, so the patterns below are our own, written to the same categories and tokens and tested on
positives *and* on look-alikes that must survive (dates, versions, prices, IPs, decimals, times, ISBNs, code):

    category            token                   what matches
    EMAIL               <EMAIL>                 local@domain.tld (a dotted domain with an alphabetic TLD)
    DART                <DART>                  DoubleClick (DART) ad ids: `dart_id=...`, `dc_rdid=...`,
                                                `ad.doubleclick.net/...` ad-tag URLs
    FB_USERID           <FB_USERID>             the numeric id in `facebook.com/profile.php?id=N`, `fbid=N`,
                                                `fb_user_id: N` (only the id is replaced)
    PHONE_NUMBER        <PHONE_NUMBER>          NANP 3-3-4 numbers `(555) 123-4567`, `555.123.4567`, `+1 ...`,
                                                and `+CC` international numbers with at least 3 digit groups
    CREDIT_CARD_NUMBER  <CREDIT_CARD_NUMBER>    13-19 digits (plain, or 4-4-4-4[-1..3] / Amex 4-6-5 groups with
                                                one consistent separator), first digit 2-6, Luhn check passes
    SSN                 <SSN>                   ddd-dd-dddd with the SSA's never-issued ranges excluded
    USER                <USER>                  @handle (1-30 word characters) not preceded by a word character

Decisions on look-alikes (documented because they are judgement calls):
- `x@y` (matrix multiply in Python, `user@host` in shell prompts) is *not* replaced: a handle must not follow a
  word character, and an e-mail needs a dotted domain with an alphabetic top-level domain.
- A line that is only a decorator or annotation (`@property`, `    @app.route("/")`, `@Override`) is kept, and so
  are well-known at-keywords of code and docs (`@param`, `@return`, `@media`, `@import`, ...). A tweet that
  starts with `@name` and continues with text is a handle and is replaced. For code domains the simplest and
  safest choice is to turn anonymisation off for that domain (see `resolve_policy`).
- Dates (2021-03-04, 03/04/2021), versions (1.2.3, v10.0.19041), prices ($1,234.56), IPs, decimals, times and
  ISBNs never match: phone numbers need 3-3-4 digit groups not glued to other digits, dots or dashes; SSNs need
  3-2-4 with dashes; card numbers need the Luhn check and a card-like grouping.

Patterns run in the order of `CATEGORIES` on the progressively anonymised text, so a dummy token is never
re-matched (they contain no digits and no `@`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Optional, Union

CATEGORIES: tuple[str, ...] = ("EMAIL", "DART", "FB_USERID", "CREDIT_CARD_NUMBER", "SSN", "PHONE_NUMBER", "USER")
TOKENS: dict[str, str] = {c: f"<{c}>" for c in CATEGORIES}

_EMAIL = re.compile(
    r"(?<![\w.+-])[A-Za-z0-9][A-Za-z0-9._%+-]{0,63}@(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+[A-Za-z]{2,24}\b"
)
_DART = re.compile(
    r"(?i)\b(?:dart[_-]?id|dc[_-]?rdid|dc[_-]?uid)\s*[=:]\s*(?P<v>[A-Za-z0-9_.\-]{4,})"
    r"|(?:\b(?:https?:)?//)?\bad\.doubleclick\.net/[^\s\"'<>]+"
)
_FB_USERID = re.compile(
    r"(?i)(?:facebook\.com/profile\.php\?id=|\bfbid=|\bfb[_-]?(?:user)?[_-]?id\s*[=:]\s*)(?P<v>\d{5,20})\b"
)
_CARD = re.compile(
    r"(?<![\d.,-])(?:"
    r"\d{13,19}"
    r"|\d{4}(?P<s1>[ -])\d{4}(?P=s1)\d{4}(?P=s1)\d{4}(?:(?P=s1)\d{1,3})?"
    r"|\d{4}(?P<s2>[ -])\d{6}(?P=s2)\d{5}"
    r")(?![\d-]|[.,]\d)"
)
_SSN = re.compile(r"(?<![\d-])(?!000|666|9\d\d)\d{3}-(?!00)\d{2}-(?!0000)\d{4}(?![\d-]|\.\d)")
_PHONE = re.compile(
    r"(?<![\w.+/-])(?:"
    r"(?:\+1[ .-]?|1[ .-])?(?:\(\d{3}\)[ ]?|\d{3}[ .-])\d{3}[ .-]\d{4}"  # NANP: (555) 123-4567, 555.123.4567, +1 555 123 4567
    r"|\+\d{1,3}[ .-]?(?:\(\d{1,4}\)[ .-]?)?\d{1,4}(?:[ .-]\d{2,4}){2,4}"  # +44 20 7946 0958, +49 (30) 1234 5678
    r")(?![\w-]|\.\d)"
)
_HANDLE = re.compile(r"(?<![\w@./+-])@(?P<name>[A-Za-z0-9_]{1,30})\b(?![@.]\w)")
_DECORATOR_LINE = re.compile(r"^[ \t]*@[A-Za-z_][\w.]*[ \t]*(?:\(.*)?$", re.MULTILINE)
# at-keywords of code, docs and stylesheets that are not user handles
CODE_AT_WORDS: frozenset[str] = frozenset(
    "param params return returns throws throw raises exception see since author version deprecated override "
    "inheritdoc link code type typedef property staticmethod classmethod abstractmethod dataclass media import "
    "font-face keyframes charset supports page namespace include mixin extend interface implementation end "
    "synthesize protocol selector encode available brief file class struct note todo example".split()
)


def luhn_ok(digits: str) -> bool:
    """The Luhn mod-10 check that every payment-card number satisfies."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2 == 1:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _is_card(m: re.Match) -> bool:
    digits = re.sub(r"\D", "", m.group(0))
    return 13 <= len(digits) <= 19 and digits[0] in "23456" and len(set(digits)) > 1 and luhn_ok(digits)


def _decorator_spans(text: str) -> list[tuple[int, int]]:
    return [m.span() for m in _DECORATOR_LINE.finditer(text)] if "@" in text else []


def _sub(pattern: re.Pattern, token: str, text: str, accept: Callable[[re.Match], bool] = lambda m: True) -> tuple[str, int]:
    """Replace each accepted match (only its `v` group when the pattern has one) by `token`; return the count."""
    pieces, last, n = [], 0, 0
    for m in pattern.finditer(text):
        if not accept(m):
            continue
        start, end = m.span("v") if "v" in m.re.groupindex and m.group("v") is not None else m.span()
        pieces.append(text[last:start])
        pieces.append(token)
        last, n = end, n + 1
    if n == 0:
        return text, 0
    pieces.append(text[last:])
    return "".join(pieces), n


def _handle_ok(spans: list[tuple[int, int]]) -> Callable[[re.Match], bool]:
    def accept(m: re.Match) -> bool:
        if m.group("name").lower() in CODE_AT_WORDS:
            return False
        return not any(s <= m.start() < e for s, e in spans)

    return accept


@dataclass(frozen=True)
class Anonymised:
    text: str
    counts: dict[str, int] = field(default_factory=dict)  # category -> replacements (only non-zero)


def anonymise(text: str) -> Anonymised:
    """Replace every Table 8 category in `text` by its dummy token; count replacements per category."""
    counts: dict[str, int] = {}

    def run(cat: str, pattern: re.Pattern, accept: Callable[[re.Match], bool] = lambda m: True) -> None:
        nonlocal text
        text, n = _sub(pattern, TOKENS[cat], text, accept)
        if n:
            counts[cat] = counts.get(cat, 0) + n

    if "@" in text:
        run("EMAIL", _EMAIL)
    if "doubleclick" in text or "=" in text or ":" in text:
        run("DART", _DART)
        run("FB_USERID", _FB_USERID)
    if any(c.isdigit() for c in text):
        run("CREDIT_CARD_NUMBER", _CARD, _is_card)
        run("SSN", _SSN)
        run("PHONE_NUMBER", _PHONE)
    if "@" in text:
        run("USER", _HANDLE, _handle_ok(_decorator_spans(text)))
    return Anonymised(text, counts)


def add_counts(total: dict[str, int], counts: Mapping[str, int]) -> dict[str, int]:
    """Accumulate per-category counts into `total` (in place) and return it."""
    for k, v in counts.items():
        total[k] = total.get(k, 0) + v
    return total


AnonymisePolicy = Union[bool, Mapping[str, bool]]


def resolve_policy(policy: AnonymisePolicy, domains: Iterable[str], default: bool = True) -> dict[str, bool]:
    """Per-domain on/off from `True`/`False` or a mapping such as `{"code": False}` (unlisted domains: `default`).

    Unknown domain names in the mapping are an error, so a typo cannot silently leave a domain un-anonymised."""
    domains = list(domains)
    if isinstance(policy, bool):
        return {d: policy for d in domains}
    unknown = sorted(set(policy) - set(domains))
    if unknown:
        raise ValueError(f"anonymise: unknown domains {unknown}; known: {domains}")
    bad = {k: v for k, v in policy.items() if not isinstance(v, bool)}
    if bad:
        raise ValueError(f"anonymise: values must be true/false, got {bad}")
    return {d: bool(policy.get(d, default)) for d in domains}


def anonymise_many(texts: Iterable[str], enabled: bool = True) -> tuple[list[str], dict[str, int]]:
    """Anonymise a list of documents (identity when not `enabled`); return texts and summed counts."""
    if not enabled:
        return list(texts), {}
    out, total = [], {}
    for t in texts:
        r = anonymise(t)
        out.append(r.text)
        add_counts(total, r.counts)
    return out, total


def parse_policy_args(on: Optional[bool], off_domains: Iterable[str]) -> AnonymisePolicy:
    """CLI helper: `--no-anonymise` -> False; `--anonymise-off code` (repeatable) -> {"code": False}."""
    off = list(off_domains)
    if on is False:
        return False
    return {d: False for d in off} if off else True
