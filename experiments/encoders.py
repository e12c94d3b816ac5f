"""The encoding strategies `data.prepare` used before it prepared chunks in worker processes, kept for
`experiments.tokenize_throughput`, which compares them: GPT-2 on threads in one process (`ThreadEncoder`), and
texts pickled to a process pool (`tokenize_documents`)."""

from __future__ import annotations

import multiprocessing as mp
from collections import deque
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
from tqdm import tqdm

from data.chunks import encode_concat
from data.tokenizer import GPT2Tokenizer, TokenizerSpec

CHUNK_CHARS = 1 << 18  # text per worker task: big enough to amortise pickling, small enough for a smooth bar
# text per encoding-thread task: no pickling, so smaller: less idle time at the end
THREAD_CHUNK_CHARS = 1 << 17


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
        self._futures.setdefault(domain, deque()).append(
            self._ex.submit(encode_concat, self.tok, batch, self.dtype)
        )


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


def _warm(spec: TokenizerSpec | None) -> None:
    if spec is not None:
        spec.load()


def make_pool(workers: int, warm: TokenizerSpec | None = None):
    """A process pool that does not fork this (possibly torch-threaded) process: forkserver where available.
    `warm` loads that tokenizer in every worker at start-up, off the clock of the first tasks."""
    if workers <= 1:
        return None
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    return mp.get_context(method).Pool(workers, initializer=_warm, initargs=(warm,))


def tokenize_documents(
    texts: Sequence[str],
    spec: TokenizerSpec,
    dtype: str,
    pool=None,
    chunk_chars: int = CHUNK_CHARS,
    progress: tqdm | None = None,
) -> Iterator[np.ndarray]:
    """[bos] + ids for every text, in order, encoded by `pool` (or in this process when None)."""
    tasks = ((spec, c, dtype) for c in _chunks(texts, chunk_chars))
    results = pool.imap(_encode_chunk, tasks) if pool is not None else map(_encode_chunk, tasks)
    for arrays in results:
        if progress is not None:
            progress.update(len(arrays))
        yield from arrays
