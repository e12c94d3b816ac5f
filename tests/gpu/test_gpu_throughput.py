"""benchmarks/gpu_throughput.py: the --tiny run of every arm through the framework's path and the bare loop, the
refusal of a full sweep without CUDA, the presets, the planner's skips, the deadline, results written cell by cell,
and (GPU only) a short real sweep with MFU and peak memory and the models built on the device."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
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
        if len(cells) == 16 and cells[1] in ARMS:
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
        fw_tok, bare_tok = (float(cells[i].replace(",", "")) for i in (4, 10))
        ratio = float(cells[15].strip("*"))
        assert fw_tok > 0 and bare_tok > 0 and math.isfinite(ratio) and ratio > 0, (arm, cells)
    result = json.loads(record.with_suffix(".json").read_text())
    assert [r["arm"] for r in result["rows"]] == list(ARMS)
    # one line per cell, in order, as each finished: the same rows as the final .json
    lines = record.with_suffix(".jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == result["rows"]
    for r in result["rows"]:
        assert r["framework"]["status"] == r["bare"]["status"] == "ok", r
        assert 0 < r["predicted_gib"]["bare"] and 0 < r["predicted_gib"]["framework"], r
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


def _tiny_plan(arm: str = "demix-2"):
    from benchmarks.gpu_throughput import parse_args, parse_arm, plan_random_tokens, run_config

    a = parse_args(["--tiny"])
    spec = parse_arm(arm, a.gshard_experts)
    return a, spec, plan_random_tokens(run_config("tiny", spec, a), spec.domain_names())


@pytest.mark.parametrize("arm", ["dense", "demix-2", "gshard"])
def test_both_phases_build_the_same_initial_weights(arm):
    from benchmarks.gpu_throughput import build_model
    from launcher.train import build_rank_model
    from model.accounting import param_counts

    _, _, plan = _tiny_plan(arm)
    cpu = torch.device("cpu")
    first, second, host = build_model(plan, cpu), build_model(plan, cpu), build_rank_model(plan, 0)
    for other in (second, host):  # each phase's own build; on the host, the trainer's build itself
        assert first.state_dict().keys() == other.state_dict().keys()
        assert all(torch.equal(v, other.state_dict()[k]) for k, v in first.state_dict().items())
    # the planner's parameter count (the row's "params held") is what the phases build
    m = plan.cfg.model
    assert first.num_parameters() == param_counts(m, vocab_size=m.padded_vocab_size(1)).total


def test_presets_and_explicit_cells():
    from benchmarks.gpu_throughput import ARMS, SIZES, parse_args, select_cells

    default = parse_args([])
    assert select_cells(default) == [
        ("gpt3-small", "dense"),
        ("gpt3-small", "demix-1"),
        ("gpt3-small", "demix-8"),
        ("gpt3-small", "gshard"),
        ("gpt3-xl", "dense"),
        ("gpt3-xl", "demix-1"),
        ("gpt3-xl", "demix-4"),
    ]
    assert (default.warmup, default.steps, default.seq_len, default.deadline_s) == (2, 3, 2048, 270.0)
    quick = parse_args(["--quick"])
    assert select_cells(quick) == [
        ("gpt3-small", "dense"),
        ("gpt3-small", "demix-1"),
        ("gpt3-small", "demix-8"),
    ]
    assert (quick.warmup, quick.steps, quick.deadline_s) == (1, 2, 150.0)
    # widening: --sizes and/or --arms give their product (the other axis: every one); no default deadline
    wide = parse_args(["--sizes", "gpt3-medium,gpt3-large", "--arms", "dense,demix-2"])
    assert select_cells(wide) == [
        ("gpt3-medium", "dense"),
        ("gpt3-medium", "demix-2"),
        ("gpt3-large", "dense"),
        ("gpt3-large", "demix-2"),
    ]
    assert wide.deadline_s is None and (wide.warmup, wide.steps) == (2, 3)
    assert select_cells(parse_args(["--sizes", "all", "--arms", "all"])) == [
        (s, a) for s in SIZES for a in ARMS
    ]
    assert select_cells(parse_args(["--sizes", "gpt3-xl"])) == [("gpt3-xl", a) for a in ARMS]
    assert select_cells(parse_args(["--arms", "dense"])) == [(s, "dense") for s in SIZES]
    assert parse_args(["--deadline-s", "0"]).deadline_s is None
    assert parse_args(["--quick", "--deadline-s", "60"]).deadline_s == 60.0
    # --tiny: every arm (with --quick the quick arms) on the tiny model, the tiny step counts, no deadline
    tiny = parse_args(["--tiny"])
    assert select_cells(tiny) == [("tiny", a) for a in ARMS]
    assert (tiny.warmup, tiny.steps, tiny.seq_len, tiny.deadline_s) == (1, 3, 64, None)
    tiny_quick = parse_args(["--tiny", "--quick"])
    assert select_cells(tiny_quick) == [("tiny", a) for a in ("dense", "demix-1", "demix-8")]
    assert (tiny_quick.warmup, tiny_quick.steps, tiny_quick.deadline_s) == (1, 2, None)


@pytest.mark.slow
def test_xl_demix_4_fits_an_h200_by_the_planner_and_demix_8_does_not():
    """The default preset's gpt3-xl x demix-4 is the most experts one H200 holds, as the module docstring says."""
    from benchmarks.gpu_throughput import (
        DEFAULT_CELLS,
        parse_args,
        parse_arm,
        plan_random_tokens,
        predict_memory,
        run_config,
    )

    assert ("gpt3-xl", ("dense", "demix-1", "demix-4")) in DEFAULT_CELLS
    h200 = 139.0  # GiB, an H200 as torch reports it (a little more in fact)
    a = parse_args([])

    def predicted(arm: str) -> dict:
        spec = parse_arm(arm, a.gshard_experts)
        return predict_memory(plan_random_tokens(run_config("gpt3-xl", spec, a), spec.domain_names()).cfg)[
            "gib"
        ]

    assert max(predicted("demix-4").values()) < h200
    assert predicted("demix-8")["framework"] > h200 + 1


def _fake_result() -> dict:
    """What `main` and `run` put in a result before the first cell, without a device."""
    return {
        "command": "python -m benchmarks.gpu_throughput --test",
        "settings": {
            "precision": "bf16",
            "zero_stage": 1,
            "recompute": "none",
            "seq_len": 64,
            "micro_batch": 4,
            "grad_accum": 2,
            "warmup": 1,
            "steps": 3,
            "gshard_experts": 8,
            "deadline_s": None,
        },
        "versions": {"gpu": None, "torch": "t", "cuda": None, "nccl": None, "deepspeed": "d"},
        "peak_tflops": None,
        "uptime_before": "up",
        "machine": {"cores": 2},
        "device_memory_gib": None,
        "cells": ["tiny dense", "tiny demix-1", "tiny demix-8"],
        "rows": [],
    }


def _fake_row(size: str, arm: str) -> dict:
    ok = {"status": "ok", "s_per_update": 0.5, "tokens_per_s": 1024.0}
    return {"size": size, "arm": arm, "framework": dict(ok), "bare": dict(ok), "ratio": 1.0}


def test_each_cell_is_on_disk_before_the_next_starts(tmp_path):
    from benchmarks.gpu_throughput import ResultWriter, parse_arm, sweep

    record = tmp_path / "out" / "sweep.md"
    writer, result, measured = ResultWriter(record), _fake_result(), []
    cells = [("tiny", parse_arm(n, 8)) for n in ("dense", "demix-1", "demix-8")]

    def measure(size, arm):
        measured.append(arm.name)
        if arm.name == "demix-1":  # the run dies in the second cell: the first must already be on disk
            assert [
                json.loads(line)["arm"] for line in record.with_suffix(".jsonl").read_text().splitlines()
            ] == ["dense"]
            raise KeyboardInterrupt
        return _fake_row(size, arm.name)

    with pytest.raises(KeyboardInterrupt):
        sweep(cells, measure, result, writer)
    assert measured == ["dense", "demix-1"]
    assert [json.loads(line) for line in record.with_suffix(".jsonl").read_text().splitlines()] == [
        _fake_row("tiny", "dense")
    ]
    assert json.loads(record.with_suffix(".json").read_text())["rows"] == [_fake_row("tiny", "dense")]
    md = record.read_text()
    assert "| tiny | dense |" in md and "| tiny | demix-1 |" not in md
    assert "Sweep in progress (or killed): 1 of 3 cells written" in md
    assert not list(record.parent.glob("*.tmp"))


def test_cells_after_the_deadline_are_recorded_not_run_and_never_measured(tmp_path):
    from benchmarks.gpu_throughput import ResultWriter, parse_arm, sweep

    now = [0.0]
    measured = []

    def measure(size, arm):
        measured.append(arm.name)
        now[0] += 10.0  # each cell takes 10 s
        return _fake_row(size, arm.name)

    record = tmp_path / "sweep.md"
    result = _fake_result()
    cells = [("tiny", parse_arm(n, 8)) for n in ("dense", "demix-1", "demix-8")]
    sweep(cells, measure, result, ResultWriter(record), deadline=15.0, clock=lambda: now[0])
    assert measured == ["dense", "demix-1"]  # demix-1 started at 10 s < 15 s; demix-8 at 20 s did not
    last = result["rows"][-1]
    assert last["arm"] == "demix-8" and last["ratio"] is None
    for phase in ("framework", "bare"):
        assert last[phase] == {"status": "not run", "reason": "not run: deadline passed before it started"}
    assert len(record.with_suffix(".jsonl").read_text().splitlines()) == 3
    assert "- tiny demix-8 framework: not run: deadline passed before it started" in record.read_text()


def _no_build(monkeypatch):
    import benchmarks.gpu_throughput as gt

    def refuse(*args, **kwargs):
        raise AssertionError("a phase that is not run builds nothing")

    for name in ("build_model", "build_bundle", "random_batches"):
        monkeypatch.setattr(gt, name, refuse)


def test_a_phase_the_planner_says_does_not_fit_is_skipped_and_never_built(monkeypatch):
    from benchmarks.gpu_throughput import markdown, planner_skip, run_cell

    assert planner_skip(142.74, 139.8) == "skipped: planner predicts 142.7 GiB > 139.8 GiB"
    assert planner_skip(0.0123, 0.001) == "skipped: planner predicts 0.012 GiB > 0.001 GiB"
    assert (
        planner_skip(3.9, 4.0) is None and planner_skip(5.0, None) is None and planner_skip(None, 4.0) is None
    )
    a, arm, plan = _tiny_plan("demix-2")
    _no_build(monkeypatch)
    row = run_cell("tiny", arm, a, torch.device("cpu"), "cpu", memory_gib=1e-4)
    for phase in ("framework", "bare"):
        predicted = row["predicted_gib"][phase]
        assert predicted > 1e-4
        assert row[phase]["status"] == "skipped", row
        said = re.fullmatch(r"skipped: planner predicts ([0-9.e-]+) GiB > 0\.0001 GiB", row[phase]["reason"])
        assert said and float(said.group(1)) == pytest.approx(predicted, rel=0.05), row[phase]
    assert row["ratio"] is None and row["device_memory_gib"] == 1e-4
    # the planner counts activations at the recipe, not only the model states (16-18 bytes per parameter)
    assert row["predicted_gib"]["bare"] * 1024**3 > 16 * row["params"]
    assert row["planner"]["activations"] == "traced"
    result = {**_fake_result(), "rows": [row], "wall_s": 1.0}
    assert "- tiny demix-2 bare: skipped: planner predicts" in markdown(result)


def test_a_phase_not_started_before_the_deadline_builds_nothing(monkeypatch):
    from benchmarks.gpu_throughput import run_cell

    a, arm, _ = _tiny_plan("dense")
    _no_build(monkeypatch)
    row = run_cell("tiny", arm, a, torch.device("cpu"), "cpu", None, deadline=time.monotonic() - 1)
    assert row["framework"]["status"] == row["bare"]["status"] == "not run"


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
    assert result["device_memory_gib"] > 0 and result["settings"]["deadline_s"] is None
    lines = record.with_suffix(".jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == result["rows"] and len(lines) == 3
    for r in result["rows"]:
        for phase in ("framework", "bare"):
            res = r[phase]
            assert res["status"] == "ok", r
            assert res["tokens_per_s"] > 0 and res["peak_mem_gib"] > 0
            assert 0 < r["predicted_gib"][phase] < result["device_memory_gib"], r
            if result["peak_tflops"] is not None:
                assert 0 < res["mfu"] < 1
        assert math.isfinite(r["ratio"])


@pytest.mark.gpu
def test_models_are_built_and_initialised_on_the_gpu_deterministically():
    from benchmarks.gpu_throughput import build_model

    assert torch.cuda.is_available()  # the gpu marker skips this test elsewhere (tests/conftest.py)
    _, _, plan = _tiny_plan("demix-2")
    cuda = torch.device("cuda", torch.cuda.current_device())
    first, second = build_model(plan, cuda), build_model(plan, cuda)
    assert all(p.device == cuda for p in first.parameters())
    assert all(torch.equal(v, second.state_dict()[k]) for k, v in first.state_dict().items())
    # the CUDA generator's draws: same distribution as the host build's, other values
    host = build_model(plan, torch.device("cpu")).state_dict()
    w = "blocks.0.attn.qkv.weight"
    assert not torch.equal(first.state_dict()[w].cpu(), host[w])
    assert abs(first.state_dict()[w].std().item() - host[w].std().item()) < 0.002
