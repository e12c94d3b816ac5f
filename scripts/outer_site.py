"""Let .venv see the packages of the Python that made it when that Python is itself inside a virtualenv.

`python -m venv --system-site-packages` links a new venv to the *base* interpreter's site-packages: made from a GPU
node's `python3` that lives in a virtualenv (/opt/torch/.venv, say), the new .venv would not see the node's torch.
This writes `outer-site.pth` into .venv's site-packages naming the outer venv's site-packages (after .venv's own, so
what .venv installs wins). Nothing to do, and nothing written, for a Python that is not in a venv.

    python scripts/outer_site.py .venv        # run with the Python that made .venv (the Makefile does)
"""

from __future__ import annotations

import site
import sys
from pathlib import Path


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: python scripts/outer_site.py VENV", file=sys.stderr)
        return 2
    if sys.prefix == sys.base_prefix:
        return 0
    venv = Path(sys.argv[1])
    inner = sorted(venv.glob("lib/python*/site-packages"))
    if not inner:
        print(f"outer_site: no site-packages under {venv}", file=sys.stderr)
        return 2
    outer = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (inner[0] / "outer-site.pth").write_text("".join(f"{p}\n" for p in outer))
    print(f"{venv} sees {', '.join(outer)} (the packages of {sys.prefix}, the virtualenv this Python is in)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
