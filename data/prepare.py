"""Per-domain JSONL -> anonymised, split, tokenised megatron-core indexed datasets, with a manifest.

    python -m data.prepare --corpus artifacts/demo/corpus --out artifacts/demo/tokens [--tokenizer gpt2]
        [--workers 2] [--seed 1234] [--valid-fraction 0.05] [--test-fraction 0.05] [--domains a,b]
        [--anonymise-off code | --no-anonymise] [--sp-vocab-size 8192] [--on-error skip|fail] [--force]

Input: `<corpus>/<domain>.jsonl` ({"id", "domain", "text"} per line, as `data.ingest` and the demo fetcher
write) and optionally `<corpus>/manifest.json`. Lines are validated as in ingestion (file:line problems;
`on_error="fail"` raises before anything expensive, `"skip"` counts them in the manifest).

Output layout (DataConfig.path = <out>; DataConfig.tokenizer picks the sub-directory):

    <out>/<tokenizer>/manifest.json              what, from what, how (see below)
    <out>/<tokenizer>/<domain>/<split>.bin/.idx  split in train | valid | test; one megatron-core sequence and
                                                 one document per corpus document, [bos] + tokens
    <out>/sentencepiece/tokenizer.model          the trained sentencepiece model (tokenizer="sentencepiece")

Token dtype: uint16 when the vocabulary (domain tokens included) is below 65,536, else int32. Splits are
document-level and deterministic: per domain, a permutation seeded by (seed, crc32(domain)) puts the first
round(n * test_fraction) documents in test, the next round(n * valid_fraction) in valid, the rest in train
(at least one each when the fraction is > 0 and n >= 3); each split keeps corpus order.

The manifest ties the token files to their tokenizer (name, vocab size, bos id, sha256 of its vocabulary files),
the corpus (sha256 of manifest.json and of every JSONL file), the split seed and fractions, the anonymisation
policy and counts, the problems, and per domain and split the documents, tokens (bos included), bytes and sha256
of each .bin. Re-running with the same inputs and settings finds the same `inputs_sha256` and existing files of
the recorded sizes and skips all work (`force=True` redoes it). The whole corpus is held in memory while it is
processed (fine for the demo's ~140 MB; a larger corpus would stream per domain).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import sys
import time
import warnings
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence, Union

import numpy as np
from tqdm import tqdm

from data.atomic import staged_dir, write_json_atomic
from data.anonymise import AnonymisePolicy, add_counts, anonymise_many, parse_policy_args, resolve_policy
from data.blocks import SPLITS
from data.ingest import MANIFEST_FORMAT as INGEST_FORMAT
from data.ingest import CorpusError, Problem, ProblemLog, check_on_error, domain_name_problem, read_jsonl
from data.tokenizer import (
    SP_MODEL_FILE, GPT2Tokenizer, Tokenizer, TokenizerSpec, load_tokenizer, sha256_file, train_sentencepiece,
)
from data.argtypes import in_range, positive_int, random_seed, unit_right_open
from data.cli import check_output_dir, cli_main, exit_process
from data.readers import InputFileError, read_json_object

FORMAT = "demix-tokens/1"
CHUNK_CHARS = 1 << 18  # text per worker task: big enough to amortise pickling, small enough for a smooth bar
THREAD_CHUNK_CHARS = 1 << 17  # text per encoding-thread task: no pickling, so smaller: less idle time at the end


@dataclass
class PrepareResult:
    out_dir: Path
    manifest: dict
    skipped: bool
    stats: dict = field(default_factory=dict)


# ---------------------------------------------------------------- worker side (light imports only) ----------

def _anonymise_chunk(texts: list[str]) -> tuple[list[str], dict[str, int]]:
    return anonymise_many(texts)


def _encode_chunk(task: tuple[TokenizerSpec, list[str], str]) -> list[np.ndarray]:
    spec, texts, dtype = task
    tok = spec.load()  # cached per process
    out = []
    for ids in tok.encode_batch(texts):
        arr = np.empty(len(ids) + 1, dtype=dtype)
        arr[0] = tok.bos_id
        arr[1:] = ids
        out.append(arr)
    return out


def encode_concat(tok: Tokenizer, texts: Sequence[str], dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """[bos] + ids of every text, concatenated into one array of `dtype`, and each document's length (bos
    included): one allocation per chunk instead of one array per document. With a tokenizer that has
    `encode_array` (GPT-2) the encoding releases the GIL, so threads run it in parallel."""
    encode = getattr(tok, "encode_array", None)
    if encode is not None:
        parts = [encode(t) for t in texts]
    else:
        parts = [np.asarray(ids, dtype=np.int64) for ids in tok.encode_batch(list(texts))]
    lengths = np.fromiter((len(a) + 1 for a in parts), dtype=np.int64, count=len(parts))
    out = np.empty(int(lengths.sum()), dtype=dtype)
    starts = np.cumsum(lengths) - lengths
    out[starts] = tok.bos_id
    pos = 1
    for a, n in zip(parts, lengths.tolist()):
        out[pos:pos + n - 1] = a
        pos += n
    return out, lengths


class ThreadEncoder:
    """GPT-2 encoding on `workers` threads that starts while the corpus is still being read.

    `add(domain, text)` queues a document; every THREAD_CHUNK_CHARS of text becomes one `encode_concat` task on
    the thread pool (tiktoken releases the GIL while it encodes, so the threads run on separate cores while this
    thread goes on parsing JSON). `end(domain)` queues the domain's last partial chunk. `results(domain)` yields
    the (flat, lengths) of the domain's chunks in document order as they finish. The threads are the tokenizer's
    `encoding_threads` (kept for the process, each with an encoding of its own, which saves the 15-20% more CPU that
    threads sharing one encoding spend; see there). The queue is not bounded: the
    texts are in memory already, and a finished chunk's tokens (2 bytes per ~4 characters) are written and
    dropped as soon as its turn comes. `close()` cancels what has not started (an error, a raise in the caller)."""

    def __init__(self, tok: GPT2Tokenizer, dtype: str, workers: int, chunk_chars: int = 0):
        self.tok, self.dtype = tok, dtype
        self.chunk_chars = chunk_chars or THREAD_CHUNK_CHARS
        self._ex = tok.encoding_threads(max(1, workers))  # kept for the process: not shut down here
        self._futures: dict[str, deque] = {}
        self._batch: dict[str, tuple[list[str], int]] = {}

    def add(self, domain: str, text: str) -> None:
        batch, size = self._batch.get(domain) or ([], 0)
        batch.append(text)
        size += len(text)
        if size >= self.chunk_chars:
            self._submit(domain, batch)
            batch, size = [], 0
        self._batch[domain] = (batch, size)

    def end(self, domain: str) -> None:
        batch, _ = self._batch.pop(domain, ([], 0))
        self._futures.setdefault(domain, deque())
        if batch:
            self._submit(domain, batch)

    def feed(self, domain: str, texts: Iterable[str]) -> None:
        for t in texts:
            self.add(domain, t)
        self.end(domain)

    def __contains__(self, domain: str) -> bool:
        return domain in self._futures

    def results(self, domain: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        futures = self._futures[domain]
        while futures:
            yield futures.popleft().result()

    def close(self) -> None:
        """Cancel the chunks not started and wait for the running ones (the threads are the tokenizer's, kept)."""
        from concurrent.futures import wait

        pending = [f for q in self._futures.values() for f in q if not f.cancel()]
        self._futures.clear()
        wait(pending)

    def _submit(self, domain: str, batch: list[str]) -> None:
        self._futures.setdefault(domain, deque()).append(self._ex.submit(encode_concat, self.tok, batch, self.dtype))


def _chunks(texts: Sequence[str], chunk_chars: int) -> Iterator[list[str]]:
    batch, size = [], 0
    for t in texts:
        batch.append(t)
        size += len(t)
        if size >= chunk_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _warm(spec: Optional[TokenizerSpec]) -> None:
    if spec is not None:
        spec.load()


def make_pool(workers: int, warm: Optional[TokenizerSpec] = None):
    """A process pool that does not fork this (possibly torch-threaded) process: forkserver where available.
    `warm` loads that tokenizer in every worker at start-up, off the clock of the first tasks."""
    if workers <= 1:
        return None
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    return mp.get_context(method).Pool(workers, initializer=_warm, initargs=(warm,))


def tokenize_documents(
    texts: Sequence[str], spec: TokenizerSpec, dtype: str, pool=None, chunk_chars: int = CHUNK_CHARS,
    progress: Optional[tqdm] = None,
) -> Iterator[np.ndarray]:
    """[bos] + ids for every text, in order, encoded by `pool` (or in this process when None)."""
    tasks = ((spec, c, dtype) for c in _chunks(texts, chunk_chars))
    results = pool.imap(_encode_chunk, tasks) if pool is not None else map(_encode_chunk, tasks)
    for arrays in results:
        if progress is not None:
            progress.update(len(arrays))
        yield from arrays


# ---------------------------------------------------------------- splitting, hashing, reading ----------------

def split_documents(n: int, domain: str, seed: int, valid_fraction: float, test_fraction: float) -> np.ndarray:
    """Split index per document (0 train, 1 valid, 2 test); see the module docstring."""
    def count(fraction: float) -> int:
        k = int(round(n * fraction))
        return max(k, 1) if fraction > 0 and n >= 3 else k

    n_test, n_valid = count(test_fraction), count(valid_fraction)
    while n_test + n_valid > max(n - 1, 0) and n_test + n_valid > 0:  # keep at least one training document
        if n_valid >= n_test:
            n_valid -= 1
        else:
            n_test -= 1
    perm = np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(domain.encode())])).permutation(n)
    split = np.zeros(n, dtype=np.int8)
    split[perm[:n_test]] = 2
    split[perm[n_test:n_test + n_valid]] = 1
    return split


def _corpus_files(corpus_dir: Path, domains: Optional[Sequence[str]]) -> dict[str, Path]:
    """`<domain>.jsonl` of the corpus by domain, checked before any work: every file a valid domain name, no two
    names equal but for case (their token folders would be one folder on macOS and Windows file systems), and, where
    the corpus has ingest's manifest, exactly the domains it lists (no file of an earlier ingest or a stray copy)."""
    found = {p.stem: p for p in sorted(corpus_dir.glob("*.jsonl"))}
    if not found:
        raise FileNotFoundError(f"{corpus_dir}: no <domain>.jsonl files")
    problems = [f"{found[d].name}: {bad}" for d in found if (bad := domain_name_problem(d)) is not None]
    folded: dict[str, list[str]] = {}
    for d in found:
        folded.setdefault(d.casefold(), []).append(d)
    problems += [f"{' and '.join(f'{d}.jsonl' for d in names)} name domains that differ only in case: merge them "
                 "into one file (data.ingest reports such documents as domain_case_clash)"
                 for names in folded.values() if len(names) > 1]
    listed = _ingested_domains(corpus_dir / "manifest.json")
    if listed is not None:
        extra = sorted(set(found) - set(listed))
        if extra:
            problems.append(f"{', '.join(f'{d}.jsonl' for d in extra)} not listed in {corpus_dir / 'manifest.json'} "
                            "(left by an earlier ingest, or copied in): list them in its \"domains\", remove them, or ingest again")
        gone = sorted(set(listed) - set(found))
        if gone:
            problems.append(f"{corpus_dir / 'manifest.json'} lists {', '.join(gone)} but {', '.join(gone)}.jsonl "
                            "is missing: ingest again")
    if problems:
        raise ValueError(f"{corpus_dir}: " + "; ".join(problems))
    if domains is None:
        return found
    missing = [d for d in domains if d not in found]
    if missing:
        raise FileNotFoundError(f"{corpus_dir}: no JSONL for domains {missing}; found {sorted(found)}")
    return {d: found[d] for d in domains}


def _read_domains(files: dict[str, Path], on_error: str, keep: int, sink: Optional[ThreadEncoder] = None,
                  stream: Sequence[str] = ()) -> tuple[dict[str, list[str]], ProblemLog]:
    """Validated texts per domain; with on_error="fail" every file is checked before returning or raising. The
    texts of the domains in `stream` also go to `sink` as they are read (`sink.end` after each)."""
    log, texts = ProblemLog(keep), {}
    for domain, path in files.items():
        texts[domain] = kept = []
        streamed = sink is not None and domain in stream
        for r in read_jsonl(path, domains=[domain], default_domain=domain):
            if isinstance(r, Problem):
                log.add(r)
            else:
                kept.append(r.text)
                if streamed:
                    sink.add(domain, r.text)
        if streamed:
            sink.end(domain)
    if on_error == "fail" and log.total:
        raise CorpusError(log, str(next(iter(files.values())).parent))
    return texts, log


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
        data = (read_json_object(corpus_manifest, {"domains?": dict}, "corpus manifest")
                if corpus_manifest.is_file() else {})
    except InputFileError as e:
        raise ValueError(f"{e}: fix or remove it (it gives the domains' train/novel roles)") from None
    doms = data.get("domains", {})
    return {d: doms[d].get("split_role", "train") if isinstance(doms.get(d), dict) else "train" for d in domains}


def _fingerprint(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _up_to_date(tok_dir: Path, inputs_sha256: str) -> Optional[dict]:
    path = tok_dir / "manifest.json"
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    if manifest.get("inputs_sha256") != inputs_sha256:
        return None
    for splits in manifest.get("counts", {}).values():
        for info in splits.values():
            for key in ("bin", "idx"):
                rel = info.get(key)
                if rel and (not (tok_dir / rel).is_file() or (tok_dir / rel).stat().st_size != info.get(f"{key}_bytes")):
                    return None
    model = manifest["tokenizer"].get("model_file")
    if model and manifest["tokenizer"]["files"].get(model) != (sha256_file(tok_dir / model) if (tok_dir / model).is_file() else None):
        return None
    return manifest


# ---------------------------------------------------------------- writing ------------------------------------

def _write_indexed(prefix: Path, arrays: Iterable[np.ndarray], dtype: type) -> tuple[int, int]:
    """One megatron-core sequence + document per array; returns (documents, tokens)."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
    docs = tokens = 0
    for arr in arrays:
        builder.add_item(torch.from_numpy(arr))
        builder.end_document()
        docs, tokens = docs + 1, tokens + len(arr)
    builder.finalize(str(prefix) + ".idx")
    return docs, tokens


def _print_table(manifest: dict, out=None) -> None:
    out = out or sys.stdout
    rows = [("domain", *(f"{s} docs" for s in SPLITS), *(f"{s} tokens" for s in SPLITS))]
    for d, splits in manifest["counts"].items():
        rows.append((d, *(f"{splits[s]['documents']:,}" for s in SPLITS), *(f"{splits[s]['tokens']:,}" for s in SPLITS)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))), file=out)


# ---------------------------------------------------------------- the pipeline -------------------------------

def prepare_corpus(
    corpus_dir: Union[str, Path], out_dir: Union[str, Path], tokenizer: str = "gpt2", workers: int = 2,
    seed: int = 1234, valid_fraction: float = 0.05, test_fraction: float = 0.05,
    anonymise: AnonymisePolicy = True, sp_vocab_size: int = 8192, on_error: str = "skip",
    domains: Optional[Sequence[str]] = None, force: bool = False, progress: bool = True, max_report: int = 20,
) -> PrepareResult:
    """Anonymise, split and tokenise `<corpus_dir>/<domain>.jsonl` into `<out_dir>/<tokenizer>/`; see the module
    docstring for the layout and the manifest. Returns the manifest and whether the work was skipped."""
    check_on_error(on_error)
    for name, value, rng in (("seed", seed, random_seed), ("workers", workers, positive_int),
                             ("sp_vocab_size", sp_vocab_size, positive_int)):
        in_range(value, rng, name)  # the CLI's rule (data/argtypes.py) for callers of the function too
    if not (0 <= valid_fraction < 1 and 0 <= test_fraction < 1 and valid_fraction + test_fraction < 1):
        raise ValueError(f"valid_fraction={valid_fraction}, test_fraction={test_fraction}: need both in [0, 1), sum < 1")
    if tokenizer not in ("gpt2", "sentencepiece"):
        raise ValueError(f"tokenizer={tokenizer!r}: choose gpt2 or sentencepiece")
    corpus_dir, out_dir = Path(corpus_dir), Path(out_dir)
    files = _corpus_files(corpus_dir, domains)
    policy = resolve_policy(anonymise, files)
    corpus_manifest = corpus_dir / "manifest.json"
    roles = corpus_roles(corpus_manifest, files)  # before any work: a broken corpus manifest fails here
    corpus = {
        "dir": str(corpus_dir.resolve()),  # absolute: the data is read from runs started in any directory
        "manifest_sha256": sha256_file(corpus_manifest) if corpus_manifest.is_file() else None,
        "files": {f"{d}.jsonl": sha256_file(p) for d, p in files.items()},
    }
    settings = {"tokenizer": tokenizer, "seed": seed, "valid_fraction": valid_fraction, "test_fraction": test_fraction,
                "anonymise": policy, "sp_vocab_size": sp_vocab_size if tokenizer == "sentencepiece" else None,
                "on_error": on_error}
    inputs_sha256 = _fingerprint({"format": FORMAT, "corpus": corpus["files"], "manifest": corpus["manifest_sha256"],
                                  "settings": settings})
    tok_dir = out_dir / tokenizer
    check_output_dir(tok_dir, (FORMAT,), ["manifest.json", SP_MODEL_FILE, *files], inputs=list(files.values()))
    say = (lambda *a: print(*a, flush=True)) if progress else (lambda *a: None)
    if not force and (done := _up_to_date(tok_dir, inputs_sha256)) is not None:
        say(f"{tok_dir}: up to date (inputs_sha256 {inputs_sha256[:12]}), nothing to do")
        return PrepareResult(tok_dir, done, skipped=True)

    t_import = time.perf_counter()
    with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": irrelevant to data
        warnings.simplefilter("ignore")
        import megatron.core.datasets.indexed_dataset  # noqa: F401  (slow first import: off the throughput clock)
    import_seconds = time.perf_counter() - t_import
    # GPT-2 encodes on threads in this process (ThreadEncoder); a domain that needs nothing between reading and
    # encoding (not anonymised, and no bad line can fail the run) is encoded while it is still being read. The
    # encoding threads are started here, once per process, off the throughput clock like the import above.
    encoder, tok = None, None
    if tokenizer == "gpt2":
        tok = load_tokenizer("gpt2")
        encoder = ThreadEncoder(tok, np.dtype(_token_dtype(tok, len(files))).name, workers)
    t0 = time.perf_counter()
    setup_seconds = t0 - t_import  # one-off per process: the megatron-core import, tokenizer, encoding threads
    stream = [d for d in files if encoder is not None and not policy[d] and on_error == "skip"]
    pool = None
    # everything (tokens, tokenizer model, manifest) is written into a staged sibling of `tok_dir` and published
    # with the manifest (data/atomic.py `staged_dir`): a failure midway, a full disk included, leaves nothing
    with staged_dir(tok_dir, manifest="manifest.json") as work:
        try:
            texts, problems = _read_domains(files, on_error, max_report, encoder, stream)
            # processes only for what threads cannot do in parallel: anonymising (pure Python), sentencepiece encoding
            if any(policy[d] for d in texts) or tokenizer == "sentencepiece":
                pool = make_pool(workers)
            anon_counts: dict[str, dict[str, int]] = {}
            for d in texts:
                if policy[d]:
                    chunks = _chunks(texts[d], CHUNK_CHARS)
                    mapped = pool.imap(_anonymise_chunk, chunks) if pool else map(_anonymise_chunk, chunks)
                    texts[d], anon_counts[d] = [], {}
                    for out, counts in mapped:
                        texts[d].extend(out)
                        add_counts(anon_counts[d], counts)
            splits = {d: split_documents(len(t), d, seed, valid_fraction, test_fraction) for d, t in texts.items()}
            if tok is None:
                tok = _tokenizer(tokenizer, work, texts, splits, sp_vocab_size, seed, workers, say)
            dtype = _token_dtype(tok, len(files))
            counts, stats = _tokenise_all(texts, splits, tok, dtype, pool, work, progress, workers, encoder,
                                          started=t0 if stream else None)
        finally:
            if pool is not None:
                pool.close()
                pool.join()
            if encoder is not None:
                encoder.close()
        manifest = {
            "format": FORMAT, "inputs_sha256": inputs_sha256, "created_unix": int(time.time()),
            "tokenizer": {**tok.describe(), **({"model_file": SP_MODEL_FILE} if tokenizer == "sentencepiece" else {})},
            "dtype": np.dtype(dtype).name, "bos_in_bin": True, "domains": list(files), "roles": roles, "corpus": corpus,
            "split": {"seed": seed, "valid_fraction": valid_fraction, "test_fraction": test_fraction,
                      "method": "per-domain permutation seeded by (seed, crc32(domain)); test first, then valid"},
            "anonymise": {"policy": policy, "counts": anon_counts}, "problems": problems.to_json(), "counts": counts,
            "stats": {**stats, "total_seconds": round(time.perf_counter() - t0, 3),
                      "megatron_import_seconds": round(import_seconds, 3),
                      "setup_seconds": round(setup_seconds, 3)},
        }
        write_json_atomic(work / "manifest.json", manifest)
    if tokenizer == "sentencepiece":  # the model file at its published path is this run's: not a cached one
        from data import tokenizer as tokenizer_module

        for path in (work, tok_dir):
            tokenizer_module._CACHE.pop(TokenizerSpec("sentencepiece", str(path / SP_MODEL_FILE)), None)
    if progress:
        _print_table(manifest)
        if problems.total:
            say(f"skipped {problems.total} bad line(s): {dict(problems.counts)} (first ones in the manifest)")
    return PrepareResult(tok_dir, manifest, skipped=False, stats=manifest["stats"])


def _token_dtype(tok: Tokenizer, num_domains: int) -> type:
    return np.uint16 if tok.total_vocab_size(num_domains) < 65536 else np.int32


def _tokenizer(name, tok_dir, texts, splits, sp_vocab_size, seed, workers, say):
    if name == "gpt2":
        return load_tokenizer("gpt2")
    import sentencepiece as spm

    spm.set_random_generator_seed(seed)
    # interleave domains so a capped sample still covers every domain; train split only
    train = {d: [t for t, s in zip(texts[d], splits[d]) if s == 0] for d in texts}
    sample = (train[d][i] for i in range(max(map(len, train.values()), default=0)) for d in train if i < len(train[d]))
    say(f"training sentencepiece BPE (vocab {sp_vocab_size}) ...")
    tok_dir.mkdir(parents=True, exist_ok=True)
    tok = train_sentencepiece(sample, tok_dir / SP_MODEL_FILE, vocab_size=sp_vocab_size, threads=workers)
    from data import tokenizer as tokenizer_module

    tokenizer_module._CACHE.pop(TokenizerSpec("sentencepiece", str(tok_dir / SP_MODEL_FILE)), None)  # retrained
    return tok


class _ChunkWriter:
    """megatron-core `IndexedDatasetBuilder` fed a whole chunk at a time: the same .bin bytes and .idx as
    `add_item` + `end_document` per document (one sequence and one document each), without a tensor per
    document; the .bin's sha256 is computed as it is written."""

    def __init__(self, prefix: Path, dtype: type):
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        prefix.parent.mkdir(parents=True, exist_ok=True)
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        self.builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
        self.sha = hashlib.sha256()
        self.docs = self.tokens = 0

    def add(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        data = np.ascontiguousarray(flat, dtype=self.dtype)
        self.builder.data_file.write(data.data)
        self.sha.update(data.data)
        b, n = self.builder, len(lengths)
        start = len(b.sequence_lengths)
        b.sequence_lengths.extend(lengths.tolist())
        b.document_indices.extend(range(start + 1, start + n + 1))
        self.docs, self.tokens = self.docs + n, self.tokens + int(data.size)

    def finalize(self) -> None:
        self.builder.finalize(str(self.prefix) + ".idx")


def _by_split(flat: np.ndarray, lengths: np.ndarray, codes: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """A chunk's documents grouped by split code: (code, their tokens, their lengths), each group in document order.
    `flat` is the documents' tokens back to back, `lengths` their token counts, `codes` their split codes."""
    if (codes == codes[0]).all():
        return [(int(codes[0]), flat, lengths)]
    per_token = np.repeat(codes, lengths)
    return [(int(c), flat[per_token == c], lengths[codes == c]) for c in np.unique(codes)]


def _tokenise_all(texts, splits, tok, dtype, pool, tok_dir: Path, progress: bool, workers: int,
                  encoder: Optional[ThreadEncoder] = None, started: Optional[float] = None):
    """Tokenise every domain and split into `tok_dir` (the staged directory `prepare_corpus` publishes).

    GPT-2 takes the fast path: `encoder` (a ThreadEncoder) encodes chunks of each domain's documents in corpus
    order on `workers` threads, streamed while reading for the domains it already holds, queued here for the others
    (e.g. after anonymisation); this thread routes each finished chunk's documents to their split's file
    (`_by_split`) while the next chunks encode. Sentencepiece encodes in the worker processes of `pool` (or here
    without one), one split after another. `started`: when encoding began, if before this call (streaming), so
    that the throughput covers all of it."""
    staging = tok_dir
    n_docs = sum(len(t) for t in texts.values())
    n_bytes = sum(len(t) if t.isascii() else len(t.encode("utf-8")) for ts in texts.values() for t in ts)
    counts: dict[str, dict] = {d: {s: {"documents": 0, "tokens": 0, "bin": None, "idx": None} for s in SPLITS}
                               for d in texts}
    bar = tqdm(total=n_docs, unit="doc", desc="tokenise", disable=not progress, file=sys.stderr, dynamic_ncols=True)
    name = np.dtype(dtype).name
    t0 = started if started is not None else time.perf_counter()
    n_tokens = 0

    def record(d: str, split: str, docs: int, tokens: int, sha: Optional[str] = None) -> None:
        rel = f"{d}/{split}"
        counts[d][split] = {"documents": docs, "tokens": tokens, "bin": rel + ".bin", "idx": rel + ".idx",
                            "bin_bytes": (staging / d / f"{split}.bin").stat().st_size,
                            "idx_bytes": (staging / d / f"{split}.idx").stat().st_size,
                            "bin_sha256": sha or sha256_file(staging / d / f"{split}.bin")}

    try:
        if encoder is not None:
            for d in texts:
                if d not in encoder:  # not streamed while reading
                    encoder.feed(d, texts[d])
            for d in texts:
                writers: dict[int, _ChunkWriter] = {}
                first = 0
                for flat, lengths in encoder.results(d):
                    codes = splits[d][first:first + len(lengths)]
                    first += len(lengths)
                    for code, part, part_lengths in _by_split(flat, lengths, codes):
                        if code not in writers:
                            writers[code] = _ChunkWriter(staging / d / SPLITS[code], dtype)
                        writers[code].add(part, part_lengths)
                    bar.update(len(lengths))
                if first != len(texts[d]):
                    raise RuntimeError(f"{d}: encoded {first} documents of {len(texts[d])}")  # a bug, not bad input
                for code in sorted(writers):
                    w = writers[code]
                    w.finalize()
                    record(d, SPLITS[code], w.docs, w.tokens, w.sha.hexdigest())
        else:
            for d, ts in texts.items():
                for code, split in enumerate(SPLITS):
                    chosen = [t for t, s in zip(ts, splits[d]) if s == code]
                    if chosen:
                        arrays = tokenize_documents(chosen, tok.spec(), name, pool, progress=bar)
                        docs, tokens = _write_indexed(staging / d / split, arrays, dtype)
                        record(d, split, docs, tokens)
        n_tokens = sum(info["tokens"] for splits_ in counts.values() for info in splits_.values())
        seconds = time.perf_counter() - t0
        bar.close()
        for d in texts:
            (staging / d).mkdir(exist_ok=True)
    finally:
        bar.close()
    stats = {"documents": n_docs, "tokens": n_tokens, "text_bytes": n_bytes, "tokenise_seconds": round(seconds, 3),
             "tokens_per_s": round(n_tokens / max(seconds, 1e-9)), "mb_per_s": round(n_bytes / 1e6 / max(seconds, 1e-9), 2),
             "workers": workers, "encoder": "threads" if encoder is not None else "processes" if pool else "in-process"}
    if progress:
        print(f"tokenised {n_bytes / 1e6:.1f} MB into {n_tokens:,} tokens in {seconds:.2f} s: "
              f"{stats['tokens_per_s']:,} tokens/s, {stats['mb_per_s']} MB/s ({workers} worker(s))", flush=True)
    return counts, stats


@cli_main
def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.prepare", description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True, help="directory of <domain>.jsonl (+ manifest.json)")
    p.add_argument("--out", required=True, help="output root; files go to <out>/<tokenizer>/")
    p.add_argument("--tokenizer", default="gpt2", choices=("gpt2", "sentencepiece"))
    p.add_argument("--workers", type=positive_int, default=2)
    p.add_argument("--seed", type=random_seed, default=1234)
    p.add_argument("--valid-fraction", type=unit_right_open, default=0.05)
    p.add_argument("--test-fraction", type=unit_right_open, default=0.05)
    p.add_argument("--domains", default=None, help="comma-separated subset (default: every <domain>.jsonl)")
    p.add_argument("--no-anonymise", dest="anonymise", action="store_false", default=None)
    p.add_argument("--anonymise-off", action="append", default=[], metavar="DOMAIN", help="repeatable, e.g. code")
    p.add_argument("--sp-vocab-size", type=positive_int, default=8192)
    p.add_argument("--on-error", default="skip", choices=("skip", "fail"))
    p.add_argument("--force", action="store_true", help="redo the work even if the manifest says it is up to date")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    try:
        prepare_corpus(
            a.corpus, a.out, tokenizer=a.tokenizer, workers=a.workers, seed=a.seed, valid_fraction=a.valid_fraction,
            test_fraction=a.test_fraction, anonymise=parse_policy_args(a.anonymise, a.anonymise_off),
            sp_vocab_size=a.sp_vocab_size, on_error=a.on_error,
            domains=a.domains.split(",") if a.domains else None, force=a.force, progress=not a.quiet,
        )
    except (CorpusError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    exit_process(main())
