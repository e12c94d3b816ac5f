"""The layering, enforced: no import cycle among the project's modules and no upward import.

    data/      corpus -> tokens -> indexed blocks -> samplers         (imports no other project folder)
    model/     plain PyTorch: GPT, FFN kinds, mixture maths, FLOPs    (no torch.distributed, deepspeed,
                                                                        parallel/, launcher/)
    parallel/  layout, process groups, TP, the DeepSpeed engine        (model/, data/; never launcher/)
    launcher/  config, plan, FFN-kind strategies, trainer, CLIs       (anything but benchmarks/)
    benchmarks/ experiments and reports                                (anything)

Every import counts, including those inside functions: a lazy import hides a cycle, it does not remove it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("data", "model", "parallel", "launcher", "benchmarks")
# folder -> import prefixes it must never use
FORBIDDEN = {
    "data": ("model", "parallel", "launcher", "benchmarks"),
    "model": ("parallel", "launcher", "benchmarks", "torch.distributed", "deepspeed"),
    "parallel": ("launcher", "benchmarks"),
    "launcher": ("benchmarks",),
}


def _modules() -> dict[str, Path]:
    return {
        ".".join(p.relative_to(ROOT).with_suffix("").parts): p
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*.py")
    }


def _imports(path: Path) -> set[str]:
    """Every name imported anywhere in the file (module and module.attr for `from m import attr`)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: {n for n in _imports(p) if n in mods and n != m} for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles (move the shared piece into a lower module): {cycles}"


def test_no_upward_imports() -> None:
    bad = []
    for mod, path in sorted(_modules().items()):
        banned = FORBIDDEN.get(mod.split(".")[0], ())
        for name in sorted(_imports(path)):
            if any(name == b or name.startswith(b + ".") for b in banned):
                bad.append(f"{mod} imports {name}")
    assert not bad, "imports against the layering (see this file's docstring):\n" + "\n".join(bad)


def test_parallel_never_takes_the_run_config() -> None:
    """parallel/ works on model/parallel/train configs and ready objects; the run config is the launcher's."""
    users = [
        str(p.relative_to(ROOT)) for p in (ROOT / "parallel").rglob("*.py") if "RunConfig" in p.read_text()
    ]
    assert not users, f"parallel/ modules that mention RunConfig: {users}"


def test_the_checker_sees_a_cycle_and_a_lazy_import(tmp_path: Path) -> None:
    """The checks can fail: a two-module cycle is found, and a function-level import is seen."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    lazy = tmp_path / "lazy.py"
    lazy.write_text("def f():\n    from launcher.config import RunConfig\n    import deepspeed\n")
    assert _imports(lazy) == {"launcher.config", "launcher.config.RunConfig", "deepspeed"}


def test_only_the_strategy_registry_branches_on_the_ffn_kind() -> None:
    """launcher/ and parallel/ ask launcher/ffn_kinds.py; a new FFN kind touches one file there."""
    pattern = re.compile(r"kind (==|!=|in)\b|kind not in\b")
    hits = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for folder in ("launcher", "parallel")
        for p in sorted((ROOT / folder).rglob("*.py"))
        if p.name != "ffn_kinds.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, "branches on the FFN kind outside launcher/ffn_kinds.py:\n" + "\n".join(hits)
