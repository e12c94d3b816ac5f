"""Exit 2, saying why, when this Python's torch is outside the range pyproject.toml declares (SYSTEM_TORCH=1).

Runs on the node's own Python before the venv exists: standard library and pip's vendored `packaging` only.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

try:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version
except ImportError:  # a bare site Python: pip carries its own copy
    from pip._vendor.packaging.specifiers import SpecifierSet
    from pip._vendor.packaging.version import Version


def main() -> int:
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    spec = SpecifierSet(re.search(r'^\s*"torch([^"]*)"', text, re.M).group(1))
    import torch

    version = Version(torch.__version__.split("+")[0])
    if version not in spec:
        print(
            f"SYSTEM_TORCH=1: this Python's torch {torch.__version__} is outside the supported range torch{spec} "
            f"(pyproject.toml); load another torch module or use the pinned one (make venv without SYSTEM_TORCH)",
            file=sys.stderr,
        )
        return 2
    print(f"system torch {torch.__version__} (cuda {torch.version.cuda}) is within torch{spec}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
