"""Anonymisation of user-identifiable strings (DEMix Appendix A.2, Table 8).

The paper replaces e-mail addresses, DART ids, Facebook user ids, phone numbers, credit-card numbers, US social
security numbers and user handles with dummy tokens. Its regexes live on regex101 links that are not
reachable offline, so the patterns below are our own, written to the same categories and tokens and tested on
positives *and* on look-alikes that must survive (dates, versions, prices, IPs, decimals, times, ISBNs, code):

    category            token                   what matches (where a part is named, only that part is replaced)
    EMAIL               <EMAIL>                 local@domain.tld (a dotted domain with an alphabetic TLD; any case,
                                                sub-domains, plus-tags); obfuscated `jane [at] example [dot] org`,
                                                `info(at)example.de` (also {at} <at>), `tom AT example DOT com`,
                                                `jane at gmail dot com` and `jane.doe at gmail.com` (well-known mail
                                                providers only); URL-encoded `jane%40example.com`
    DART                <DART>                  DoubleClick (DART) ids: the value of `dart_id=`, `dc_rdid=`,
                                                `dc_uid=`, `dclid=`; any `*.doubleclick.net/...` URL with a path
    FB_USERID           <FB_USERID>             the id in `facebook.com/profile.php?id=N` (1-20 digits; also after
                                                other parameters, on m./www./web./mbasic. hosts and fb.com) and in
                                                `facebook.com/people/Name/N`; `fbid=N`, `fb_user_id: N` (5-20
                                                digits); the name in `facebook.com/jane.doe` (5-50 letters, digits
                                                and dots, not a reserved path: groups/, events/, sharer.php, ...)
    PHONE_NUMBER        <PHONE_NUMBER>          NANP 3-3-4 numbers `(555) 123-4567`, `555.123.4567`, `1-800-...`;
                                                international `+CC ...` and `00CC ...` (8-15 digits, a real E.164
                                                country code, `(0)` trunk digit allowed; `+447700900123` unseparated
                                                with 10-15 digits); extensions `x12`, `ext. 204`; any 7-15 digit
                                                number after a label (tel, phone, mobile, cell, fax, whatsapp,
                                                hotline, call/ring/dial, text me at, ...); `wa.me/N`
    CREDIT_CARD_NUMBER  <CREDIT_CARD_NUMBER>    13-19 digits (plain, or 4-4-4-4[-1..3] / Amex 4-6-5 / Diners 4-6-4
                                                groups with one consistent separator) whose prefix and length fit a
                                                card scheme (`card_brand_ok`) and that pass the Luhn check
    SSN                 <SSN>                   ddd-dd-dddd outside the SSA's never-issued ranges; `ddd dd dddd`
                                                and `ddddddddd` only after a label (SSN, SS#, social security
                                                number); UK National Insurance numbers `AB 12 34 56 C` (the compact
                                                `AB123456C` only after NINO / NI number / national insurance)
    USER                <USER>                  @handle (1-30 letters, digits, `_`, with inner `.` and `-`) not
                                                preceded by a word character; `@name@mastodon.social`; Reddit
                                                `u/name` and `/u/name`; the name in twitter.com/, x.com/,
                                                instagram.com/, t.me/, reddit.com/user/ (or /u/), linkedin.com/in/,
                                                youtube.com/user/ URLs, in `HOST/@name` (youtube, tiktok, medium,
                                                fediverse) and in `github.com/name` when no repository follows;
                                                Discord `name#1234` after the word Discord

Decisions on look-alikes (documented because they are judgement calls):
- `x@y` (matrix multiply in Python, `user@host` in shell prompts) is *not* replaced: a handle must not follow a
  word character, and an e-mail needs a dotted domain with an alphabetic top-level domain. `user@host:path`
  (scp, rsync, CVS), URL user info (`ssh://git@host/...`), `git@github.com` (the code host's SSH account, not a
  person; `git@` on other domains is a person's address) and image names such as `logo@2x.png` are kept.
- Code: a line that is only a decorator or annotation (`@property`, `    @app.route("/")  # comment`,
  `>>> @np.vectorize`) is kept, and so are well-known at-keywords of code, docs, stylesheets and chat tools
  (`@param`, `@Test`, `@media`, `@font-face`, `@here`, ...), `@name` directly followed by `(` or `/` (`@dataclass(`,
  npm scopes `@angular/core`) or by a declaration keyword (`@Test void f()`), `@name` inside backticks, dotted
  names that read as code (`@pytest.mark.slow`, `@x.setter`, `@nx._dispatchable`, `@GLIBC_2.3`), quantities
  (`@3pm`, `@2x`) and domains (`'%@example.com'`). A tweet that starts with `@name` and continues with text is a
  handle and is replaced. For code domains the simplest and safest choice is to turn anonymisation off for that
  domain (see `resolve_policy`).
- Dates (2021-03-04, 03/04/2021), versions (1.2.3, v10.0.19041), prices ($1,234.56), IPs, decimals, times and
  ISBNs never match: phone numbers need 3-3-4 digit groups not glued to other digits, dots or dashes, or a `+`/`00`
  prefix with a real country code and no thousands grouping (`+12.345.678` is a quantity); SSNs need 3-2-4 with
  dashes; card numbers need a card scheme's prefix and length, the Luhn check and a card-like grouping.
- Numbers that could be ids or timestamps (a bare `5551234567`, `1614556800`, order numbers) are phone numbers
  only after a phone label; national forms (`020 7946 0958`, `07700 900461`, `030/1234567`) likewise; `123 45 6789`
  and `123456789` are SSNs only after an SSN label. A label is never enough on its own: dates after it
  (`call on 2021-03-04`) and short numbers (`pH 7.4`, `Text STOP to 55512`) are kept.
- Spelled-out `at` / `dot` are e-mail only in a form people use to hide an address: bracketed, upper-case
  `AT`/`DOT` (not in all-caps prose), or lower case before a well-known mail provider; `look at the dot com bubble`
  and `log in at gmail.com` are kept.
- Reddit: `r/name` is a community and is kept; `u/` inside a path (`src/u/x`, `~/u/x`, `/u/local/bin`), after a
  number (`10 u/kg/day`) or with fewer than 3 characters (`u/s`) is kept.
- Profile URLs of organisations (`facebook.com/pytorch`, `@NASA`) are replaced like people's: the form does not
  tell them apart. GitHub repository URLs (`github.com/org/repo`) are kept: they are references to code, and
  their owner is usually an organisation; a bare `github.com/name` is a profile.
- Not matched on purpose (no form separates them from ordinary text; see benchmarks/results/anonymise_recall.md):
  vanity numbers (`1-800-FLOWERS`), user names after other labels (`IG: name`, `Skype: name`), other national
  ids (Canadian SIN, Aadhaar), IBANs, unseparated `00` numbers, `jane at example dot com` for other domains.

The steps of `_anonymise` run on the progressively anonymised text (fediverse handles before e-mails, then
roughly in the order of `CATEGORIES`), so a dummy token is never re-matched (tokens hold no digit, `@`, `/` or
`.`). Each step runs only where cheap tests on a byte shape of the text say it can match (the "pre-screens"
section; `_anonymise_reference` is the same pipeline unscreened, with the same output), so anonymising costs less
than a third of GPT-2 encoding (benchmarks/results/anonymise_speed.md). `find_spans` runs the same steps and maps
every replacement back to its range of the input; `evaluate_spans` scores it against a labelled set, also from the
command line:

    python -m data.anonymise --evaluate tests/data/anonymise_labelled.jsonl [--errors] [--baseline OTHER.py]
"""

from __future__ import annotations

import argparse
import bisect
import errno
import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Mapping, NamedTuple, Optional, Sequence, Union

from data.cli import cli_main, exit_process

CATEGORIES: tuple[str, ...] = (
    "EMAIL",
    "DART",
    "FB_USERID",
    "CREDIT_CARD_NUMBER",
    "SSN",
    "PHONE_NUMBER",
    "USER",
)
TOKENS: dict[str, str] = {c: f"<{c}>" for c in CATEGORIES}

_LABEL = (
    r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+[A-Za-z]{2,24}\b"  # dotted domain, alphabetic TLD
)
_EMAIL = re.compile(
    r"(?<![\w.+-])(?<!//)[A-Za-z0-9_][A-Za-z0-9._%+-]{0,63}@" + _LABEL + r"(?!\.[A-Za-z0-9]|:\S)"
)
# jane [at] example [dot] org, info(at)example.de, tom AT example DOT com, jane at gmail dot com, bob%40example.net
_CODE_HOSTS = frozenset(
    "github.com gitlab.com bitbucket.org codeberg.org gitee.com ssh.dev.azure.com git.sr.ht".split()
)
_MAIL_PROVIDERS = (
    "gmail|googlemail|yahoo|hotmail|outlook|live|msn|aol|icloud|me|protonmail|proton|gmx|web|yandex|mail|zoho"
)
_OBF_DOT = r"(?:\s*[\[({<]\s*(?i:dot)\s*[\])}>]\s*|\s+(?i:dot)\s+)"  # [dot] (dot) {dot} <dot>, or " dot "
_EMAIL_OBFUSCATED = re.compile(
    r"(?<![\w.+-])(?:[A-Za-z0-9_][A-Za-z0-9._+-]{0,63}" + _OBF_DOT + r")*[A-Za-z0-9_][A-Za-z0-9._+-]{0,63}(?:"
    r"\s*[\[({<]\s*(?i:at)\s*[\])}>]\s*[A-Za-z0-9-]+(?:(?:\.|\s*[\[({<]\s*(?i:dot)\s*[\])}>]\s*)[A-Za-z0-9-]+)*"
    r"(?:\.|\s*[\[({<]\s*(?i:dot)\s*[\])}>]\s*)[A-Za-z]{2,24}"
    r"|\s+AT\s+[A-Za-z0-9-]+(?:\s+DOT\s+[A-Za-z0-9-]+)*\s+DOT\s+[A-Za-z]{2,24}"
    r"|\s+at\s+(?:" + _MAIL_PROVIDERS + r")(?:\.|\s+dot\s+)(?:com|net|org|de|fr|co\.uk|co\s+dot\s+uk|ru|ch)"
    r"|%40" + _LABEL + r")\b"
)
_OBFUSCATION_HINT = re.compile(r"[aA][tT]\s*[\])}>]|\sAT\s|\s[aA][tT]\s+(?:" + _MAIL_PROVIDERS + r")\b")
_DART = re.compile(r"(?i)\b(?:dart[_-]?id|dc[_-]?rdid|dc[_-]?uid|dclid)\s*[=:]\s*(?P<v>[A-Za-z0-9_.\-]{4,})")
_DART_URL = re.compile(r"(?i)(?:\b(?:https?:)?//)?(?<![\w.-])(?:[a-z0-9-]+\.)*doubleclick\.net/[^\s\"'<>]+")
_FB_HOST = r"(?<![\w.-])(?:https?://)?(?:(?:www|m|web|mbasic|touch|business)\.)?(?:facebook|fb)\.com/"
_FB_USERID = re.compile(
    r"(?i)(?:" + _FB_HOST + r"(?:profile\.php\?(?:[^\s#\"'<>]*?&)?id=|(?:people/[^/\s]+|app_scoped_user_id)/)"
    r"(?P<v>\d{1,20})"
    r"|(?:\bfbid=|\bfb[_-]?(?:user)?[_-]?id\s*[=:]\s*)(?P<v2>\d{5,20}))\b"
)
# facebook.com/<username>: 5-50 letters, digits and dots; not a reserved first path segment, not a .php page
_FB_RESERVED = (
    "groups|pages|events|watch|marketplace|gaming|policies|privacy|legal|terms|login|logout|recover|sharer|share|"
    "dialog|plugins|business|settings|notifications|messages|friends|search|hashtag|stories|reels|photos|videos|"
    "photo|video|media|story|permalink|profile|people|about|careers|fundraisers|bookmarks|saved|memories|places|"
    "games|developers|security|campaign|badges|directory|mobile|public|home|help"
)
_FB_VANITY = re.compile(
    r"(?i)" + _FB_HOST + r"(?!(?:" + _FB_RESERVED + r")(?![A-Za-z0-9.])|[A-Za-z0-9.]*\.php\b)"
    r"(?P<v>[A-Za-z0-9][A-Za-z0-9.]{3,48}[A-Za-z0-9])(?![\w.-]*\w|[-=])"
)
# Patterns that run on every text start with a character class (not a look-behind), which the regex engine
# uses to skip ahead: `\d(?<![\d.,-]\d)` is "a digit not preceded by a digit, dot, comma or dash".
_CARD = re.compile(
    r"\d(?<![\d.,-]\d)(?:"
    r"\d{12,18}"
    r"|\d{3}(?P<s1>[ -])\d{4}(?P=s1)\d{4}(?P=s1)\d{4}(?:(?P=s1)\d{1,3})?"
    r"|\d{3}(?P<s2>[ -])\d{6}(?P=s2)\d{4,5}"  # Amex 4-6-5, Diners 4-6-4
    r")(?![\d-]|[.,]\d)"
)
_SSN = re.compile(r"\d(?<![\d-]\d)\d\d-\d\d-\d{4}(?![\d-]|\.\d)")  # issued ranges: `_is_ssn`
# SSN: 123 45 6789 / 123456789 only after a label; SSN, SS#, social security (number|no|#), optional is/:/=
_SSN_LABELLED = re.compile(
    r"(?i:\b(?:ssn\b|ss\#|soc(?:ial)?\.?\s*sec(?:urity)?\.?)(?:\s*(?:number|no\.?|num|\#))?"
    r"\s*(?:is\s+|was\s+|[:=#]\s*)?)"
    r"(?<![\d-])(?P<v>\d{3}(?P<sep>[ -]?)\d{2}(?P=sep)\d{4})(?![\d-]|\.\d)"
)
# UK National Insurance number: the spaced form alone, the compact one after a label (prefixes never issued left out)
_NINO_CORE = r"(?!BG|GB|KN|NK|NT|TN|ZZ)[A-CEGHJ-PR-TW-Z][A-CEGHJ-NPR-TW-Z]"
_NINO = re.compile(  # a capital that starts a word, a second one, and not a prefix that is never issued
    r"[A-CEGHJ-PR-TW-Z](?<![A-Za-z0-9][A-Z])[A-CEGHJ-NPR-TW-Z](?<!BG|GB|KN|NK|NT|TN|ZZ)"
    r" \d{2} \d{2} \d{2} [A-D](?![A-Za-z0-9])"
)
_NINO_LABELLED = re.compile(
    r"(?i:\b(?:national\s+insurance(?:\s+(?:number|no\.?|\#))?|NI\s+(?:number|no\.?)|NINO)\s*(?:is\s+|[:#]\s*)?)"
    r"(?P<v>" + _NINO_CORE + r" ?\d{2} ?\d{2} ?\d{2} ?[A-D])(?![A-Za-z0-9])"
)
_EXT = r"(?P<ext>\s*(?:x|ext\.?|extension)\s*\d{1,6})?"  # x12, ext. 204
_PHONE = re.compile(
    r"(?<![\w.+/-])(?:"
    # NANP: (555) 123-4567, 555.123.4567, +1 555 123 4567
    r"(?:\+1[ .-]?|1[ .-])?(?:\(\d{3}\)[ ]?|\d{3}[ .-])\d{3}[ .-]\d{4}"
    # international: +44 20 7946 0958, 0049 (0)30 1234567, +447700900123 (checked by `_is_phone`)
    r"|(?P<intl>\+|(?<!\d[ .-])00(?=[1-9]\d{0,2}[ .(-]))(?P<cc>\d+)(?:[ .-]?\(\d{1,4}\)[ .-]?\d+|[ .-]\d+)*"
    r")" + _EXT + r"(?![\w-]|\.\d)"
)
# national or unseparated numbers only after a label: `tel: 5551234567`, `Phone: 07700 900461`, `call me at 555-0199`
_PHONE_LABELLED = re.compile(
    r"(?i:\b(?:t[eé]l(?:[eé]phone|efon|[eé]fono)?|phone|ph(?=[.:])|mobile|mob|cell(?:phone)?|fax|whats\s?app|"
    r"hotline|"
    r"contact\s+(?:number|no)|(?:call|ring|dial)(?:\s+(?:me|us))?(?:\s+(?:at|on))?|text\s+(?:me|us)(?:\s+(?:at|on))?)"
    r"\b\.?(?:\s*(?:number|no\.?|num|\#))?\s*[:#.=]?\s*(?:is\s+|at\s+|on\s+)?)"
    r"(?<![\w.+/-])(?P<v>(?:\+|00)?\(?\d[\d ().\-/]*\d" + _EXT + r")(?![\w-]|\.\d)"
)
_PHONE_LABEL_HINTS = (
    "tel",
    "tél",
    "phone",
    "ph.",
    "ph:",
    "mob",
    "cell",
    "fax",
    "whats",
    "hotline",
    "contact",
    "call",
    "ring",
    "dial",
    "text",
)
_WHATSAPP = re.compile(r"(?i)\bwa\.me/(?P<v>\d{8,15})\b")
_DATE_LIKE = re.compile(r"\d{4}-\d{1,2}-\d{1,2}|\d{1,2}[/.]\d{1,2}[/.]\d{2,4}\b")
_THOUSANDS = re.compile(r"\+?\d{1,3}(?:([ .,])\d{3})(?:\1\d{3})*")
# E.164 country codes (for `00CC ...` and `+CC ...` numbers)
_COUNTRY_CODES: frozenset[str] = frozenset(
    "1 7 20 27 30 31 32 33 34 36 39 40 41 43 44 45 46 47 48 49 51 52 53 54 55 56 57 58 60 61 62 63 64 65 66 81 82 84 "
    "86 90 91 92 93 94 95 98 211 212 213 216 218 290 291 297 298 299 420 421 423 670 800 808 850 852 853 855 856 870 "
    "878 880 881 882 883 886 888 979 992 993 994 995 996 998".split()
    + [
        str(c)
        for lo, hi in ((220, 269), (350, 359), (370, 389), (500, 509), (590, 599), (672, 692), (960, 977))
        for c in range(lo, hi + 1)
    ]
)

# user handles -------------------------------------------------------------------------------------------------
# Both start with the literal `@` (the look-behind on the character before it comes second, `@(?<!X@)` being
# `(?<!X)@`), so the regex engine jumps from one `@` to the next instead of trying every position.
_FEDI_HANDLE = re.compile(r"@(?<![\w@.+-]@)[A-Za-z0-9_]{1,30}@" + _LABEL)  # @alex@mastodon.social
_HANDLE = re.compile(
    r"@(?<![\w@./+`%*-]@)(?P<name>[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,28}[A-Za-z0-9_])?)"
    r"(?![\w@/(-]|\.\w|\s+(?:public|private|protected|static|final|void|abstract|def|fun|async|function)\b)"
)
_HANDLE_DOMAIN = re.compile(
    r".+\.(?:com|net|org|edu|gov|mil|int|io|co|uk|de|fr|ru|jp|cn|info|biz)", re.IGNORECASE
)
_HANDLE_QUANTITY = re.compile(
    r"\d+(?:\.\d+)?(?:am|pm|k|m|x|h|hrs?|min|s|mph|px|em|rem|kg|g|lb)?", re.IGNORECASE
)
# u/name, /u/name (Reddit: 3-20 letters, digits, _ and -); not inside paths (src/u/x) or doses (10 u/day)
_REDDIT_USER = re.compile(r"(?<![\w/.~\\-])(?<!\d )/?u/(?P<name>[A-Za-z0-9_-]{3,20})(?![\w/-])")
# profile URLs: the name of twitter.com/NAME, x.com/NAME, instagram.com/NAME, t.me/NAME, reddit.com/user/NAME,
# linkedin.com/in/NAME, youtube.com/user/NAME; github.com/NAME only as a whole URL (not github.com/NAME/repo)
_PROFILE_URL = re.compile(
    r"(?i)(?<![\w.-])(?:https?://)?(?:(?:www|mobile|m|old|new|np)\.)?"
    r"(?P<host>twitter\.com|x\.com|instagram\.com|t\.me|github\.com|reddit\.com/(?:u|user)|linkedin\.com/in|"
    r"youtube\.com/user)/(?P<v>[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,98}[A-Za-z0-9_])?)(?![\w-]|\.\w)"
)
_PROFILE_HOSTS = (
    "twitter.com",
    "x.com",
    "instagram.com",
    "t.me/",
    "github.com",
    "reddit.com",
    "linkedin.com",
    "youtube.com",
)
_PROFILE_RESERVED: frozenset[str] = frozenset(
    "home explore search i intent share hashtag settings notifications messages login logout signup tos privacy "
    "about compose p reel reels stories tv accounts direct features topics orgs marketplace pricing sponsors join "
    "joinchat addstickers addemoji s c proxy socks help en jobs legal developers apps enterprise site security "
    "contact collections trending sessions new organizations team customer-stories readme events business".split()
)
# youtube.com/@name, tiktok.com/@name, medium.com/@name, mastodon.social/@name (other hosts: not before a path)
_AT_URL = re.compile(
    r"(?i)(?<![\w.-])(?:https?://)?(?P<host>(?:[a-z0-9-]+\.)+[a-z]{2,24})/"
    r"(?P<v>@[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,48}[A-Za-z0-9_])?)(?![\w-]|\.\w)(?P<path>/)?"
)
_AT_URL_HOSTS = ("youtube.com", "tiktok.com", "medium.com", "threads.net")
_DISCORD = re.compile(
    r"(?i:\bdiscord(?:\s+(?:tag|id|name|username))?\s*[:=]?\s*(?:is\s+)?)(?P<v>[A-Za-z0-9_.]{2,32}#\d{4})\b"
)
_DECORATOR_LINE = re.compile(
    r"^[ \t]*(?:(?:>>>|\.\.\.)[ \t]+)?@[A-Za-z_][\w.]*[ \t]*(?:\(.*)?(?:#.*)?$", re.MULTILINE
)
# a dotted @name that reads as code (`@np.vectorize`, `@x.setter`, `@pytest.mark.slow`, `@nx._dispatchable`)
_CODE_MODULES: frozenset[str] = frozenset(
    "np numpy pd pandas torch tf jax jnp nn F pytest unittest mock functools typing abc app router bp api nx st "
    "dataclasses contextlib asyncio attr attrs pydantic numba nb triton django flask click util utils self cls "
    "angular ember vue react ng".split()
)
# at-keywords of code, docs, stylesheets and chat tools that are not user handles
CODE_AT_WORDS: frozenset[str] = frozenset(
    "param params return returns throws throw raises exception see since author version deprecated override "
    "inheritdoc link code type typedef property staticmethod classmethod abstractmethod dataclass media import "
    "font-face keyframes charset supports page namespace include mixin extend interface implementation end "
    "synthesize protocol selector encode available brief file class struct note todo example "
    # JUnit / Java / Kotlin / Spring / JSDoc / CSS at-rules / Sass / Slack-style group mentions
    "test before after beforeeach aftereach beforeall afterall beforeclass afterclass ignore disabled "
    "parameterizedtest nested suppresswarnings functionalinterface safevarargs nullable nonnull notnull "
    "autowired inject component service repository controller restcontroller entity table column id "
    "transactional bean configuration jsonproperty requestmapping getmapping postmapping override "
    "callback template returns async private public protected static readonly module exports const enum "
    "memberof fires event yields requires license summary description default abstract alias augments "
    "tailwind apply layer container font-feature-values counter-style use forward each if else for while "
    "function debug warn error content at-root here channel everyone "
    "system-service privileged basic-io raw-io file-system network-io".split()  # systemd syscall filter sets
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


def card_brand_ok(digits: str) -> bool:
    """Whether the issuer prefix and length fit a card scheme (Visa, Mastercard, Amex, Diners, JCB, Discover,
    UnionPay, Maestro): fewer ids and order numbers that merely pass Luhn look like cards."""
    n, p2, p3, p4 = len(digits), int(digits[:2]), int(digits[:3]), int(digits[:4])
    if digits[0] == "4":
        return n in (13, 16, 19)
    if 51 <= p2 <= 55 or 2221 <= p4 <= 2720:
        return n == 16 or (digits[0] == "5" and 16 <= n <= 19)
    if p2 in (34, 37):
        return n == 15
    if p2 in (36, 38, 39) or 300 <= p3 <= 305:
        return 14 <= n <= 19
    if 3528 <= p4 <= 3589:
        return 16 <= n <= 19
    return digits[0] in "56" and 16 <= n <= 19  # Discover, UnionPay, Maestro


def _is_card(m: re.Match) -> bool:
    digits = re.sub(r"\D", "", m.group(0))
    return 13 <= len(digits) <= 19 and len(set(digits)) > 1 and card_brand_ok(digits) and luhn_ok(digits)


def _is_ssn(m: re.Match) -> bool:
    """Not in the SSA's never-issued ranges: area 000, 666 or 9xx, group 00, serial 0000."""
    d = re.sub(r"\D", "", m.group("v") if "v" in m.re.groupindex else m.group(0))
    return d[:3] not in ("000", "666") and d[0] != "9" and d[3:5] != "00" and d[5:] != "0000"


def _is_phone(m: re.Match) -> bool:
    """International (`+CC`, `00CC`) numbers: 8-15 digits, a real country code, not a signed quantity."""
    if m.group("intl") is None:
        return True
    number = m.group(0)[: m.start("ext") - m.start()] if m.group("ext") else m.group(0)
    digits = re.sub(r"\D", "", number)
    if m.group("intl") == "00":
        digits = digits[2:]
    cc = m.group("cc")
    if len(cc) > 3:  # +447700900123: no separator after the country code
        return 10 <= len(digits) <= 15 and any(cc[:k] in _COUNTRY_CODES for k in (1, 2, 3))
    if _THOUSANDS.fullmatch(number.lstrip("+0") if m.group("intl") == "00" else number):
        return False
    return 8 <= len(digits) <= 15 and cc in _COUNTRY_CODES


def _is_labelled_phone(m: re.Match) -> bool:
    v = m.group("v")[: m.start("ext") - m.start("v")] if m.group("ext") else m.group("v")
    return 7 <= sum(c.isdigit() for c in v) <= 15 and not _DATE_LIKE.search(v)


_RETINA = re.compile(r"\d+(?:\.\d+)?x\.")  # logo@2x.png
_PATH_NEXT = re.compile(r"/[\w.-]")  # github.com/org/repo


def _email_ok(m: re.Match) -> bool:
    """Not `git@github.com` (a code host's SSH account) nor `logo@2x.png` (a retina image name)."""
    local, _, domain = m.group(0).lower().partition("@")
    if local == "git" and (domain in _CODE_HOSTS or domain.startswith(("github.", "gitlab."))):
        return False
    return not _RETINA.match(domain)


def _obfuscated_ok(m: re.Match) -> bool:
    """`TOM AT HOME DOT COM` (all-caps prose) and `log in at gmail.com` (no e-mail-like local part) are kept."""
    text = m.group(0)
    local = re.split(r"[\s\[({<%]", text, maxsplit=1)[0]
    if re.search(r"\sAT\s", text):
        return not local.isupper()
    if re.search(r"\sat\s", text) and not re.search(r"\sdot\s", text):
        return bool(re.search(r"[._\d]", local))
    return True


def _profile_ok(m: re.Match) -> bool:
    name, host = m.group("v").lower(), m.group("host").lower()
    if name in _PROFILE_RESERVED:
        return False
    return not host.startswith("github") or not _PATH_NEXT.match(m.string[m.end() : m.end() + 2])


def _at_url_ok(m: re.Match) -> bool:
    host = m.group("host").lower()
    return host.endswith(_AT_URL_HOSTS) or m.group("path") is None


def _reddit_ok(m: re.Match) -> bool:
    return m.group("name").lower() not in ("day", "hour", "min", "week", "month", "year", "dose")


def _decorator_spans(text: str) -> list[tuple[int, int]]:
    return [m.span() for m in _DECORATOR_LINE.finditer(text)] if "@" in text else []


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
        self.spans: list[Optional[Span]] = []  # None: absorbed by a later, wider match
        self._tokens: list[tuple[int, int, int]] = []
        self._starts: list[int] = []
        self._shape: Optional[_Shape] = None

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

    def shape(self) -> "_Shape":
        """The byte shape of the current text (made again only after a step changed the text)."""
        if self._shape is None or self._shape.text is not self.text:
            self._shape = _Shape(self.text)
        return self._shape

    def run(
        self,
        cat: str,
        pattern: re.Pattern,
        accept: Callable[[re.Match], bool] = lambda m: True,
        matches: Optional[Iterable[re.Match]] = None,
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


def _handle_ok(text: str) -> Callable[[re.Match], bool]:
    decorators: list[list[tuple[int, int]]] = []  # the decorator lines of `text`, found on first need

    def accept(m: re.Match) -> bool:
        name = m.group("name")
        if (
            name.lower() in CODE_AT_WORDS
            or _HANDLE_QUANTITY.fullmatch(name)
            or _HANDLE_DOMAIN.fullmatch(name)
        ):
            return False  # @param, @media, @3pm, @2x, '%@example.com'
        if "." in name:
            parts = name.split(".")
            if (
                parts[0] in _CODE_MODULES
                or parts[-1] in ("setter", "getter", "deleter")
                or any(q.startswith("_") for q in parts)
                or re.search(r"\d\.\d+$", name)
            ):  # @GLIBC_2.3
                return False
        if not decorators:
            decorators.append(_decorator_spans(text))
        return not any(s <= m.start() < e for s, e in decorators[0])

    return accept


@dataclass(frozen=True)
class Anonymised:
    text: str
    counts: dict[str, int] = field(default_factory=dict)  # category -> replacements (only non-zero)


# --- pre-screens ------------------------------------------------------------------------------------------------
# Most steps find nothing in most documents, and a regex that cannot jump to a literal first character tries every
# position of the text (10-40 ns a character, more than GPT-2 encoding leaves us). So `_anonymise`
#   1. tests a byte *shape* of the text (`_Shape`: same length, so offsets agree; lower-cased, each digit 0-9 is
#      b"0", each non-ASCII character b"?") with substring tests and byte regexes that start with a literal (~1 ns
#      a character);
#   2. runs a step only when the current text holds what every *accepted* match of it needs (with no accepted
#      match a step changes nothing, whatever it rejects);
#   3. runs the costly steps only where a match can be: `pattern.match` at candidate starts (`_matches_at`) or
#      `finditer` in windows around an anchor (an `@`, a `.com/`) that hold every character a match there reads.
#      Each finder says why it yields exactly `pattern.finditer(text)`.
# A text whose shape is not exact (a decimal digit other than 0-9; İ ı ſ K, which case-insensitive patterns take
# for i, i, s, k and `str.lower` turns into ASCII) goes through `_anonymise_reference`, the same steps unscreened.
# tests/test_anonymise.py compares the two pipelines and pins outputs at every pre-screen's boundary.

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
    for codec in (
        "latin-1",
        "cp1252",
    ):  # fast whole-text checks; neither repertoire holds a character >= U+0130
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

    def __init__(self, text: str, b: Optional[bytes] = None) -> None:
        self.text = text
        self.b = text.encode("ascii", "replace").translate(_SHAPE) if b is None else b
        self._anchors: Optional[list[int]] = None
        self._anchor_matches: list[re.Match] = []
        self._kinds: Optional[dict[str, list[int]]] = None
        self._slashes: Optional[dict[str, list[int]]] = None

    def spliced(self, text: str, replaced: list[tuple[int, int]], token: str) -> "_Shape":
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


def _occurrences(hay: Union[str, bytes], needle: Union[str, bytes]) -> list[int]:
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


_EMAIL_WINDOWS: dict[Union[str, tuple[int, str]], tuple[tuple[int, int], ...]] = {}  # see `_email_spans`
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
        lo = max(
            lo, mask.rfind(b".", lo, a) + 1, mask.rfind(b"@", lo, a) + 1
        )  # the local-part run before the `@`
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


_DART_KEY = re.compile(
    rb"d(?:art[_\-]?id|c(?:[_\-]?rdid|[_\-]?uid|lid))"
)  # `dart_id`, `dc_rdid`, `dcuid`, `dclid`
_DART_HINTS = (b"dart", b"dc_", b"dc-", b"dclid", b"dcrdid", b"dcuid")
_FB_ID_HINT = re.compile(rb"fb[_\-]?(?:user)?[_\-]?id")  # `fbid=`, `fb_user_id:`


_NINO_LABEL = re.compile(
    rb"ni(?:no|" + _SP + rb"+n)"
)  # in the lower-cased shape: `NINO`, `NI number`, `NI no`
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


def _anonymise(text: str, track: bool) -> _Pass:
    """The one anonymisation pipeline behind `anonymise` and `find_spans` (each step sees the previous output).

    The steps, their order and their word gates are `_anonymise_reference`'s; here each step runs only when the
    current text can hold a match it accepts, and only where (the pre-screens above), so a text without
    candidates costs a few substring tests. The word gates test the input, as the reference's do; a gate that
    every match implies (a phone label word, a profile host) is left to the step's finder."""
    if not _screenable(text):
        return _anonymise_reference(text, track)
    p = _Pass(text, track)
    sh = (
        p.shape()
    )  # the current text's shape: taken again after each step that ran (a replacement splices it)
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
    if b"0" in sh.b:
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


# --- evaluation on a labelled set -------------------------------------------------------------------------------

SpanLike = Union[Span, tuple[int, int, str]]
_TOKEN = re.compile("|".join(re.escape(t) for t in TOKENS.values()))


def load_labelled(path: Union[str, os.PathLike]) -> list[dict]:
    """Read a labelled JSONL file: one `{"text": str, "spans": [{"start", "end", "category"}, ...]}` per line.

    Raises ValueError naming `file:line` for a malformed line (bad JSON, a span outside the text, overlapping
    spans, an unknown category) and OSError for an unreadable file."""
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
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
    errors: Optional[list[tuple[str, str, str]]] = None,
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
    spec = importlib.util.spec_from_file_location("_anonymise_baseline", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--baseline {path}: not a Python file")
    if not os.path.isfile(path):
        raise FileNotFoundError(errno.ENOENT, "No such file", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is created
    try:
        spec.loader.exec_module(mod)
    except (SyntaxError, ImportError) as e:
        raise ValueError(f"--baseline {path}: cannot import it ({type(e).__name__}: {e})") from None
    finally:
        del sys.modules[spec.name]
    if not callable(getattr(mod, "anonymise", None)):
        raise ValueError(f"--baseline {path}: has no anonymise(text) function")
    return lambda text: mod.anonymise(text).text


@cli_main
def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m data.anonymise --evaluate FILE`: a precision/recall table (0), or one error line (2)."""
    p = argparse.ArgumentParser(
        prog="python -m data.anonymise", description=evaluate_spans.__doc__.split("\n")[0]
    )
    p.add_argument("--evaluate", required=True, metavar="FILE", help="labelled JSONL (see load_labelled)")
    p.add_argument(
        "--baseline",
        metavar="MODULE.py",
        help="evaluate the anonymise() of another copy of this module instead of this one",
    )
    p.add_argument("--errors", action="store_true", help="also list every missed and spurious span")
    a = p.parse_args(argv)
    records = load_labelled(a.evaluate)
    find = find_spans
    if a.baseline:
        other = _load_anonymiser(a.baseline)
        find = lambda text: spans_from_output(text, other(text))  # noqa: E731
    errors: list[tuple[str, str, str]] = []
    result = evaluate_spans(records, find, errors if a.errors else None)
    print(f"{a.evaluate}: {len(records)} lines, anonymiser {a.baseline or 'data/anonymise.py'}")
    print(format_table(result))
    for kind, cat, text in errors:
        print(f"{kind}\t{cat}\t{text}")
    return 0


if __name__ == "__main__":
    exit_process(main())
