"""Per-domain JSONL -> anonymised, split, tokenised megatron-core indexed datasets, with a manifest, streamed.

    python -m data.prepare --corpus artifacts/demo/corpus --out artifacts/demo/tokens [--tokenizer gpt2]
        [--workers N (default: every core)] [--seed 1234] [--valid-fraction 0.05] [--test-fraction 0.05]
        [--domains a,b] [--novel d1 d2] [--anonymise [--anonymise-off code]] [--sp-vocab-size 8192]
        [--on-error skip|fail]
        [--num-shards N --shard-index I | --merge] [--chunk-mb 64] [--force]

Input: `<corpus>/<domain>.jsonl` ({"id", "domain", "text"} per line, as `data.ingest` writes) and optionally
`<corpus>/manifest.json`. Lines are validated as in ingestion (file:line problems; `on_error="fail"` checks every
line and raises before anything is encoded, `"skip"` counts them in the manifest).

How (data/chunks.py): every domain file is cut at line boundaries into chunks of `--chunk-mb`; worker processes
(`--workers`) each prepare whole chunks (read, validate, split, anonymise, encode, write the chunk's parts), so no
text crosses between processes and each holds one small batch: the memory of a run does not grow with the corpus.
A finished chunk leaves its record in `<out>/<tokenizer>.parts/`; a killed run, started again with the same
arguments, redoes only the chunks without one. `--num-shards N --shard-index I` prepares every N-th chunk from
the I-th (one process, node or SLURM array task per shard, on a file system they share), and `--merge` (or a run
without `--num-shards`) then writes the final files: each split's parts concatenated in chunk order
(data/indexed.py), byte for byte what one process writes. Splits are document level and deterministic
(data/chunks.py: exact per-domain permutation for a domain file up to one chunk, a seeded hash of the document id
for larger ones). Sentencepiece is trained first, on a bounded sample (`sentencepiece_sample`).

Output layout (DataConfig.path = <out>; DataConfig.tokenizer picks the sub-directory):

    <out>/<tokenizer>/manifest.json              what, from what, how (see below)
    <out>/<tokenizer>/<domain>/<split>.bin/.idx  split in train | valid | test; one megatron-core sequence and
                                                 one document per corpus document, [bos] + tokens
    <out>/<tokenizer>/<domain>/token_counts.npy  int64 (3, vocabulary): occurrences of each token id per split
                                                 (train, valid, test) in the .bin files: the unigram baseline's fit
    <out>/sentencepiece/tokenizer.model          the trained sentencepiece model (tokenizer="sentencepiece")

Token dtype: uint16 when the vocabulary (domain tokens included) is below 65,536, else int32.

The manifest ties the token files to their tokenizer (name, vocab size, bos id, sha256 of its vocabulary files),
the corpus (sha256 of manifest.json and of every JSONL file), the split seed, fractions and chunk size, the
anonymisation policy and counts, the problems, and per domain and split the documents, tokens (bos included),
bytes and sha256 of each .bin. Re-running with the same settings on corpus files of the same size and
modification time (`plan_key`) finds the files of the recorded sizes and skips all work (`force=True` redoes it).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import sys
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence, Union

import numpy as np
from tqdm import tqdm

from data import atomic
from data.anonymise import AnonymisePolicy, add_counts, parse_policy_args, resolve_policy
from data.argtypes import in_range, nonneg_int, positive_float, positive_int, random_seed, unit_right_open
from data.atomic import staged_dir, write_json_atomic
from data.blocks import SPLITS
from data.chunks import (
    CHUNK_BYTES,
    Chunk,
    ChunkJob,
    absolute_problems,
    check_chunk,
    plan_chunks,
    prepare_chunk,
    read_record,
    sentencepiece_sample,
    split_documents,
    split_texts,
)
from data.cli import check_output_dir, cli_main, exit_process
from data.indexed import merge_domains
from data.ingest import MANIFEST_FORMAT as INGEST_FORMAT
from data.ingest import CorpusError, Problem, ProblemLog, check_on_error, domain_name_problem
from data.readers import InputFileError, read_json_object
from data.tokenizer import (
    SP_MODEL_FILE,
    Tokenizer,
    TokenizerSpec,
    load_tokenizer,
    sha256_file,
    train_sentencepiece,
)

FORMAT = "demix-tokens/1"
PARTS_FORMAT = "demix-token-parts/1"
PROCESS_MIN_BYTES = (
    8 << 20
)  # less input than this is prepared in this process: starting workers would cost more

__all__ = ["prepare_corpus", "split_documents", "split_texts", "PrepareResult", "main"]


@dataclass
class PrepareResult:
    out_dir: Path
    manifest: dict
    skipped: bool
    stats: dict = field(default_factory=dict)
    merged: bool = (
        True  # False for a shard run (--num-shards without --merge): the parts are written, not merged
    )


def available_cores() -> int:
    """The cores this process may run on (the CPU affinity where the OS has one: a SLURM task's allocation)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# ---------------------------------------------------------------- the corpus ----------------------------------


def _corpus_files(corpus_dir: Path, domains: Optional[Sequence[str]]) -> dict[str, Path]:
    """`<domain>.jsonl` of the corpus by domain, checked before any work: every file a valid domain name, no two
    names equal but for case (their token folders would be one folder on macOS and Windows file systems), and, where
    the corpus has ingest's manifest, exactly the domains it lists (no file of an earlier ingest or a stray copy)."""
    found = {p.stem: p for p in sorted(corpus_dir.glob("*.jsonl"))}
    if not found:
        raw = [p.name for p in sorted(corpus_dir.iterdir())[:3]] if corpus_dir.is_dir() else []
        raise FileNotFoundError(
            f"{corpus_dir}: no <domain>.jsonl files"
            + (f" (it holds {', '.join(raw)}, ...)" if raw else "")
            + f": --corpus is what data.ingest writes; run `python -m data.ingest {corpus_dir} --out CORPUS` "
            "first (it reads JSONL with text/domain fields, or one folder of .txt files per domain)"
        )
    problems = [f"{found[d].name}: {bad}" for d in found if (bad := domain_name_problem(d)) is not None]
    folded: dict[str, list[str]] = {}
    for d in found:
        folded.setdefault(d.casefold(), []).append(d)
    problems += [
        f"{' and '.join(f'{d}.jsonl' for d in names)} name domains that differ only in case: merge them "
        "into one file (data.ingest reports such documents as domain_case_clash)"
        for names in folded.values()
        if len(names) > 1
    ]
    listed = _ingested_domains(corpus_dir / "manifest.json")
    if listed is not None:
        extra = sorted(set(found) - set(listed))
        if extra:
            problems.append(
                f"{', '.join(f'{d}.jsonl' for d in extra)} not listed in {corpus_dir / 'manifest.json'} "
                '(left by an earlier ingest, or copied in): list them in its "domains", remove them, or ingest again'
            )
        gone = sorted(set(listed) - set(found))
        if gone:
            problems.append(
                f"{corpus_dir / 'manifest.json'} lists {', '.join(gone)} but {', '.join(gone)}.jsonl "
                "is missing: ingest again"
            )
    if problems:
        raise ValueError(f"{corpus_dir}: " + "; ".join(problems))
    if domains is None:
        return found
    missing = [d for d in domains if d not in found]
    if missing:
        raise FileNotFoundError(f"{corpus_dir}: no JSONL for domains {missing}; found {sorted(found)}")
    return {d: found[d] for d in domains}


def _ingested_domains(corpus_manifest: Path) -> Optional[list[str]]:
    """The domains data.ingest's manifest lists, or None where there is no such manifest (a corpus written by
    hand)."""
    if not corpus_manifest.is_file():
        return None
    try:
        data = json.loads(corpus_manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # corpus_roles names the broken file
    doms = data.get("domains") if isinstance(data, dict) else None
    return list(doms) if isinstance(doms, dict) and data.get("format") == INGEST_FORMAT else None


def corpus_roles(corpus_manifest: Path, domains: Iterable[str]) -> dict[str, str]:
    """Each domain's `split_role` ("train" or "novel") from the corpus manifest, copied into the token manifest
    so the roles travel with the tokens (default "train"). A corpus manifest that is not JSON is an error."""
    try:
        data = (
            read_json_object(corpus_manifest, {"domains?": dict}, "corpus manifest")
            if corpus_manifest.is_file()
            else {}
        )
    except InputFileError as e:
        raise ValueError(f"{e}: fix or remove it (it gives the domains' train/novel roles)") from None
    doms = data.get("domains", {})
    return {
        d: doms[d].get("split_role", "train") if isinstance(doms.get(d), dict) else "train" for d in domains
    }


def _fingerprint(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------- the parts directory -------------------------


def _parts_dir(out_dir: Path, tokenizer: str) -> Path:
    return out_dir / f"{tokenizer}.parts"


def _open_parts(parts: Path, plan: dict, fresh: bool) -> None:
    """Make `parts` hold this plan's work: kept when its plan.json is this plan's (a resumed run, another shard),
    emptied when it is another plan's (changed inputs or settings) or `fresh`; a folder without our plan.json is
    someone else's and refused."""
    record = parts / "plan.json"
    if parts.exists():
        try:
            old = json.loads(record.read_text())
        except (OSError, ValueError):
            old = None
        if not isinstance(old, dict) or old.get("format") != PARTS_FORMAT:
            if any(parts.iterdir()):
                raise ValueError(
                    f"{parts} exists and was not written by data.prepare (no {record.name} of format "
                    f"{PARTS_FORMAT}): move it away"
                )
        elif old.get("plan_key") == plan["plan_key"] and not fresh:
            return
        shutil.rmtree(parts)
    parts.mkdir(parents=True, exist_ok=True)
    write_json_atomic(record, plan)


@contextmanager
def _parts_kept_on_progress(parts: Path, final: Path) -> Iterator[None]:
    """On a failure (Ctrl-C included), keep the parts folder when a chunk finished (the same command then resumes
    after it, and says so now); when none did, the shared rule (data/atomic.py `discard_on_failure`) removes it and
    the folders made for it. Either way a full disk is raised as the DiskFullError of `final`."""
    made = list(reversed([p for p in parts.parents if not p.exists()]))  # outermost first; `parts` is staged
    try:
        yield
    except BaseException as e:
        if not (parts.is_dir() and any(parts.glob("*/*.json"))):
            with atomic.discard_on_failure(final, parts, made=made):
                raise
        finished = len(list(parts.glob("*/*.json")))
        print(
            f"{finished} finished chunk(s) kept in {parts}: the same command resumes after them (remove that "
            "folder to start over)",
            file=sys.stderr,
            flush=True,
        )
        full = atomic.disk_full_error(e, final, [parts]) if isinstance(e, Exception) else None
        if full is not None:
            raise full from e
        raise


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (created): shards starting together train one sentencepiece model, not N."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _tokenizer(
    name: str,
    parts: Path,
    chunks: Sequence[Chunk],
    roles: dict[str, str],
    split: dict,
    policy: dict[str, bool],
    sp_vocab_size: int,
    seed: int,
    workers: int,
    say,
) -> Tokenizer:
    """GPT-2, or the run's sentencepiece model: trained once per plan on `sentencepiece_sample` of the training
    domains (novel domains are held out of the tokenizer too) and kept in the parts folder for every shard."""
    if name == "gpt2":
        return load_tokenizer("gpt2")
    model = parts / SP_MODEL_FILE
    with _locked(parts / "tokenizer.lock"):
        if not model.is_file():
            import sentencepiece as spm

            train = [d for d in roles if roles[d] != "novel"] or list(roles)
            sample = sentencepiece_sample(chunks, train, split, policy)
            say(
                f"training sentencepiece BPE (vocab {sp_vocab_size}) on {sum(map(len, sample)) / 1e6:.1f} M "
                f"characters of the training split of {', '.join(train)} ..."
            )
            spm.set_random_generator_seed(seed)
            train_sentencepiece(sample, model, vocab_size=sp_vocab_size, threads=workers)
    from data import tokenizer as tokenizer_module

    tokenizer_module._CACHE.pop(TokenizerSpec("sentencepiece", str(model)), None)  # a model of this plan
    return load_tokenizer("sentencepiece", model)


def _token_dtype(tok: Tokenizer, num_domains: int) -> type:
    return np.uint16 if tok.total_vocab_size(num_domains) < 65536 else np.int32


# ---------------------------------------------------------------- running chunks ------------------------------


def _warm(spec: Optional[TokenizerSpec]) -> None:
    if spec is not None:
        spec.load()


def _pool(workers: int, warm: Optional[TokenizerSpec]) -> ProcessPoolExecutor:
    """Worker processes that do not fork this (possibly torch-threaded) process: forkserver where available."""
    import multiprocessing as mp

    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    return ProcessPoolExecutor(
        workers, mp_context=mp.get_context(method), initializer=_warm, initargs=(warm,)
    )


def _run(fn, tasks: Sequence[tuple], workers: int, bar: Optional[tqdm], size) -> list:
    """`fn(*task)` for every task, on `workers` processes (here when one suffices), results in task order; the
    first failure cancels what has not started and is raised (finished chunks stay finished)."""
    if workers <= 1 or len(tasks) <= 1:
        out = []
        for t in tasks:
            out.append(fn(*t))
            if bar is not None:
                bar.update(size(t))
        return out
    spec = next((t[1].tokenizer for t in tasks if isinstance(t[-1], ChunkJob)), None)
    ex = _pool(min(workers, len(tasks)), spec)
    try:
        futures = {ex.submit(fn, *t): i for i, t in enumerate(tasks)}
        results: list = [None] * len(tasks)
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for f in done:
                results[futures[f]] = f.result()  # raises the worker's exception
                if bar is not None:
                    bar.update(size(tasks[futures[f]]))
        return results
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


def _check(chunks: Sequence[Chunk], keep: int, workers: int, whole: bool) -> ProblemLog:
    """on_error="fail": every line of `chunks` validated before any encoding. `whole`: the chunks are every chunk
    of their domains, so line numbers can be made file-absolute (a shard reports chunk-relative ones)."""
    procs = workers if sum(c.end - c.start for c in chunks) >= PROCESS_MIN_BYTES else 1
    records = _run(check_chunk, [(c, keep) for c in chunks], procs, None, None)
    log = ProblemLog(keep)
    for recs in _by_domain_records(records).values():
        if whole:
            part = absolute_problems(recs, keep)
        else:
            part = ProblemLog(keep)
            for r in recs:
                c = r["chunk"]
                for reason, n in r["problems"]["counts"].items():
                    part.counts[reason] += n
                part.first.extend(
                    Problem(f"{c['path']} (bytes {c['start']}-{c['end']})", line, reason, detail)
                    for line, reason, detail in r["problems"]["first"]
                )
        for reason, n in part.counts.items():
            log.counts[reason] += n
        log.first.extend(part.first[: max(0, keep - len(log.first))])
    return log


def _by_domain_records(records: Sequence[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in records:
        out.setdefault(r["chunk"]["domain"], []).append(r)
    return out


# ---------------------------------------------------------------- merging -------------------------------------


def _hash_files(files: dict[str, Path], out: dict) -> threading.Thread:
    """sha256 of every corpus file into `out`, on a thread (hashlib releases the GIL) while the parts merge."""

    def run() -> None:
        for d, p in files.items():
            out[f"{d}.jsonl"] = sha256_file(p)

    t = threading.Thread(target=run, name="corpus-sha256", daemon=True)
    t.start()
    return t


def _up_to_date(tok_dir: Path, plan_key: str) -> Optional[dict]:
    path = tok_dir / "manifest.json"
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("plan_key") != plan_key:
        return None
    rels = [
        info.get(k)
        for splits in manifest.get("counts", {}).values()
        for info in splits.values()
        for k in ("bin", "idx")
    ]
    sizes = [
        info.get(f"{k}_bytes")
        for splits in manifest.get("counts", {}).values()
        for info in splits.values()
        for k in ("bin", "idx")
    ]
    for rel, size in zip(rels, sizes):
        if rel and (not (tok_dir / rel).is_file() or (tok_dir / rel).stat().st_size != size):
            return None
    if any(not (tok_dir / rel).is_file() for rel in manifest.get("token_counts", {}).values()):
        return None
    model = manifest["tokenizer"].get("model_file")
    if model and manifest["tokenizer"]["files"].get(model) != (
        sha256_file(tok_dir / model) if (tok_dir / model).is_file() else None
    ):
        return None
    return manifest


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


def _policy_line(policy: dict[str, bool]) -> str:
    on = [d for d, v in policy.items() if v]
    if not on:
        return (
            "anonymisation: off (--anonymise replaces e-mail addresses, phone numbers, user names, ... by dummy "
            "tokens, as DEMix does; --anonymise-off DOMAIN keeps a domain, e.g. code, as it is)"
        )
    off = [d for d, v in policy.items() if not v]
    return (
        f"anonymisation: ON for {', '.join(on)}"
        + (f"; off for {', '.join(off)}" if off else "")
        + ": their text is rewritten (counts per domain at the end and in the manifest)"
    )


def _anonymised_lines(anon: dict[str, dict[str, int]], touched: dict[str, int], counts: dict) -> list[str]:
    """What anonymisation replaced, per domain: the replacements per category and the documents touched."""
    lines = []
    for d, c in anon.items():
        docs = sum(counts[d][s]["documents"] for s in SPLITS)
        what = ", ".join(f"{n:,} {k}" for k, n in sorted(c.items(), key=lambda kv: -kv[1])) or "nothing"
        lines.append(f"anonymised {d}: {what} in {touched.get(d, 0):,} of {docs:,} documents")
    return lines


# ---------------------------------------------------------------- the pipeline -------------------------------


def prepare_corpus(
    corpus_dir: Union[str, Path],
    out_dir: Union[str, Path],
    tokenizer: str = "gpt2",
    workers: Optional[int] = None,
    seed: int = 1234,
    valid_fraction: float = 0.05,
    test_fraction: float = 0.05,
    anonymise: AnonymisePolicy = False,
    sp_vocab_size: int = 8192,
    on_error: str = "skip",
    domains: Optional[Sequence[str]] = None,
    force: bool = False,
    progress: bool = True,
    max_report: int = 20,
    chunk_bytes: int = CHUNK_BYTES,
    num_shards: int = 1,
    shard_index: int = 0,
    merge: bool = False,
    novel: Optional[Sequence[str]] = None,
) -> PrepareResult:
    """Anonymise, split and tokenise `<corpus_dir>/<domain>.jsonl` into `<out_dir>/<tokenizer>/`; see the module
    docstring for the layout, the manifest, sharding (`num_shards`, `shard_index`, `merge`) and resuming.
    `workers`: processes (default: every core this process may use). Returns the manifest and whether the work
    was skipped. `anonymise`: off (default), on for every domain (True), or per domain ({"code": False}: on for
    the others). `novel`: the held-out domains (else the corpus manifest's `split_role`s)."""
    workers = available_cores() if workers is None else workers
    check_on_error(on_error)
    for name, value, rng in (
        ("seed", seed, random_seed),
        ("workers", workers, positive_int),
        ("sp_vocab_size", sp_vocab_size, positive_int),
        ("chunk_bytes", chunk_bytes, positive_int),
        ("num_shards", num_shards, positive_int),
        ("shard_index", shard_index, nonneg_int),
    ):
        in_range(value, rng, name)  # the CLI's rule (data/argtypes.py) for callers of the function too
    if shard_index >= num_shards:
        raise ValueError(f"shard_index={shard_index}: need 0 <= shard_index < num_shards={num_shards}")
    if merge and num_shards > 1:
        raise ValueError("merge: give it without num_shards/shard_index (it merges what every shard wrote)")
    if not (0 <= valid_fraction < 1 and 0 <= test_fraction < 1 and valid_fraction + test_fraction < 1):
        raise ValueError(
            f"valid_fraction={valid_fraction}, test_fraction={test_fraction}: need both in [0, 1), sum < 1"
        )
    if tokenizer not in ("gpt2", "sentencepiece"):
        raise ValueError(f"tokenizer={tokenizer!r}: choose gpt2 or sentencepiece")
    corpus_dir, out_dir = Path(corpus_dir), Path(out_dir)
    files = _corpus_files(corpus_dir, domains)
    policy = resolve_policy(anonymise, files)
    corpus_manifest = corpus_dir / "manifest.json"
    roles = corpus_roles(corpus_manifest, files)  # before any work: a broken corpus manifest fails here
    if novel is not None:
        unknown = sorted(set(novel) - set(files))
        if unknown:
            raise ValueError(f"novel domains {unknown} are not in {corpus_dir}; domains: {', '.join(files)}")
        roles = {d: "novel" if d in set(novel) else "train" for d in files}
    manifest_sha = sha256_file(corpus_manifest) if corpus_manifest.is_file() else None
    settings = {
        "tokenizer": tokenizer,
        "seed": seed,
        "valid_fraction": valid_fraction,
        "test_fraction": test_fraction,
        "anonymise": policy,
        "sp_vocab_size": sp_vocab_size if tokenizer == "sentencepiece" else None,
        "on_error": on_error,
    }
    split = {
        "seed": seed,
        "valid_fraction": valid_fraction,
        "test_fraction": test_fraction,
        "chunk_bytes": chunk_bytes,
    }
    stat = {f"{d}.jsonl": [p.stat().st_size, p.stat().st_mtime_ns] for d, p in files.items()}
    plan_key = _fingerprint(
        {
            "format": FORMAT,
            "settings": settings,
            "split": split,
            "files": stat,
            "roles": roles,
            "manifest": manifest_sha,
            "dir": str(corpus_dir.resolve()),
        }
    )
    tok_dir, parts = out_dir / tokenizer, _parts_dir(out_dir, tokenizer)
    check_output_dir(
        tok_dir, (FORMAT,), ["manifest.json", SP_MODEL_FILE, *files], inputs=list(files.values())
    )
    say = (lambda *a: print(*a, flush=True)) if progress else (lambda *a: None)
    say(_policy_line(policy))
    if not force and (done := _up_to_date(tok_dir, plan_key)) is not None:
        say(
            f"{tok_dir}: up to date (plan {plan_key[:12]}: same settings, corpus files of the same size and time), "
            "nothing to do"
        )
        return PrepareResult(tok_dir, done, skipped=True)

    t0 = time.perf_counter()
    chunks = plan_chunks(files, chunk_bytes)
    mine = [] if merge else [c for i, c in enumerate(chunks) if i % num_shards == shard_index]
    if on_error == "fail" and mine:  # every line of this run's chunks, before anything is written
        log = _check(mine, max_report, workers, whole=num_shards == 1)
        if log.total:
            raise CorpusError(log, str(corpus_dir))
    plan = {
        "format": PARTS_FORMAT,
        "plan_key": plan_key,
        "settings": settings,
        "split": split,
        "chunks": [c.name for c in chunks],
    }
    with _parts_kept_on_progress(parts, tok_dir):
        _open_parts(parts, plan, fresh=force and not merge and num_shards == 1)
        tok = _tokenizer(tokenizer, parts, chunks, roles, split, policy, sp_vocab_size, seed, workers, say)
        dtype = _token_dtype(tok, len(files))
        job = ChunkJob(
            str(parts),
            tok.spec(),
            np.dtype(dtype).name,
            tok.total_vocab_size(len(files)),
            seed,
            valid_fraction,
            test_fraction,
            False,
            max_report,
            plan_key,
            os.getpid(),
        )
        pending = [c for c in mine if read_record(parts, c, plan_key) is None]
        stats = _prepare_chunks(pending, job, policy, workers, progress, say, len(mine))
    if num_shards > 1:
        say(
            f"shard {shard_index} of {num_shards}: {len(mine)} chunk(s) ready in {parts} ({len(pending)} prepared "
            f"now). When every shard is done: python -m data.prepare --corpus {corpus_dir} --out {out_dir} "
            f"--tokenizer {tokenizer} [same options] --merge"
        )
        return PrepareResult(tok_dir, {}, skipped=False, stats=stats, merged=False)
    return _finish(
        corpus_dir,
        files,
        parts,
        tok_dir,
        chunks,
        plan,
        tok,
        dtype,
        roles,
        manifest_sha,
        settings,
        split,
        policy,
        stats,
        t0,
        max_report,
        progress,
        say,
    )


def _prepare_chunks(
    pending: Sequence[Chunk],
    job: ChunkJob,
    policy: dict[str, bool],
    workers: int,
    progress: bool,
    say,
    planned: int,
) -> dict:
    """Prepare the chunks not yet finished, on `workers` processes, with a progress bar in input bytes."""
    total = sum(c.end - c.start for c in pending)
    if planned and len(pending) < planned:
        say(f"resuming: {planned - len(pending)} of {planned} chunk(s) already prepared")
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="prepare",
        disable=not progress or not pending,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    t0 = time.perf_counter()
    try:
        tasks = [(c, ChunkJob(**{**job.__dict__, "anonymise": policy[c.domain]})) for c in pending]
        procs = workers if total >= PROCESS_MIN_BYTES else 1
        records = _run(prepare_chunk, tasks, procs, bar, lambda t: t[0].end - t[0].start)
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    text = sum(r["text_bytes"] for r in records)
    return {
        "chunks": len(pending),
        "input_bytes": total,
        "text_bytes": text,
        "tokenise_seconds": round(seconds, 3),
        "mb_per_s": round(total / 1e6 / max(seconds, 1e-9), 2),
        "workers": workers,
        "encoder": "chunk processes" if procs > 1 and len(pending) > 1 else "in-process",
    }


def _finish(
    corpus_dir,
    files,
    parts,
    tok_dir,
    chunks,
    plan,
    tok,
    dtype,
    roles,
    manifest_sha,
    settings,
    split,
    policy,
    stats,
    t0,
    keep,
    progress,
    say,
) -> PrepareResult:
    """Merge every chunk's parts into the published `tok_dir` (staged: a failure leaves the old one), write the
    manifest, then remove the parts."""
    records = [read_record(parts, c, plan["plan_key"]) for c in chunks]
    missing = [c.name for c, r in zip(chunks, records) if r is None]
    if missing:
        raise ValueError(
            f"{parts}: {len(missing)} of {len(chunks)} chunk(s) not prepared yet "
            f"({', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}): run the shards that "
            "prepare them (chunk i belongs to shard i % num_shards), or run without --num-shards/--merge "
            "to prepare what is missing here"
        )
    hashes: dict[str, str] = {}
    hasher = _hash_files(files, hashes)
    bar = tqdm(
        total=sum(info["bin_bytes"] for r in records for info in r["splits"].values()),
        unit="B",
        unit_scale=True,
        desc="merge",
        disable=not progress,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    with staged_dir(tok_dir, manifest="manifest.json") as work:
        try:
            counts, token_counts = merge_domains(
                parts, work, records, dtype, tok.total_vocab_size(len(files)), bar
            )
        finally:
            bar.close()
            hasher.join()
        if (parts / SP_MODEL_FILE).is_file():
            shutil.copyfile(parts / SP_MODEL_FILE, work / SP_MODEL_FILE)
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
        corpus = {
            "dir": str(corpus_dir.resolve()),  # absolute: the data is read from runs started in any directory
            "manifest_sha256": manifest_sha,
            "files": {f"{d}.jsonl": hashes[f"{d}.jsonl"] for d in files},
        }
        n_tokens = sum(info["tokens"] for s in counts.values() for info in s.values())
        total_seconds = time.perf_counter() - t0
        manifest = {
            "format": FORMAT,
            "plan_key": plan["plan_key"],
            "inputs_sha256": _fingerprint(
                {"format": FORMAT, "corpus": corpus["files"], "manifest": manifest_sha, "settings": settings}
            ),
            "created_unix": int(time.time()),
            "tokenizer": {
                **tok.describe(),
                **({"model_file": SP_MODEL_FILE} if tok.name == "sentencepiece" else {}),
            },
            "dtype": np.dtype(dtype).name,
            "bos_in_bin": True,
            "domains": list(files),
            "roles": roles,
            "corpus": corpus,
            "split": {
                **split,
                "method": "a domain file up to chunk_bytes: per-domain permutation seeded by "
                "(seed, crc32(domain)), test first, then valid; a larger one: blake2b(seed, domain, document id) "
                "per document (data/chunks.py)",
            },
            "anonymise": {"policy": policy, "counts": anon, "documents": touched},
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
        say(
            f"prepared {stats['input_bytes'] / 1e6:.1f} MB into {n_tokens:,} tokens in {total_seconds:.1f} s: "
            f"{manifest['stats']['tokens_per_s']:,} tokens/s, {stats['mb_per_s']} MB/s ({stats['encoder']}, "
            f"{stats['workers']} worker(s))"
        )
    return PrepareResult(tok_dir, manifest, skipped=False, stats=manifest["stats"])


@cli_main
def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.prepare", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--corpus",
        required=True,
        help="directory of <domain>.jsonl (+ manifest.json), as data.ingest writes it",
    )
    p.add_argument("--out", required=True, help="output root; files go to <out>/<tokenizer>/")
    p.add_argument("--tokenizer", default="gpt2", choices=("gpt2", "sentencepiece"))
    p.add_argument(
        "--workers",
        type=positive_int,
        default=None,
        help=f"worker processes (default: every core, here {available_cores()})",
    )
    p.add_argument("--seed", type=random_seed, default=1234)
    p.add_argument("--valid-fraction", type=unit_right_open, default=0.05)
    p.add_argument("--test-fraction", type=unit_right_open, default=0.05)
    p.add_argument("--domains", default=None, help="comma-separated subset (default: every <domain>.jsonl)")
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--anonymise",
        dest="anonymise",
        action="store_true",
        default=None,
        help="replace e-mail addresses, phone numbers, user names, ... by dummy tokens (DEMix A.2; "
        "data/anonymise.py); off by default: it rewrites text, code especially",
    )
    g.add_argument("--no-anonymise", dest="anonymise", action="store_false", help="the default")
    p.add_argument(
        "--anonymise-off",
        action="append",
        default=[],
        metavar="DOMAIN",
        help="with --anonymise: not this domain (repeatable, e.g. code)",
    )
    p.add_argument(
        "--novel",
        nargs="+",
        default=None,
        metavar="DOMAIN",
        help="held-out domains: prepared and evaluated as novel, never trained on (nor the tokenizer)",
    )
    p.add_argument("--sp-vocab-size", type=positive_int, default=8192)
    p.add_argument("--on-error", default="skip", choices=("skip", "fail"))
    p.add_argument(
        "--chunk-mb",
        type=positive_float,
        default=CHUNK_BYTES / 2**20,
        help="MiB of a domain file per chunk (the unit of work, of resuming and of sharding)",
    )
    p.add_argument("--num-shards", type=positive_int, default=1, help="prepare only every N-th chunk ...")
    p.add_argument("--shard-index", type=nonneg_int, default=0, help="... starting at this one (0-based)")
    p.add_argument(
        "--merge", action="store_true", help="merge what every shard prepared into the final files"
    )
    p.add_argument(
        "--force", action="store_true", help="redo the work even if the manifest says it is up to date"
    )
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    if a.anonymise_off and not a.anonymise:
        p.error("--anonymise-off DOMAIN goes with --anonymise (anonymisation is off by default)")
    try:
        prepare_corpus(
            a.corpus,
            a.out,
            tokenizer=a.tokenizer,
            workers=a.workers,
            seed=a.seed,
            valid_fraction=a.valid_fraction,
            test_fraction=a.test_fraction,
            anonymise=parse_policy_args(True, a.anonymise_off) if a.anonymise else False,
            sp_vocab_size=a.sp_vocab_size,
            on_error=a.on_error,
            domains=a.domains.split(",") if a.domains else None,
            force=a.force,
            progress=not a.quiet,
            chunk_bytes=max(1, int(a.chunk_mb * 2**20)),
            num_shards=a.num_shards,
            shard_index=a.shard_index,
            merge=a.merge,
            novel=a.novel,
        )
    except (CorpusError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    exit_process(main())
