"""A wheelhouse for an offline GPU node: every dependency of the project except torch, as wheels for the node's
Python, at the exact versions this machine's `.venv` was tested with.

    make wheels                    # this machine's Python and platform
    make wheels PY=3.12            # e.g. a cluster node's Python 3.12 (x86-64 Linux; ARCH=aarch64 for Grace)
    make wheels PY=3.12 NODE=node.txt   # leave out what the node has (node.txt: its `pip list --format=freeze`)
    # copy the repository (with wheelhouse/) to the node, then on the node, without network:
    make venv OFFLINE=1 SYSTEM_TORCH=1

Two folders: `wheelhouse/core` (what training, evaluation and the tests need) and `wheelhouse/extras` (wandb and
lm-evaluation-harness with their dependencies: heavy, optional; `make venv OFFLINE=1` installs them when the
folder is there). torch and the packages only torch needs (nvidia-*, triton, sympy, ...) are never included:
the node's own CUDA build of torch is used (`SYSTEM_TORCH=1`). Packages published only as source (deepspeed) are
built here into pure-Python wheels. `wheelhouse/manifest.json` lists what was taken, for which Python and platform.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # project_requirements beside this file
# the project's `tracking` and `harness` extras  # heavy and optional: their own folder
EXTRAS_ROOTS = (
    "wandb",
    "lm-eval",
)
NEVER = ("torch",)  # the node's own build; what only torch needs is reached through it alone, so never walked


def _env(py: str, extras: Iterable[str] = ()) -> list[dict[str, str]]:
    """Marker environments of the target Python (Linux), one per extra asked for (plus none)."""
    base = dict(
        default_environment(),
        python_version=py,
        python_full_version=f"{py}.0",
        sys_platform="linux",
        platform_system="Linux",
        os_name="posix",
        implementation_name="cpython",
        platform_python_implementation="CPython",
    )
    return [dict(base, extra=e) for e in ("", *extras)]


def _applies(req: Requirement, envs: list[dict[str, str]]) -> bool:
    return req.marker is None or any(req.marker.evaluate(e) for e in envs)


def project_roots(py: str) -> list[Requirement]:
    """The project's own requirements with its extras (`dev`: the tests run on the node; `tracking`, `harness`: wandb
    and lm-eval) for the target Python, read from pyproject.toml (scripts/project_requirements.py)."""
    from project_requirements import requirements

    envs = _env(py, ("dev", "tracking", "harness"))
    return [r for r in map(Requirement, requirements(["dev", "tracking", "harness"])) if _applies(r, envs)]


def closure(
    roots: Iterable[Requirement], py: str, skip: set[str]
) -> tuple[dict[str, str], dict[str, SpecifierSet]]:
    """(name -> pinned requirement, name -> what every requirer asks of it) for everything `roots` need on the
    target Python, from this environment's installed distributions (the versions the test suite ran with). A
    package needed only on the target Python and absent here keeps its specifier (`name>=x`), resolved by pip."""
    pins: dict[str, str] = {}
    wants: dict[str, SpecifierSet] = {}
    walked: set[tuple[str, str]] = set()  # (name, extra): `fsspec[http]` after `fsspec` still needs aiohttp
    todo = list(roots)
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in skip:
            continue
        wants[name] = wants.get(name, SpecifierSet()) & req.specifier
        extras = {"", *req.extras} - {e for n, e in walked if n == name}
        if not extras:
            continue
        walked |= {(name, e) for e in extras}
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            pins.setdefault(name, f"{req.name}{req.specifier}")
            continue
        pins[name] = f"{req.name}=={dist.version}"
        envs = [e for e in _env(py, extras - {""}) if e["extra"] in extras]
        todo += [r for r in map(Requirement, dist.requires or []) if _applies(r, envs)]
    return pins, wants


def node_packages(freeze: Path) -> dict[str, Version]:
    """name -> version from the node's `python3 -m pip list --format=freeze` (or `pip freeze`)."""
    out = {}
    for line in freeze.read_text().splitlines():
        name, sep, version = line.strip().partition("==")
        if sep and not line.startswith("#"):
            try:
                out[canonicalize_name(name)] = Version(version)
            except InvalidVersion:
                continue
    return out


def not_on_node(
    pins: dict[str, str], wants: dict[str, SpecifierSet], node: dict[str, Version]
) -> dict[str, str]:
    """The pins the node does not already satisfy (pip installs against the requirements, not against the pins)."""
    return {n: p for n, p in pins.items() if not (n in node and node[n] in wants.get(n, SpecifierSet()))}


def platforms(arch: str) -> list[str]:
    """pip matches --platform tags exactly: every manylinux tag a node with glibc >= 2.17 accepts."""
    return [f"manylinux2014_{arch}", f"manylinux1_{arch}"] + [f"manylinux_2_{n}_{arch}" for n in range(5, 40)]


def download(pins: dict[str, str], dest: Path, py: str, arch: str) -> list[str]:
    """Wheels for every pin into `dest`; source-only packages built here as pure wheels. Returns those that failed."""
    dest.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    target = [
        "--only-binary=:all:",
        "--python-version",
        py,
        "--implementation",
        "cp",
        "--abi",
        f"cp{py.replace('.', '')}",
        "--abi",
        "abi3",
        "--abi",
        "none",
        *[a for p in platforms(arch) for a in ("--platform", p)],
    ]
    base = [*pip, "download", "--no-deps", "--quiet", "--dest", str(dest), *target]
    if subprocess.run([*base, *pins.values()], capture_output=True).returncode == 0:
        return []
    failed = []
    for _name, pin in sorted(pins.items()):
        if subprocess.run([*base, pin], capture_output=True).returncode == 0:
            continue
        with tempfile.TemporaryDirectory() as tmp:  # no wheel published: build one (pure Python only)
            built = subprocess.run(
                [*pip, "wheel", "--no-deps", "--no-build-isolation", "--quiet", "--wheel-dir", tmp, pin],
                capture_output=True,
                text=True,
            )
            wheels = list(Path(tmp).glob("*.whl"))
            if (
                built.returncode != 0
                or not wheels
                or not all(w.name.endswith("-none-any.whl") for w in wheels)
            ):
                failed.append(
                    f"{pin}: no wheel for Python {py} on {arch}, and it does not build as a pure-Python "
                    f"wheel here ({(built.stderr or '').strip().splitlines()[-1:] or 'platform wheel'})"
                )
                continue
            for w in wheels:
                shutil.move(str(w), dest / w.name)
    return failed


def _installed(name: str) -> bool:
    try:
        metadata.distribution(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def size_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.glob("*.whl")) / 2**20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--python-version",
        default=f"{sys.version_info.major}.{sys.version_info.minor}",
        help="the node's Python, e.g. 3.12 (default: this one)",
    )
    p.add_argument("--arch", default=platform.machine(), choices=("x86_64", "aarch64"), help="the node's CPU")
    p.add_argument("--out", type=Path, default=REPO / "wheelhouse")
    p.add_argument("--no-extras", action="store_true", help="only wheelhouse/core (no wandb, no lm-eval)")
    p.add_argument(
        "--node-has",
        type=Path,
        metavar="FREEZE",
        help="the node's `python3 -m pip list --format=freeze`: leave out what it already satisfies",
    )
    a = p.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", a.python_version):
        p.error(f"--python-version {a.python_version!r}: expected MAJOR.MINOR, e.g. 3.12")
    roots = project_roots(a.python_version)
    missing = [r.name for r in roots if canonicalize_name(r.name) not in NEVER and not _installed(r.name)]
    if missing:
        print(
            f"error: {', '.join(missing)} not installed in {sys.prefix}: the wheelhouse takes the versions tested "
            "there; run `make venv` first",
            file=sys.stderr,
        )
        return 2
    extra_roots = [r for r in roots if canonicalize_name(r.name) in EXTRAS_ROOTS]
    core_roots = [r for r in roots if r not in extra_roots]
    core, _ = closure(core_roots, a.python_version, skip=set(NEVER))
    # the extras' own closure walked whole: an extra of a core package (`fsspec[http]`) brings extras-only needs
    every, wants = closure(
        core_roots + ([] if a.no_extras else extra_roots), a.python_version, skip=set(NEVER)
    )
    extras = {n: pin for n, pin in every.items() if n not in core}
    core = {n: every[n] for n in core}
    if a.node_has:
        node = node_packages(a.node_has)
        core, extras = not_on_node(core, wants, node), not_on_node(extras, wants, node)
    failed = []
    for folder, pins in (("core", core), ("extras", extras)):
        if pins:
            shutil.rmtree(a.out / folder, ignore_errors=True)
            failed += download(pins, a.out / folder, a.python_version, a.arch)
    torch_pin = next(str(r.specifier) for r in roots if canonicalize_name(r.name) == "torch")
    manifest = {
        "python": a.python_version,
        "arch": a.arch,
        "torch": f"the node's own, torch{torch_pin}",
        "node_has": str(a.node_has) if a.node_has else None,
        "core": sorted(core.values()),
        "extras": sorted(extras.values()),
        "core_mb": round(size_mb(a.out / "core"), 1),
        "extras_mb": round(size_mb(a.out / "extras"), 1) if extras else 0.0,
    }
    (a.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wheelhouse for Python {a.python_version} on {a.arch} (torch: the node's own, {torch_pin}):")
    print(f"  {a.out / 'core'}: {len(core)} packages, {manifest['core_mb']:.1f} MB")
    if extras:
        print(
            f"  {a.out / 'extras'}: {len(extras)} packages, {manifest['extras_mb']:.1f} MB (wandb, lm-eval)"
        )
    for f in failed:
        print(f"error: {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
