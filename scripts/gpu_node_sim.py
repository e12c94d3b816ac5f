"""A stand-in for an offline GPU node without its GPU: the one-call command from a fresh copy, network cut.

    python scripts/gpu_node_sim.py --node-python /path/to/node/bin/python3 [--wheels gpu-wheels]
    python scripts/gpu_node_sim.py --make-node DIR [--wheels-from-installed]   # a node from this .venv (same Python)

What a lent node is: its own Python inside a virtualenv holding torch and the scientific stack but not deepspeed,
megatron-core or pydantic, no network, the repository copied with gpu-wheels/ beside it. This script copies the
working tree (tracked and untracked files git does not ignore, as the device tool does) into a fresh folder, puts
the wheels there, puts the node's Python first on PATH as `python3`, cuts the network (`unshare -n`, loopback up)
and runs the documented command, `bash scripts/gpu_checks.sh --out OUT`. On a machine without CUDA the expected end
is: every project module imported (OUT/imports.txt), then "no CUDA device", exit 2, no check result written; the
script checks that and the time it took (under a minute) and exits 0 when all hold, 1 otherwise.

`--make-node DIR`: a node Python made from this machine's .venv without copying it: a virtualenv of the same base
Python whose site-packages see a folder of links to every installed distribution except what gpu-wheels carries
(scripts/gpu_wheels.py's selection) and the optional wandb / lm-eval. `--wheels-from-installed` also writes the
carried wheels for that node from the installed distributions (no network; for a node of this Python only).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.utils import canonicalize_name

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_wheels import DEFAULT_NODE, project_roots, read_node, select  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NODE_LACKS_TOO = (
    "wandb",
    "lm-eval",
    "demix",
)  # optional extras the image has not; the project itself is the copy


def carried_names(py: str) -> set[str]:
    """Canonical names of what `make gpu-wheels` carries to the described node."""
    return set(select(project_roots(py), read_node(DEFAULT_NODE), py).carry)


def _top_levels(dist: metadata.Distribution) -> set[str]:
    """The entries a distribution puts directly into site-packages (packages, modules, its .dist-info, .libs)."""
    tops = set()
    for f in dist.files or []:
        parts = Path(str(f)).parts
        if parts and parts[0] not in ("..", "__pycache__") and not parts[0].endswith(".pth"):
            tops.add(parts[0])
    return tops


def make_node(dest: Path, lacks: set[str]) -> Path:
    """A virtualenv of this Python's base interpreter whose site-packages link to every distribution installed here
    but `lacks`; returns its python3."""
    shutil.rmtree(dest, ignore_errors=True)
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    farm = dest / "node-site"
    farm.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    for dist in metadata.distributions():
        if canonicalize_name(dist.metadata["Name"] or "") in lacks:
            continue
        for top in _top_levels(dist):
            src = site / top
            if src.exists() and not (farm / top).exists():
                (farm / top).symlink_to(src)
    node_site = next(dest.glob("lib/python*/site-packages"))
    (node_site / "node-site.pth").write_text(f"{farm}\n")
    # pip (the script installs the wheels with it): this Python's own, linked like the rest
    for top in ("pip", *(p.name for p in site.glob("pip-*.dist-info"))):
        if (site / top).exists() and not (farm / top).exists():
            (farm / top).symlink_to(site / top)
    return dest / "bin" / "python3"


def repack(dist: metadata.Distribution, out: Path) -> Path:
    """A wheel of an installed distribution (its files as installed, a fresh RECORD): for a node of this Python."""
    name = (dist.metadata["Name"] or "").replace("-", "_")
    wheel = out / f"{name}-{dist.version}-py3-none-any.whl"
    site = Path(sysconfig.get_paths()["purelib"])
    files = [
        Path(str(f))
        for f in dist.files or []
        if Path(str(f)).parts[0] != ".." and "__pycache__" not in Path(str(f)).parts
    ]
    record_path = next(str(f) for f in files if f.name == "RECORD" and f.parent.name.endswith(".dist-info"))
    rows = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        for f in files:
            if str(f) == record_path or not (site / f).is_file():
                continue
            data = (site / f).read_bytes()
            z.writestr(str(f), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append(f"{f},sha256={digest},{len(data)}")
        z.writestr(record_path, "\n".join([*rows, f"{record_path},,"]) + "\n")
    return wheel


def copy_tree(dest: Path) -> None:
    """The working tree as the device tool carries it: tracked and untracked files that git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for rel in filter(None, (p.decode() for p in listed)):
        src = REPO / rel
        if src.is_file() and not src.is_symlink():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)


def run_call(node_python: Path, wheels: Path, work: Path, cut_network: bool) -> dict:
    """The documented one-call command in a fresh copy; returns its exit code, seconds, output and what it wrote."""
    shutil.rmtree(work, ignore_errors=True)
    clone, out = work / "repo", work / "out"
    clone.mkdir(parents=True)
    copy_tree(clone)
    shutil.copytree(wheels, clone / "gpu-wheels")
    # the node's virtualenv bin/ first on PATH, as on the node (a link elsewhere would lose the venv's pyvenv.cfg)
    bindir = node_python.parent
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "TORCH_EXTENSIONS_DIR")
    }
    env["PATH"] = f"{bindir}:{env.get('PATH', '/usr/bin:/bin')}"
    env["CUDA_VISIBLE_DEVICES"] = (
        ""  # a CUDA build of torch on a machine without a GPU must not find one either
    )
    cmd = f"bash scripts/gpu_checks.sh --out {out}"
    argv = ["bash", "-c", cmd]
    if cut_network:
        argv = ["unshare", "-n", "bash", "-c", f"ip link set lo up 2>/dev/null; {cmd}"]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=clone, env=env, capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - t0
    imports = (out / "imports.txt").read_text() if (out / "imports.txt").exists() else ""
    return {
        "command": cmd,
        "network_cut": cut_network,
        "exit": proc.returncode,
        "seconds": round(seconds, 1),
        "stderr": proc.stderr,
        "imports": imports,
        "wrote": sorted(p.name for p in out.iterdir()) if out.exists() else [],
    }


def verdict(r: dict) -> list[str]:
    """What failed of the expected end on a machine without CUDA (empty: all held)."""
    bad = []
    if r["exit"] != 2:
        bad.append(f"exit {r['exit']}, expected 2")
    if "no CUDA device" not in r["stderr"]:
        bad.append("no 'no CUDA device' message")
    first = r["imports"].splitlines()[1:2]
    if not first or not first[0].startswith(tuple(f"{n} of {n} " for n in range(1, 1000))):
        bad.append(f"not every module imported: {first}")
    if {"gpu_checks.md", "gpu_throughput.md"} & set(r["wrote"]):
        bad.append(f"results written without CUDA: {r['wrote']}")
    if r["seconds"] >= 60:
        bad.append(f"took {r['seconds']} s (limit 60)")
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--node-python", type=Path, help="the node's python3 (inside its virtualenv)")
    p.add_argument(
        "--wheels", type=Path, default=REPO / "gpu-wheels", help="the carried folder (make gpu-wheels)"
    )
    p.add_argument("--work", type=Path, default=REPO / "runs" / "gpu_node_sim")
    p.add_argument("--make-node", type=Path, metavar="DIR", help="make a node from this .venv, then run")
    p.add_argument(
        "--wheels-from-installed", action="store_true", help="with --make-node: carried wheels from here"
    )
    p.add_argument(
        "--no-unshare", action="store_true", help="keep the network (where unshare -n is not allowed)"
    )
    a = p.parse_args(argv)
    if a.make_node:
        py = f"{sys.version_info.major}.{sys.version_info.minor}"
        carried = carried_names(py)
        a.node_python = make_node(a.make_node, carried | set(NODE_LACKS_TOO))
        if a.wheels_from_installed:
            a.wheels = a.make_node / "wheels"
            a.wheels.mkdir()
            for dist in metadata.distributions():
                if canonicalize_name(dist.metadata["Name"] or "") in carried:
                    repack(dist, a.wheels)
    if a.node_python is None or not a.wheels.is_dir():
        p.error("give --node-python (or --make-node) and a --wheels folder (make gpu-wheels)")
    if a.node_python.name != "python3" or not (a.node_python.parent / "python3").exists():
        p.error(f"--node-python {a.node_python}: expected the python3 in a virtualenv's bin/")
    r = run_call(a.node_python.absolute(), a.wheels.absolute(), a.work.absolute(), not a.no_unshare)
    bad = verdict(r)
    print(json.dumps({k: v for k, v in r.items() if k != "stderr"}, indent=1))
    print(r["stderr"][-3000:], file=sys.stderr)
    print("expected end reached" if not bad else "NOT as expected: " + "; ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
