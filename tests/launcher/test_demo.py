"""launcher/demo.py's report from hand-written evaluation results, its Markdown parsed back into values: every
perplexity, the unigram column and the averages per role, the throughput rows, the commands, and the `make
reproduce` budget that the line on what a short run cannot show quotes."""

import argparse
import re
from pathlib import Path

from benchmarks.reproduce import Budget
from launcher import demo
from launcher.config import CONFIG_DIR


def _result(modes, ppl, unigram):
    return {
        "modes": list(modes),
        "domains": {
            d: {
                "role": role,
                "ppl": {m: ppl[d] + i for i, m in enumerate(modes)},  # each mode its own number: +0, +1, ...
                "unigram": {"ppl": unigram[d]},
            }
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

    # the title: steps, ranks; the last line: the time
    title = re.fullmatch(r"# Demo: .* \((\d+) steps, (\d+) CPU ranks\)", md.splitlines()[0])
    assert title.groups() == ("10", "2")
    assert re.search(r"Total demo time: ([\d.]+) s\.", md).group(1) == "12.0"

    # the perplexity table, parsed back: every domain's number and the averages per role, unigram last
    rows = _table(md, "| domain")
    assert rows[0] == ["domain", "role", "dense", *(f"DEMix {m}" for m in demo.DEMIX_MODES), "unigram"]
    got = {(r[0], r[1]): [float(v.strip("*")) for v in r[2:]] for r in rows[1:]}
    modes = range(len(demo.DEMIX_MODES))
    assert got == {  # the train average of unigram is the floor: (700 + 500) / 2
        ("news", "train"): [400.0, *(350.0 + i for i in modes), 700.0],
        ("code", "train"): [300.0, *(250.0 + i for i in modes), 500.0],
        ("**average**", "train"): [350.0, *(300.0 + i for i in modes), 600.0],
        ("legal", "novel"): [800.0, *(780.0 + i for i in modes), 900.0],
        ("**average**", "novel"): [800.0, *(780.0 + i for i in modes), 900.0],
    }
    # training domains first, then novel ones, each group closed by its average
    assert [r[0] for r in rows[1:]] == ["news", "code", "**average**", "legal", "**average**"]

    # the throughput table and the commands: one row per model, the command each run recorded
    throughput = _table(md, "| model")
    assert [r[0] for r in throughput[1:]] == ["dense", "demix"]
    assert all(r[-1] == "5.000" and r[3] == "1" for r in throughput[1:])  # final train loss, tokens/s
    commands = dict(re.findall(r"^- (\w+): `(.*)`$", md, re.M))
    assert commands == {a: f"python -m launcher.train {a}" for a in ("dense", "demix")}

    # what a short run cannot show points to `make reproduce` with the budget it really has
    seeds, blocks = re.search(r"(\w+) seeds of Dense and DEMix, (\d+) blocks per domain", md).groups()
    budget = Budget.load(CONFIG_DIR / "reproduce" / "full.yaml")
    words = {"two": 2, "three": 3, "four": 4}
    assert words[seeds] == len(budget.seeds["dense"]) == len(budget.seeds["demix"])
    assert int(blocks) == budget.eval_blocks


def _table(md: str, header: str) -> list[list[str]]:
    """The Markdown table whose header line starts with `header`, as rows of cells (the --- line dropped)."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        if not line.startswith("|---"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows
