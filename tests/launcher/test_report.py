"""`python -m launcher.report`: one page of loss curves, throughput, perplexities side by side and the exact commands.

The run directories are written by the project's own writers where one exists: config.yaml as launcher.launch
dumps it, metrics.jsonl through launcher/metrics.py's MetricsLogger (the trainer's record keys), a consolidated
checkpoint and its eval.json from launcher.evaluation.evaluate on the tiny corpus.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import report
from launcher.report import figures

REPO = Path(__file__).resolve().parents[2]
DOMAINS = ("cooking", "sailing", "finance")  # conftest.py's tiny corpus
# (FFN kind, world size, global tokens/s per log interval: the first is the warm-up interval, left out)
RUNS = {
    "demix": ("demix", 2, [100.0, 400.0, 200.0, 300.0]),
    "dense": ("dense", 4, [50.0, 800.0, 900.0, 1000.0]),
}


def _train_record(step: int, tps: float, world: int, i: int) -> dict:
    """A `train` record with the trainer's keys (launcher/train.py `step_record`, `throughput_record`)."""
    rec = {"kind": "train", "step": step, "loss": 9.0 - i}
    rec.update({f"loss/{d}": 9.0 - i + j / 10 for j, d in enumerate(DOMAINS)})
    rec.update(
        {
            "lr": 1e-3,
            "grad_norm": 1.5,
            "peak_mem_gb": 0.5 + i / 10,
            "tokens_per_s": tps,
            "step_time_s": 4096 / tps,
            "tflops_per_gpu_recompute": tps / 1e4 * 4 / 3,
            "tflops_per_gpu_no_recompute": tps / 1e4,
            "tflops_per_gpu": tps / 1e4,
            "mfu": tps / 1e6 if world == 4 else None,
            "hfu": tps / 1e6 if world == 4 else None,
            "comm/data_parallel/all_reduce/bytes": 1e6,
            "comm/data_parallel/all_reduce/calls": 2.0,
        }
    )
    return rec


def make_run(run: Path, ffn: str, world: int, speeds: list[float], tokens: Path, checkpoint) -> Path:
    """A run directory as launch + trainer + evaluator leave it (20 steps, log every 5, eval of the export)."""
    import yaml

    from launcher.config import load_run_config
    from launcher.evaluation.evaluate import evaluate_checkpoint
    from launcher.metrics import MetricsLogger
    from launcher.typed import to_dict

    cfg = load_run_config(
        None,
        [
            "model.preset=tiny",
            f"model.ffn.kind={ffn}",
            "train.steps=20",
            "logging.log_interval=5",
            "logging.progress_bar=false",
            "logging.wandb_mode=disabled",
            f"data.path={tokens}",
            "data.tokenizer=gpt2",
        ],
        check=False,
    )
    run.mkdir(parents=True)
    # launcher/launch.py's dump
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    line = shlex.join(
        [
            sys.executable,
            "-m",
            "deepspeed.launcher.runner",
            "--no_local_rank",
            "--num_gpus",
            str(world),
            "--module",
            "launcher.train",
            "--run-dir",
            str(run),
            "--set",
            f"model.ffn.kind={ffn}",
        ]
    )
    (run / "command.sh").write_text(
        f"#!/usr/bin/env bash\n# world size {world}; written by launcher.launch\n"
        f"cd {shlex.quote(str(REPO))}\n{line}\n"
    )
    log = MetricsLogger(run, cfg, True, 20)
    log.log(
        {
            "kind": "start",
            "step": 0,
            "world_size": world,
            "resumed_from": None,
            "device": "cpu",
            "topology": {"world_size": world},
            "notes": [],
        }
    )
    for i, tps in enumerate(speeds):
        log.log(_train_record(5 * (i + 1), tps, world, i))
    log.log({"kind": "eval", "step": 20, **{f"val_loss/{d}": 5.0 + j for j, d in enumerate(DOMAINS)}})
    log.close()
    checkpoint(run / "model", ffn)
    # eval.json and eval.md as written; the heatmaps (seconds each) left out
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("launcher.evaluation.figures.write_figures", lambda results, out: {})
        evaluate_checkpoint(
            run / "model",
            tokens,
            max_blocks=2,
            cached_blocks=2,
            out_dir=run / "model" / "eval",
            progress=False,
            device="cpu",
            modes=("naive", "uniform", "cached"),
        )
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_tokens, random_checkpoint) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("report_runs")
    return {
        name: make_run(root / name, ffn, world, speeds, tiny_tokens, random_checkpoint)
        for name, (ffn, world, speeds) in RUNS.items()
    }


def _render(capsys, *argv: str) -> tuple[int, str]:
    rc = report.main(list(argv))
    return rc, capsys.readouterr().err


def test_the_trainer_logs_global_and_per_gpu_tokens_per_s(runs):
    """metrics.jsonl: tokens_per_s is global; MetricsLogger adds tokens_per_s_per_gpu = global / the start's world."""
    recs = [json.loads(line) for line in (runs["demix"] / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["kind"] == "train"]
    assert [r["tokens_per_s_per_gpu"] for r in train] == [50.0, 200.0, 100.0, 150.0]
    assert list(train[0]).index("tokens_per_s_per_gpu") == list(train[0]).index("tokens_per_s") + 1
    assert "tokens_per_s_per_gpu" not in recs[0] and "tokens_per_s_per_gpu" not in recs[-1]


def test_report_numbers_tables_figure_and_commands(runs, tmp_path, capsys):
    out = tmp_path / "rep"
    rc, err = _render(capsys, str(runs["demix"]), str(runs["dense"]), "--out", str(out))
    assert rc == 0, err
    assert sorted(p.name for p in out.iterdir()) == sorted(report.REPORT_FILES)
    for png in ("loss.png", "loss_domains.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "report.json").read_text())
    assert data["format"] == report.REPORT_FORMAT
    demix, dense = data["runs"]
    assert (demix["ffn_kind"], demix["world_size"], demix["steps"], demix["configured_steps"]) == (
        "demix",
        2,
        20,
        20,
    )
    assert (dense["ffn_kind"], dense["world_size"]) == ("dense", 4)
    # medians after the warm-up record: (400, 200, 300) and (800, 900, 1000); per GPU = global / world size
    assert demix["throughput"]["records"] == 3 and demix["throughput"]["warmup_records_left_out"] == 1
    assert (
        demix["throughput"]["tokens_per_s"] == 300.0 and demix["throughput"]["tokens_per_s_per_gpu"] == 150.0
    )
    assert (
        dense["throughput"]["tokens_per_s"] == 900.0 and dense["throughput"]["tokens_per_s_per_gpu"] == 225.0
    )
    assert demix["throughput"]["tflops_per_gpu"] == pytest.approx(0.03) and demix["throughput"]["mfu"] is None
    assert dense["throughput"]["mfu"] == pytest.approx(9e-4) and demix["throughput"]["counts"]["mfu"] == 0
    assert demix["final_loss"] == 6.0 and demix["final_val_loss"] == pytest.approx(6.0)
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert "| demix | demix | 2 | 20 | 3 | 300 | 150 | 0.03 | 0.03 | – | – |" in md
    assert "| dense | dense | 4 | 20 | 3 | 900 | 225 |" in md and "0.1 %" in md  # MFU 9e-4
    assert "`tokens_per_s` in metrics.jsonl is GLOBAL" in md
    # perplexity: every cell and interval as eval.json records them, one column per run and mode
    cols = [(c["run"], c["mode"]) for c in data["perplexity"]["columns"]]
    assert cols == [("demix", "naive"), ("demix", "uniform"), ("demix", "cached"), ("dense", "ppl")]
    for name in ("demix", "dense"):
        ev = json.loads((runs[name] / "model" / "eval" / "eval.json").read_text())
        for d in DOMAINS:
            for m in ev["modes"]:
                ppl, (lo, hi) = ev["domains"][d]["ppl"][m], ev["tables"]["per_domain_ci"][d][m]
                cell = data["perplexity"]["domains"][d]["cells"][f"{name}|{m}"]
                assert cell == {"ppl": ppl, "ci": [lo, hi]}
                assert f"{ppl:.2f} [{lo:.2f}–{hi:.2f}]" in md and f"{ppl:.2f} [{lo:.2f}–{hi:.2f}]" in page
            assert data["perplexity"]["domains"][d]["unigram"] == ev["domains"][d]["unigram"]["ppl"]
        avg = ev["tables"]["in_domain_average"][ev["modes"][0]]
        assert data["perplexity"]["averages"]["train"][f"{name}|{ev['modes'][0]}"]["ppl"] == avg
    assert "| domain | demix (naive) | demix (uniform) | demix (cached) | dense | unigram |" in md
    assert "### Novel domains" not in md  # the tiny corpus has none
    # the same content in HTML: tables and images beside it, no other file needed
    assert page.count("<table>") == md.count("\n|---") == 3 and '<img src="loss.png"' in page
    assert "<th>dense</th>" in page and "http" not in page.split("<body>")[1]
    # the exact commands: command.sh, the evaluation's settings, the report's own
    assert (runs["dense"] / "command.sh").read_text().splitlines()[-1] in md
    assert '# split: "test"' in md and "# max_blocks: 2" in md
    assert f"-m launcher.report {runs['demix']} {runs['dense']} --out {out}" in md
    # a second report may replace the first (its report.json is the manifest)
    rc, err = _render(capsys, str(runs["dense"]), "--out", str(out), "--eval", "none")
    assert rc == 0, err
    again = json.loads((out / "report.json").read_text())
    assert [r["label"] for r in again["runs"]] == ["dense"] and again["perplexity"]["columns"] == []


def test_eval_override_novel_domain_and_comparability_notes(runs, tmp_path, capsys):
    """--eval per run in order (a file; auto); a novel domain gets its own table; differing roles are noted."""
    from launcher.evaluation.report import summary_tables

    ev = json.loads((runs["dense"] / "model" / "eval" / "eval.json").read_text())
    ev["domains"]["finance"]["role"] = "novel"
    ev["tables"] = summary_tables(ev)
    novel = tmp_path / "novel_eval.json"
    novel.write_text(json.dumps(ev))
    out = tmp_path / "rep"
    rc, err = _render(
        capsys,
        str(runs["dense"]),
        str(runs["demix"]),
        "--eval",
        str(novel),
        "--eval",
        "auto",
        "--out",
        str(out),
    )
    assert rc == 0, err
    data = json.loads((out / "report.json").read_text())
    assert data["runs"][0]["eval"]["path"] == str(novel)
    assert data["runs"][1]["eval"]["path"] == str(runs["demix"] / "model" / "eval" / "eval.json")
    md = (out / "report.md").read_text()
    train_part, novel_part = md.split("### Novel domains")
    assert "| finance |" in novel_part.split("## Commands")[0] and "| finance |" not in train_part
    lo, hi = ev["tables"]["novel_average_ci"]["ppl"]  # the domain is placed by the first run's role
    assert (
        f"| average | {ev['tables']['novel_average']['ppl']:.2f} [{lo:.2f}–{hi:.2f}] | – | – | – |"
        in novel_part
    )
    assert any(
        "finance is a train domain of demix but a novel domain of another run" in n for n in data["notes"]
    )


def test_resumed_run_warmup_per_start_and_world_size_per_start():
    """Each start's first interval is left out; per GPU uses the world size of the start a record follows."""
    recs = [
        {"kind": "start", "world_size": 2},
        {"kind": "train", "step": 1, "tokens_per_s": 100.0},
        {"kind": "train", "step": 2, "tokens_per_s": 400.0},
        {"kind": "train", "step": 3, "tokens_per_s": 200.0},
        {"kind": "start", "world_size": 4},
        {"kind": "train", "step": 4, "tokens_per_s": 10.0},
        {"kind": "train", "step": 5, "tokens_per_s": 800.0},
    ]
    run = report.Run(Path("r"), {}, "config.yaml", recs)
    t = report.throughput(run)
    assert (t["records"], t["warmup_records_left_out"], t["world_size"]) == (3, 2, 4)
    # medians of (400,200,800), (200,100,200)
    assert t["tokens_per_s"] == 400.0 and t["tokens_per_s_per_gpu"] == 200.0
    one = report.throughput(report.Run(Path("r"), {}, "config.yaml", recs[:2]))
    assert one["warmup_included"] and one["records"] == 1 and one["tokens_per_s_per_gpu"] == 50.0


def test_without_matplotlib_the_report_says_so_and_has_no_png(runs, tmp_path, monkeypatch):
    report.write_report([runs["dense"]], tmp_path / "rep")
    assert (tmp_path / "rep" / "loss.png").is_file()
    monkeypatch.setattr(figures, "_pyplot", lambda: None)
    data = report.write_report([runs["dense"]], tmp_path / "rep")  # replaces the first report, PNGs and all
    assert not list((tmp_path / "rep").glob("*.png")) and data["files"] == []
    assert "matplotlib is not installed" in (tmp_path / "rep" / "report.md").read_text()


def test_a_report_beside_other_files_replaces_only_its_own(runs, tmp_path):
    """--out a folder that holds the runs: written into it, and written again, the runs stay untouched."""
    import shutil

    shutil.copytree(runs["dense"], tmp_path / "dense")
    before = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "dense").rglob("*"))
    for _ in range(2):
        report.write_report([tmp_path / "dense"], tmp_path)
    assert sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "dense").rglob("*")) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(("dense", *report.REPORT_FILES))


def _bad_inputs(runs: dict[str, Path], tmp: Path) -> list[tuple[list[str], str]]:
    no_metrics, no_config, no_train = tmp / "no_metrics", tmp / "no_config", tmp / "no_train"
    for d in (no_metrics, no_config, no_train):
        d.mkdir()
    (no_metrics / "config.yaml").write_text((runs["dense"] / "config.yaml").read_text())
    (no_config / "metrics.jsonl").write_text((runs["dense"] / "metrics.jsonl").read_text())
    (no_train / "config.yaml").write_text((runs["dense"] / "config.yaml").read_text())
    (no_train / "metrics.jsonl").write_text('{"kind": "start", "step": 0, "world_size": 1}\n')
    (tmp / "bad.json").write_text("{not json")
    (tmp / "other.json").write_text('{"format": "something-else"}')
    clash = tmp / "clash"
    clash.mkdir()
    (clash / "report.md").write_text("the user's own notes")
    dense = str(runs["dense"])
    # a user's file
    return [
        ([str(no_metrics)], f"{no_metrics} is not a run directory: metrics.jsonl is missing"),
        ([str(no_config)], f"{no_config} is not a run directory: config.yaml is missing"),
        ([str(tmp / "nowhere")], "nowhere is not a run directory: no such folder"),
        ([str(no_train)], "holds no training record (kind: train) yet"),
        (
            [dense, "--eval", str(tmp / "bad.json")],
            f"{tmp / 'bad.json'} (an evaluation of launcher.evaluation.evaluate) is not valid JSON",
        ),
        (
            [dense, "--eval", str(tmp / "other.json")],
            "is not an eval.json of launcher.evaluation.evaluate (format 'something-else'",
        ),
        (
            [dense, "--eval", str(tmp / "missing.json")],
            "missing.json (an evaluation of launcher.evaluation.evaluate): no such file",
        ),
        ([dense, str(runs["demix"]), "--eval", "auto"], "--eval given 1 time(s) for 2 run directories"),
        ([dense, dense], "is given twice"),
        (
            [dense, "--out", str(clash)],
            "already holds report.md that this tool did not write",
        ),
    ]


def test_bad_inputs_are_refused_clearly_and_write_nothing(runs, tmp_path, capsys):
    cases = _bad_inputs(runs, tmp_path)
    for argv, needle in cases:
        out = tmp_path / "out"
        if "--out" not in argv:
            argv = argv + ["--out", str(out)]
        before = sorted(p.name for p in tmp_path.iterdir())
        rc, err = _render(capsys, *argv)
        assert rc == 2 and err.startswith("error: ") and needle in err, (argv, err)
        assert sorted(p.name for p in tmp_path.iterdir()) == before, argv  # no report, no staging left
    assert (tmp_path / "clash" / "report.md").read_text() == "the user's own notes"


def test_the_command_line_entry_point(tmp_path):
    """`python -m launcher.report` ends through exit_process: status 2 and one error line for a bad input."""
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.report", str(tmp_path), "--out", str(tmp_path / "o")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        proc.returncode == 2
        and proc.stderr
        == f"error: {tmp_path} is not a run directory: metrics.jsonl is "
        "missing (the trainer's rank 0 writes it at the first log interval)\n"
    )
    assert not (tmp_path / "o").exists()
