"""How the suite selects and skips GPU tests: the `gpu` marker decides (tests/conftest.py), not the folder a test is
in. Every test under tests/gpu/ has the package name `gpu` among its keywords, so a check on keywords skipped the CPU
tests there on CPU, and `-m gpu` (which reads markers) did not select them either: they never ran anywhere."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THROUGHPUT = "tests/gpu/test_gpu_throughput.py"


def _pytest(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}  # no GPU, whatever the machine
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _marked_gpu(node: ast.AST) -> bool:
    return any("mark.gpu" in ast.unparse(d) for d in getattr(node, "decorator_list", []))


def gpu_marked_tests() -> set[str]:
    """`path::name` (Class::name for methods) of every test function the `gpu` marker applies to, read from the
    source: a module's `pytestmark`, a class's or the function's decorators."""
    out = set()
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        rel = path.relative_to(ROOT).as_posix()
        module = any(
            isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)
            and "mark.gpu" in ast.unparse(n.value)
            for n in tree.body
        )
        for n in tree.body:
            if isinstance(n, ast.FunctionDef) and n.name.startswith("test"):
                if module or _marked_gpu(n):
                    out.add(f"{rel}::{n.name}")
            elif isinstance(n, ast.ClassDef) and n.name.startswith("Test"):
                for m in n.body:
                    if isinstance(m, ast.FunctionDef) and m.name.startswith("test"):
                        if module or _marked_gpu(n) or _marked_gpu(m):
                            out.add(f"{rel}::{n.name}::{m.name}")
    return out


@pytest.mark.slow  # pytest in a subprocess
def test_collect_only_gpu_lists_exactly_the_gpu_marked_tests():
    """`pytest --collect-only -m gpu tests/` on CPU lists every gpu-marked test and nothing else: not the CPU tests
    of tests/gpu/ (the --tiny throughput run, the refusals), which run in the ordinary suite."""
    proc = _pytest("--collect-only", "-q", "-m", "gpu", "tests/")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    collected = {i.split("[", 1)[0] for i in ids}
    want = gpu_marked_tests()
    assert want and collected == want, (sorted(collected - want), sorted(want - collected))
    assert f"{THROUGHPUT}::test_gpu_sweep_reports_mfu_and_peak_memory" in collected
    assert not any(i.startswith(f"{THROUGHPUT}::test_tiny") for i in collected)


@pytest.mark.slow  # pytest in a subprocess
def test_a_test_under_tests_gpu_is_skipped_only_when_marked_gpu():
    """Without CUDA, a gpu-marked test is skipped with the reason; an unmarked test in the same gpu module runs."""
    proc = _pytest(
        "-q",
        "-rs",
        f"{THROUGHPUT}::test_tiny_never_writes_the_gpu_results_file",
        f"{THROUGHPUT}::test_gpu_sweep_reports_mfu_and_peak_memory",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 passed, 1 skipped" in proc.stdout, proc.stdout[-3000:]
    assert "SKIPPED [1] tests/gpu/test_gpu_throughput.py" in proc.stdout and "needs a CUDA GPU" in proc.stdout


def test_two_rank_gpu_cases_skip_below_two_gpus_with_the_reason():
    """tests/gpu/test_gpu.py runs every multi-rank check at 1 rank and at 2; the 2-rank case skips, saying why,
    where NCCL cannot run it (fewer than two GPUs), instead of shrinking to one rank unseen."""
    from tests.gpu import test_gpu

    values = test_gpu.NPROC.args[1]
    assert values[0] == 1
    skip = values[1].marks[0]
    assert values[1].values == (2,) and skip.name == "skipif" and skip.kwargs["reason"] == test_gpu.NEEDS_TWO
    assert skip.args[0] == (test_gpu._gpus() < 2)
    assert "needs >= 2 GPUs" in test_gpu.NEEDS_TWO and len(test_gpu.ONE_GPU_CANNOT_CHECK) >= 5
