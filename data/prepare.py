"""Per-domain JSONL -> anonymised, split, tokenised megatron-core indexed datasets, with a manifest, streamed.

    python -m data.prepare --corpus artifacts/demo/corpus --out artifacts/demo/tokens [--tokenizer gpt2]
        [--workers N (default: every core)] [--seed 1234] [--valid-fraction 0.05] [--test-fraction 0.05]
        [--domains a,b] [--novel d1 d2] [--anonymise [--anonymise-off code]]
        [--sp-vocab-size 8192 | --sp-model ANCHOR_TOKENS/sentencepiece/tokenizer.model]
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
for larger ones). Sentencepiece is trained first, on a bounded sample (`sentencepiece_sample`) of the training
domains, unless `--sp-model` gives an existing model (e.g. an anchor's, so that a data owner's tokens have the
anchor's token ids): that one is copied and used as it is, and the manifest's tokenizer (and its fingerprint) is
that of the data it came from.

Output layout (DataConfig.path = <out>; DataConfig.tokenizer picks the sub-directory):

    <out>/<tokenizer>/manifest.json              what, from what, how (see below)
    <out>/<tokenizer>/<domain>/<split>.bin/.idx  split in train | valid | test; one megatron-core sequence and
                                                 one document per corpus document, [bos] + tokens
    <out>/<tokenizer>/<domain>/token_counts.npy  int64 (3, vocabulary): occurrences of each token id per split
                                                 (train, valid, test) in the .bin files: the unigram baseline's fit
    <out>/sentencepiece/tokenizer.model          the trained (or --sp-model's) sentencepiece model

Token dtype: uint16 when the vocabulary (domain tokens included) is below 65,536, else int32.

The manifest ties the token files to their tokenizer (name, vocab size, bos id, sha256 of its vocabulary files;
with --sp-model, `tokenizer_from` names the file it was copied from), the corpus (sha256 of manifest.json and of
every JSONL file), the split seed, fractions and chunk size, the anonymisation policy and counts, the problems, and
per domain and split the documents, tokens (bos included), bytes and sha256 of each .bin. Re-running with the same
settings (an --sp-model by its sha256) on corpus files of the same size and modification time (`plan_key`) finds
the files of the recorded sizes and skips all work (`force=True` redoes it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data.anonymise import AnonymisePolicy, parse_policy_args
from data.argtypes import in_range, nonneg_int, positive_float, positive_int, random_seed, unit_right_open
from data.chunks import (
    CHUNK_BYTES,
    Chunk,
    ChunkJob,
    absolute_problems,
    check_chunk,
    plan_chunks,
    prepare_chunk,
    read_record,
    split_documents,
    split_texts,
)
from data.cli import check_output_dir, cli_main, exit_process, usage_error
from data.ingest import CorpusError, Problem, ProblemLog, check_on_error
from data.prepare_merge import _finish
from data.prepare_parts import (
    PARTS_FORMAT,
    _by_domain_records,
    _open_parts,
    _parts_dir,
    _parts_kept_on_progress,
    _token_dtype,
    _tokenizer,
)
from data.prepare_plan import FORMAT, _make_plan, _Plan, _up_to_date
from data.tokenizer import SP_MODEL_FILE, TokenizerSpec, sentencepiece_model_file

# less input than this is prepared in this process: starting workers would cost more
PROCESS_MIN_BYTES = 8 << 20
# the sentencepiece vocabulary trained unless --sp-vocab-size says otherwise (--sp-model: the model's)
SP_VOCAB_SIZE = 8192

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


# ---------------------------------------------------------------- running chunks ------------------------------


def _warm(spec: TokenizerSpec | None) -> None:
    if spec is not None:
        spec.load()


def _pool(workers: int, warm: TokenizerSpec | None) -> ProcessPoolExecutor:
    """Worker processes that do not fork this (possibly torch-threaded) process: forkserver where available."""
    import multiprocessing as mp

    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    return ProcessPoolExecutor(
        workers, mp_context=mp.get_context(method), initializer=_warm, initargs=(warm,)
    )


def _run(fn, tasks: Sequence[tuple], workers: int, bar: tqdm | None, size) -> list:
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


# ---------------------------------------------------------------- the pipeline -------------------------------


def prepare_corpus(
    corpus_dir: str | Path,
    out_dir: str | Path,
    tokenizer: str = "gpt2",
    workers: int | None = None,
    seed: int = 1234,
    valid_fraction: float = 0.05,
    test_fraction: float = 0.05,
    anonymise: AnonymisePolicy = False,
    sp_vocab_size: int | None = None,
    on_error: str = "skip",
    domains: Sequence[str] | None = None,
    force: bool = False,
    progress: bool = True,
    max_report: int = 20,
    chunk_bytes: int = CHUNK_BYTES,
    num_shards: int = 1,
    shard_index: int = 0,
    merge: bool = False,
    novel: Sequence[str] | None = None,
    sp_model: str | Path | None = None,
) -> PrepareResult:
    """Anonymise, split and tokenise `<corpus_dir>/<domain>.jsonl` into `<out_dir>/<tokenizer>/`; see the module
    docstring for the layout, the manifest, sharding (`num_shards`, `shard_index`, `merge`) and resuming.
    `workers`: processes (default: every core this process may use). Returns the manifest and whether the work
    was skipped. `anonymise`: off (default), on for every domain (True), or per domain ({"code": False}: on for
    the others). `novel`: the held-out domains (else the corpus manifest's `split_role`s). Sentencepiece: a model
    of `sp_vocab_size` (default 8192) trained on the training domains, or the existing model `sp_model` (a model
    file, a prepared tokenizer directory or a tokens root; not with `sp_vocab_size`)."""
    workers = available_cores() if workers is None else workers
    _check_arguments(
        on_error=on_error,
        seed=seed,
        workers=workers,
        sp_vocab_size=sp_vocab_size,
        chunk_bytes=chunk_bytes,
        num_shards=num_shards,
        shard_index=shard_index,
        merge=merge,
        valid_fraction=valid_fraction,
        test_fraction=test_fraction,
        tokenizer=tokenizer,
        sp_model=sp_model,
    )
    model = sentencepiece_model_file(sp_model, "--sp-model") if sp_model is not None else None
    if tokenizer == "sentencepiece" and model is None and sp_vocab_size is None:
        sp_vocab_size = SP_VOCAB_SIZE
    plan = _make_plan(
        Path(corpus_dir),
        domains=domains,
        novel=novel,
        anonymise=anonymise,
        tokenizer=tokenizer,
        seed=seed,
        valid_fraction=valid_fraction,
        test_fraction=test_fraction,
        sp_vocab_size=sp_vocab_size,
        on_error=on_error,
        chunk_bytes=chunk_bytes,
        sp_model=model,
    )
    out_dir = Path(out_dir)
    tok_dir = out_dir / tokenizer
    check_output_dir(
        tok_dir,
        (FORMAT,),
        ["manifest.json", SP_MODEL_FILE, *plan.files],
        inputs=[*plan.files.values(), *([model] if model is not None else [])],
    )
    say = (lambda *a: print(*a, flush=True)) if progress else (lambda *a: None)
    say(_policy_line(plan.policy))
    if not force and (done := _up_to_date(tok_dir, plan.key)) is not None:
        say(
            f"{tok_dir}: up to date (plan {plan.key[:12]}: same settings, corpus files of the same size and time), "
            "nothing to do"
        )
        return PrepareResult(tok_dir, done, skipped=True)
    return _run_plan(plan, out_dir, workers, max_report, force, num_shards, shard_index, merge, progress, say)


def _run_plan(
    plan: _Plan,
    out_dir: Path,
    workers: int,
    max_report: int,
    force: bool,
    num_shards: int,
    shard_index: int,
    merge: bool,
    progress: bool,
    say: Callable[..., None],
) -> PrepareResult:
    """Prepare this shard's chunks of the plan (checking them first with on_error="fail"), then, unless this is one
    shard of several, merge every chunk's parts into `<out_dir>/<tokenizer>/` (`_finish`)."""
    t0 = time.perf_counter()
    tok_dir, parts = out_dir / plan.tokenizer, _parts_dir(out_dir, plan.tokenizer)
    chunks = plan_chunks(plan.files, plan.chunk_bytes)
    mine = [] if merge else [c for i, c in enumerate(chunks) if i % num_shards == shard_index]
    if plan.on_error == "fail" and mine:  # every line of this run's chunks, before anything is written
        log = _check(mine, max_report, workers, whole=num_shards == 1)
        if log.total:
            raise CorpusError(log, str(plan.corpus_dir))
    with _parts_kept_on_progress(parts, tok_dir):
        _open_parts(parts, _parts_plan(plan, chunks), fresh=force and not merge and num_shards == 1)
        tok = _tokenizer(
            plan.tokenizer,
            parts,
            chunks,
            plan.roles,
            plan.split,
            plan.policy,
            plan.sp_vocab_size,
            plan.seed,
            workers,
            say,
            plan.sp_model,
            plan.sp_model_sha,
        )
        dtype = _token_dtype(tok, len(plan.files))
        job = ChunkJob(
            str(parts),
            tok.spec(),
            np.dtype(dtype).name,
            tok.total_vocab_size(len(plan.files)),
            plan.seed,
            plan.valid_fraction,
            plan.test_fraction,
            False,
            max_report,
            plan.key,
            os.getpid(),
        )
        pending = [c for c in mine if read_record(parts, c, plan.key) is None]
        stats = _prepare_chunks(pending, job, plan.policy, workers, progress, say, len(mine))
    if num_shards > 1:
        say(
            f"shard {shard_index} of {num_shards}: {len(mine)} chunk(s) ready in {parts} ({len(pending)} prepared "
            f"now). When every shard is done: python -m data.prepare --corpus {plan.corpus_dir} --out {out_dir} "
            f"--tokenizer {plan.tokenizer} [same options] --merge"
        )
        return PrepareResult(tok_dir, {}, skipped=False, stats=stats, merged=False)
    manifest = _finish(plan, chunks, parts, tok_dir, tok, dtype, stats, t0, max_report, progress, say)
    return PrepareResult(tok_dir, manifest, skipped=False, stats=manifest["stats"])


def _check_arguments(
    on_error: str,
    seed: int,
    workers: int,
    sp_vocab_size: int | None,
    chunk_bytes: int,
    num_shards: int,
    shard_index: int,
    merge: bool,
    valid_fraction: float,
    test_fraction: float,
    tokenizer: str,
    sp_model: str | Path | None,
) -> None:
    """`prepare_corpus`'s arguments of the same names, checked before any work (ValueError naming the value)."""
    check_on_error(on_error)
    for name, value, rng in (
        ("seed", seed, random_seed),
        ("workers", workers, positive_int),
        *([("sp_vocab_size", sp_vocab_size, positive_int)] if sp_vocab_size is not None else []),
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
    if sp_model is not None and tokenizer != "sentencepiece":
        raise ValueError(
            f"--sp-model goes with --tokenizer sentencepiece (the {tokenizer} vocabulary is fixed already)"
        )
    if sp_model is not None and sp_vocab_size is not None:
        raise ValueError("--sp-vocab-size goes without --sp-model: the given model fixes the vocabulary")


def _parts_plan(plan: _Plan, chunks: Sequence[Chunk]) -> dict:
    """What the parts folder records of the plan (its plan.json): a resumed run or another shard checks it."""
    return {
        "format": PARTS_FORMAT,
        "plan_key": plan.key,
        "settings": plan.settings,
        "split": plan.split,
        "chunks": [c.name for c in chunks],
    }


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


def _parser() -> argparse.ArgumentParser:
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
    p.add_argument(
        "--sp-vocab-size",
        type=positive_int,
        default=None,
        help=f"the sentencepiece vocabulary to train (default {SP_VOCAB_SIZE})",
    )
    p.add_argument(
        "--sp-model",
        default=None,
        metavar="FILE",
        help="with --tokenizer sentencepiece: encode with this existing model instead of training one, e.g. "
        "an anchor's ANCHOR_TOKENS/sentencepiece/tokenizer.model (or that folder, or ANCHOR_TOKENS), so the "
        "tokens share its token ids and tokenizer fingerprint",
    )
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
    return p


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
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
            sp_model=a.sp_model,
        )
    except (CorpusError, ValueError, FileNotFoundError) as e:
        return usage_error(e)
    return 0


if __name__ == "__main__":
    exit_process(main())
