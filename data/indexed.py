"""megatron-core indexed datasets (.bin/.idx) written from chunk parts with memory that does not grow with them.

megatron-core's `IndexedDatasetBuilder` keeps every sequence length and document index of a dataset in Python
lists until `finalize` (about 70 bytes per document). `merge_parts` writes the same two files from the parts that
`data.chunks.prepare_chunk` wrote (`<stem>.bin`: tokens; `<stem>.len`: int32 document lengths, [bos] included):
the .bin is the parts' bytes back to back (hashed as it is copied), and the .idx is megatron-core's header (its
magic, version 1 and dtype code; `tests/data/test_prepare.py` checks them against megatron-core's `_INDEX_HEADER` and
`DType`, so that preparing data never imports torch) followed by its three arrays,
each streamed part by part: sequence lengths (int32), sequence pointers (int64 byte offsets), document indices
(int64, 0..n: one sequence per document). The bytes equal `add_item` + `end_document` per document and `finalize`
(tests/data/test_prepare.py), and megatron-core's reader opens them.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

COPY_BYTES = 8 << 20
INDEX_BLOCK = 1 << 20  # document entries written at once
INDEX_HEADER = b"MMIDIDX\x00\x00"  # megatron.core.datasets.indexed_dataset._INDEX_HEADER
# megatron's DType
DTYPE_CODES = {
    np.dtype(t): c
    for t, c in (
        (np.uint8, 1),
        (np.int8, 2),
        (np.int16, 3),
        (np.int32, 4),
        (np.int64, 5),
        (np.float64, 6),
        (np.float32, 7),
        (np.uint16, 8),
    )
}


def _copy_hashed(src: Path, out, sha) -> int:
    n = 0
    with open(src, "rb") as f:
        while block := f.read(COPY_BYTES):
            out.write(block)
            sha.update(block)
            n += len(block)
    return n


def merge_parts(stems: Sequence[str | Path], prefix: str | Path, dtype: np.dtype) -> dict:
    """Write `<prefix>.bin` and `<prefix>.idx` from the parts `<stem>.bin`/`<stem>.len` in order; returns
    {"documents", "tokens", "bin_bytes", "idx_bytes", "bin_sha256"}."""
    dtype = np.dtype(dtype)
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    sha = hashlib.sha256()
    nbytes = 0
    with open(f"{prefix}.bin", "wb") as out:
        for stem in stems:
            nbytes += _copy_hashed(Path(f"{stem}.bin"), out, sha)
    docs = sum(os.path.getsize(f"{stem}.len") // 4 for stem in stems)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(INDEX_HEADER + struct.pack("<Q", 1) + struct.pack("<B", DTYPE_CODES[dtype]))
        f.write(struct.pack("<Q", docs))  # sequences: one per document
        f.write(struct.pack("<Q", docs + 1))  # document indices: 0, then the end of each document
        for stem in stems:
            f.write(np.fromfile(f"{stem}.len", dtype=np.int32).tobytes())
        offset = 0
        for stem in stems:
            lengths = np.fromfile(f"{stem}.len", dtype=np.int32).astype(np.int64)
            ends = np.cumsum(lengths) * dtype.itemsize + offset
            f.write((ends - lengths * dtype.itemsize).tobytes())
            offset = int(ends[-1]) if len(ends) else offset
        for first in range(0, docs + 1, INDEX_BLOCK):
            f.write(np.arange(first, min(first + INDEX_BLOCK, docs + 1), dtype=np.int64).tobytes())
    if offset != nbytes:
        # a bug, or damage
        raise RuntimeError(f"{prefix}: parts hold {nbytes} bytes but their lengths say {offset}")
    return {
        "documents": docs,
        "tokens": nbytes // dtype.itemsize,
        "bin_bytes": nbytes,
        "idx_bytes": os.path.getsize(f"{prefix}.idx"),
        "bin_sha256": sha.hexdigest(),
    }


def write_indexed(prefix: str | Path, arrays, dtype: type) -> tuple[int, int]:
    """One megatron-core sequence + document per array, with megatron-core's own builder (for a dataset that fits
    in memory anyway, e.g. data/cluster_domains.py's); returns (documents, tokens)."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
    docs = tokens = 0
    for arr in arrays:
        builder.add_item(torch.from_numpy(arr))
        builder.end_document()
        docs, tokens = docs + 1, tokens + len(arr)
    builder.finalize(str(prefix) + ".idx")
    return docs, tokens


def merge_domains(
    parts: Path, work: Path, records: Sequence[dict], dtype, vocab: int, bar=None
) -> tuple[dict, dict]:
    """Each domain's split parts concatenated into `work/<domain>/<split>.bin/.idx` and its token counts summed
    into `work/<domain>/token_counts.npy`: (the manifest's counts per domain and split, its token_counts paths).
    `records`: every chunk's record (data/chunks.py `prepare_chunk`), in plan order."""
    from data.blocks import SPLITS

    counts, token_counts = {}, {}
    by_domain: dict[str, list[dict]] = {}
    for r in records:
        by_domain.setdefault(r["chunk"]["domain"], []).append(r)
    for d, recs in by_domain.items():
        counts[d] = {}
        (work / d).mkdir(parents=True, exist_ok=True)
        for split in SPLITS:
            stems = [parts / d / f"{r['chunk']['index']:05d}.{split}" for r in recs if split in r["splits"]]
            if not stems:
                counts[d][split] = {"documents": 0, "tokens": 0, "bin": None, "idx": None}
                continue
            info = merge_parts(stems, work / d / split, dtype)
            counts[d][split] = {
                "documents": info["documents"],
                "tokens": info["tokens"],
                "bin": f"{d}/{split}.bin",
                "idx": f"{d}/{split}.idx",
                "bin_bytes": info["bin_bytes"],
                "idx_bytes": info["idx_bytes"],
                "bin_sha256": info["bin_sha256"],
            }
            if bar is not None:
                bar.update(info["bin_bytes"])
        total = np.zeros((len(SPLITS), vocab), dtype=np.int64)
        for r in recs:
            with np.load(parts / d / f"{r['chunk']['index']:05d}.counts.npz", allow_pickle=False) as z:
                total += z["counts"]
        np.save(work / d / "token_counts.npy", total)
        token_counts[d] = f"{d}/token_counts.npy"
    return counts, token_counts
