"""Atomic writes: a reader (or a resumed run) sees the old file or the new one, never half of one.

One helper for every file the project publishes (manifests, corpora, tokenizer models, checkpoints, reports):
write to a temporary sibling, then `os.replace` it onto the final name (atomic on POSIX within one
filesystem). A writer killed midway leaves only a `.tmp` sibling behind. Lives in data/, the lowest layer,
so that data/, parallel/ and launcher/ all use the same one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `path` to write; on success it replaces `path`, on error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """`path.write_bytes(data)`, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text_atomic(path: Path, text: str) -> None:
    """`path.write_text(text)` (UTF-8), atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: Path, data: Any) -> None:
    """`data` as indented JSON (UTF-8, non-ASCII kept), atomically."""
    write_text_atomic(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def atomic_dir(final: Path) -> Path:
    """A fresh temporary sibling directory of `final`; pass it to `commit_dir` when complete."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))


def commit_dir(tmp: Path, final: Path) -> None:
    """Replace directory `final` by `tmp` (a killed writer leaves only a `.tmp-*` directory, never a half one)."""
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
