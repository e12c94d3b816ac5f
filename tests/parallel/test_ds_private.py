"""parallel/ds_private.py is the one file that uses DeepSpeed's private names, and the installed DeepSpeed has them.

An upgrade of DeepSpeed that renames or removes one fails here, naming it and the version; a private name used
anywhere else in the project fails the guard (whose self-test plants one)."""

from __future__ import annotations

import importlib
import inspect
import io
import tokenize
from pathlib import Path

import pytest

from parallel.ds_private import PRIVATE_NAMES

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("launcher", "parallel", "model", "data", "benchmarks", "experiments", "scripts")
ADAPTER = ROOT / "parallel" / "ds_private.py"
PRIVATE = {name for _, _, name in PRIVATE_NAMES}


@pytest.mark.parametrize("module, cls, name", PRIVATE_NAMES, ids=[n for _, _, n in PRIVATE_NAMES])
def test_the_installed_deepspeed_has_every_private_name_the_adapter_uses(module, cls, name):
    import deepspeed

    where = f"{module}.{cls}" if cls else module
    owner = importlib.import_module(module)
    if cls:
        owner = getattr(owner, cls)
    # an attribute DeepSpeed sets at run time (on self, or on a parameter) is found in the source that sets it
    found = hasattr(owner, name) or f".{name} =" in inspect.getsource(owner)
    assert found, (
        f"DeepSpeed {deepspeed.__version__} no longer has {where}.{name}, which parallel/ds_private.py relies on: "
        "adapt that file (and only it) to the new DeepSpeed"
    )


def private_uses(source: str) -> list[str]:
    """DeepSpeed private names (`PRIVATE_NAMES`) used in code: attribute accesses, string literals naming them
    (getattr/hasattr) and `from deepspeed... import _name`; not comments or docstrings."""
    out = []
    prev = None
    skip = (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME and tok.string in PRIVATE and prev is not None and prev.string == ".":
            out.append(f"line {tok.start[0]}: .{tok.string}")
        elif tok.type == tokenize.STRING and tok.string.strip("\"'") in PRIVATE:
            out.append(f"line {tok.start[0]}: {tok.string}")
        if tok.type not in skip:
            prev = tok
    for i, line in enumerate(source.splitlines(), 1):
        s = line.strip()
        if s.startswith("from deepspeed") and " import " in s:
            names = s.split(" import ", 1)[1].replace("(", "").replace(")", "").split(",")
            out += [f"line {i}: import {n.strip()}" for n in names if n.strip().startswith("_")]
    return out


def test_no_file_but_the_adapter_uses_a_deepspeed_private_name():
    found = []
    for pkg in SCANNED:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path != ADAPTER:
                found += [f"{path.relative_to(ROOT)} {u}" for u in private_uses(path.read_text())]
    assert not found, (
        "DeepSpeed private names outside parallel/ds_private.py (add a function there):\n" + "\n".join(found)
    )


def test_the_guard_sees_a_planted_private_name():
    planted = (
        'def f(engine, p):\n    engine._backward_prologue()\n    return getattr(p, "_hp_mapping", None)\n'
    )
    assert private_uses(planted) == ["line 2: ._backward_prologue", 'line 3: "_hp_mapping"']
    assert private_uses("from deepspeed.utils.groups import _get_data_parallel_group\n")
    assert not private_uses('"""engine._backward_prologue in a docstring"""\n# p._hp_mapping in a comment\n')
