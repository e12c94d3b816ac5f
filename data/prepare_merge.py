"""The last step of `data.prepare` (data/prepare.py): every chunk's parts merged into the published token files
(data/indexed.py), the manifest written beside them (what, from what, how; see data/prepare.py's docstring), the
parts folder removed, and the summary printed."""

from __future__ import annotations

import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data.anonymise import add_counts
from data.atomic import staged_dir, write_json_atomic
from data.blocks import SPLITS
from data.chunks import Chunk, absolute_problems, read_record
from data.indexed import merge_domains
from data.ingest import ProblemLog
from data.prepare_parts import _by_domain_records
from data.prepare_plan import FORMAT, _fingerprint, _Plan
from data.tokenizer import SP_MODEL_FILE, Tokenizer, TokenizerSpec, sha256_file


def _finish(
    plan: _Plan,
    chunks: Sequence[Chunk],
    parts: Path,
    tok_dir: Path,
    tok: Tokenizer,
    dtype: type,
    stats: dict,
    t0: float,
    keep: int,
    progress: bool,
    say: Callable[..., None],
) -> dict:
    """Merge every chunk's parts into the published `tok_dir` (staged: a failure leaves the old one), write the
    manifest, then remove the parts; returns the manifest."""
    records = _finished_records(parts, chunks, plan.key)
    hashes: dict[str, str] = {}
    hasher = _hash_files(plan.files, hashes)
    with staged_dir(tok_dir, manifest="manifest.json") as work:
        counts, token_counts = _merge_parts(
            parts, work, records, dtype, tok, len(plan.files), hasher, progress
        )
        if (parts / SP_MODEL_FILE).is_file():
            shutil.copyfile(parts / SP_MODEL_FILE, work / SP_MODEL_FILE)
        problems, anon, touched = _problems_and_anonymised(records, plan.policy, keep)
        # absolute: the data is read from runs started in any directory
        corpus = {
            "dir": str(plan.corpus_dir.resolve()),
            "manifest_sha256": plan.manifest_sha,
            "files": {f"{d}.jsonl": hashes[f"{d}.jsonl"] for d in plan.files},
        }
        total_seconds = time.perf_counter() - t0
        manifest = _manifest(
            plan, tok, dtype, corpus, counts, token_counts, problems, anon, touched, stats, total_seconds
        )
        write_json_atomic(work / "manifest.json", manifest)
    shutil.rmtree(parts, ignore_errors=True)
    if tok.name == "sentencepiece":  # the published model file is this run's: not a cached one
        from data import tokenizer as tokenizer_module

        tokenizer_module._CACHE.pop(TokenizerSpec("sentencepiece", str(tok_dir / SP_MODEL_FILE)), None)
    if progress:
        _print_table(manifest)
        for line in _anonymised_lines(anon, touched, counts):
            say(line)
        if problems.total:
            say(f"skipped {problems.total} bad line(s): {dict(problems.counts)} (first ones in the manifest)")
        n_tokens = manifest["stats"]["tokens"]
        say(
            f"prepared {stats['input_bytes'] / 1e6:.1f} MB into {n_tokens:,} tokens in {total_seconds:.1f} s: "
            f"{manifest['stats']['tokens_per_s']:,} tokens/s, {stats['mb_per_s']} MB/s ({stats['encoder']}, "
            f"{stats['workers']} worker(s))"
        )
    return manifest


def _finished_records(parts: Path, chunks: Sequence[Chunk], plan_key: str) -> list[dict]:
    """The record of every chunk; an error naming the chunks that no shard has prepared yet."""
    records = [read_record(parts, c, plan_key) for c in chunks]
    missing = [c.name for c, r in zip(chunks, records) if r is None]
    if missing:
        raise ValueError(
            f"{parts}: {len(missing)} of {len(chunks)} chunk(s) not prepared yet "
            f"({', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}): run the shards that "
            "prepare them (chunk i belongs to shard i % num_shards), or run without --num-shards/--merge "
            "to prepare what is missing here"
        )
    return records


def _merge_parts(
    parts: Path,
    work: Path,
    records: list[dict],
    dtype: type,
    tok: Tokenizer,
    num_domains: int,
    hasher: threading.Thread,
    progress: bool,
) -> tuple[dict, dict]:
    """The parts concatenated into `work` with a progress bar in bytes; returns the counts and token-count files.
    Waits for `hasher` (the corpus files' sha256) either way."""
    bar = tqdm(
        total=sum(info["bin_bytes"] for r in records for info in r["splits"].values()),
        unit="B",
        unit_scale=True,
        desc="merge",
        disable=not progress,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    try:
        return merge_domains(parts, work, records, dtype, tok.total_vocab_size(num_domains), bar)
    finally:
        bar.close()
        hasher.join()


def _problems_and_anonymised(
    records: list[dict], policy: dict[str, bool], keep: int
) -> tuple[ProblemLog, dict[str, dict[str, int]], dict[str, int]]:
    """The chunks' problems (file-absolute lines, the first `keep` kept) and, per anonymised domain, the
    replacements per category and the documents touched."""
    problems, anon, touched = ProblemLog(keep), {}, {}
    for d, recs in _by_domain_records(records).items():
        log = absolute_problems(recs, keep)
        for reason, n in log.counts.items():
            problems.counts[reason] += n
        problems.first.extend(log.first[: max(0, keep - len(problems.first))])
        if policy[d]:
            anon[d] = {}
            for r in recs:
                add_counts(anon[d], r["anonymise"])
            touched[d] = sum(r.get("anonymised_documents", 0) for r in recs)
    return problems, anon, touched


def _manifest(
    plan: _Plan,
    tok: Tokenizer,
    dtype: type,
    corpus: dict,
    counts: dict,
    token_counts: dict,
    problems: ProblemLog,
    anon: dict[str, dict[str, int]],
    touched: dict[str, int],
    stats: dict,
    total_seconds: float,
) -> dict:
    """The token manifest (the module docstring of data/prepare.py says what it holds)."""
    n_tokens = sum(info["tokens"] for s in counts.values() for info in s.values())
    return {
        "format": FORMAT,
        "plan_key": plan.key,
        "inputs_sha256": _fingerprint(
            {
                "format": FORMAT,
                "corpus": corpus["files"],
                "manifest": plan.manifest_sha,
                "settings": plan.settings,
            }
        ),
        "created_unix": int(time.time()),
        "tokenizer": {
            **tok.describe(),
            **({"model_file": SP_MODEL_FILE} if tok.name == "sentencepiece" else {}),
        },
        # --sp-model: the existing model encoded with (its copy is the model_file; no sample of this corpus)
        **({"tokenizer_from": str(plan.sp_model.resolve())} if plan.sp_model is not None else {}),
        "dtype": np.dtype(dtype).name,
        "bos_in_bin": True,
        "domains": list(plan.files),
        "roles": plan.roles,
        "corpus": corpus,
        "split": {
            **plan.split,
            "method": "a domain file up to chunk_bytes: per-domain permutation seeded by "
            "(seed, crc32(domain)), test first, then valid; a larger one: blake2b(seed, domain, document id) "
            "per document (data/chunks.py)",
        },
        "anonymise": {"policy": plan.policy, "counts": anon, "documents": touched},
        "problems": problems.to_json(),
        "counts": counts,
        "token_counts": token_counts,
        "stats": {
            **stats,
            "documents": sum(i["documents"] for s in counts.values() for i in s.values()),
            "tokens": n_tokens,
            "total_seconds": round(total_seconds, 3),
            "tokens_per_s": round(n_tokens / max(stats["tokenise_seconds"], 1e-9)),
        },
    }


def _hash_files(files: dict[str, Path], out: dict) -> threading.Thread:
    """sha256 of every corpus file into `out`, on a thread (hashlib releases the GIL) while the parts merge."""

    def run() -> None:
        for d, p in files.items():
            out[f"{d}.jsonl"] = sha256_file(p)

    t = threading.Thread(target=run, name="corpus-sha256", daemon=True)
    t.start()
    return t


def _print_table(manifest: dict, out=None) -> None:
    out = out or sys.stdout
    rows = [("domain", *(f"{s} docs" for s in SPLITS), *(f"{s} tokens" for s in SPLITS))]
    for d, splits in manifest["counts"].items():
        rows.append(
            (
                d,
                *(f"{splits[s]['documents']:,}" for s in SPLITS),
                *(f"{splits[s]['tokens']:,}" for s in SPLITS),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print(
            "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))),
            file=out,
        )


def _anonymised_lines(anon: dict[str, dict[str, int]], touched: dict[str, int], counts: dict) -> list[str]:
    """What anonymisation replaced, per domain: the replacements per category and the documents touched."""
    lines = []
    for d, c in anon.items():
        docs = sum(counts[d][s]["documents"] for s in SPLITS)
        what = ", ".join(f"{n:,} {k}" for k, n in sorted(c.items(), key=lambda kv: -kv[1])) or "nothing"
        lines.append(f"anonymised {d}: {what} in {touched.get(d, 0):,} of {docs:,} documents")
    return lines
