"""The GPU node's first contact, checked on CPU: the offline wheelhouse's contents and the GPU checks' refusal.

The whole offline path (`make wheels`, then `make venv OFFLINE=1 SYSTEM_TORCH=1` with the network cut and
`make test-fast` in that venv) is recorded in experiments/results/offline_install.md; it downloads and installs too
much for the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import wheelhouse  # noqa: E402


def test_the_wheelhouse_takes_everything_but_torch_at_the_tested_versions():
    roots = wheelhouse.project_roots("3.12")
    names = {r.name for r in roots}
    assert {
        "deepspeed",
        "megatron-core",
        "wandb",
        "lm_eval",
        "pytest",
    } <= names  # every extra, tests included
    core, wants = wheelhouse.closure(
        [r for r in roots if r.name in ("deepspeed", "megatron-core")], "3.12", {"torch"}
    )
    assert not any(n == "torch" or n.startswith(("nvidia-", "triton")) for n in core), core
    from importlib.metadata import version

    assert core["deepspeed"] == f"deepspeed=={version('deepspeed')}" and "hjson" in core and "msgpack" in core
    assert str(wants["pydantic"]) == ">=2.0.0"
    # an extra asked for after the bare package still brings its own needs (datasets asks fsspec[http]: aiohttp)
    from packaging.requirements import Requirement

    later, _ = wheelhouse.closure([Requirement("fsspec[http]"), Requirement("fsspec")], "3.12", {"torch"})
    assert (
        "aiohttp" in later and "aiohttp" not in wheelhouse.closure([Requirement("fsspec")], "3.12", set())[0]
    )


def test_what_the_node_already_satisfies_is_left_out(tmp_path):
    pins = {"pydantic": "pydantic==2.14.4", "hjson": "hjson==3.1.0", "numpy": "numpy==2.4.6"}
    from packaging.specifiers import SpecifierSet

    wants = {"pydantic": SpecifierSet(">=2"), "hjson": SpecifierSet(), "numpy": SpecifierSet(">=1.26,<3")}
    freeze = tmp_path / "node.txt"
    freeze.write_text("numpy==2.5.2\npydantic==1.10.0\n# comment\nsome-local @ file:///x\n")
    left = wheelhouse.not_on_node(pins, wants, wheelhouse.node_packages(freeze))
    # numpy 2.5.2 satisfies, pydantic 1 not
    assert left == {
        "pydantic": "pydantic==2.14.4",
        "hjson": "hjson==3.1.0",
    }


def test_system_torch_outside_the_supported_range_is_refused(tmp_path):
    ok = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "torch_range.py")], capture_output=True, text=True
    )
    assert ok.returncode == 0 and "is within torch" in ok.stdout, ok.stderr
    fake = tmp_path / "torch"  # a site Python whose torch is too old: shadows the real one for the check
    fake.mkdir()
    (fake / "__init__.py").write_text("__version__ = '2.4.1+cu121'\nclass version:\n    cuda = '12.1'\n")
    bad = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "torch_range.py")],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(tmp_path)),
    )
    assert bad.returncode == 2 and "torch 2.4.1+cu121 is outside the supported range" in bad.stderr
