"""Ingest a user's corpus into the normalised per-domain JSONL format, reporting every bad line.

Accepted sources:
- a JSONL file, or a directory of `*.jsonl` files, one JSON object per line; the text and domain fields are
  configurable (`text_field`, `domain_field`, `id_field`); a missing id becomes `<file>:<line>`;
- a directory with one sub-directory per domain, holding `.txt` files (searched recursively); one file is one
  document, its id is its path relative to the domain directory.

Output (the format the demo fetcher writes too, and the input of `data.prepare`):

    <out>/<domain>.jsonl     one {"id", "domain", "text"} object per line, UTF-8
    <out>/manifest.json      source, fields, per-domain counts, and problem counts per reason

Every rejected line is a `Problem` with file and line number and one reason of `REASONS`. `on_error="fail"`
scans everything first and raises one `CorpusError` listing the first problems (nothing is written);
`on_error="skip"` drops the bad lines, counts them per reason and records the counts (and the first problems)
in the manifest. Nothing is dropped silently: documents in == documents out + problems.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from data.argtypes import nonneg_int
from data.atomic import staged_dir, write_json_atomic
from data.cli import check_output_dir, cli_main, exit_process, usage_error
from data.readers import not_utf8_at

REASONS: tuple[str, ...] = (
    "invalid_json",
    "not_an_object",
    "missing_text",
    "text_not_string",
    "empty_text",
    "non_utf8",
    "missing_domain",
    "unknown_domain",
    "invalid_domain_name",
    "domain_case_clash",
    "empty_domain",
    "unreadable_domain",
    "unreadable_file",
)
# A domain name becomes a file name (<out>/<domain>.jsonl, tokens/<domain>/): no separators, no "..", no hidden files.
DOMAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
ON_ERROR: tuple[str, ...] = ("skip", "fail")
MANIFEST_FORMAT = "demix-corpus/1"


@dataclass(frozen=True)
class Document:
    id: str
    domain: str
    text: str
    path: str = ""  # where it was read (for problems found later, e.g. a domain-name case clash)
    line: int = 0


@dataclass(frozen=True)
class Problem:
    path: str
    line: int  # 1-based; for a .txt document, the first offending line
    reason: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}" + (f" ({self.detail})" if self.detail else "")


@dataclass
class ProblemLog:
    """Counts per reason plus the first `keep` problems in full (file:line)."""

    keep: int = 20
    counts: Counter = field(default_factory=Counter)
    first: list[Problem] = field(default_factory=list)

    def add(self, p: Problem) -> None:
        self.counts[p.reason] += 1
        if len(self.first) < self.keep:
            self.first.append(p)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def to_json(self) -> dict:
        return {
            "total": self.total,
            "counts": dict(sorted(self.counts.items())),
            "first": [str(p) for p in self.first],
        }


class CorpusError(ValueError):
    """Raised by `on_error="fail"`: one message listing the first problems with file:line."""

    def __init__(self, log: ProblemLog, source: str):
        self.log = log
        counts = ", ".join(f"{k}={v}" for k, v in sorted(log.counts.items()))
        lines = "\n".join(f"  {p}" for p in log.first)
        more = log.total - len(log.first)
        super().__init__(
            f"{source}: {log.total} bad line(s) ({counts}); first {len(log.first)}:\n{lines}"
            + (f"\n  ... and {more} more" if more > 0 else "")
            + "\n(use on_error='skip' to drop them and record the counts in the manifest)"
        )


def domain_name_problem(domain: str) -> str | None:
    """Why `domain` cannot be a domain name (it becomes a file and folder name), or None."""
    if DOMAIN_NAME.fullmatch(domain) and ".." not in domain:
        return None
    return (
        f"{domain[:80]!r}: a domain name becomes a file name; use letters, digits, '_', '-' and '.', starting "
        "with a letter or digit, at most 64 characters"
    )


def check_on_error(on_error: str) -> None:
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error={on_error!r}: choose one of {', '.join(ON_ERROR)}")


def _parse_line(
    raw: bytes,
    path: str,
    lineno: int,
    text_field: str,
    domain_field: str,
    id_field: str,
    domains: frozenset[str] | None,
    default_domain: str | None,
    fallback_id: str | None = None,
    offset: int = 0,
) -> Document | Problem:
    """One JSONL line (at byte `offset` of its file) as a Document, or the Problem that keeps it out. A record
    without an id gets `fallback_id`, by default "<file name>:<line>"."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return Problem(path, lineno, "non_utf8", not_utf8_at(raw, e, lineno, offset)[1])
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return Problem(path, lineno, "invalid_json", e.msg + f" at column {e.colno}")
    if not isinstance(obj, dict):
        return Problem(path, lineno, "not_an_object", type(obj).__name__)
    if text_field not in obj or obj[text_field] is None:
        return Problem(path, lineno, "missing_text", f"no field {text_field!r}")
    text = obj[text_field]
    if not isinstance(text, str):
        return Problem(path, lineno, "text_not_string", type(text).__name__)
    if not text or text.isspace():  # (no stripped copy of a long text)
        return Problem(path, lineno, "empty_text")
    if not text.isascii():  # isascii is O(1) on CPython's compact strings; ASCII cannot hold a surrogate
        try:
            # a JSON escape such as "\ud83d" alone decodes to an unencodable lone surrogate
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            return Problem(path, lineno, "non_utf8", f"unpaired surrogate at character {e.start}")
    domain = obj.get(domain_field, default_domain)
    if domain is None or domain == "":
        return Problem(path, lineno, "missing_domain", f"no field {domain_field!r}")
    if not isinstance(domain, str):  # `true` or 3 would become a domain named "True" or "3"
        return Problem(path, lineno, "domain_not_string", f"{domain_field!r} is {json.dumps(domain)[:40]}")
    if (bad := domain_name_problem(domain)) is not None:
        return Problem(path, lineno, "invalid_domain_name", bad)
    if domains is not None and domain not in domains:
        return Problem(path, lineno, "unknown_domain", f"{domain!r} not in {sorted(domains)}")
    doc_id = obj.get(id_field)
    if doc_id is None:
        doc_id = fallback_id if fallback_id is not None else f"{Path(path).name}:{lineno}"
    return Document(str(doc_id), domain, text, path, lineno)


def read_jsonl(
    path: str | Path,
    *,
    text_field: str = "text",
    domain_field: str = "domain",
    id_field: str = "id",
    domains: Iterable[str] | None = None,
    default_domain: str | None = None,
) -> Iterator[Document | Problem]:
    """Yield a `Document` or a `Problem` for each non-blank line of a JSONL file (read as bytes, so non-UTF-8
    lines are reported with their number instead of aborting the file)."""
    allowed = frozenset(domains) if domains is not None else None
    offset = 0
    with open(path, "rb") as f:
        for lineno, whole in enumerate(f, start=1):
            raw, start = whole.rstrip(b"\r\n"), offset
            offset += len(whole)
            if not raw or raw.isspace():
                continue  # blank lines carry nothing: not a document, not a problem
            yield _parse_line(
                raw,
                str(path),
                lineno,
                text_field,
                domain_field,
                id_field,
                allowed,
                default_domain,
                offset=start,
            )


def read_text_dir(root: str | Path, domains: Iterable[str] | None = None) -> Iterator[Document | Problem]:
    """Yield documents from `root/<domain>/**/*.txt` (one file = one document)."""
    root = Path(root)
    allowed = frozenset(domains) if domains is not None else None
    for ddir in sorted(root.iterdir()):
        # a domain whose folder is gone is reported, never dropped
        if ddir.is_symlink() and not ddir.exists():
            yield Problem(
                str(ddir), 0, "unreadable_domain", f"a dangling symbolic link (to {os.readlink(ddir)})"
            )
            continue
        if not ddir.is_dir():
            continue
        try:
            files = sorted(ddir.rglob("*.txt"))
        except (
            OSError
        ) as e:  # a folder that cannot be listed (permissions): its documents are not silently lost
            yield Problem(str(ddir), 0, "unreadable_domain", e.strerror or type(e).__name__)
            continue
        if (bad := domain_name_problem(ddir.name)) is not None:
            yield Problem(str(ddir), 0, "invalid_domain_name", f"{bad}; {len(files)} file(s) not read")
            continue
        if not files:  # a domain folder with nothing in it is reported, never dropped without a word
            yield Problem(str(ddir), 0, "empty_domain", "no .txt files in this domain folder")
        for path in files:
            try:
                data = path.read_bytes()
            except OSError as e:  # a dangling link, a folder named *.txt, no permission
                yield Problem(str(path), 0, "unreadable_file", e.strerror or type(e).__name__)
                continue
            if allowed is not None and ddir.name not in allowed:
                yield Problem(str(path), 1, "unknown_domain", f"{ddir.name!r} not in {sorted(allowed)}")
                continue
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as e:
                line, where = not_utf8_at(data, e)
                yield Problem(str(path), line, "non_utf8", where)
                continue
            if not text.strip():
                yield Problem(str(path), 1, "empty_text")
                continue
            yield Document(str(path.relative_to(ddir)), ddir.name, text, str(path), 1)


def iter_source(
    source: str | Path,
    *,
    text_field: str = "text",
    domain_field: str = "domain",
    id_field: str = "id",
    domains: Sequence[str] | None = None,
) -> Iterator[Document | Problem]:
    """Documents and problems from a JSONL file, a directory of JSONL files, or a directory of domain folders.
    Domain names are unique ignoring case (they become file names, and macOS and Windows file systems ignore
    case): a document whose domain differs from an earlier one only in case is a `domain_case_clash` problem."""
    first: dict[str, str] = {}  # casefolded name -> the spelling seen first
    for r in _iter_source(Path(source), text_field, domain_field, id_field, domains):
        if isinstance(r, Document) and first.setdefault(r.domain.casefold(), r.domain) != r.domain:
            yield Problem(
                r.path,
                r.line,
                "domain_case_clash",
                f"{r.domain!r} differs only in case from the domain {first[r.domain.casefold()]!r}; "
                "spell it one way",
            )
            continue
        yield r


def _iter_source(
    source: Path, text_field: str, domain_field: str, id_field: str, domains: Sequence[str] | None
) -> Iterator[Document | Problem]:
    if source.is_file():
        files = [source]
    elif source.is_dir():
        files = sorted(source.glob("*.jsonl"))
        if not files:
            yield from read_text_dir(source, domains)
            return
    else:
        raise FileNotFoundError(f"{source}: no such file or directory")
    for f in files:
        yield from read_jsonl(
            f, text_field=text_field, domain_field=domain_field, id_field=id_field, domains=domains
        )


@dataclass
class IngestReport:
    out_dir: str
    documents: dict[str, int]  # per domain
    problems: ProblemLog

    def to_json(self) -> dict:
        return {"documents": self.documents, "problems": self.problems.to_json()}


def scan(records: Iterable[Document | Problem], keep: int = 20) -> ProblemLog:
    """Validate only (the cheap pass `on_error="fail"` runs before anything is written)."""
    log = ProblemLog(keep)
    for r in records:
        if isinstance(r, Problem):
            log.add(r)
    return log


def ingest(
    source: str | Path,
    out_dir: str | Path,
    *,
    text_field: str = "text",
    domain_field: str = "domain",
    id_field: str = "id",
    domains: Sequence[str] | None = None,
    on_error: str = "skip",
    max_report: int = 20,
    novel: Sequence[str] = (),
) -> IngestReport:
    """Normalise `source` into `<out_dir>/<domain>.jsonl` + `manifest.json`; see the module docstring. `novel`:
    domains held out of training (their `split_role` in the manifest is "novel"; data.prepare copies it)."""
    check_on_error(on_error)
    bad = [f"{d!r}: {p}" for d in novel if (p := domain_name_problem(d)) is not None]
    if domains is not None:
        bad += [f"{d!r} is not one of --domains {', '.join(domains)}" for d in novel if d not in domains]
    if bad:
        raise ValueError("novel domains: " + "; ".join(bad))
    if not Path(source).exists():
        raise FileNotFoundError(f"{source}: no such file or directory")
    out_dir = Path(out_dir)
    existing = [p.name for p in out_dir.glob("*.jsonl")] if out_dir.is_dir() else []
    check_output_dir(out_dir, (MANIFEST_FORMAT,), ["manifest.json", *existing], inputs=[Path(source)])
    kw = dict(text_field=text_field, domain_field=domain_field, id_field=id_field, domains=domains)
    if on_error == "fail":
        log = scan(iter_source(source, **kw), max_report)
        if log.total:
            raise CorpusError(log, str(source))
    log, counts, handles = ProblemLog(max_report), Counter(), {}
    # every file is written into a staged sibling of `out_dir`, published with the manifest (data/atomic.py
    # `staged_dir`): a failure midway (a full disk included) leaves no <domain>.jsonl without its manifest
    with staged_dir(out_dir, manifest="manifest.json") as tmp:
        try:
            for r in iter_source(source, **kw):
                if isinstance(r, Problem):
                    log.add(r)
                    continue
                if r.domain not in handles:
                    handles[r.domain] = open(tmp / f"{r.domain}.jsonl", "w", encoding="utf-8")
                handles[r.domain].write(
                    json.dumps({"id": r.id, "domain": r.domain, "text": r.text}, ensure_ascii=False) + "\n"
                )
                counts[r.domain] += 1
        finally:
            for h in handles.values():
                h.close()
        report = IngestReport(str(out_dir), dict(sorted(counts.items())), log)
        absent = sorted(set(novel) - set(counts))
        if absent:  # nothing is published: the staged folder is removed
            raise ValueError(
                f"novel domains {absent} have no documents in {source}; domains: {', '.join(sorted(counts))}"
            )
        manifest = {
            "format": MANIFEST_FORMAT,
            "source": str(source),
            "on_error": on_error,
            "fields": {"text": text_field, "domain": domain_field, "id": id_field},
            "domains": {
                d: {"documents": n, "file": f"{d}.jsonl", "split_role": "novel" if d in novel else "train"}
                for d, n in report.documents.items()
            },
            "problems": log.to_json(),
        }
        write_json_atomic(tmp / "manifest.json", manifest)
    return report


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    """`python -m data.ingest SOURCE --out DIR`: 0 with a JSON summary on stdout, 2 with one error line."""
    p = argparse.ArgumentParser(
        prog="python -m data.ingest",
        description=__doc__.split("\n\n")[0],
        epilog="Then: python -m data.prepare --corpus DIR --out TOKENS --tokenizer gpt2",
    )
    p.add_argument(
        "source", help="a JSONL file, a directory of *.jsonl files, or a directory of domain folders of .txt"
    )
    p.add_argument("--out", required=True, help="output directory: <domain>.jsonl files and manifest.json")
    p.add_argument("--text-field", default="text")
    p.add_argument("--domain-field", default="domain")
    p.add_argument("--id-field", default="id")
    p.add_argument(
        "--domains", nargs="+", help="keep only these domains (others are 'unknown_domain' problems)"
    )
    p.add_argument(
        "--on-error",
        choices=ON_ERROR,
        default="skip",
        help="skip: drop bad lines and count them (default); fail: write nothing if any line is bad",
    )
    p.add_argument(
        "--max-report", type=nonneg_int, default=20, help="problems listed in full (all are counted)"
    )
    p.add_argument(
        "--novel",
        nargs="+",
        default=[],
        metavar="DOMAIN",
        help="held-out domains: recorded as novel, never trained on (data.prepare --novel also sets them)",
    )
    args = p.parse_args(argv)
    try:
        report = ingest(
            args.source,
            args.out,
            text_field=args.text_field,
            domain_field=args.domain_field,
            id_field=args.id_field,
            domains=args.domains,
            on_error=args.on_error,
            max_report=args.max_report,
            novel=args.novel,
        )
    except (CorpusError, OSError, ValueError) as e:
        return usage_error(e)
    print(json.dumps({"out": report.out_dir, **report.to_json()}))
    return 0


if __name__ == "__main__":
    exit_process(main())
