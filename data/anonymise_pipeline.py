"""The anonymisation pipeline (data/anonymise.py is its front door): the steps of `_anonymise`, in order, each
run only where the pre-screens (data/anonymise_prescreen.py) say it can match; `_anonymise_reference` is the same
pipeline unscreened, with the same output. The order and its reasons are in docs/anonymise.md."""

from __future__ import annotations

from dataclasses import dataclass, field

from data.anonymise_pass import Span, _Pass
from data.anonymise_patterns import (
    _AT_URL,
    _CARD,
    _DART,
    _DART_URL,
    _DISCORD,
    _EMAIL,
    _EMAIL_OBFUSCATED,
    _FB_USERID,
    _FB_VANITY,
    _FEDI_HANDLE,
    _HANDLE,
    _NINO,
    _NINO_LABELLED,
    _OBFUSCATION_HINT,
    _PHONE,
    _PHONE_LABEL_HINTS,
    _PHONE_LABELLED,
    _PROFILE_HOSTS,
    _PROFILE_URL,
    _REDDIT_USER,
    _SSN,
    _SSN_LABELLED,
    _WHATSAPP,
    _at_url_ok,
    _email_ok,
    _handle_ok,
    _is_card,
    _is_labelled_phone,
    _is_phone,
    _is_ssn,
    _obfuscated_ok,
    _profile_ok,
    _reddit_ok,
)
from data.anonymise_prescreen import (
    _DART_HINTS,
    _DART_KEY,
    _FB_ID_HINT,
    _NINO_DIGITS,
    _NINO_LABEL,
    _email_spans,
    _labelled_phone_starts,
    _matches_at,
    _obfuscated_possible,
    _occurrences,
    _phone_starts,
    _profile_matches,
    _screenable,
    _Shape,
)


@dataclass(frozen=True)
class Anonymised:
    text: str
    counts: dict[str, int] = field(default_factory=dict)  # category -> replacements (only non-zero)


def _anonymise(text: str, track: bool) -> _Pass:
    """The one anonymisation pipeline behind `anonymise` and `find_spans` (each step sees the previous output).

    The steps, their order and their word gates are `_anonymise_reference`'s; here each step runs only when the
    current text can hold a match it accepts, and only where (the pre-screens), so a text without candidates
    costs a few substring tests. The word gates test the input, as the reference's do; a gate that every match
    implies (a phone label word, a profile host) is left to the step's finder. Inline but for the numbers: one
    call fewer per step on a hot path."""
    if not _screenable(text):
        return _anonymise_reference(text, track)
    p = _Pass(text, track)
    # the current text's shape: taken again after each step that ran (a replacement splices it)
    sh = p.shape()
    low = sh.low  # the input's, for the word gates
    has_at = "@" in text
    if has_at:
        if text.count("@") > 1:
            p.run("USER", _FEDI_HANDLE)  # before EMAIL, which would take its user@instance part
        p.replace("EMAIL", _email_spans(p.shape()))  # = p.run("EMAIL", _EMAIL, _email_ok)
        sh = p.shape()
    if _obfuscated_possible(sh) and ("%40" in text or _OBFUSCATION_HINT.search(text)):
        p.run("EMAIL", _EMAIL_OBFUSCATED, _obfuscated_ok)
        sh = p.shape()
    if _DART_KEY.search(sh.low) and any(k in low for k in _DART_HINTS):
        p.run("DART", _DART)
        sh = p.shape()
    if sh.slashes["doubleclick"] and b"doubleclick" in low:
        p.run("DART", _DART_URL)
        sh = p.shape()
    if sh.slashes["fb_host"] or _FB_ID_HINT.search(sh.low):  # then `fb` or `facebook` is in `low`
        p.run("FB_USERID", _FB_USERID)
        sh = p.shape()
        if "/" in text and sh.slashes["fb_host"]:
            p.run("FB_USERID", _FB_VANITY)
            sh = p.shape()
    sh = _number_steps(p, text, low, sh)
    if "/" in text:
        slashes = sh.slashes
        if anchors := sorted(slashes["com"] + slashes["t_me"]):
            p.run("USER", _PROFILE_URL, _profile_ok, _profile_matches(sh, anchors))
            sh = p.shape()
        if has_at and "/@" in text:
            p.run("USER", _AT_URL, _at_url_ok)
            sh = p.shape()
        if starts := [s for q in sh.slashes["u"] for s in (q - 1, q) if s >= 0]:  # u/name, /u/name
            p.run("USER", _REDDIT_USER, _reddit_ok, _matches_at(_REDDIT_USER, p.text, starts))
            sh = p.shape()
    if "#" in text and b"#0000" in sh.b and b"discord" in low:
        p.run("USER", _DISCORD)
    if "@" in p.text:
        p.run("USER", _HANDLE, _handle_ok(p.text))
    return p


def _number_steps(p: _Pass, text: str, low: bytes, sh: _Shape) -> _Shape:
    """The steps of `_anonymise` for card numbers, SSNs and national insurance numbers, and phone numbers, from
    the current shape `sh`; returns the shape after them."""
    if sh.anchors:  # a 7-digit number: cards, SSNs, phone numbers
        if starts := sh.kind("card"):
            p.run("CREDIT_CARD_NUMBER", _CARD, _is_card, _matches_at(_CARD, p.text, starts))
            sh = p.shape()
        if sh.kind("ssn_labelled") and any(k in low for k in (b"ssn", b"ss#", b"soc")):
            p.run("SSN", _SSN_LABELLED, _is_ssn)
            sh = p.shape()
        if "-" in text and (starts := sh.kind("ssn")):
            p.run("SSN", _SSN, _is_ssn, _matches_at(_SSN, p.text, starts))
            sh = p.shape()
    if b"0" not in sh.b:
        return sh
    if starts := [q - 2 for q in _occurrences(sh.b, b" 00 00 00 ") if q >= 2]:  # AB 12 34 56 C
        p.run("SSN", _NINO, matches=_matches_at(_NINO, p.text, starts))
        sh = p.shape()
    if (
        _NINO_DIGITS.search(sh.b)
        and (b"insurance" in sh.low or _NINO_LABEL.search(sh.low))
        and any(k in low for k in (b"insurance", b"nino", b"ni "))
    ):
        p.run("SSN", _NINO_LABELLED)
        sh = p.shape()
    if sh.anchors:
        if starts := _phone_starts(sh):
            p.run("PHONE_NUMBER", _PHONE, _is_phone, _matches_at(_PHONE, p.text, starts))
            sh = p.shape()
        if starts := _labelled_phone_starts(sh):
            p.run(
                "PHONE_NUMBER",
                _PHONE_LABELLED,
                _is_labelled_phone,
                _matches_at(_PHONE_LABELLED, p.text, starts),
            )
            sh = p.shape()
    if sh.slashes["wa_me"] and b"00000000" in sh.b:
        p.run("PHONE_NUMBER", _WHATSAPP)
        sh = p.shape()
    return sh


def _anonymise_reference(text: str, track: bool) -> _Pass:
    """`_anonymise` without pre-screens: each step whose word or character gate passes scans the whole text."""
    p = _Pass(text, track)
    low = text.lower()
    has_at, has_digit, has_slash = "@" in text, any(c.isdigit() for c in text), "/" in text
    if has_at:
        if text.count("@") > 1:
            p.run("USER", _FEDI_HANDLE)
        p.run("EMAIL", _EMAIL, _email_ok)
    if "%40" in text or _OBFUSCATION_HINT.search(text):
        p.run("EMAIL", _EMAIL_OBFUSCATED, _obfuscated_ok)
    if any(k in low for k in ("dart", "dc_", "dc-", "dclid", "dcrdid", "dcuid")):
        p.run("DART", _DART)
    if "doubleclick" in low:
        p.run("DART", _DART_URL)
    if "fb" in low or "facebook" in low:
        p.run("FB_USERID", _FB_USERID)
        if has_slash:
            p.run("FB_USERID", _FB_VANITY)
    if has_digit:
        p.run("CREDIT_CARD_NUMBER", _CARD, _is_card)
        if any(k in low for k in ("ssn", "ss#", "soc")):
            p.run("SSN", _SSN_LABELLED, _is_ssn)
        if "-" in text:
            p.run("SSN", _SSN, _is_ssn)
        p.run("SSN", _NINO)
        if any(k in low for k in ("insurance", "nino", "ni ")):
            p.run("SSN", _NINO_LABELLED)
        p.run("PHONE_NUMBER", _PHONE, _is_phone)
        if any(k in low for k in _PHONE_LABEL_HINTS):
            p.run("PHONE_NUMBER", _PHONE_LABELLED, _is_labelled_phone)
        if "wa.me/" in low:
            p.run("PHONE_NUMBER", _WHATSAPP)
    if has_slash:
        if any(h in low for h in _PROFILE_HOSTS):
            p.run("USER", _PROFILE_URL, _profile_ok)
        if "/@" in text:
            p.run("USER", _AT_URL, _at_url_ok)
        if "u/" in text:
            p.run("USER", _REDDIT_USER, _reddit_ok)
    if has_digit and "#" in text and "discord" in low:
        p.run("USER", _DISCORD)
    if "@" in p.text:
        p.run("USER", _HANDLE, _handle_ok(p.text))
    return p


def anonymise(text: str) -> Anonymised:
    """Replace every Table 8 category in `text` by its dummy token; count replacements per category."""
    p = _anonymise(text, track=False)
    return Anonymised(p.text, p.counts)


def find_spans(text: str) -> list[Span]:
    """The input ranges that `anonymise(text)` replaces, sorted by start (same pipeline, offsets kept)."""
    return sorted(s for s in _anonymise(text, track=True).spans if s is not None)
