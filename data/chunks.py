"""The unit of `data.prepare`'s work: a chunk of one domain's JSONL file, prepared by one process on its own.

A domain file is cut at line boundaries into chunks of about `chunk_bytes` (`plan_chunks`). A worker process
reads its chunk's byte range, validates each line as ingestion does, assigns the document its split, anonymises
it (if the domain's policy says so), encodes it and appends its tokens to the chunk's part files, a small batch at
a time (`prepare_chunk`): nothing but the byte range and a short record crosses between processes, and a worker
holds one batch of text (BATCH_CHARS) and its tokens, whatever the size of the corpus. The part files and the
record are written under temporary names and renamed, the record last: a chunk whose record exists is finished
(a killed run resumes after it), and a chunk without one is redone from its start.

Splits (document level, deterministic, independent of the number of workers, shards and chunks):
- a domain file no larger than `chunk_bytes` is one chunk, split exactly as before streaming: a permutation of its
  documents seeded by (seed, crc32(domain)) puts the first round(n * test_fraction) in test, the next
  round(n * valid_fraction) in valid (at least one each when the fraction is > 0 and n >= 3), the rest in train
  (`split_documents`); its tokens are held until the file ends (at most `chunk_bytes` of text's tokens);
- a larger file is split per document by `hash_split`: blake2b of (seed, domain, the document's id, or its byte
  offset where the line has no id) as a number u in [0, 1): test when u < test_fraction, valid when
  u < test_fraction + valid_fraction, else train. The counts then follow the fractions within binomial noise
  (at 64 MiB of text per chunk, thousands of documents), and no state spans documents.

Each split's documents keep corpus order; `data.indexed.merge_parts` concatenates the chunks' parts in order.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from data.anonymise import add_counts, anonymise, anonymise_many
from data.blocks import SPLITS
from data.ingest import Document, Problem, ProblemLog, _parse_line

CHUNK_BYTES = 64 << 20  # default chunk size; also the largest domain file that is split exactly
SP_SAMPLE_CHARS = (
    20_000_000  # sentencepiece's training sample, drawn over every chunk of the training domains
)
# text a worker reads, anonymises and encodes at once (memory per worker: a few of these)
BATCH_CHARS = 1 << 20
READ_BYTES = 8 << 20  # bytes read from the file at once
RECORD_FORMAT = "demix-chunk/1"


@dataclass(frozen=True)
class Chunk:
    """Bytes [start, end) of `path` (a whole number of lines), the `index`-th chunk of `domain`'s file. `exact`:
    the whole file, split by permutation (`split_documents`); else split by `hash_split`."""

    domain: str
    index: int
    path: str
    start: int
    end: int
    exact: bool

    @property
    def name(self) -> str:
        return f"{self.domain}/{self.index:05d}"


def plan_chunks(files: dict[str, Path], chunk_bytes: int = CHUNK_BYTES) -> list[Chunk]:
    """Every domain file cut into chunks: a file up to `chunk_bytes` is one exact chunk; a larger one is cut after
    the first newline at or past each multiple of `chunk_bytes` (so no line is cut, and the cut depends only on
    the file). Domains in the order of `files`, chunks in file order."""
    chunks = []
    for domain, path in files.items():
        size = path.stat().st_size
        if size <= chunk_bytes:
            chunks.append(Chunk(domain, 0, str(path), 0, size, True))
            continue
        cuts = [0]
        with open(path, "rb") as f:
            for target in range(chunk_bytes, size, chunk_bytes):
                if target <= cuts[-1]:
                    continue  # a line longer than a chunk: the previous cut already passed this target
                cut = _next_line_start(f, target, size)
                if cut < size:
                    cuts.append(cut)
        cuts.append(size)
        chunks.extend(
            Chunk(domain, i, str(path), a, b, False) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))
        )
    return chunks


def _next_line_start(f, pos: int, size: int) -> int:
    """The offset just after the first b"\\n" at or after `pos - 1` (so a cut at `pos` that already starts a line
    stays there), or `size`."""
    f.seek(pos - 1)
    while True:
        block = f.read(1 << 16)
        if not block:
            return size
        i = block.find(b"\n")
        if i >= 0:
            return f.tell() - len(block) + i + 1


def split_documents(
    n: int, domain: str, seed: int, valid_fraction: float, test_fraction: float
) -> np.ndarray:
    """Split code per document of an exact chunk (0 train, 1 valid, 2 test); see the module docstring."""

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
    split[perm[n_test : n_test + n_valid]] = 1
    return split


class HashSplit:
    """`hash_split` for one domain: split codes from document keys; see the module docstring."""

    def __init__(self, domain: str, seed: int, valid_fraction: float, test_fraction: float):
        self._base = hashlib.blake2b(f"demix-split\0{seed}\0{domain}\0".encode(), digest_size=8)
        self._test = int(test_fraction * 2**64)
        self._valid = int((test_fraction + valid_fraction) * 2**64)

    def code(self, key: str) -> int:
        h = self._base.copy()
        h.update(key.encode("utf-8", "surrogatepass"))
        u = int.from_bytes(h.digest(), "little")
        return 2 if u < self._test else 1 if u < self._valid else 0


def hash_split(
    keys: Sequence[str], domain: str, seed: int, valid_fraction: float, test_fraction: float
) -> np.ndarray:
    """Split code per document key (0 train, 1 valid, 2 test), each decided by that key alone."""
    s = HashSplit(domain, seed, valid_fraction, test_fraction)
    return np.fromiter((s.code(k) for k in keys), dtype=np.int8, count=len(keys))


# ---------------------------------------------------------------- reading a chunk -----------------------------


def read_chunk(chunk: Chunk) -> Iterator[tuple[int, int, bytes]]:
    """(line number within the chunk, 1-based; byte offset in the file; the line without its end) of every line
    of the chunk, blank ones included (they count for line numbers)."""
    with open(chunk.path, "rb") as f:
        f.seek(chunk.start)
        pos, lineno, carry = chunk.start, 0, b""
        while pos < chunk.end:
            block = f.read(min(READ_BYTES, chunk.end - pos))
            if not block:
                break
            pos += len(block)
            data = carry + block if carry else block
            lines = data.split(b"\n")
            carry = lines.pop()
            offset = pos - len(data)
            for line in lines:
                lineno += 1
                yield lineno, offset, line
                offset += len(line) + 1
        if carry:
            yield lineno + 1, pos - len(carry), carry


def chunk_documents(
    chunk: Chunk, log: ProblemLog, lines: list[int] | None = None
) -> Iterator[tuple[Document, str]]:
    """The chunk's valid documents with their split key (the record's id, else "@<byte offset>"); problems go to
    `log` with chunk-relative line numbers (`absolute_problems` makes them absolute). `lines[0]` is set to the
    number of lines read (how far the next chunk's line numbers are shifted)."""
    path = chunk.path
    allowed = frozenset([chunk.domain])
    for lineno, offset, raw in read_chunk(chunk):
        if lines is not None:
            lines[0] = lineno
        raw = raw.rstrip(b"\r")
        if not raw or raw.isspace():
            continue
        r = _parse_line(
            raw, path, lineno, "text", "domain", "id", allowed, chunk.domain, fallback_id=f"@{offset}"
        )
        if isinstance(r, Problem):
            log.add(r)
        else:
            yield r, r.id


# ---------------------------------------------------------------- preparing a chunk ---------------------------


@dataclass(frozen=True)
class ChunkJob:
    """What a worker needs besides the chunk: the settings every chunk of a run shares."""

    parts: str  # the run's parts directory
    tokenizer: object  # a data.tokenizer.TokenizerSpec
    dtype: str
    vocab: int  # length of the token-count rows
    seed: int
    valid_fraction: float
    test_fraction: float
    anonymise: bool
    keep: int  # problems kept in full
    plan_key: str
    owner_pid: int = 0  # the prepare process that planned the run; a worker stops when it is gone (killed)


class _PartWriter:
    """One split's part of a chunk: tokens appended to `<stem>.bin`, document lengths to `<stem>.len` (int32),
    both under temporary names until `close(publish=True)`."""

    def __init__(self, stem: Path, dtype: np.dtype):
        self.stem, self.dtype = stem, dtype
        self._bin = open(f"{stem}.bin.tmp", "wb")
        self._len = open(f"{stem}.len.tmp", "wb")
        self.documents = self.tokens = 0

    def add(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        self._bin.write(np.ascontiguousarray(flat, dtype=self.dtype).data)
        self._len.write(np.ascontiguousarray(lengths, dtype=np.int32).data)
        self.documents += len(lengths)
        self.tokens += int(flat.size)

    def close(self, publish: bool) -> None:
        self._bin.close()
        self._len.close()
        for ext in ("bin", "len"):
            tmp = Path(f"{self.stem}.{ext}.tmp")
            if publish:
                os.replace(tmp, f"{self.stem}.{ext}")
            else:
                tmp.unlink(missing_ok=True)


def _by_split(
    flat: np.ndarray, lengths: np.ndarray, codes: np.ndarray
) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """A batch's documents grouped by split code: (code, their tokens, their lengths), each in document order."""
    if (codes == codes[0]).all():
        return [(int(codes[0]), flat, lengths)]
    per_token = np.repeat(codes, lengths)
    return [(int(c), flat[per_token == c], lengths[codes == c]) for c in np.unique(codes)]


def encode_concat(tok, texts: Sequence[str], dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """[bos] + ids of every text, concatenated into one array of `dtype`, and each document's length (bos
    included): one allocation per batch instead of one array per document."""
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
        out[pos : pos + n - 1] = a
        pos += n
    return out, lengths


class _ChunkState:
    """What `prepare_chunk` accumulates: writers per split, token counts per split, anonymisation counts."""

    def __init__(self, chunk: Chunk, job: ChunkJob):
        self.chunk, self.job = chunk, job
        self.stem = Path(job.parts) / chunk.domain / f"{chunk.index:05d}"
        self.stem.parent.mkdir(parents=True, exist_ok=True)
        self.writers: dict[int, _PartWriter] = {}
        self.counts = np.zeros((len(SPLITS), job.vocab), dtype=np.int64)
        self.anon: dict[str, int] = {}
        self.anon_docs = 0  # documents anonymisation changed
        self.text_bytes = 0
        self.held: list[tuple[np.ndarray, np.ndarray]] = []  # an exact chunk's batches, until its end

    def route(self, flat: np.ndarray, lengths: np.ndarray, codes: np.ndarray) -> None:
        for code, part, part_lengths in _by_split(flat, lengths, codes):
            if code not in self.writers:
                self.writers[code] = _PartWriter(
                    Path(f"{self.stem}.{SPLITS[code]}"), np.dtype(self.job.dtype)
                )
            self.writers[code].add(part, part_lengths)
            self.counts[code] += np.bincount(part, minlength=self.job.vocab)[: self.job.vocab]

    def close(self, publish: bool) -> None:
        for w in self.writers.values():
            w.close(publish)


def prepare_chunk(chunk: Chunk, job: ChunkJob) -> dict:
    """Read, validate, split, anonymise, encode and write one chunk (see the module docstring); returns its record,
    also written to `<parts>/<domain>/<index>.json` after its part files."""
    tok = job.tokenizer.load()  # cached per process
    log = ProblemLog(job.keep)
    st = _ChunkState(chunk, job)
    splitter = HashSplit(chunk.domain, job.seed, job.valid_fraction, job.test_fraction)
    ok, lines = False, [0]
    try:
        texts, keys, size = [], [], 0
        for doc, key in chunk_documents(chunk, log, lines):
            texts.append(doc.text)
            keys.append(key)
            size += len(doc.text)
            if size >= BATCH_CHARS:
                _batch(st, tok, splitter, texts, keys)
                texts, keys, size = [], [], 0
        if texts:
            _batch(st, tok, splitter, texts, keys)
        if chunk.exact and st.held:
            lengths = np.concatenate([b[1] for b in st.held])
            codes = split_documents(
                len(lengths), chunk.domain, job.seed, job.valid_fraction, job.test_fraction
            )
            flat = np.concatenate([b[0] for b in st.held])
            st.held.clear()
            st.route(flat, lengths, codes)
        ok = True
    finally:
        st.close(publish=ok)
    # mostly zeros: a few KB, not 3 x V x 8
    np.savez_compressed(f"{st.stem}.counts.tmp.npz", counts=st.counts)
    os.replace(f"{st.stem}.counts.tmp.npz", f"{st.stem}.counts.npz")
    record = {
        "format": RECORD_FORMAT,
        "plan_key": job.plan_key,
        "chunk": asdict(chunk),
        "lines": lines[0],
        "text_bytes": st.text_bytes,
        "anonymise": st.anon,
        "anonymised_documents": st.anon_docs,
        "problems": {"counts": dict(log.counts), "first": [[p.line, p.reason, p.detail] for p in log.first]},
        "splits": {
            SPLITS[c]: {
                "documents": w.documents,
                "tokens": w.tokens,
                "bin_bytes": w.tokens * np.dtype(job.dtype).itemsize,
            }
            for c, w in sorted(st.writers.items())
        },
    }
    tmp = Path(f"{st.stem}.json.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, f"{st.stem}.json")
    return record


def _owner_alive(pid: int) -> bool:
    if not pid:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's (a reused pid): not ours to judge
        return True
    return True


def _batch(st: _ChunkState, tok, splitter: HashSplit, texts: list[str], keys: list[str]) -> None:
    """Anonymise (when on), encode and route one batch of documents (held until the end in an exact chunk). A
    worker whose prepare process was killed stops here, before the next batch, instead of finishing its chunk."""
    if not _owner_alive(st.job.owner_pid):
        raise SystemExit(f"data.prepare (pid {st.job.owner_pid}) is gone: chunk {st.chunk.name} abandoned")
    if st.job.anonymise:
        for i, t in enumerate(texts):
            r = anonymise(t)
            texts[i] = r.text
            if r.counts:
                add_counts(st.anon, r.counts)
                st.anon_docs += 1
    st.text_bytes += sum(len(t) if t.isascii() else len(t.encode("utf-8")) for t in texts)
    flat, lengths = encode_concat(tok, texts, st.job.dtype)
    if st.chunk.exact:
        st.held.append((flat, lengths))
    else:
        st.route(flat, lengths, np.fromiter((splitter.code(k) for k in keys), dtype=np.int8, count=len(keys)))


def check_chunk(chunk: Chunk, keep: int) -> dict:
    """Only validate the chunk's lines (on_error="fail" checks everything before any encoding)."""
    log, lines = ProblemLog(keep), [0]
    for _ in chunk_documents(chunk, log, lines):
        pass
    return {
        "chunk": asdict(chunk),
        "lines": lines[0],
        "problems": {"counts": dict(log.counts), "first": [[p.line, p.reason, p.detail] for p in log.first]},
    }


def read_record(parts: str | Path, chunk: Chunk, plan_key: str) -> dict | None:
    """The finished record of `chunk` in `parts`, or None when the chunk is not finished for this plan: no record,
    another plan's, or a part file missing or of another size than recorded (it is then redone)."""
    stem = Path(parts) / chunk.domain / f"{chunk.index:05d}"
    try:
        record = json.loads(Path(f"{stem}.json").read_text())
    except (OSError, ValueError):
        return None
    if (
        not isinstance(record, dict)
        or record.get("format") != RECORD_FORMAT
        or record.get("plan_key") != plan_key
        or record.get("chunk") != asdict(chunk)
    ):
        return None
    for split, info in record.get("splits", {}).items():
        for ext, size in (("bin", info.get("bin_bytes")), ("len", 4 * info.get("documents", -1))):
            p = Path(f"{stem}.{split}.{ext}")
            if not p.is_file() or p.stat().st_size != size:
                return None
    if not Path(f"{stem}.counts.npz").is_file():
        return None
    return record


def absolute_problems(records: Sequence[dict], keep: int) -> ProblemLog:
    """One domain's problems from its chunks' records (in chunk order), line numbers made file-absolute."""
    log, shift = ProblemLog(keep), 0
    for r in records:
        path = r["chunk"]["path"]
        for reason, n in r["problems"]["counts"].items():
            log.counts[reason] += n
        for line, reason, detail in r["problems"]["first"]:
            if len(log.first) < keep:
                log.first.append(Problem(path, line + shift, reason, detail))
        shift += r["lines"]
    return log


# ---------------------------------------------------------------- the documents of a split --------------------


def split_texts(
    files: dict[str, Path], split: dict, code: int, policy: dict[str, bool], max_docs: int | None = None
) -> dict[str, list[str]]:
    """The texts of split `code` (0 train, 1 valid, 2 test) of every domain, exactly as `prepare_corpus` assigned
    and anonymised them: `split` is the manifest's "split" record (seed, fractions, chunk_bytes). The first
    `max_docs` of each domain."""
    out = {}
    # data prepared before chunks (no chunk_bytes recorded) split every domain exactly, whatever its size
    chunk_bytes = split.get("chunk_bytes") or 1 + max((p.stat().st_size for p in files.values()), default=0)
    for d, chunks in by_domain(plan_chunks(files, int(chunk_bytes))).items():
        docs = list(_split_docs(chunks, split, code, max_docs))
        out[d] = anonymise_many(docs, enabled=bool(policy.get(d, False)))[0]
    return out


def by_domain(chunks: Sequence[Chunk]) -> dict[str, list[Chunk]]:
    """The chunks of each domain, in order."""
    out: dict[str, list[Chunk]] = {}
    for c in chunks:
        out.setdefault(c.domain, []).append(c)
    return out


def _split_docs(chunks: Sequence[Chunk], split: dict, code: int, limit: int | None) -> Iterator[str]:
    """Texts (not anonymised) of split `code` of one domain's chunks, in corpus order, at most `limit`."""
    seed, vf, tf = split["seed"], split["valid_fraction"], split["test_fraction"]
    if limit is not None and limit <= 0:
        return
    n = 0
    for c in chunks:
        if c.exact:  # the permutation needs the number of documents first: one pass to count them
            total = sum(1 for _ in chunk_documents(c, ProblemLog(0)))
            codes = iter(split_documents(total, c.domain, seed, vf, tf).tolist())
            pick = lambda key, codes=codes: next(codes)  # noqa: E731
        else:
            splitter = HashSplit(c.domain, seed, vf, tf)
            pick = splitter.code
        for doc, key in chunk_documents(c, ProblemLog(0)):
            if pick(key) == code:
                yield doc.text
                n += 1
                if limit is not None and n >= limit:
                    return


def sentencepiece_sample(
    chunks: Sequence[Chunk],
    domains: Sequence[str],
    split: dict,
    policy: dict[str, bool],
    chars: int = SP_SAMPLE_CHARS,
) -> list[str]:
    """Sentencepiece's training texts: training-split documents of `domains`, an equal share of `chars` per
    domain drawn as an equal share from each of its chunks (the first documents of each chunk, so the sample
    spans the whole file), anonymised like the tokens, interleaved across domains. Memory: the sample."""
    per_domain: list[list[str]] = []
    groups = by_domain([c for c in chunks if c.domain in set(domains)])
    for d, cs in groups.items():
        quota, texts = max(1, chars // max(1, len(groups)) // len(cs)), []
        for c in cs:
            got = 0
            for t in _split_docs([c], split, 0, None):
                texts.append(t)
                got += len(t)
                if got >= quota:
                    break
        per_domain.append(anonymise_many(texts, enabled=policy[d])[0])
    longest = max(map(len, per_domain), default=0)
    return [texts[i] for i in range(longest) for texts in per_domain if i < len(texts)]
