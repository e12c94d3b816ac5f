"""The wheels a stock GPU image lacks for the project's GPU checks: one small folder to carry to an offline node.

    make gpu-wheels                                  # Python 3.12, x86-64, the node described in scripts/gpu_nodes/
    make gpu-wheels PY=3.11 NODE=path/to/freeze.txt  # another node: its `python3 -m pip list --format=freeze`

A GPU image already holds torch (its own CUDA build), numpy, transformers, tokenizers, sentencepiece, pytest and
most of the scientific stack; a full wheelhouse (`make wheels`, 100+ MiB) would shadow them with the versions of this
machine. This folder holds only what the node does not have, walked from the project's requirements (and the
`dev` extra: the tests run there), `--no-deps`, at the versions tested here:

* a requirement the node lacks is carried, with every requirement of it that the node lacks in turn;
* a package the node has is never carried for the project's own pins (pyproject.toml pins transformers, the node
  keeps its own: recorded in the list as "node's own"), only when a *carried* package needs a version the node's
  known version fails, and never one of NEVER_SHADOW (torch, numpy, transformers, tokenizers, ...): that is an error;
* CARRY_ANYWAY names the packages carried although the node has them, each with its reason.

Output: `gpu-wheels/*.whl` (at most 10 MiB, else an error) and `gpu-wheels/CARRIED.txt` (what was taken and why,
what the node keeps), `gpu-wheels/manifest.json`. On the node, `bash scripts/gpu_checks.sh` installs them with
`pip install --no-deps --no-index --target` into a folder on PYTHONPATH: no venv, no resolver, no network.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wheelhouse import REPO, _applies, _env, download, size_mb  # noqa: E402

DEFAULT_NODE = REPO / "scripts" / "gpu_nodes" / "nvidia-h200.txt"
LIMIT_MB = 10.0
EXTRAS = (
    "dev",
)  # the tests run on the node; wandb and lm-eval (tracking, harness) stay behind: their tests skip
# The node's own builds and the libraries they were built with: shadowing one breaks the node's torch or its stack.
NEVER_SHADOW = frozenset(
    {
        "torch",
        "triton",
        "numpy",
        "transformers",
        "tokenizers",
        "safetensors",
        "huggingface-hub",
        "sentencepiece",
    }
    | {"tiktoken", "protobuf", "pytest", "pyyaml", "psutil", "scipy", "scikit-learn", "matplotlib"}
)
CARRY_ANYWAY = {
    "typing-extensions": "pydantic and pydantic-core need a recent typing-extensions (>=4.16 for the versions "
    "tested here) and the image's version is not known; it is pure Python and backward compatible",
}


@dataclass
class Selection:
    """What to carry (name -> pin, with the reason) and what the node keeps (name -> its version, or None)."""

    carry: dict[str, str] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)
    node_keeps: dict[str, Version | None] = field(default_factory=dict)
    tested_with: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def read_node(path: Path) -> dict[str, Version | None]:
    """name -> version from a node description: `pip list --format=freeze` lines, or a bare name where the image is
    known to hold the package at an unknown version; `#` starts a comment."""
    out: dict[str, Version | None] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or "@" in line:
            continue
        name, sep, version = line.partition("==")
        try:
            out[canonicalize_name(name.strip())] = Version(version.strip()) if sep else None
        except InvalidVersion:
            out[canonicalize_name(name.strip())] = None
    return out


def project_roots(py: str) -> list[Requirement]:
    """pyproject.toml's dependencies and the `dev` extra, for the target Python."""
    from project_requirements import requirements

    envs = _env(py, EXTRAS)
    return [r for r in map(Requirement, requirements(list(EXTRAS))) if _applies(r, envs)]


def _version_here(name: str) -> str | None:
    try:
        return metadata.distribution(name).version
    except metadata.PackageNotFoundError:
        return None


def select(roots: list[Requirement], node: dict[str, Version | None], py: str) -> Selection:
    """Walk the requirements from `roots`; carry what the node lacks (at the version installed here), descending
    only into carried packages (a package the node has brings its own dependencies there)."""
    sel = Selection()
    envs = _env(py)
    todo: list[tuple[Requirement, str | None]] = [(r, None) for r in roots]  # (requirement, carried requirer)
    while todo:
        req, requirer = todo.pop(0)
        name = canonicalize_name(req.name)
        if name in sel.carry:
            continue
        has = name in node
        reason = None
        if not has:
            reason = f"the node lacks it (needed by {requirer or 'the project'})"
        elif name in CARRY_ANYWAY:
            reason = CARRY_ANYWAY[name]
        elif requirer and node[name] is not None and node[name] not in req.specifier:
            if name in NEVER_SHADOW:
                sel.problems.append(
                    f"{requirer} needs {req} but the node has {name} {node[name]}, which is never shadowed: "
                    f"carry another version of {requirer}"
                )
                continue
            reason = f"{requirer} needs {req}; the node has {node[name]}"
        if reason is None:
            sel.node_keeps[name] = node[name]
            here = _version_here(req.name)
            if here and str(req.specifier) and not requirer:
                sel.tested_with[name] = f"{req.name}{req.specifier} (tested here with {here})"
            continue
        version = _version_here(req.name)
        if version is None:
            sel.problems.append(
                f"{req.name} is not installed here: run `make venv` first (versions come from it)"
            )
            continue
        sel.carry[name] = f"{req.name}=={version}"
        sel.why[name] = reason
        requires = metadata.distribution(req.name).requires or []
        todo += [(r, req.name) for r in map(Requirement, requires) if _applies(r, envs)]
    return sel


def carried_text(sel: Selection, py: str, arch: str, node_file: Path, sizes: dict[str, float]) -> str:
    """CARRIED.txt: each wheel with its size and reason, then what the node keeps."""
    lines = [
        f"# Carried to the GPU node (Python {py}, {arch}; node described by {node_file.name}), installed there",
        "# with `pip install --no-deps --no-index --target` by scripts/gpu_checks.sh. Made by `make gpu-wheels`.",
    ]
    for name in sorted(sel.carry):
        lines.append(f"{sel.carry[name]:<40} {sizes.get(name, 0.0):6.2f} MiB  {sel.why[name]}")
    lines += ["", "# The node's own (never carried):"]
    for name in sorted(sel.node_keeps):
        v = sel.node_keeps[name]
        lines.append(
            f"{name} {v if v is not None else '(version not known here)'}  {sel.tested_with.get(name, '')}"
        )
    return "\n".join(lines).rstrip() + "\n"


def wheel_sizes(folder: Path) -> dict[str, float]:
    """canonical name -> MiB of its wheel in `folder`."""
    return {
        canonicalize_name(w.name.split("-")[0]): w.stat().st_size / 2**20
        for w in sorted(folder.glob("*.whl"))
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python-version", default="3.12", help="the node's Python (default 3.12)")
    p.add_argument("--arch", default=platform.machine(), choices=("x86_64", "aarch64"), help="the node's CPU")
    p.add_argument(
        "--node", type=Path, default=DEFAULT_NODE, help="what the node has (freeze lines or names)"
    )
    p.add_argument("--out", type=Path, default=REPO / "gpu-wheels")
    p.add_argument("--dry-run", action="store_true", help="print the selection, download nothing")
    a = p.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", a.python_version):
        p.error(f"--python-version {a.python_version!r}: expected MAJOR.MINOR, e.g. 3.12")
    if not a.node.is_file():
        p.error(f"--node {a.node}: no such file (a node's `python3 -m pip list --format=freeze`)")
    sel = select(project_roots(a.python_version), read_node(a.node), a.python_version)
    if sel.problems:
        for line in sel.problems:
            print(f"error: {line}", file=sys.stderr)
        return 2
    if a.dry_run:
        print(carried_text(sel, a.python_version, a.arch, a.node, {}), end="")
        return 0
    staging = a.out.with_name(a.out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    failed = download(sel.carry, staging, a.python_version, a.arch)
    total = size_mb(staging) if staging.exists() else 0.0
    if failed or total > LIMIT_MB:
        for f in failed:
            print(f"error: {f}", file=sys.stderr)
        if total > LIMIT_MB:
            print(
                f"error: {total:.1f} MiB of wheels, over the {LIMIT_MB:.0f} MiB a call may carry",
                file=sys.stderr,
            )
        shutil.rmtree(staging, ignore_errors=True)
        return 1
    sizes = wheel_sizes(staging)
    (staging / "CARRIED.txt").write_text(carried_text(sel, a.python_version, a.arch, a.node, sizes))
    manifest = {
        "python": a.python_version,
        "arch": a.arch,
        "node": a.node.name,
        "carry": sorted(sel.carry.values()),
        "node_keeps": {n: (str(v) if v is not None else None) for n, v in sorted(sel.node_keeps.items())},
        "mib": round(total, 2),
    }
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    shutil.rmtree(a.out, ignore_errors=True)
    staging.rename(a.out)
    print(f"{a.out}: {len(sel.carry)} wheels, {total:.1f} MiB, for Python {a.python_version} on {a.arch}")
    print((a.out / "CARRIED.txt").read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
