"""Atomic writes: a reader (or a resumed run) sees the old file or the new one, never half of one.

One helper for every file the project publishes (manifests, corpora, tokenizer models, checkpoints, reports):
write to a temporary sibling, then `os.replace` it onto the final name (atomic on POSIX within one
filesystem). Lives in data/, the lowest layer, so that data/, parallel/ and launcher/ all use the same one.

The rule for a failed writer is here too, shared by every writer that stages its output:

* `staged_dir(final)`: the whole output is written into a temporary sibling directory, which replaces (or fills)
  `final` only when the writer succeeded. On any failure - an exception, Ctrl-C, the commit itself - the staged
  directory and the parent directories made for it are removed before the error goes on, so a failed run leaves
  nothing behind (no half checkpoint in `.out.tmp-*`, no corpus files without their manifest).
  `atomic_path` does the same for one file. `discard_on_failure` is the failure half alone, for writers whose
  staging is shared by several ranks (launcher/state.py).
* `disk_full_error`: a write that failed for want of space (ENOSPC, EDQUOT, or torch's writer failing with the
  filesystem full) becomes a `DiskFullError` that says "no space left on device" and names the output path, the
  filesystem's mount point and its free bytes, instead of "unexpected pos 704 vs 598".
* `output_path_problem`: an output path that cannot become a directory (a file, a dangling symbolic link) is named
  before any work; data/cli.py `check_output_dir` refuses it, `staged_dir` refuses it as a last resort.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# errno values that mean "no room for these bytes": the filesystem is full, or the user's quota is spent
DISK_FULL_ERRNOS = frozenset(e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None)) if e is not None)
# How torch's zip writer reports a write that failed: it writes to a path in C++ (std::ofstream, errno lost) and
# says only "unexpected pos N vs M" or "PytorchStreamWriter failed writing file ..." (caffe2/serialize/
# inline_container.cc); written through a Python file, the OSError it raised is the RuntimeError's __context__.
TORCH_WRITE_FAILURES = ("unexpected pos", "PytorchStreamWriter failed writing file", "file write failed")
# Below this many free bytes a failed write without an errno (torch's C++ writer) is taken for a full disk.
FULL_MARGIN_BYTES = 16 << 20


class DiskFullError(OSError):
    """A write that failed because its filesystem is full (ENOSPC) or the user's quota is spent (EDQUOT).

    `str()` is the whole message: "no space left on device writing PATH (...): the filesystem mounted at MOUNT
    had N bytes free ...". `path` is the output named, `mount`/`free`/`total` describe its filesystem."""

    def __init__(
        self,
        path: Path,
        code: int,
        reason: str,
        mount: Path | None,
        free: int | None,
        total: int | None,
    ) -> None:
        self.path, self.reason, self.mount, self.free, self.total = Path(path), reason, mount, free, total
        if mount is None:
            where = "its filesystem could not be examined"
        else:
            where = (
                f"the filesystem mounted at {mount} had {free:,} bytes ({_human(free)}) free of {_human(total)} "
                "when the write failed"
            )
        super().__init__(
            code,
            f"no space left on device writing {path} ({reason}): {where}; make room there, or "
            "write to another filesystem",
        )

    def __str__(self) -> str:
        return str(self.strerror)

    def renamed(self, path: Path) -> DiskFullError:
        """The same failure, naming `path` (the output a staged file belonged to) instead."""
        return DiskFullError(path, self.errno, self.reason, self.mount, self.free, self.total)


def _human(n: int | None) -> str:
    if n is None:
        return "?"
    size = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} bytes" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} bytes"


def filesystem_of(path: Path) -> tuple[Path, int, int]:
    """(mount point, bytes free to an unprivileged user, total bytes) of the filesystem that holds (or would hold)
    `path`: `os.statvfs` of its nearest existing ancestor, the mount point found by walking up to `os.path.ismount`."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    p = Path(os.path.realpath(p))
    st = os.statvfs(p)
    mount = p
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    return mount, st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and every exception it was raised from or during (__cause__, __context__), each once."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]


def _inside(path: Path, roots: Iterable[Path]) -> bool:
    p = Path(os.path.abspath(path))
    return any(p == r or r in p.parents for r in (Path(os.path.abspath(x)) for x in roots))


def disk_full_error(exc: BaseException, path: Path, staged: Iterable[Path] = ()) -> DiskFullError | None:
    """The DiskFullError that `exc`, raised while writing output `path`, stands for; None when it is another error.

    Recognised: an OSError with errno ENOSPC or EDQUOT anywhere in the exception's chain (Python writes, and torch
    writing through a Python file, whose RuntimeError has that OSError as its __context__); torch's "unexpected
    pos" / "PytorchStreamWriter failed writing file" RuntimeError without an errno (a save to a path, written in
    C++) when the filesystem has less than FULL_MARGIN_BYTES free. A DiskFullError that names a file inside one of
    `staged` (a temporary that is about to be removed) is renamed to `path`; another DiskFullError is left as it is."""
    if isinstance(exc, DiskFullError):
        return exc.renamed(Path(path)) if _inside(exc.path, staged) else None
    chain = list(_chain(exc))
    code, reason = None, ""
    for e in chain:
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            code, reason = e.errno, f"[Errno {e.errno}] {e.strerror or os.strerror(e.errno)}"
            break
    if code is None:
        torch_msg = next(
            (
                str(e).strip()
                for e in chain
                if isinstance(e, RuntimeError) and any(m in str(e) for m in TORCH_WRITE_FAILURES)
            ),
            None,
        )
        if torch_msg is None:
            return None
        code, reason = errno.ENOSPC, f"torch's writer: {torch_msg.splitlines()[-1][:200]}"
    try:
        mount, free, total = filesystem_of(path)
    except OSError:
        mount = free = total = None
    if (
        code == errno.ENOSPC
        and reason.startswith("torch's writer")
        and (free is None or free >= FULL_MARGIN_BYTES)
    ):
        return None  # the C++ writer failed with room left: some other I/O error, not a full disk
    return DiskFullError(Path(path), code, reason, mount, free, total)


def _remove(path: Path) -> None:
    """Remove a file, a symbolic link or a directory tree, if there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except OSError:  # gone already, or not ours to remove: the error being raised matters more
            pass


def _make_parents(directory: Path) -> list[Path]:
    """`directory.mkdir(parents=True, exist_ok=True)`; returns the directories it created, outermost first."""
    directory = Path(directory)
    missing = []
    p = directory
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    made = list(reversed(missing))
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except BaseException:
        _remove_made(made)  # those it did make before failing (a full disk, a permission)
        raise
    return made


def _remove_made(made: list[Path]) -> None:
    """Remove the directories `_make_parents` created, innermost first, where they are still empty."""
    for p in reversed(made):
        try:
            p.rmdir()
        except OSError:
            return


@contextmanager
def discard_on_failure(final: Path, *staged: Path, made: list[Path] | None = None) -> Iterator[None]:
    """The failure half of the rule: if the block raises anything (KeyboardInterrupt included), remove `staged`
    (files or directories) and the directories in `made` (from `_make_parents`), and raise a full disk as a
    DiskFullError naming `final` (see `disk_full_error`); other errors go on unchanged."""
    try:
        yield
    except BaseException as e:
        # translated first: the free space is the filesystem's when the write failed, before the cleanup
        full = disk_full_error(e, Path(final), staged) if isinstance(e, Exception) else None
        for p in staged:
            _remove(Path(p))
        _remove_made(made or [])
        if full is not None:
            raise full from e
        raise


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `path` to write; on success it replaces `path`, on error it is removed (with the
    directories made for it) and a full disk is raised as a DiskFullError naming `path`."""
    path = Path(path)
    made: list[Path] = []
    tmp: Path | None = None
    try:
        made += _make_parents(path.parent)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        tmp = Path(name)
        yield tmp
        os.replace(tmp, path)
    except BaseException as e:
        full = disk_full_error(e, path, [tmp] if tmp else []) if isinstance(e, Exception) else None
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        _remove_made(made)
        if full is not None:
            raise full from e
        raise


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


def output_path_problem(path: Path) -> str | None:
    """Why `path` cannot be (or become) an output directory, or None: it is a file, a dangling symbolic link, a
    symbolic link loop, or lies under a file. The clause completes "<path> ..."; data/cli.py `check_output_dir`
    refuses such a path before any work."""
    path = Path(path)
    if path.is_symlink() and not path.exists():
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return (
            f"is a dangling symbolic link (to {target}): a directory cannot be written there; remove the link, "
            "create its target, or choose another path"
        )
    if path.exists() and not path.is_dir():
        return "is a file, not a directory: choose a directory path"
    for parent in path.parents:
        if os.path.lexists(parent):
            if not parent.is_dir():
                return f"lies under {parent}, which is not a directory: choose another path"
            break
    return None


def _default_dir_mode() -> int:
    """The mode `mkdir` gives a new directory (0o777 less the umask): mkdtemp's own is 0o700."""
    try:  # read without changing it: os.umask is process-wide, and other threads may be creating files
        with open("/proc/self/status", encoding="ascii") as f:
            mask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0)
        os.umask(mask)
    return 0o777 & ~mask


def atomic_dir(final: Path) -> Path:
    """A fresh temporary sibling directory of `final` (the permissions `mkdir` would give); pass it to `commit_dir`
    when complete. Prefer `staged_dir`, which also cleans up after a failure."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    os.chmod(tmp, _default_dir_mode())
    return tmp


def commit_dir(tmp: Path, final: Path) -> None:
    """Replace directory `final` by `tmp` (a killed writer leaves only a `.tmp-*` directory, never a half one). If
    the second rename fails, the old `final` is put back."""
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
        try:
            os.replace(tmp, final)
        except BaseException:
            os.replace(old, final)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def _merge_dir(tmp: Path, final: Path, last: str | None) -> None:
    """Move every entry of `tmp` into the existing directory `final` (`last` moved last), replacing entries of the
    same name and leaving the others; if a move fails, the entries already moved are taken back out and the
    replaced ones put back."""
    names = sorted(os.listdir(tmp), key=lambda n: (n == last, n))
    backup = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
    done: list[tuple[str, bool]] = []  # (name, whether an old entry was moved to backup)
    try:
        for n in names:
            had = os.path.lexists(final / n)
            if had:
                os.replace(final / n, backup / n)
            done.append((n, had))
            os.replace(tmp / n, final / n)
    except BaseException:
        for n, had in reversed(done):
            if os.path.lexists(final / n) and not os.path.lexists(tmp / n):
                os.replace(final / n, tmp / n)
            if had:
                os.replace(backup / n, final / n)
        raise
    finally:
        shutil.rmtree(backup, ignore_errors=True)


@contextmanager
def staged_dir(final: Path, manifest: str | None = None, shared: bool = False) -> Iterator[Path]:
    """The shared rule for a writer of a whole output directory: yield a fresh temporary sibling of `final` to write
    everything into; when the block succeeds, publish it, and on any failure remove it.

    Publishing: when `final` does not exist, the staged directory is renamed onto it (atomic); when `final` holds
    `manifest` (an earlier output of the same tool, which data/cli.py `check_output_dir` let through) it is replaced
    whole (`commit_dir`, stale files of the earlier run gone); otherwise - an empty directory, one holding files of
    others, or any `shared` one (several reports side by side) - the staged entries are moved into it, `manifest`
    last, and nothing else there is touched. A symbolic link to a directory is written through (the staging sits
    beside its target).

    Failure: an exception, KeyboardInterrupt, or a failed commit removes the staged directory and the parent
    directories made for it before the error goes on; a full disk is raised as a DiskFullError naming `final`
    and its filesystem (`discard_on_failure`). A `final` that cannot be a directory (`output_path_problem`) is
    refused before anything is made."""
    final = Path(final)
    problem = output_path_problem(final)
    if problem is not None:
        raise FileExistsError(f"cannot publish the output directory {final}: the path {problem}")
    target = Path(os.path.realpath(final)) if final.is_symlink() else final
    made: list[Path] = []
    with discard_on_failure(final, made=made):  # no room even for the folder: named as a full disk too
        made += _make_parents(target.parent)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    with discard_on_failure(final, tmp, made=made):
        os.chmod(tmp, _default_dir_mode() if not target.is_dir() else os.stat(target).st_mode & 0o7777)
        yield tmp
        if not target.exists():
            os.replace(tmp, target)
        elif manifest is not None and not shared and (target / manifest).is_file():
            commit_dir(tmp, target)
        else:
            _merge_dir(tmp, target, manifest)
            tmp.rmdir()
