"""The layering, enforced: no import cycle among the project's modules and no upward import.

    data/      corpus -> tokens -> indexed blocks -> samplers         (imports no other project folder)
    model/     plain PyTorch: GPT, FFN kinds, mixture maths, FLOPs    (no torch.distributed, deepspeed,
                                                                        parallel/, launcher/)
    parallel/  layout, process groups, TP, the DeepSpeed engine        (model/, data/; never launcher/)
    launcher/  config, plan, FFN-kind strategies, trainer, CLIs,      (anything below)
               the demo (`make demo`)
    benchmarks/ the user's measuring targets: make bench, make         (anything below)
               reproduce, sweeps, reports, the cost model, GPU sweep
    experiments/ one-off experiments, each with its recorded result    (anything but tests/)

No project folder imports tests/: the test harness is the tests' own.

Inside launcher/, lowest first (`LAUNCHER_ORDER`):

    launcher/checkpoint_data.py, launcher/expert_surgery.py,  the data a checkpoint reads, expert surgery, the
    launcher/router_vectors.py                                 router vectors its meta.json may hold
    launcher/evaluation/   measures checkpoints: perplexity tables, the lm-eval harness, generation, figures
    launcher/modular/      edits checkpoints (add/remove experts, BTX, merges, the HF export) and reports on them
                           with the evaluation (DEMix Tables 6, 7, 13), so it sits above launcher/evaluation/

Every import counts, including those inside functions: a lazy import hides a cycle, it does not remove it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("data", "model", "parallel", "launcher", "benchmarks", "experiments")
# folder -> import prefixes it must never use
FORBIDDEN = {
    "data": ("model", "parallel", "launcher", "benchmarks", "experiments", "tests"),
    "model": ("parallel", "launcher", "benchmarks", "experiments", "tests", "torch.distributed", "deepspeed"),
    "parallel": ("launcher", "benchmarks", "experiments", "tests"),
    "launcher": ("benchmarks", "experiments", "tests"),
    "benchmarks": ("experiments", "tests"),
    "experiments": ("tests",),
}


def _modules() -> dict[str, Path]:
    return {
        ".".join(p.relative_to(ROOT).with_suffix("").parts): p
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*.py")
    }


def _imports(path: Path) -> set[str]:
    """Every name imported anywhere in the file (module and module.attr for `from m import attr`)."""
    return _imports_of(path.read_text(), str(path))


def _imports_of(source: str, filename: str = "<source>") -> set[str]:
    """`_imports` of a source text."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source, filename)):
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


def _kind_literals(node: ast.AST, kinds: frozenset[str]) -> set[str]:
    """The FFN-kind names `node` spells: a string literal, or a tuple/list/set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & kinds
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in kinds}
    return set()


def _names_a_kind(node: ast.AST) -> bool:
    """`kind`, `x.ffn_kind`, `meta["kind"]`, `d.get("kind")`: an expression named like an FFN kind."""
    if isinstance(node, ast.Name):
        return node.id.endswith("kind")
    if isinstance(node, ast.Attribute):
        return node.attr.endswith("kind")
    if isinstance(node, ast.Subscript):
        key = node.slice
        return isinstance(key, ast.Constant) and isinstance(key.value, str) and key.value.endswith("kind")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        key = node.args[0] if node.args else None
        return isinstance(key, ast.Constant) and isinstance(key.value, str) and key.value.endswith("kind")
    return False


def _kind_branches(source: str, kinds: frozenset[str]) -> list[int]:
    """Lines where a kind-named expression is compared (==, !=, in, not in) or matched (match/case) with an
    FFN-kind name literal."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for op, a, b in zip(node.ops, operands, operands[1:]):
                if not isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)):
                    continue
                if (_kind_literals(b, kinds) and _names_a_kind(a)) or (
                    _kind_literals(a, kinds) and _names_a_kind(b)
                ):
                    lines.append(node.lineno)
        elif isinstance(node, ast.Match) and _names_a_kind(node.subject):
            lines += [
                c.pattern.lineno
                for c in node.cases
                for v in ast.walk(c.pattern)
                if isinstance(v, ast.MatchValue) and _kind_literals(v.value, kinds)
            ]
    return sorted(set(lines))


def _ffn_kind_names() -> frozenset[str]:
    from launcher.ffn_kinds import KINDS

    return frozenset(KINDS)


# Files allowed to branch on the FFN kind, with the reason. Only ever shrink. (parallel/ asks model/ffn.py's
# ffn_traits, over model/config.py's FFN_KINDS, the table at its own level; model/ is not scanned: model/ffn.py and
# model/config.py are the model's registry.)
KIND_BRANCH_EXCEPTIONS: dict[str, str] = {}


def test_only_the_strategy_registry_branches_on_the_ffn_kind() -> None:
    """launcher/ and parallel/ ask launcher/ffn_kinds.py; a new FFN kind touches one file there."""
    kinds = _ffn_kind_names()
    hits = [
        f"{p.relative_to(ROOT)}:{i}: {p.read_text().splitlines()[i - 1].strip()}"
        for folder in ("launcher", "parallel")
        for p in sorted((ROOT / folder).rglob("*.py"))
        if p.relative_to(ROOT).as_posix() not in ("launcher/ffn_kinds.py", *KIND_BRANCH_EXCEPTIONS)
        for i in _kind_branches(p.read_text(), kinds)
    ]
    assert not hits, "branches on the FFN kind outside launcher/ffn_kinds.py:\n" + "\n".join(hits)


def test_the_ffn_kind_check_sees_a_branch() -> None:
    """The guard can fail: comparisons and a match on a kind are flagged; other strings and names pass."""
    kinds = _ffn_kind_names()
    assert {"dense", "demix", "gshard", "cse"} <= kinds
    planted = (
        'if kind == "demix":\n    pass\n'  # 1
        'x = cfg.model.ffn_kind != "gshard"\n'  # 3
        'y = meta["config"]["model"]["ffn"]["kind"] in ("cse", "dense")\n'  # 4
        'z = "demix" == c.cfg.model.ffn.kind\n'  # 5
        'match cfg.model.ffn.kind:\n    case "dense":\n        pass\n'  # 6-8: case on line 7
    )
    assert _kind_branches(planted, kinds) == [1, 3, 4, 5, 7]
    control = (
        'if kind == "ewm":\n    pass\n'  # not an FFN kind
        'a = arch == "demix"\n'  # not named like a kind
        "b = ffn_kind(cfg).domain_experts\n"  # the registry's answer
        'c = kind is None or "demix" in text\n'
    )
    assert _kind_branches(control, kinds) == []


# launcher/'s own layers, lowest first: a module may import its own layer and those below, never one above.
# launcher/harness/ (lm-evaluation-harness) scores checkpoints as evaluation/ does and Hugging Face exports of
# modular/, so it sits above both.
LAUNCHER_ORDER: tuple[tuple[str, ...], ...] = (
    ("launcher.checkpoint_data", "launcher.expert_surgery", "launcher.router_vectors"),
    ("launcher.evaluation",),
    ("launcher.modular",),
    ("launcher.harness",),
)
# (importing module, imported module) pairs allowed against LAUNCHER_ORDER, each with its reason. Only ever shrink.
LAUNCHER_ORDER_EXCEPTIONS: dict[tuple[str, str], str] = {}


def _layer(name: str, order: tuple[tuple[str, ...], ...]) -> int | None:
    """The index in `order` of the layer holding module `name` (or `name`'s module for `module.attr`)."""
    for i, prefixes in enumerate(order):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return i
    return None


def _order_violations(
    imports: dict[str, set[str]],
    order: tuple[tuple[str, ...], ...] = LAUNCHER_ORDER,
    exceptions: dict[tuple[str, str], str] = LAUNCHER_ORDER_EXCEPTIONS,
) -> list[str]:
    """'<module> imports <name>' for every import of a higher layer of `order` than the importing module's own."""
    bad = []
    for mod, names in sorted(imports.items()):
        here = _layer(mod, order)
        if here is None:
            continue
        for name in sorted(names):
            there = _layer(name, order)
            excused = any(mod == m and (name == n or name.startswith(n + ".")) for m, n in exceptions)
            if there is not None and there > here and not excused:
                bad.append(f"{mod} imports {name}")
    return bad


def test_launcher_layers_import_only_downwards() -> None:
    """launcher/evaluation/ never imports launcher/modular/, neither imports launcher/harness/; the shared modules
    below import none of them."""
    imports = {m: _imports(p) for m, p in _modules().items() if m.startswith("launcher.")}
    bad = _order_violations(imports)
    assert not bad, "imports against LAUNCHER_ORDER (move the shared piece below both):\n" + "\n".join(bad)


def test_the_launcher_order_check_sees_an_upward_import() -> None:
    """A planted upward import is flagged, a lazy one included; downward and same-layer imports and the listed
    exceptions pass."""
    planted = {
        "launcher.evaluation.fake": _imports_of(
            "from launcher.checkpoint_data import load_blocks\n"
            "def f():\n    from launcher.modular.experts import add_expert\n"
        ),
        "launcher.checkpoint_data": _imports_of("import launcher.evaluation.evaluate\n"),
        "launcher.modular.fake": _imports_of(
            "from launcher.evaluation.evaluate import evaluate_checkpoint\nimport launcher.modular.btx\n"
        ),
    }
    assert _order_violations(planted) == [
        "launcher.checkpoint_data imports launcher.evaluation.evaluate",
        "launcher.evaluation.fake imports launcher.modular.experts",
        "launcher.evaluation.fake imports launcher.modular.experts.add_expert",
    ]
    excused = {
        "launcher.evaluation.fake": {"launcher.modular.hf_export", "launcher.modular.hf_export.export"}
    }
    listed = {("launcher.evaluation.fake", "launcher.modular.hf_export"): "a listed exception"}
    assert _order_violations(excused, exceptions=listed) == []
    assert _order_violations(excused, exceptions={}) == [
        "launcher.evaluation.fake imports launcher.modular.hf_export",
        "launcher.evaluation.fake imports launcher.modular.hf_export.export",
    ]
    assert _order_violations({"launcher.modular.fake": _imports_of("import launcher.harness.check\n")}) == [
        "launcher.modular.fake imports launcher.harness.check"
    ]
