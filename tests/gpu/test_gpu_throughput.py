"""benchmarks/gpu_throughput.py: the --tiny run of every arm through the framework's path and the bare loop, the
refusal of a full sweep without CUDA, and (GPU only) a short real sweep with MFU and peak memory."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ARMS = ("dense", "demix-1", "demix-2", "demix-8", "gshard")


def _run(
    args: list[str], env_extra: dict[str, str] | None = None, timeout: int = 300
) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_throughput", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _rows(md: str) -> dict[str, list[str]]:
    """Table rows of the results markdown by arm: the cells after `| size | arm |`."""
    out = {}
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 14 and cells[1] in ARMS:
            out[cells[1]] = cells
    return out


@pytest.mark.slow
def test_tiny_run_measures_every_arm_with_a_finite_ratio(tmp_path):
    record = tmp_path / "tiny.md"
    proc = _run(["--tiny", "--record", str(record)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md = record.read_text()
    assert "Command: `python -m benchmarks.gpu_throughput --tiny --record" in md
    assert "DeepSpeed 0.19.8" in md and "Machine load:" in md
    rows = _rows(md)
    assert sorted(rows) == sorted(ARMS), md
    for arm, cells in rows.items():
        fw_tok, bare_tok = (float(cells[i].replace(",", "")) for i in (4, 9))
        ratio = float(cells[13].strip("*"))
        assert fw_tok > 0 and bare_tok > 0 and math.isfinite(ratio) and ratio > 0, (arm, cells)
    result = json.loads(record.with_suffix(".json").read_text())
    assert [r["arm"] for r in result["rows"]] == list(ARMS)
    for r in result["rows"]:
        assert r["framework"]["status"] == r["bare"]["status"] == "ok", r
        assert r["framework"]["tokens_per_s"] > 0 and math.isfinite(r["ratio"])
        # the project's accounting: DEMix = dense FLOPs, GShard top-2 adds the second expert's FFN
        assert r["flops_per_update_no_recompute"] > 0
    by_arm = {r["arm"]: r for r in result["rows"]}
    assert (
        by_arm["demix-8"]["flops_per_update_no_recompute"] == by_arm["dense"]["flops_per_update_no_recompute"]
    )
    assert (
        by_arm["gshard"]["flops_per_update_no_recompute"] > by_arm["dense"]["flops_per_update_no_recompute"]
    )
    assert (
        by_arm["demix-8"]["params"]
        > by_arm["demix-2"]["params"]
        > by_arm["demix-1"]["params"]
        == by_arm["dense"]["params"]
    )


def test_full_sweep_without_cuda_is_refused_with_the_reason(tmp_path):
    # CUDA hidden, so the refusal is checked on a GPU machine too
    proc = _run(["--record", str(tmp_path / "x.md")], {"CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert proc.returncode != 0
    assert "no CUDA device" in proc.stderr and "--tiny" in proc.stderr
    assert not (tmp_path / "x.md").exists()


def test_tiny_never_writes_the_gpu_results_file():
    default = ROOT / "benchmarks" / "results" / "gpu_throughput.md"
    before = default.read_bytes() if default.exists() else None
    proc = _run(["--tiny", "--record", str(default)], timeout=120)
    assert proc.returncode == 2 and "never writes the GPU results file" in proc.stderr
    assert (default.read_bytes() if default.exists() else None) == before


def test_out_of_memory_is_recorded_and_the_sweep_goes_on():
    from benchmarks.gpu_throughput import guarded

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def broken():
        raise RuntimeError("something else")

    assert guarded(oom, torch.device("cpu"))["status"] == "OOM"
    assert guarded(broken, torch.device("cpu"))["status"] == "error"


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_sweep_reports_mfu_and_peak_memory(tmp_path):
    assert torch.cuda.is_available()  # the gpu marker skips this test elsewhere (tests/conftest.py)
    record = tmp_path / "gpu.md"
    proc = _run(
        [
            "--sizes",
            "gpt3-small",
            "--arms",
            "dense,demix-2,gshard",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--micro-batch",
            "1",
            "--seq-len",
            "512",
            "--record",
            str(record),
        ],
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(record.with_suffix(".json").read_text())
    assert result["versions"]["gpu"] and result["device"] != "cpu"
    for r in result["rows"]:
        for phase in ("framework", "bare"):
            res = r[phase]
            assert res["status"] == "ok", r
            assert res["tokens_per_s"] > 0 and res["peak_mem_gib"] > 0
            if result["peak_tflops"] is not None:
                assert 0 < res["mfu"] < 1
        assert math.isfinite(r["ratio"])
