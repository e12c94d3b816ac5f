"""Anonymisation speed: `data.anonymise.anonymise` vs tiktoken GPT-2 `encode_ordinary` on the same text, one core.

    python -m experiments.anonymise_speed [--mb 10] [--doc-kb 4] [--rounds 3] [--baseline-rev REV | --baseline OLD.py]
        [--out FILE.md]

The data pipeline anonymises every document before it encodes it, so anonymisation should cost at most a third of
the encoding: `anonymise` at >= 3x the speed of `encode_ordinary` on one core. Text (offline, on any Debian-like
machine): README, changelog, NEWS and copyright files from /usr/share/doc (.gz ones decompressed), the licences in
/usr/share/common-licenses and the Python standard library's .py files, in a seeded random order, at most 200 KB
from each file, cut into documents of `--doc-kb` KB until `--mb` MB of UTF-8. Each round times, one after the other
on this thread, GPT-2 encoding of every document (`load_tokenizer("gpt2").encode`, i.e. `encode_ordinary`),
`anonymise` of every document and, with `--baseline-rev` or `--baseline`, the `anonymise` of another copy of
data/anonymise.py (`git show REV:data/anonymise.py`, or a file), whose output is compared with this one's on every
document. The best round of each is reported, as MB/s and as the ratio to encoding, with the ratio of every round.
/proc/loadavg before and after and the CPU other processes used are recorded: the machine may be shared, so only
ratios within one run compare. Writes experiments/results/anonymise_speed.md.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import os
import platform
import random
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

from data.argtypes import positive_float, positive_int, random_seed
from data.cli import ModuleImportError, import_module_file, usage_error
from launcher.tables import markdown_table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
_DOC_PREFIXES = ("readme", "changelog", "news", "changes", "copyright")


def source_files() -> list[Path]:
    """The files the text is made of, sorted (the order is then shuffled with a seed)."""
    files: list[Path] = []
    for root, _, names in os.walk("/usr/share/doc"):
        files += [Path(root, n) for n in names if n.lower().startswith(_DOC_PREFIXES)]
    files += [p for p in Path("/usr/share/common-licenses").glob("*")]
    files += list(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    return sorted(p for p in set(files) if p.is_file())


def build_documents(
    mb: float, doc_chars: int, seed: int = 0, per_file: int = 200_000
) -> tuple[list[str], int]:
    """Documents of `doc_chars` characters cut from the source files in a seeded order; and how many files."""
    files = source_files()
    random.Random(seed).shuffle(files)
    docs: list[str] = []
    size, used = 0, 0
    for path in files:
        try:
            raw = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
        except OSError:
            continue
        text = raw.decode("utf-8", "replace")[:per_file]
        used += 1
        for i in range(0, len(text), doc_chars):
            docs.append(text[i : i + doc_chars])
            size += len(docs[-1].encode())
        if size >= mb * 1e6:
            break
    return docs, used


def load_module(path: str, option: str = "--baseline") -> ModuleType:
    """Another copy of data/anonymise.py, imported under its own name; one error line and exit status 2 when it
    cannot be imported (data/cli.py `import_module_file`)."""
    try:
        return import_module_file(path, option, "_anonymise_speed_baseline")
    except ModuleImportError as e:
        raise SystemExit(usage_error(e)) from None


def baseline_from_git(rev: str) -> str:
    """data/anonymise.py at `rev`, written to a temporary file (local git only); returns its path."""
    p = subprocess.run(["git", "show", f"{rev}:data/anonymise.py"], cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"--baseline-rev {rev}: {p.stderr.strip() or 'git show failed'}")
    f = tempfile.NamedTemporaryFile("w", suffix="_anonymise.py", delete=False)
    f.write(p.stdout)
    f.close()
    return f.name


def loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return f"{os.getloadavg()[0]:.2f} (os.getloadavg)"


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=positive_float, default=10.0, help="megabytes of UTF-8 text (default 10)")
    ap.add_argument("--doc-kb", type=positive_float, default=4.0, help="document size in KB (default 4)")
    ap.add_argument(
        "--rounds", type=positive_int, default=3, help="timed rounds; the best is reported (default 3)"
    )
    ap.add_argument("--seed", type=random_seed, default=0, help="order of the source files (default 0)")
    base_arg = ap.add_mutually_exclusive_group()
    base_arg.add_argument(
        "--baseline-rev", metavar="REV", help="also time (and compare with) data/anonymise.py at REV"
    )
    base_arg.add_argument(
        "--baseline", metavar="OLD.py", help="also time (and compare with) another copy of it"
    )
    ap.add_argument("--out", default=str(RESULTS / "anonymise_speed.md"), help="the Markdown report")
    return ap.parse_args(argv)


def _baseline(a: argparse.Namespace) -> tuple[ModuleType | None, str, str]:
    """(the baseline module or None, its sha256 prefix, its name in the report) from --baseline-rev / --baseline."""
    base_path = baseline_from_git(a.baseline_rev) if a.baseline_rev else a.baseline
    try:
        base = (
            load_module(base_path, "--baseline-rev" if a.baseline_rev else "--baseline")
            if base_path
            else None
        )
        digest = hashlib.sha256(Path(base_path).read_bytes()).hexdigest()[:12] if base_path else ""
    finally:
        if a.baseline_rev:
            os.unlink(base_path)
    base_name = f"at {a.baseline_rev}" if a.baseline_rev else f"baseline {a.baseline}"
    return base, digest, base_name


def _time_rows(
    rows: dict[str, Callable[[], object]], rounds: int
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, object], dict]:
    """Every row once per round, in order: (wall seconds, CPU seconds, first output) per row, and other load."""
    from benchmarks.machine import OtherLoad

    times: dict[str, list[float]] = {k: [] for k in rows}
    cpu: dict[str, list[float]] = {k: [] for k in rows}
    outputs: dict[str, object] = {}
    with OtherLoad() as others:
        for _ in range(rounds):
            for name, run in rows.items():
                t0, c0 = time.perf_counter(), time.process_time()
                out = run()
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
                outputs.setdefault(name, out)
    return times, cpu, outputs, others.result()


def _markdown(
    a: argparse.Namespace, argv: Sequence[str] | None, result: dict, base_name: str, digest: str
) -> list[str]:
    """The report's lines: machine, text, the table of rows, the baseline comparison and the two notes."""
    times, cpu, counts, mb = result["times"], result["cpu"], result["counts"], result["mb"]
    names = list(times)
    enc = names[0]
    best = {k: min(v) for k, v in times.items()}
    best_cpu = {k: min(v) for k, v in cpu.items()}
    args = list(argv if argv is not None else sys.argv[1:])
    command = " ".join(["python -m experiments.anonymise_speed"] + ([shlex.join(args)] if args else []))
    lines = [
        "# Anonymisation speed vs GPT-2 encoding (one core)",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {os.cpu_count()} cores, {_cpu()}, {platform.platform()}, Python {platform.python_version()}. "
        f"`/proc/loadavg` before: `{result['load_before']}`; after: `{result['load_after']}`. Other processes used "
        f"{_fmt(result['others'].get('others_cores'))} cores on average during the timed rounds (the machine is "
        "shared: only ratios taken in the same run compare).",
        "",
        f"Text: {result['docs']} documents of up to {a.doc_kb:g} KB, {mb:.2f} MB of UTF-8 "
        f"({result['tokens']:,} GPT-2 tokens), "
        f"cut from {result['files']} files in a seeded order (seed {a.seed}, at most 200 KB from each): README, "
        "changelog, NEWS and copyright files of /usr/share/doc (.gz decompressed), /usr/share/common-licenses, "
        f"the Python standard library's .py files. {result['unscreened_docs']} documents hold a character the "
        "byte shape cannot stand for (a non-ASCII digit, İ ı ſ K) and take the unscreened path. Replacements: "
        + ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items()))
        + ".",
        "",
        f"Best of {a.rounds} rounds (each round runs every row once, in this order); wall time, and the CPU "
        "time of this process (`time.process_time`), which counts less of what other processes take:",
        "",
        *markdown_table(
            [
                "row",
                "best wall s",
                "MB/s",
                "vs encoding",
                "per round vs encoding",
                "best CPU s",
                "CPU MB/s",
                "vs encoding (CPU)",
            ],
            [
                [
                    name,
                    f"{best[name]:.3f}",
                    f"{mb / best[name]:.2f}",
                    f"{best[enc] / best[name]:.2f}x",
                    ", ".join(f"{e / t:.2f}x" for e, t in zip(times[enc], times[name])),
                    f"{best_cpu[name]:.3f}",
                    f"{mb / best_cpu[name]:.2f}",
                    f"{best_cpu[enc] / best_cpu[name]:.2f}x",
                ]
                for name in names
            ],
            align="lrrrlrrr",
        ),
    ]
    if "identical" in result:
        lines += [
            "",
            f"Baseline: data/anonymise.py {base_name} (sha256 {digest}...). Output: {result['identical']} "
            f"of {result['docs']} documents give the same text and counts with both copies; this copy is "
            f"{best[names[2]] / best[names[1]]:.1f}x as fast as the baseline.",
        ]
    lines += ["", "## Where the time went before", "", _BEFORE, "", "## How `anonymise` keeps up", "", _HOW]
    return lines


def main(argv: Sequence[str] | None = None) -> dict:
    """Time the rows, print a summary and write the Markdown report; returns the figures."""
    a = _parse(argv)
    base, digest, base_name = _baseline(a)  # a baseline that cannot be imported: one error, before any work

    from data.anonymise import anonymise
    from data.anonymise_prescreen import _screenable
    from data.tokenizer import load_tokenizer

    load_before = loadavg()
    docs, n_files = build_documents(a.mb, int(a.doc_kb * 1000), a.seed)
    mb = sum(len(d.encode()) for d in docs) / 1e6
    tok = load_tokenizer("gpt2")
    rows: dict[str, Callable[[], object]] = {
        "tiktoken GPT-2 `encode_ordinary`": lambda: [tok.encode(d) for d in docs],
        "`anonymise` (this data/anonymise.py)": lambda: [anonymise(d) for d in docs],
    }
    if base is not None:
        rows[f"`anonymise` ({base_name})"] = lambda: [base.anonymise(d) for d in docs]
    times, cpu, outputs, others = _time_rows(rows, a.rounds)
    load_after = loadavg()
    names = list(rows)
    tokens = sum(len(ids) for ids in outputs[names[0]])
    result = {
        "mb": mb,
        "docs": len(docs),
        "files": n_files,
        "tokens": tokens,
        "times": times,
        "cpu": cpu,
        "load_before": load_before,
        "load_after": load_after,
        "others": others,
    }
    if base is not None:
        ours, theirs = outputs[names[1]], outputs[names[2]]
        result["identical"] = sum((x.text, x.counts) == (y.text, y.counts) for x, y in zip(ours, theirs))
    counts: dict[str, int] = {}
    for r in outputs[names[1]]:
        for k, v in r.counts.items():
            counts[k] = counts.get(k, 0) + v
    result["counts"] = counts
    result["unscreened_docs"] = sum(not _screenable(d) for d in docs)

    lines = _markdown(a, argv, result, base_name, digest)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines[: len(lines) - 7]))
    return result


_BEFORE = """\
Measured once when the change was made (cProfile and per-step timers, 10 MB of the same kind of text, 2,700
documents): the implementation at d2420ed spent 4.1 s, 0.40x the speed of encoding. By step: `_PHONE_LABELLED` 0.78 s
(its label words are in almost every document: `tel` in `hotel`, `ring` in `string`, `text`, `call`),
`_PHONE` 0.73 s and `_CARD` 0.20 s, `_SSN` 0.17 s, `_NINO` 0.09 s (digits are in nearly every document), the
`_OBFUSCATION_HINT` gate 0.41 s (a scan from every position), `_EMAIL` 0.32 s, `_FB_USERID` and `_FB_VANITY`
0.40 s (`fb` in hex and `0xfb`), `_PROFILE_URL` 0.19 s, `_FEDI_HANDLE` 0.17 s, the `isdigit` loop 0.18 s; no step
but `_EMAIL` replaced much. A differential check of that implementation against this one (text, counts and
`find_spans`) on 30 MB of such documents, the labelled set's texts and over 500,000 mutated and generated strings
(digits, `@`, `/`, `.`, labels, URLs, non-ASCII spaces and digits inserted) found no difference."""

_HOW = """\
Most steps find nothing in most documents, and a regex whose first element is a look-behind, a case-insensitive
word or a character class tries every position of the text (10-40 ns a character here, while GPT-2 encoding takes
100-170). `data/anonymise.py` therefore screens first (its "pre-screens" section):

- a byte *shape* of each document (same length, digits 0-9 as `0`, non-ASCII as `?`) is tested with substring
  searches and byte regexes that start with a literal, which the regex engine scans for at about 1 ns a character;
  after a step replaces something, the shape is spliced (a token's shape is itself), not made again;
- a step runs only when the current text holds what every accepted match of it needs: a run of 7+ digits (an
  *anchor*) for cards, SSNs and phone numbers, `@` for e-mails, `.com/` or `t.me/` for profile URLs, a DART key,
  a NINO label and digits, ...; gates that any match implies (phone label words, profile hosts) are left to the
  step;
- the costly steps run only where a match can start (`pattern.match` at candidates: card, SSN and NANP shapes at
  anchors, `+`/`00`, label words in the run of label characters before an anchor, `u/`) or in windows around an
  `@` or a `.com/` that hold every character a match there reads; a `github.com/org/repo` link, which
  `_profile_ok` rejects, is skipped; e-mail windows, which recur (a changelog's maintainers), are kept per content;
- `@handle` and fediverse patterns start with the literal `@` (`@(?<!X@)` for `(?<!X)@`), the profile and e-mail
  accept functions no longer compile a regex per call, and `_OBFUSCATION_HINT` (a full scan) runs only after a
  byte pre-screen for bracketed `at`, ` AT ... DOT ` or ` at PROVIDER`.

A text the shape cannot stand for exactly (a decimal digit other than 0-9; İ ı ſ K, which case-insensitive
patterns read as i, i, s, k) goes through `_anonymise_reference`, the same steps over the whole text. The output is
unchanged: tests/data/test_anonymise.py pins the outputs of the implementation before this change at every pre-screen's
boundary and compares both pipelines (text, counts, spans) on 2,000 seeded mutated texts; the labelled set's
precision/recall table (`python -m data.anonymise --evaluate tests/fixtures/anonymise_labelled.jsonl`) is the same."""


def _cpu() -> str:
    try:
        return next(
            (l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?"
        )
    except OSError:
        return "?"


def _fmt(x: float | None) -> str:
    return "?" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    main()
