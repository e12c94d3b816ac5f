"""Anonymisation (DEMix Table 8): every category replaced, look-alikes kept, per-domain policy."""

import pytest

from data.anonymise import anonymise, anonymise_many, luhn_ok, resolve_policy

POSITIVES = [
    ("write to jane.doe+news@example.co.uk today", "write to <EMAIL> today", "EMAIL"),
    ("contact: J_Smith@mail-server.example.org.", "contact: <EMAIL>.", "EMAIL"),
    ("tag dart_id=AB12cd34ef loaded", "tag dart_id=<DART> loaded", "DART"),
    ("<img src=http://ad.doubleclick.net/ad/N123.site/B456;sz=1x1>", "<img src=<DART>>", "DART"),
    ("see facebook.com/profile.php?id=100004123456789 now", "see facebook.com/profile.php?id=<FB_USERID> now", "FB_USERID"),
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


@pytest.mark.parametrize("text,expected,category", POSITIVES)
def test_positive_is_replaced_and_counted(text, expected, category):
    r = anonymise(text)
    assert r.text == expected
    assert r.counts.get(category, 0) >= 1


@pytest.mark.parametrize("text", NEGATIVES)
def test_look_alike_is_kept(text):
    r = anonymise(text)
    assert r.text == text, r.counts
    assert r.counts == {}


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
