"""Import every module of the project (launcher, model, parallel, data, benchmarks, experiments) and say which fail,
and why.

    python scripts/check_imports.py [--out imports.txt]

Run by scripts/gpu_checks.sh on a node's own Python before anything else: a module that needs a package the node
lacks, or a version it does not have, shows here in seconds instead of as a failed test minutes later. Then the
requirements of what is importable are checked against the versions found (as `pip check` would, for the carried
wheels on PYTHONPATH too). Exit 0 when every module imports, 1 otherwise; the report lists both.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import pkgutil
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("launcher", "model", "parallel", "data", "benchmarks", "experiments")
SKIP = ("__main__",)  # a package's CLI entry runs on import
# The optional extras (pyproject.toml `tracking`, `harness`): a module that needs one where it is not installed is
# listed, not failed (its tests skip, saying so); a GPU image has neither.
OPTIONAL = {"wandb": "tracking", "lm_eval": "harness"}


def project_modules() -> list[str]:
    """Every module and package under PACKAGES, in a stable order."""
    names = []
    for pkg in PACKAGES:
        names.append(pkg)
        found = pkgutil.walk_packages([str(REPO / pkg)], prefix=f"{pkg}.")
        names += sorted(m.name for m in found if m.name.rsplit(".", 1)[-1] not in SKIP)
    return names


def import_all(names: list[str]) -> dict[str, str | None]:
    """module -> None when it imports, "optional: ..." when it needs an optional extra that is not installed,
    else the last line of the error."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            importlib.import_module(name)
            out[name] = None
        except ModuleNotFoundError as e:
            top = (e.name or "").split(".")[0]
            missing = (
                top in OPTIONAL and importlib.util.find_spec(top) is None
            )  # the extra itself, not a part of it
            out[name] = (
                f"optional: needs {top} (extra `{OPTIONAL[top]}`), not installed" if missing else str(e)
            )
        except BaseException as e:  # a SystemExit or a missing shared library is a failure to report too
            out[name] = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()[-1]
    return out


def unmet_requirements() -> list[str]:
    """`pip check` over every distribution on sys.path (carried wheels included): requirements not met."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: dict[str, metadata.Distribution] = {}
    for dist in metadata.distributions():  # first on sys.path wins, as imports do
        name = canonicalize_name(dist.metadata["Name"] or "")
        seen.setdefault(name, dist)
    problems = []
    for name, dist in sorted(seen.items()):
        for raw in dist.requires or []:
            req = Requirement(raw)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            other = seen.get(canonicalize_name(req.name))
            if other is None:
                problems.append(f"{name} {dist.version} requires {req}: not installed")
            elif other.version not in req.specifier:
                problems.append(f"{name} {dist.version} requires {req}: {req.name} {other.version} found")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="write the report here too")
    a = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    t0 = time.perf_counter()
    results = import_all(project_modules())
    optional = {m: e for m, e in results.items() if e is not None and e.startswith("optional:")}
    failed = {m: e for m, e in results.items() if e is not None and m not in optional}
    counted = len(results) - len(optional)
    lines = [
        f"python {sys.version.split()[0]} at {sys.executable}",
        f"{counted - len(failed)} of {counted} project modules import ({time.perf_counter() - t0:.1f} s); "
        f"{len(optional)} need an optional extra not installed here",
        *(f"FAILED {m}: {e}" for m, e in failed.items()),
        *(f"skipped {m}: {e}" for m, e in optional.items()),
        "",
        "requirements of the installed distributions (pip check):",
        *(unmet_requirements() or ["all met"]),
    ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if a.out:
        a.out.write_text(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
