"""benchmarks/demo.py's report from hand-written evaluation results: the unigram column and its averages, and
the line saying what a short run can and cannot show."""

import argparse
from pathlib import Path

from benchmarks import demo


def _result(modes, ppl, unigram):
    return {
        "modes": list(modes),
        "domains": {
            d: {"role": role, "ppl": {m: ppl[d] for m in modes}, "unigram": {"ppl": unigram[d]}}
            for d, role in (("news", "train"), ("code", "train"), ("legal", "novel"))
        },
    }


def test_demo_report_has_the_unigram_floor_and_points_to_reproduce(tmp_path: Path):
    for arch in ("dense", "demix"):
        (tmp_path / arch).mkdir()
        (tmp_path / arch / "command.sh").write_text(f"#!/bin/sh\npython -m launcher.train {arch}\n")
    uni = {"news": 700.0, "code": 500.0, "legal": 900.0}
    results = {
        "dense": _result(["ppl"], {"news": 400.0, "code": 300.0, "legal": 800.0}, uni),
        "demix": _result(demo.DEMIX_MODES, {"news": 350.0, "code": 250.0, "legal": 780.0}, uni),
    }
    speed = {
        a: {
            "params_total": 1,
            "params_active": 1,
            "tokens_per_s": 1.0,
            "tflops_per_gpu_no_recompute": 0.1,
            "tflops_per_gpu_recompute": 0.1,
            "step_time_s": 1.0,
            "final_train_loss": 5.0,
        }
        for a in results
    }
    args = argparse.Namespace(steps=10, nproc=2, out=str(tmp_path))
    report = demo.build_report(results, speed, args, 12.0)
    assert report["columns"][-1] == "unigram"
    assert report["averages"]["train"]["unigram"] == 600.0 and report["averages"]["novel"]["unigram"] == 900.0
    md = demo.markdown(report)
    header = next(line for line in md.splitlines() if line.startswith("| domain"))
    assert header.endswith("| unigram |")
    assert "What a run this short can show" in md and "bootstrap interval" in md and "make reproduce" in md
    assert "**600.0**" in md
