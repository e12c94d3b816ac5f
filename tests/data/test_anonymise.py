"""Anonymisation (DEMix Table 8): every category replaced, look-alikes kept, per-domain policy, and the span
evaluation on the labelled set tests/fixtures/anonymise_labelled.jsonl."""

import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from data.anonymise import CATEGORIES, Span, anonymise, anonymise_many, find_spans, main, resolve_policy
from data.anonymise_eval import evaluate_spans, load_labelled, spans_from_output
from data.anonymise_patterns import card_brand_ok, luhn_ok
from data.anonymise_pipeline import _anonymise_reference

ROOT = Path(__file__).resolve().parents[2]
LABELLED = ROOT / "tests" / "fixtures" / "anonymise_labelled.jsonl"

POSITIVES = [
    ("write to jane.doe+news@example.co.uk today", "write to <EMAIL> today", "EMAIL"),
    ("contact: J_Smith@mail-server.example.org.", "contact: <EMAIL>.", "EMAIL"),
    ("tag dart_id=AB12cd34ef loaded", "tag dart_id=<DART> loaded", "DART"),
    ("<img src=http://ad.doubleclick.net/ad/N123.site/B456;sz=1x1>", "<img src=<DART>>", "DART"),
    (
        "see facebook.com/profile.php?id=100004123456789 now",
        "see facebook.com/profile.php?id=<FB_USERID> now",
        "FB_USERID",
    ),
    ("fb_user_id: 1234567890", "fb_user_id: <FB_USERID>", "FB_USERID"),
    ("call (555) 123-4567 now", "call <PHONE_NUMBER> now", "PHONE_NUMBER"),
    ("call 555.123.4567.", "call <PHONE_NUMBER>.", "PHONE_NUMBER"),
    ("or +1 555 123 4567", "or <PHONE_NUMBER>", "PHONE_NUMBER"),
    ("London +44 20 7946 0958", "London <PHONE_NUMBER>", "PHONE_NUMBER"),
    ("card 4111 1111 1111 1111 exp", "card <CREDIT_CARD_NUMBER> exp", "CREDIT_CARD_NUMBER"),
    ("card 4111-1111-1111-1111", "card <CREDIT_CARD_NUMBER>", "CREDIT_CARD_NUMBER"),
    ("amex 3782 822463 10005", "amex <CREDIT_CARD_NUMBER>", "CREDIT_CARD_NUMBER"),
    ("mc 5555555555554444", "mc <CREDIT_CARD_NUMBER>", "CREDIT_CARD_NUMBER"),
    ("SSN 123-45-6789 on file", "SSN <SSN> on file", "SSN"),
    ("thanks @jack_dorsey and @NASA!", "thanks <USER> and <USER>!", "USER"),
    ("@nytimes great piece", "<USER> great piece", "USER"),
]

NEGATIVES = [
    "on 2021-03-04 and 03/04/2021 at 12:30:45 or 9:05 pm",
    "version 1.2.3, build v10.0.19041.1415, python 3.11.4",
    "it costs $1,234.56 or EUR 1.234,56; pi is 3.14159265358979",
    "server 192.168.100.200 and 10.0.0.1:8080, netmask 255.255.255.0",
    "ISBN 978-3-16-148410-0 and ISBN 0-306-40615-2, ISBN-13 9780306406157",
    "@property\ndef name(self):\n    return self._name\n",
    "class A:\n    @app.route('/users/<id>')\n    def f(self): pass\n",
    "c = a@b  # matrix multiply\nuser@host:~$ ls\n",
    "/**\n * @param name the name\n * @return the value\n */\n@Override\npublic String toString()",
    "@media screen { body { color: red } }",
    "order 4111111111111112 (Luhn fails), id 1234567890123456",
    "2020-2021 season, pages 123-456, 1999-2004-2010",
    "invoice 000-12-3456 and 666-12-3456 are never issued SSNs",
    "phone-like 1234-567-8901 or 12345.678.9012 are not NANP numbers",
    "coordinates 47.6062, -122.3321; 1e-10; 0x7fff_ffff",
    "<EMAIL> <USER> <PHONE_NUMBER>",
]


def test_counts_per_category_on_a_mixed_document():
    text = "Mail a@b.com or c@d.org, call 555-123-4567, cc @bob. SSN 219-09-9999. " + "@alice hi"
    r = anonymise(text)
    assert r.counts == {"EMAIL": 2, "PHONE_NUMBER": 1, "USER": 2, "SSN": 1}
    assert "@" not in r.text


def test_luhn():
    assert luhn_ok("4111111111111111") and luhn_ok("378282246310005")
    assert not luhn_ok("4111111111111112")


def test_policy_per_domain_and_typos_rejected():
    assert resolve_policy(True, ["news", "code"]) == {"news": True, "code": True}
    assert resolve_policy({"code": False}, ["news", "code"]) == {"news": True, "code": False}
    with pytest.raises(ValueError, match="unknown domains"):
        resolve_policy({"kode": False}, ["news", "code"])
    texts, counts = anonymise_many(["x@y.com"], enabled=False)
    assert texts == ["x@y.com"] and counts == {}


# --- forms added for the labelled set: each with its look-alikes ------------------------------------------------------

NEW_POSITIVES = [
    # e-mail: case, sub-domains, plus-tags, obfuscations, URL-encoded
    ("mail JANE.DOE@EXAMPLE.COM now", "mail <EMAIL> now", "EMAIL"),
    ("to: a.b+tag@sub.mail.example.org", "to: <EMAIL>", "EMAIL"),
    ("from _jane@example.com", "from <EMAIL>", "EMAIL"),
    ("Reported-by: Daniel Hahler <git@thequod.de>", "Reported-by: Daniel Hahler <<EMAIL>>", "EMAIL"),
    ("write to maria [at] example [dot] org today", "write to <EMAIL> today", "EMAIL"),
    ("Questions? info(at)kanzlei-beispiel.de", "Questions? <EMAIL>", "EMAIL"),
    ("feedback {at} example {dot} org", "<EMAIL>", "EMAIL"),
    ("reach me at tom.h AT gmail DOT com", "reach me at <EMAIL>", "EMAIL"),
    ("jenny at gmail dot com", "<EMAIL>", "EMAIL"),
    ("Erdal Ronahi <erdal dot ronahi at gmail dot com>", "Erdal Ronahi <<EMAIL>>", "EMAIL"),
    ("Nick <nick(dot)treleaven(at)btinternet(dot)com>", "Nick <<EMAIL>>", "EMAIL"),
    ("jane.doe at gmail.com", "<EMAIL>", "EMAIL"),
    ("unsub?email=bob.k%40example.net&list=7", "unsub?email=<EMAIL>&list=7", "EMAIL"),
    # DART: click ids and any doubleclick.net ad URL with a path
    ("landing.html?dclid=CJ3g8pXy7O8CFQ&x=1", "landing.html?dclid=<DART>&x=1", "DART"),
    ('<iframe src="https://googleads.g.doubleclick.net/pagead/id?x=1">', '<iframe src="<DART>">', "DART"),
    # Facebook: profile ids of any length, other hosts and URL shapes, vanity names
    ("facebook.com/profile.php?id=4", "facebook.com/profile.php?id=<FB_USERID>", "FB_USERID"),
    (
        "https://m.facebook.com/profile.php?id=1000123&ref=bm",
        "https://m.facebook.com/profile.php?id=<FB_USERID>&ref=bm",
        "FB_USERID",
    ),
    (
        "fb.com/profile.php?sk=about&id=100064123456789",
        "fb.com/profile.php?sk=about&id=<FB_USERID>",
        "FB_USERID",
    ),
    (
        "www.facebook.com/people/Anna-Schmidt/100087654321098/",
        "www.facebook.com/people/Anna-Schmidt/<FB_USERID>/",
        "FB_USERID",
    ),
    ("Add me on facebook.com/jenny.larsen.71 :)", "Add me on facebook.com/<FB_USERID> :)", "FB_USERID"),
    # cards: Diners 4-6-4, JCB, Mastercard 2-series, 13-digit Visa
    ("Diners 3056 930902 5904 declined", "Diners <CREDIT_CARD_NUMBER> declined", "CREDIT_CARD_NUMBER"),
    ("JCB 3530 1113 3330 0000", "JCB <CREDIT_CARD_NUMBER>", "CREDIT_CARD_NUMBER"),
    ("MC 2223 0031 2200 3222", "MC <CREDIT_CARD_NUMBER>", "CREDIT_CARD_NUMBER"),
    ("visa 4222222222222", "visa <CREDIT_CARD_NUMBER>", "CREDIT_CARD_NUMBER"),
    # SSN with a label in other spellings; UK National Insurance numbers
    ("my social security number is 219 09 9999, thanks", "my social security number is <SSN>, thanks", "SSN"),
    ("SSN 536228741 on the form", "SSN <SSN> on the form", "SSN"),
    ("ssn=501-22-3344&year=2020", "ssn=<SSN>&year=2020", "SSN"),
    ("National Insurance No. JG 10 37 59 A", "National Insurance No. <SSN>", "SSN"),
    ("NINO: PE123456B", "NINO: <SSN>", "SSN"),
    ("payslip shows AB 12 34 56 C", "payslip shows <SSN>", "SSN"),
    # phones: international forms, extensions, labelled national / unseparated numbers, wa.me
    ("Call us on +49 (0)30 1234567 today", "Call us on <PHONE_NUMBER> today", "PHONE_NUMBER"),
    ("UK office 0044 20 7946 0123.", "UK office <PHONE_NUMBER>.", "PHONE_NUMBER"),
    ("from Europe dial 001 212 555 0100", "from Europe dial <PHONE_NUMBER>", "PHONE_NUMBER"),
    ("new number +447700900987, save it", "new number <PHONE_NUMBER>, save it", "PHONE_NUMBER"),
    ("Mobile: +33 6 12 34 56 78", "Mobile: <PHONE_NUMBER>", "PHONE_NUMBER"),
    ("whatsapp +91 98765 43210 for orders", "whatsapp <PHONE_NUMBER> for orders", "PHONE_NUMBER"),
    ("Reception: 555-014-7788 ext. 204", "Reception: <PHONE_NUMBER>", "PHONE_NUMBER"),
    ("Dial (555) 010-3344 x12 now", "Dial <PHONE_NUMBER> now", "PHONE_NUMBER"),
    ("Tel +49 30 1234 56789 ext. 1234, ask for Jan", "Tel <PHONE_NUMBER>, ask for Jan", "PHONE_NUMBER"),
    ("tel: 5550192834", "tel: <PHONE_NUMBER>", "PHONE_NUMBER"),
    ("Phone: 07700 900461", "Phone: <PHONE_NUMBER>", "PHONE_NUMBER"),
    ("call me at 555-0199 after six", "call me at <PHONE_NUMBER> after six", "PHONE_NUMBER"),
    ("Tel.: 030/1234567", "Tel.: <PHONE_NUMBER>", "PHONE_NUMBER"),
    ("ph. (02) 9374 4000", "ph. <PHONE_NUMBER>", "PHONE_NUMBER"),
    (
        "api.whatsapp.com/send?phone=447700900123",
        "api.whatsapp.com/send?phone=<PHONE_NUMBER>",
        "PHONE_NUMBER",
    ),
    ("Message me on wa.me/447700900123", "Message me on wa.me/<PHONE_NUMBER>", "PHONE_NUMBER"),
    # user handles: Reddit, dotted/dashed @names, fediverse, profile URLs, Discord tags
    ("thanks u/throwaway_4821!", "thanks <USER>!", "USER"),
    ("As /u/spez said", "As <USER> said", "USER"),
    ("posted by u/Frugal-Fox-22.", "posted by <USER>.", "USER"),
    ("reddit.com/user/kindly_stranger99/comments", "reddit.com/user/<USER>/comments", "USER"),
    ("old.reddit.com/u/lurker_since_2012", "old.reddit.com/u/<USER>", "USER"),
    ("IG @sarah.bakes.bread for pics", "IG <USER> for pics", "USER"),
    ("cc @octo-cat for review", "cc <USER> for review", "USER"),
    ("toot me at @alex@mastodon.social", "toot me at <USER>", "USER"),
    (
        "twitter.com/devon_writes/status/1367890123456789504",
        "twitter.com/<USER>/status/1367890123456789504",
        "USER",
    ),
    (
        "x.com/CityBakery_NYC and instagram.com/citybakery.nyc.",
        "x.com/<USER> and instagram.com/<USER>.",
        "USER",
    ),
    ("tiktok.com/@dance.with.mia", "tiktok.com/<USER>", "USER"),
    ("https://www.youtube.com/@MrTechReviews/videos", "https://www.youtube.com/<USER>/videos", "USER"),
    ("follow mastodon.social/@alex", "follow mastodon.social/<USER>", "USER"),
    ("My GitHub is github.com/jdoe42, PRs welcome", "My GitHub is github.com/<USER>, PRs welcome", "USER"),
    ("linkedin.com/in/maria-gonzalez-8a1b2c3", "linkedin.com/in/<USER>", "USER"),
    ("telegram: t.me/crypto_dave", "telegram: t.me/<USER>", "USER"),
    ("Discord: gamer_kat#4821 to squad up", "Discord: <USER> to squad up", "USER"),
]

NEW_NEGATIVES = [
    # e-mail look-alikes
    "look at the dot com bubble of 1999",
    "LOOK AT THE HOME DOT COM ERA",
    "log in at gmail.com with your work account",
    "git clone git@github.com:pytorch/pytorch.git; ssh -T git@gitlab.com",
    "ssh://git@gitlab.example.com/group/proj.git and ftp://anonymous@ftp.example.com/pub",
    "scp build.tar deploy@host.example.com:/srv/app/",
    "Download logo@2x.png and icon@3x.webp for retina screens",
    "SELECT * FROM users WHERE email LIKE '%@example.com';",
    "the [at] sign and the (dot) operator",
    # DART / Facebook look-alikes
    "Add 0.0.0.0 ad.doubleclick.net to /etc/hosts; uBlock blocks doubleclick.net.",
    "Join facebook.com/groups/123456789012345 or facebook.com/events/987654321/",
    "Shared via facebook.com/sharer/sharer.php?u=https%3A%2F%2Fexample.com",
    "see facebook.com/help/12345, facebook.com/hashtag/nlp and facebook.com/marketplace/item/123",
    "notfacebook.com/jenny.larsen is another site; fb_id = 0",
    # card look-alikes: Luhn passes, but no card scheme has that prefix and length
    "order 2000123456000005, ref 41234567890000003, id 7123456789000008, 3061234567000000",
    "IBAN DE89 3704 0044 0532 0130 00, BIC COBADEFFXXX",
    "ORCID 0000-0002-1825-0097; card ending **** **** **** 4242",
    # SSN / NINO look-alikes
    "Part number 123 45 6789 is out of stock; ssn 123 456 789 is not the shape",
    "SSN: 000-12-3456 and SSN 900-12-3456 were never issued",
    "Model AB123456C filter; HMRC's example QQ 12 34 56 C; GB 12 34 56 A",
    "session 123456789 closed",
    # phone look-alikes
    "Order #5551234567 shipped; user_id: 5551234567; ts 1614556800",
    "Text STOP to 55512 to opt out",
    "Call for papers: deadline 2021-05-15; call on 2021-03-04 at noon",
    "Tel Aviv 6100000, Israel",
    "pH 7.4 buffer, Mobile: 2.5 GHz, iPhone 12 Pro, phone: see website",
    "revenue +12.345.678 EUR, +12 345 678 visitors, +1.5% growth, +15 points",
    "UTC+05:30 and GMT+01:00",
    "0012 3456 7890 is not a dialling prefix",
    "ZIP+4 98052-6399, ISBN 0-306-40615-2, pages 123-456",
    # handle look-alikes
    "Check out r/AskHistorians and /r/science",
    "The bug is in src/u/boot/loader.c and ~/u/projects; /u/local/bin",
    "Dose 10 u/kg/day, or 10 u/day; the pump is u/s; 1000 U/min",
    "meet me @ the park, Meeting @3pm, 2 @ $0.49/lb, logo @2x",
    "@here standup moved to 10:30; @channel please review",
    "import { Component } from '@angular/core';\nnpm i -D @types/node @babel/core",
    "Decorated with @functools.lru_cache(maxsize=None) to memoise.",
    "Use `@dataclass(frozen=True)` and `@staticmethod`.",
    '@Test void parsesDates() { }\n@SuppressWarnings("unchecked") List<String> xs;',
    "@font-face { font-family: 'Inter'; }\n@tailwind base;",
    "see https://github.com/huggingface/transformers/issues/1234 and github.com/features",
    "twitter.com/home, twitter.com/search?q=x, instagram.com/p/CLx9ZyZnQ4T/, t.me/joinchat/AAAAAEk",
    "linkedin.com/company/acme-corp/jobs; unpkg.com/@babel/standalone/babel.min.js",
    "dropbox.com/s/abc/file.txt and box.com/files",
    "fixes issue#1234 and PR#5678",
]


@pytest.mark.parametrize("text,expected,category", POSITIVES + NEW_POSITIVES)
def test_positive_is_replaced_and_counted(text, expected, category):
    r = anonymise(text)
    assert r.text == expected
    assert r.counts.get(category, 0) >= 1


@pytest.mark.parametrize("text", NEGATIVES + NEW_NEGATIVES)
def test_look_alike_is_kept(text):
    r = anonymise(text)
    assert r.text == text, r.counts
    assert r.counts == {}


def test_card_schemes():
    assert (
        card_brand_ok("4111111111111111")
        and card_brand_ok("378282246310005")
        and card_brand_ok("30569309025904")
    )
    assert not card_brand_ok("2000123456000005") and not card_brand_ok("41234567890000003")


# --- the pre-screened pipeline ---------------------------------------------------------------------------------------
# `anonymise` runs each step only where its pre-screens (data/anonymise.py, "pre-screens") say a match can be. Texts
# at each pre-screen's boundary, with the outputs of the implementation before the pre-screens existed (every step
# over the whole text): a 7-digit number vs 6, digits inside words, a label far before its number or behind
# non-ASCII spaces, a rejected `+CC` number covering a NANP one, e-mail windows, GitHub repository links, the `/`
# index, e-mail windows kept per content (the same address after `//` and after a space), and texts that must take
# the unscreened path (a non-ASCII digit, K and ı, which (?i) reads as k and i).
PRESCREEN_BOUNDARIES = [
    ("call me at 555 1234 today", "call me at <PHONE_NUMBER> today", {"PHONE_NUMBER": 1}),
    ("call me at 555 123 today", "call me at 555 123 today", {}),
    ("tel: 1 2 3 4 5 6 7", "tel: <PHONE_NUMBER>", {"PHONE_NUMBER": 1}),
    ("tel: 1 2 3 4 5 6", "tel: 1 2 3 4 5 6", {}),
    ("build abc1234567def and v2x3y4z5w6q7r8", "build abc1234567def and v2x3y4z5w6q7r8", {}),
    ("ref x4111111111111111 y", "ref x<CREDIT_CARD_NUMBER> y", {"CREDIT_CARD_NUMBER": 1}),
    (
        "Copyright (C) 1999-2004 call 1999-2004",
        "Copyright (C) 1999-2004 call <PHONE_NUMBER>",
        {"PHONE_NUMBER": 1},
    ),
    ("on 2021-03-04 call 2021-03-04", "on 2021-03-04 call 2021-03-04", {}),
    ("Tel." + "\n" * 70 + "07700 900461", "Tel." + "\n" * 70 + "<PHONE_NUMBER>", {"PHONE_NUMBER": 1}),
    ("mobile" + " " * 300 + "07700 900461", "mobile" + " " * 300 + "<PHONE_NUMBER>", {"PHONE_NUMBER": 1}),
    (
        "tel"
        + " " * 50
        + "number"
        + " " * 20
        + ":"
        + " " * 20
        + "is 07700 900461",  # 9 non-space in the last 64
        "tel" + " " * 50 + "number" + " " * 20 + ":" + " " * 20 + "is <PHONE_NUMBER>",
        {"PHONE_NUMBER": 1},
    ),
    ("tel:\xa0\xa0020 7946 0958", "tel:\xa0\xa0<PHONE_NUMBER>", {"PHONE_NUMBER": 1}),
    ("Téléphone : 030/1234567", "Téléphone : <PHONE_NUMBER>", {"PHONE_NUMBER": 1}),
    ("phone number is definitely 07700 900461", "phone number is definitely 07700 900461", {}),
    ("call 12 ext 5 07700 900461", "call 12 ext 5 07700 900461", {}),
    ("string 07700 900461", "string 07700 900461", {}),
    (
        "Date: Mon, 04 Mar 2021 12:30:45 +0100 call 555-123-4567",
        "Date: Mon, 04 Mar 2021 12:30:45 +0100 call <PHONE_NUMBER>",
        {"PHONE_NUMBER": 1},
    ),
    ("+12 345-678-9012", "+12 345-678-9012", {}),  # `+12 ...` is rejected and covers the NANP number
    ("0044 20 7946 0958", "<PHONE_NUMBER>", {"PHONE_NUMBER": 1}),
    ("+447700900123", "<PHONE_NUMBER>", {"PHONE_NUMBER": 1}),
    ("(555) 123-4567 or +1 (555) 123-4567", "<PHONE_NUMBER> or <PHONE_NUMBER>", {"PHONE_NUMBER": 2}),
    (
        "4111 1111 1111 1111 and 4111-1111-1111-1111",
        "<CREDIT_CARD_NUMBER> and <CREDIT_CARD_NUMBER>",
        {"CREDIT_CARD_NUMBER": 2},
    ),
    ("3782 822463 10005", "<CREDIT_CARD_NUMBER>", {"CREDIT_CARD_NUMBER": 1}),
    ("ssn 123 45 6789", "ssn <SSN>", {"SSN": 1}),
    ("id 123-45-67890", "id 123-45-67890", {}),
    ("AB 12 34 56 C and AB 12 34 56 E", "<SSN> and AB 12 34 56 E", {"SSN": 1}),
    ("NINO AB123456C", "NINO <SSN>", {"SSN": 1}),
    (
        "user@host.com:path and mail jane@example.com: hi",
        "user@host.com:path and mail <EMAIL>: hi",
        {"EMAIL": 1},
    ),
    ("a" * 64 + "@example.com", "<EMAIL>", {"EMAIL": 1}),
    ("a" * 65 + "@example.com", "a" * 65 + "@example.com", {}),
    ("éjane@example.com", "éjane@example.com", {}),
    ("a@b@c.com", "a@<EMAIL>", {"EMAIL": 1}),
    (
        "see //jane@example.com and jane@example.com, jane@example.com",  # one address, kept after `//` only
        "see //jane@example.com and <EMAIL>, <EMAIL>",
        {"EMAIL": 2},
    ),
    ("git@github.com and git@example.org", "git@github.com and <EMAIL>", {"EMAIL": 1}),
    (
        "https://github.com/org/repo and https://github.com/jane",
        "https://github.com/org/repo and https://github.com/<USER>",
        {"USER": 1},
    ),
    ("github.com/jane/", "github.com/<USER>/", {"USER": 1}),
    ("github.com/jane.-/x", "github.com/<USER>.-/x", {"USER": 1}),
    ("see xhttps://github.com/jane", "see xhttps://github.com/<USER>", {"USER": 1}),
    (
        "https://mobile.twitter.com/jack https://t.me/durov",
        "https://mobile.twitter.com/<USER> https://t.me/<USER>",
        {"USER": 2},
    ),
    ("FB.COM/profile.php?id=123456", "FB.COM/profile.php?id=<FB_USERID>", {"FB_USERID": 1}),
    ("u/spez and /u/bob but src/u/xyz", "<USER> and <USER> but src/u/xyz", {"USER": 2}),
    ("wa.me/4915123456789 wa.me/1234567", "wa.me/<PHONE_NUMBER> wa.me/1234567", {"PHONE_NUMBER": 1}),
    ("print(format) at)", "print(format) at)", {}),
    ("jane (at) example (dot) org", "<EMAIL>", {"EMAIL": 1}),
    ("TOM AT HOME DOT COM", "TOM AT HOME DOT COM", {}),
    (
        "dart_id=AB12cd34 and wildcard dc_uid: 99887766",
        "dart_id=<DART> and wildcard dc_uid: <DART>",
        {"DART": 2},
    ),
    ("fbid=1234567 fb_user_id: 12345", "fbid=<FB_USERID> fb_user_id: <FB_USERID>", {"FB_USERID": 2}),
    ("discord: jane#1234", "discord: <USER>", {"USER": 1}),
    ("call \u0665\u0665\u0665 1234", "call <PHONE_NUMBER>", {"PHONE_NUMBER": 1}),
    ("faceboo\u212a.com/jane.doe", "faceboo\u212a.com/<FB_USERID>", {"FB_USERID": 1}),
    ("lin\u212aedin.com/in/jane", "lin\u212aedin.com/in/<USER>", {"USER": 1}),
    ("mob\u0131le 07700 900461", "mob\u0131le <PHONE_NUMBER>", {"PHONE_NUMBER": 1}),
    ("\uff11\uff12\uff13-\uff14\uff15-\uff16\uff17\uff18\uff19", "<SSN>", {"SSN": 1}),
]


def _reference(text):
    p = _anonymise_reference(text, track=True)
    return p.text, p.counts, sorted(s for s in p.spans if s is not None)


@pytest.mark.parametrize("text,expected,counts", PRESCREEN_BOUNDARIES)
def test_prescreen_boundaries_keep_the_output(text, expected, counts):
    r = anonymise(text)
    assert (r.text, r.counts) == (expected, counts)
    assert (r.text, r.counts, find_spans(text)) == _reference(text)


def test_prescreened_pipeline_is_the_reference_on_mutated_texts():
    """Seeded texts made of the labelled set, the boundary texts and the pieces the pre-screens look for, cut and
    mixed: the pre-screened and the unscreened pipeline give the same text, counts and spans."""
    rnd = random.Random(16)
    sources = [r["text"] for r in load_labelled(LABELLED)] + [t for t, _, _ in PRESCREEN_BOUNDARIES]
    pieces = list("0123456789@/.-+()#: \n") + [
        "\xa0",
        "é",
        "\u0131",
        "\u0663",
        "%40",
        "tel: ",
        "call me at ",
        "SSN ",
        "NINO ",
        "facebook.com/",
        "github.com/",
        "t.me/",
        ".com/",
        "u/",
        "wa.me/",
        "https://www.",
        "ext. 12",
        "+44 ",
        "0044 ",
        "+1 ",
        "(555) ",
        "555-123-4567",
        "4111 1111 1111 1111",
        "123-45-6789",
        " AT ",
        " DOT ",
        "[at]",
        " at gmail.com",
        "jane.doe@example.com",
        "@alice",
        "#1234",
        "discord ",
        "dart_id=",
        "1999-2004",
    ]
    for _ in range(2000):
        src = rnd.choice(sources)
        cut = rnd.randint(0, len(src))
        chars = list(src[cut : cut + rnd.randint(0, 120)])
        for _ in range(rnd.randint(1, 8)):
            chars.insert(rnd.randint(0, len(chars)), rnd.choice(pieces))
        text = "".join(chars)
        r = anonymise(text)
        assert (r.text, r.counts, find_spans(text)) == _reference(text), text


# --- spans and evaluation -------------------------------------------------------------------------------------------


def _apply(text, spans):
    out, last = [], 0
    for s in spans:
        out += [text[last : s.start], f"<{s.category}>"]
        last = s.end
    return "".join(out) + text[last:]


def _all_texts():
    return (
        [t for t, _, _ in POSITIVES + NEW_POSITIVES]
        + NEGATIVES
        + NEW_NEGATIVES
        + [r["text"] for r in load_labelled(LABELLED)]
    )


def test_find_spans_is_the_anonymise_pipeline():
    """Replacing the input ranges of `find_spans` gives exactly `anonymise`'s text (one seam, no second copy)."""
    for text in _all_texts():
        spans = find_spans(text)
        assert all(a.end <= b.start for a, b in zip(spans, spans[1:])), spans
        assert _apply(text, spans) == anonymise(text).text, text
        assert sum(anonymise(text).counts.values()) == len(spans)


def test_find_spans_offsets_after_earlier_replacements():
    text = "a@b.com then u/spez and +44 20 7946 0958, facebook.com/profile.php?id=42"
    spans = find_spans(text)
    assert [(text[s.start : s.end], s.category) for s in spans] == [
        ("a@b.com", "EMAIL"),
        ("u/spez", "USER"),
        ("+44 20 7946 0958", "PHONE_NUMBER"),
        ("42", "FB_USERID"),
    ]


def test_a_wider_later_match_absorbs_earlier_tokens():
    """The offset map stays right when a later step's match covers earlier tokens (no shipped pattern does)."""
    import re

    from data.anonymise_pass import _Pass
    from data.anonymise_patterns import _EMAIL

    text = "x a@b.com y c@d.org z, then e@f.net"
    p = _Pass(text, track=True)
    p.run("EMAIL", _EMAIL)
    p.run("USER", re.compile(r"x <EMAIL> y <EMAIL> z"))
    p.run("PHONE_NUMBER", re.compile(r"then"))
    assert p.text == "<USER>, <PHONE_NUMBER> <EMAIL>"
    live = sorted(s for s in p.spans if s is not None)
    assert [(text[s.start : s.end], s.category) for s in live] == [
        ("x a@b.com y c@d.org z", "USER"),
        ("then", "PHONE_NUMBER"),
        ("e@f.net", "EMAIL"),
    ]


def test_spans_from_output_recovers_the_same_spans():
    for text in _all_texts():
        assert spans_from_output(text, anonymise(text).text) == find_spans(text), text
    # a token that was already in the input is no span
    assert spans_from_output("<EMAIL> x@y.com", "<EMAIL> <EMAIL>") == [Span(8, 15, "EMAIL")]


def test_evaluate_spans_definition():
    records = [
        {
            "text": "mail a@b.com, call 555-123-4567",
            "spans": [
                {"start": 5, "end": 12, "category": "EMAIL"},
                {"start": 19, "end": 31, "category": "PHONE_NUMBER"},
            ],
        },
        {"text": "x", "spans": []},
    ]
    # an overlapping prediction of the same category counts; a different category is a miss and a spurious span
    pred = {"mail a@b.com, call 555-123-4567": [(5, 8, "EMAIL"), (19, 31, "SSN")], "x": [(0, 1, "USER")]}
    errors = []
    r = evaluate_spans(records, lambda t: pred[t], errors)
    assert r["EMAIL"] == {
        "gold": 1,
        "found": 1,
        "predicted": 1,
        "correct": 1,
        "precision": 1.0,
        "recall": 1.0,
    }
    assert r["PHONE_NUMBER"]["recall"] == 0.0 and r["SSN"]["precision"] == 0.0 and r["USER"]["predicted"] == 1
    assert r["overall"] == {
        "gold": 2,
        "found": 1,
        "predicted": 3,
        "correct": 1,
        "precision": 1 / 3,
        "recall": 0.5,
    }
    assert ("missed", "PHONE_NUMBER", "555-123-4567") in errors and ("spurious", "USER", "x") in errors
    assert set(r) == set(CATEGORIES) | {"overall"}


def test_labelled_set_is_well_formed_and_mixed():
    records = load_labelled(LABELLED)
    assert len(records) >= 150
    assert sum(1 for r in records if not r["spans"]) >= 60  # hard negatives
    assert {s["category"] for r in records for s in r["spans"]} == set(CATEGORIES)
    for (
        r
    ) in records:  # gold spans are exact: no surrounding blanks, no sentence punctuation (a URL may end in ?)
        for s in r["spans"]:
            piece = r["text"][s["start"] : s["end"]]
            end_ok = piece[-1] not in ".,;:!)" + ("" if s["category"] == "DART" else "?")
            assert piece == piece.strip() and end_ok, piece


def test_recall_and_precision_on_the_labelled_set():
    """The original patterns had recall 0.598 / precision 0.869 on this set (see
    experiments/results/anonymise_recall.md); the one remaining miss is a deliberate choice (`at`/`dot` spelt out
    with an unknown provider)."""
    r = evaluate_spans(load_labelled(LABELLED))
    assert r["overall"]["recall"] >= 0.99, r["overall"]
    assert r["overall"]["precision"] >= 0.99, r["overall"]
    assert all(r[c]["recall"] >= 0.95 and r[c]["precision"] == 1.0 for c in CATEGORIES), r


# --- CLI ------------------------------------------------------------------------------------------------------------


def test_cli_prints_the_table(capsys):
    assert main(["--evaluate", str(LABELLED)]) == 0
    out = capsys.readouterr().out
    assert "| overall |" in out and "| USER |" in out


def test_cli_baseline_is_another_copy_of_the_module(tmp_path, capsys):
    copy = tmp_path / "anonymise_copy.py"
    shutil.copy(ROOT / "data" / "anonymise.py", copy)
    assert main(["--evaluate", str(LABELLED)]) == 0
    ours = capsys.readouterr().out.splitlines()[1:]
    assert main(["--evaluate", str(LABELLED), "--baseline", str(copy)]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == ours


@pytest.mark.parametrize(
    "content,expected",
    [
        (None, "No such file"),
        ('{"text": "a", "spans": []}\nnot json\n', ":2: not JSON"),
        (
            '{"text": "abc", "spans": [{"start": 2, "end": 9, "category": "EMAIL"}]}\n',
            ":1: bad or overlapping span",
        ),
        (
            '{"text": "abc", "spans": [{"start": 0, "end": 1, "category": "NAME"}]}\n',
            ":1: bad or overlapping span",
        ),
        ('["text"]\n', ':1: expected {"text": str'),
        ("", "--baseline"),  # an empty file is a valid (empty) set; the broken --baseline module is the error
    ],
)
def test_cli_bad_file_is_one_error_line(tmp_path, content, expected):
    path = tmp_path / "labelled.jsonl"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    extra = []
    if content == "":
        (tmp_path / "broken.py").write_text("def anonymise(:\n", encoding="utf-8")
        extra = ["--baseline", str(tmp_path / "broken.py")]
    p = subprocess.run(
        [sys.executable, "-m", "data.anonymise", "--evaluate", str(path), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert p.returncode == 2 and p.stdout == ""
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
    assert p.stderr.startswith("error: ") and expected in p.stderr, p.stderr
