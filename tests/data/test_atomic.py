"""data/atomic.py: atomic files and directories, and the rule for a failed writer: a staged
output is published whole or removed, and a full disk is reported as one ("no space left on device", the path, its
filesystem and free bytes), including the way torch's writer really reports it."""

from __future__ import annotations

import errno
import io
import os
import stat
from pathlib import Path

import pytest
import torch

from data import atomic
from data.atomic import (
    DiskFullError,
    atomic_path,
    commit_dir,
    discard_on_failure,
    disk_full_error,
    filesystem_of,
    output_path_problem,
    staged_dir,
    write_json_atomic,
    write_text_atomic,
)


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _enospc() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class _FullFile(io.RawIOBase):
    """A writable file that takes `room` bytes, then fails as a full disk does."""

    def __init__(self, room: int) -> None:
        self.room, self.data = room, bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        b = bytes(b)
        if len(b) > self.room:
            self.data += b[: self.room]
            self.room = 0
            raise _enospc()
        self.room -= len(b)
        self.data += b
        return len(b)


# ---------------------------------------------------------------- staged_dir: published whole ----------------------


def test_staged_dir_publishes_a_new_directory_with_mkdir_permissions(tmp_path):
    final = tmp_path / "a" / "b" / "out"
    with staged_dir(final) as tmp:
        assert tmp.parent == final.parent and tmp.name.startswith(".out.tmp-") and not final.exists()
        (tmp / "x.txt").write_text("x")
    assert (final / "x.txt").read_text() == "x"
    assert _listing(final.parent) == ["out", "out/x.txt"]
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(final.stat().st_mode) == 0o777 & ~mask  # not mkdtemp's 0700


def test_staged_dir_replaces_an_earlier_output_whole_and_fills_other_directories(tmp_path):
    own = tmp_path / "own"
    own.mkdir()
    (own / "manifest.json").write_text("{}")
    (own / "stale.jsonl").write_text("old run")
    with staged_dir(own, manifest="manifest.json") as tmp:
        (tmp / "manifest.json").write_text('{"new": 1}')
    assert _listing(own) == ["manifest.json"]  # an earlier output of the tool: replaced, stale files gone
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "notes.txt").write_text("mine")
    (shared / "r.md").write_text("old report")
    with staged_dir(shared, manifest="r.json") as tmp:
        (tmp / "r.json").write_text("{}")
        (tmp / "r.md").write_text("new report")
    assert (
        _listing(shared) == ["notes.txt", "r.json", "r.md"] and (shared / "notes.txt").read_text() == "mine"
    )
    assert (shared / "r.md").read_text() == "new report"
    (shared / "other.json").write_text("{}")
    with staged_dir(
        shared, manifest="r.json", shared=True
    ) as tmp:  # several reports side by side: never replaced
        (tmp / "r.json").write_text('{"again": 1}')
    assert _listing(shared) == ["notes.txt", "other.json", "r.json", "r.md"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_staged_dir_writes_through_a_link_to_a_directory(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with staged_dir(tmp_path / "link", manifest="m.json") as tmp:
        assert tmp.parent == tmp_path
        (tmp / "m.json").write_text("{}")
    assert (tmp_path / "link").is_symlink() and (tmp_path / "real" / "m.json").is_file()
    assert _listing(tmp_path) == ["link", "real", "real/m.json"]


# ---------------------------------------------------------------- staged_dir: removed on any failure ---------------


@pytest.mark.parametrize("error", [ValueError("bad record"), KeyboardInterrupt(), SystemExit(3)])
def test_staged_dir_removes_what_it_staged_on_any_failure(tmp_path, error):
    old = tmp_path / "old"
    old.mkdir()
    (old / "manifest.json").write_text("{}")
    for final in (tmp_path / "new" / "deeper" / "out", old):
        with pytest.raises(type(error)) as e:
            with staged_dir(final, manifest="manifest.json") as tmp:
                (tmp / "big.bin").write_bytes(b"\0" * 4096)
                raise error
        assert e.value is error  # the same exception, not translated
        # neither the staging nor the parents made for it
        assert _listing(tmp_path) == [
            "old",
            "old/manifest.json",
        ]


def test_a_failed_commit_leaves_the_old_output_and_no_staging(tmp_path, monkeypatch):
    final = tmp_path / "out"
    final.mkdir()
    (final / "manifest.json").write_text("old")
    real_replace = os.replace

    def replace(src, dst):
        if Path(dst) == final and Path(src).name.startswith(".out.tmp-"):  # the new directory cannot go in
            raise OSError(errno.EIO, "I/O error")
        return real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace)
    with pytest.raises(OSError, match="I/O error"):
        with staged_dir(final, manifest="manifest.json") as tmp:
            (tmp / "manifest.json").write_text("new")
    monkeypatch.undo()
    assert (
        _listing(tmp_path) == ["out", "out/manifest.json"] and (final / "manifest.json").read_text() == "old"
    )


def test_a_failed_merge_is_rolled_back(tmp_path, monkeypatch):
    final = tmp_path / "out"
    final.mkdir()
    (final / "a.txt").write_text("old a")
    (final / "mine.txt").write_text("mine")
    real_replace = os.replace

    def replace(src, dst):
        if Path(dst).name == "b.txt" and Path(dst).parent == final:
            raise _enospc()
        return real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace)
    with pytest.raises(DiskFullError):
        with staged_dir(final) as tmp:
            (tmp / "a.txt").write_text("new a")
            (tmp / "b.txt").write_text("new b")
    monkeypatch.undo()
    assert (
        _listing(tmp_path) == ["out", "out/a.txt", "out/mine.txt"]
        and (final / "a.txt").read_text() == "old a"
    )


def test_commit_dir_puts_the_old_directory_back_when_the_new_one_cannot_go_in(tmp_path, monkeypatch):
    final, tmp = tmp_path / "out", tmp_path / "staged"
    final.mkdir()
    tmp.mkdir()
    (final / "f").write_text("old")
    calls = []
    real_replace = os.replace

    def replace(src, dst):
        calls.append((Path(src).name, Path(dst).name))
        if len(calls) == 2:
            raise OSError(errno.EXDEV, "cross-device link")
        return real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace)
    with pytest.raises(OSError):
        commit_dir(tmp, final)
    monkeypatch.undo()
    assert (final / "f").read_text() == "old"


def test_no_room_even_for_the_staging_folder(tmp_path, monkeypatch):
    def mkdtemp(**kw):
        raise _enospc()

    monkeypatch.setattr(atomic.tempfile, "mkdtemp", mkdtemp)
    with pytest.raises(DiskFullError, match=f"no space left on device writing {tmp_path / 'a' / 'out'} "):
        with staged_dir(tmp_path / "a" / "out"):
            pytest.fail("the body ran")
    assert _listing(tmp_path) == []


@pytest.mark.parametrize("make", ["dangling", "file", "under-a-file"])
def test_staged_dir_refuses_a_path_that_cannot_be_a_directory_before_writing(tmp_path, make):
    final = tmp_path / "out"
    if make == "dangling":
        final.symlink_to(tmp_path / "gone" / "ckpt")
    elif make == "file":
        final.write_text("mine")
    else:
        (tmp_path / "f").write_text("mine")
        final = tmp_path / "f" / "out"
    before = _listing(tmp_path)
    with pytest.raises(FileExistsError, match="cannot publish the output directory"):
        with staged_dir(final):
            pytest.fail("the body ran")
    assert _listing(tmp_path) == before


def test_output_path_problem():
    assert output_path_problem(Path("/nonexistent/x/y")) is None
    assert output_path_problem(Path("/")) is None
    assert "is a file, not a directory" in output_path_problem(Path(__file__))
    assert "which is not a directory" in output_path_problem(Path(__file__) / "x")


def test_output_path_problem_names_a_dangling_link(tmp_path):
    (tmp_path / "l").symlink_to(tmp_path / "gone")
    assert output_path_problem(tmp_path / "l").startswith(
        f"is a dangling symbolic link (to {tmp_path / 'gone'})"
    )
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    assert "dangling symbolic link" in output_path_problem(tmp_path / "loop")


# ---------------------------------------------------------------- a full disk, named ------------------------------


def test_disk_full_error_names_the_path_its_filesystem_and_free_bytes(tmp_path):
    e = disk_full_error(_enospc(), tmp_path / "out")
    mount, free, total = filesystem_of(tmp_path / "out")
    assert isinstance(e, DiskFullError) and isinstance(e, OSError) and e.errno == errno.ENOSPC
    text = str(e)
    assert text.startswith(
        f"no space left on device writing {tmp_path / 'out'} ([Errno 28] No space left on device)"
    )
    assert f"the filesystem mounted at {mount} had" in text and "bytes (" in text and os.path.ismount(mount)
    assert e.free is not None and e.free >= 0 and total > 0
    if hasattr(errno, "EDQUOT"):
        q = disk_full_error(OSError(errno.EDQUOT, "Disk quota exceeded"), tmp_path)
        assert q.errno == errno.EDQUOT and "no space left on device writing" in str(q) and "quota" in str(q)
    for other in (
        OSError(errno.EACCES, "Permission denied"),
        ValueError("x"),
        RuntimeError("CUDA out of memory"),
    ):
        assert disk_full_error(other, tmp_path) is None


def test_filesystem_of_a_path_not_made_yet(tmp_path):
    mount, free, total = filesystem_of(tmp_path / "a" / "b" / "c")
    assert mount == filesystem_of(tmp_path)[0] and 0 <= free <= total


def test_torch_save_through_a_python_file_keeps_the_errno():
    """How torch really reports it: written through a Python file, the writer's RuntimeError ("unexpected pos")
    carries the OSError as its __context__; the translation finds it there."""
    with pytest.raises(RuntimeError) as e:
        torch.save({"w": torch.zeros(10_000)}, _FullFile(1000))
    assert "unexpected pos" in str(e.value) and isinstance(e.value.__context__, OSError)
    full = disk_full_error(e.value, Path("/x/out"))
    assert full is not None and "no space left on device writing /x/out ([Errno 28]" in str(full)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_torch_save_to_a_path_on_a_full_device(monkeypatch):
    """torch.save to a path writes in C++ and loses the errno: "unexpected pos" alone. Taken for a full disk when
    the filesystem has (almost) no room left; with room left it is some other I/O error and stays as it is."""
    with pytest.raises(RuntimeError) as e:
        torch.save({"w": torch.zeros(10_000)}, "/dev/full")
    assert "unexpected pos" in str(e.value) and not any(
        isinstance(x, OSError) for x in atomic._chain(e.value)
    )
    monkeypatch.setattr(atomic, "filesystem_of", lambda p: (Path("/"), 4096, 1 << 30))
    full = disk_full_error(e.value, Path("/x/out"))
    assert full is not None and "no space left on device writing /x/out (torch's writer: " in str(full)
    monkeypatch.setattr(atomic, "filesystem_of", lambda p: (Path("/"), 1 << 30, 1 << 31))
    assert disk_full_error(e.value, Path("/x/out")) is None
    with pytest.raises(OSError) as e2:  # a Python file on the same device: the OSError itself
        with open("/dev/full", "wb") as f:
            torch.save({"w": torch.zeros(10_000)}, f)
    assert disk_full_error(e2.value, Path("/x/out")) is not None


def test_staged_dir_translates_a_full_disk_and_names_the_output(tmp_path):
    final = tmp_path / "out"
    with pytest.raises(DiskFullError) as e:
        with staged_dir(final) as tmp:
            with open(tmp / "model.pt", "wb") as f:
                torch.save({"w": torch.zeros(10_000)}, _FullFile(1000))
                f.write(b"partial")
    assert f"no space left on device writing {final} " in str(e.value) and e.value.path == final
    assert isinstance(e.value.__cause__, RuntimeError)  # the original, for --debug
    assert _listing(tmp_path) == []


def test_atomic_path_removes_its_temporary_and_the_parents_it_made(tmp_path):
    path = tmp_path / "a" / "b" / "m.json"
    with pytest.raises(DiskFullError) as e:
        with atomic_path(path) as tmp:
            tmp.write_text("half")
            raise _enospc()
    assert str(e.value).startswith(f"no space left on device writing {path} ") and _listing(tmp_path) == []
    write_json_atomic(path, {"a": 1})
    write_text_atomic(path, "x")
    assert path.read_text() == "x" and _listing(tmp_path) == ["a", "a/b", "a/b/m.json"]


def test_a_full_disk_inside_a_staged_directory_names_the_output_not_the_temporary(tmp_path):
    final = tmp_path / "ckpt"
    with pytest.raises(DiskFullError) as e:
        with staged_dir(final) as tmp:
            with atomic_path(tmp / "meta.json"):
                raise _enospc()
    assert e.value.path == final and f"writing {final} " in str(e.value) and ".tmp-" not in str(e.value)
    outside = tmp_path / "elsewhere.json"
    with pytest.raises(DiskFullError) as e:  # a full disk on another output is left naming that one
        with discard_on_failure(final, tmp_path / "staging"):
            with atomic_path(outside):
                raise _enospc()
    assert e.value.path == outside


def test_discard_on_failure_removes_files_and_directories(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_text("x")
    (tmp_path / "f").write_text("f")
    with pytest.raises(KeyboardInterrupt):
        with discard_on_failure(tmp_path / "out", tmp_path / "d", tmp_path / "f"):
            raise KeyboardInterrupt
    assert _listing(tmp_path) == []
    with discard_on_failure(tmp_path / "out", tmp_path / "kept"):
        (tmp_path / "kept").write_text("ok")
    assert _listing(tmp_path) == ["kept"]
