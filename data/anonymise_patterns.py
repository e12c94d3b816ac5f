"""What counts as a match in anonymisation (data/anonymise.py): the categories and their dummy tokens, the compiled
patterns of each category, and the checks that accept or reject a match (Luhn, card schemes, issued SSN ranges,
country codes, code look-alikes). Compiled once, at import: anonymisation is a hot path. The choices behind each
pattern are in docs/anonymise.md."""

from __future__ import annotations

import re
from collections.abc import Callable

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
            # @GLIBC_2.3
            if (
                parts[0] in _CODE_MODULES
                or parts[-1] in ("setter", "getter", "deleter")
                or any(q.startswith("_") for q in parts)
                or re.search(r"\d\.\d+$", name)
            ):
                return False
        if not decorators:
            decorators.append(_decorator_spans(text))
        return not any(s <= m.start() < e for s, e in decorators[0])

    return accept
