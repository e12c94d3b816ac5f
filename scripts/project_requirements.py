"""Print the project's requirements (pyproject.toml's dependencies plus the named extras), one per line.

The offline venv (`make venv OFFLINE=1`) installs these from wheelhouse/ and puts the repository on the path with a
.pth file, as an editable install would, without building the project: a build would need a setuptools that the
node's torch may refuse (torch 2.11 requires setuptools<82). Standard library (or pip's vendored tomli) only.

    python scripts/project_requirements.py dev,tracking,harness
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib


def requirements(extras: list[str]) -> list[str]:
    """The dependencies and those of `extras`; an unknown extra is an error (a typo would install less)."""
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"unknown extras {unknown}; pyproject.toml has {sorted(optional)}")
    return [*project["dependencies"], *(r for e in extras for r in optional[e])]


if __name__ == "__main__":
    print("\n".join(requirements([e for e in (sys.argv[1] if len(sys.argv) > 1 else "").split(",") if e])))
