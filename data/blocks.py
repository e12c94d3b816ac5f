"""Fixed-length training blocks across document boundaries, read from a megatron-core indexed dataset.

The token file of one domain and split (written by `data.prepare`) is the stream
`[bos] doc_0 [bos] doc_1 ...` (the beginning-of-document token is stored in the file, one per document), so a
block is a plain window over the concatenated stream, crossing document boundaries (PAPER.md:
"cross-document 1024-token blocks"):

    block i = stream[i*T : i*T + T + 1]        T = seq_len (1024), so each block holds T + 1 tokens
    inputs  = block[:-1],  targets = block[1:]
    len     = (N - 1) // T                     N = tokens in the stream; the tail that fills no block is unused

Consecutive blocks share one token (the last of block i is the first of block i+1), so every token but the first
is a target exactly once per epoch. Reads go through `megatron.core.datasets.indexed_dataset.IndexedDataset`
(memory-mapped); anything with `sequence_lengths` and `get(idx, offset, length)` works as a source, e.g.
`InMemoryDocuments` in tests, which avoids importing megatron-core in every test process.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from data.readers import read_json_object

DEFAULT_SEQ_LEN = 1024
SPLITS: tuple[str, ...] = ("train", "valid", "test")


class DocumentSource(Protocol):
    sequence_lengths: np.ndarray

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray: ...


class InMemoryDocuments:
    """A `DocumentSource` over a list of token arrays (tests, small corpora)."""

    def __init__(self, documents: Sequence[Sequence[int]], dtype: type = np.int32):
        self._docs = [np.asarray(d, dtype=dtype) for d in documents]
        self.sequence_lengths = np.array([len(d) for d in self._docs], dtype=np.int64)

    def __len__(self) -> int:
        return len(self._docs)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        d = self._docs[idx]
        return d[offset:] if length is None else d[offset : offset + length]


def split_prefix(root: str | Path, tokenizer: str, domain: str, split: str) -> Path:
    """`<root>/<tokenizer>/<domain>/<split>` (add .bin / .idx): the layout `data.prepare` writes."""
    return Path(root) / tokenizer / domain / split


def open_indexed(prefix: str | Path) -> DocumentSource:
    """megatron-core's memory-mapped `IndexedDataset` for `<prefix>.bin/.idx` (imported lazily: it is slow)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = str(prefix)
    if not (Path(prefix + ".bin").is_file() and Path(prefix + ".idx").is_file()):
        raise FileNotFoundError(f"{prefix}.bin/.idx not found (run `python -m data.prepare` first)")
    return IndexedDataset(prefix, mmap=True)


class BlockDataset:
    """Blocks of `seq_len + 1` tokens over one domain's split; see the module docstring for the layout."""

    def __init__(self, source: str | Path | DocumentSource, seq_len: int = DEFAULT_SEQ_LEN, name: str = ""):
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len}: must be >= 1")
        self.source = open_indexed(source) if isinstance(source, (str, Path)) else source
        self.seq_len = seq_len
        self.name = name or (str(source) if isinstance(source, (str, Path)) else "")
        lengths = np.asarray(self.source.sequence_lengths, dtype=np.int64)
        self._doc_starts = np.concatenate([[0], np.cumsum(lengths)])  # stream offset of each document
        self.num_tokens = int(self._doc_starts[-1])
        self.num_documents = len(lengths)

    @classmethod
    def from_prepared(
        cls,
        root: str | Path,
        tokenizer: str,
        domain: str,
        split: str = "train",
        seq_len: int = DEFAULT_SEQ_LEN,
    ) -> BlockDataset:
        """Open `<root>/<tokenizer>/<domain>/<split>` after checking the prepare manifest lists it."""
        manifest_path = Path(root) / tokenizer / "manifest.json"
        if manifest_path.is_file():
            counts = read_json_object(manifest_path, {"counts": dict}, what="token manifest")["counts"]
            if domain not in counts:
                raise KeyError(f"{manifest_path}: no domain {domain!r}; domains: {sorted(counts)}")
            if not isinstance(counts[domain], dict) or not isinstance(counts[domain].get(split), dict):
                raise ValueError(f"{manifest_path}: counts.{domain}.{split} is missing or not an object")
            if counts[domain][split].get("documents") == 0:
                raise ValueError(f"{manifest_path}: {domain}/{split} has 0 documents")
        return cls(split_prefix(root, tokenizer, domain, split), seq_len, name=f"{domain}/{split}")

    def __len__(self) -> int:
        return max(0, (self.num_tokens - 1) // self.seq_len)

    def tokens(self, start: int, length: int) -> np.ndarray:
        """`length` tokens of the stream from offset `start` (may span many documents)."""
        out = np.empty(length, dtype=np.int64)
        doc = int(np.searchsorted(self._doc_starts, start, side="right")) - 1
        filled = 0
        while filled < length:
            offset = start + filled - int(self._doc_starts[doc])
            take = min(length - filled, int(self._doc_starts[doc + 1] - self._doc_starts[doc]) - offset)
            if take > 0:
                out[filled : filled + take] = self.source.get(doc, offset=offset, length=take)
                filled += take
            doc += 1
        return out

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"block {i} out of range for {n} blocks ({self.name})")
        i = i % n
        return self.tokens(i * self.seq_len, self.seq_len + 1)
