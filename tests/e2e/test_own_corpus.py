"""A new user's own corpus, end to end, exactly the README's "Training your own models" path: folders of .txt per
domain -> data.ingest (one domain held out with --novel) -> data.prepare (GPT-2; a code-like domain, nothing
rewritten unannounced) -> launcher.launch on 2 ranks -> launcher.evaluation.evaluate (data and tokenizer from the
checkpoint) -> launcher.report. Nothing is read from the demo: every command runs in a folder of its own, and no
output names artifacts/demo."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data.blocks import SPLITS, open_indexed

REPO = Path(__file__).resolve().parents[2]

PROSE = [
    "The river rose after three days of rain and the ferry stopped running.",
    "Bread needs flour, water, salt and time; the rest is patience.",
    "She wrote to the council about the broken street lamps on Elm Road.",
    "A good map shows what you need and leaves out what you do not.",
]
CODE = [
    "@property\ndef name(self):\n    # maintainer: dev@example.org\n    return self._name\n",
    "my @items = sort { $a <=> $b } @numbers;\nprint join(', ', @items), \"\\n\";\n",
    "for i in range(10):\n    if i % 2:\n        print(i, end=' ')\n",
    "@dataclass\nclass Point:\n    x: float\n    y: float\n",
]
FORTUNES = [
    "You will meet a tall stranger who knows the answer.",
    "Today is a good day to finish what you started.",
    "A watched pot never boils, but an unwatched one boils over.",
    "Fortune favours the prepared corpus.",
]


def _source(root: Path) -> Path:
    """One folder of .txt files per domain, as a user would have them."""
    src = root / "my_text"
    for domain, base in (("prose", PROSE), ("code", CODE), ("fortunes", FORTUNES)):
        (src / domain).mkdir(parents=True)
        for i in range(40):
            text = "\n".join(base[(i + k) % len(base)] for k in range(1 + i % 4)) + f"\n# {domain} {i}\n"
            (src / domain / f"{i:03d}.txt").write_text(text)
    return src


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    p = subprocess.run(
        [sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert p.returncode == 0, f"{args[0]} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return p


@pytest.mark.long  # a whole pipeline through the launcher: make test-long
def test_own_corpus_ingest_prepare_launch_evaluate_report(tmp_path):
    work = tmp_path / "work"  # every command runs here: relative defaults cannot reach the repository's demo
    work.mkdir()
    src = _source(tmp_path)
    _run(["data.ingest", str(src), "--out", "corpus", "--novel", "fortunes"], work)
    p = _run(
        [
            "data.prepare",
            "--corpus",
            "corpus",
            "--out",
            "tokens",
            "--tokenizer",
            "gpt2",
            "--workers",
            "1",
            "--valid-fraction",
            "0.1",
            "--test-fraction",
            "0.2",
        ],
        work,
    )
    assert "anonymisation: off" in p.stdout
    m = json.loads((work / "tokens" / "gpt2" / "manifest.json").read_text())
    assert m["roles"] == {"code": "train", "fortunes": "novel", "prose": "train"}
    assert m["anonymise"]["counts"] == {}
    from data.tokenizer import load_tokenizer

    tok = load_tokenizer("gpt2")
    stored = []
    for s in SPLITS:
        if m["counts"]["code"][s]["documents"]:
            ds = open_indexed(work / "tokens" / "gpt2" / "code" / s)
            stored += [tok.decode(np.asarray(ds[i][1:]).tolist()) for i in range(len(ds))]
    written = [p.read_text() for p in sorted((src / "code").glob("*.txt"))]
    assert sum("my @items" in t for t in stored) == sum("my @items" in t for t in written) > 0
    assert not any("<USER>" in t or "<EMAIL>" in t for t in stored)

    sets = [
        "model.preset=tiny",
        "model.n_layers=2",
        "model.d_model=64",
        "model.n_heads=2",
        "model.seq_len=32",
        "model.ffn.kind=demix",
        "data.path=tokens",
        "data.tokenizer=gpt2",
        "data.mixture=by_domain",
        "train.steps=4",
        "train.micro_batch=2",
        "train.grad_accum=1",
        "train.eval_batches=1",
        "train.save_interval=4",
        "logging.log_interval=1",
        "logging.wandb_mode=disabled",
        "logging.progress_bar=false",
    ]
    overrides = [a for s in sets for a in ("--set", s)]
    dry = _run(["launcher.dryrun", "--world-size", "2", *overrides], work)
    assert "fortunes" in dry.stdout + dry.stderr and "code" in dry.stdout + dry.stderr  # the real domains
    _run(["launcher.launch", "--nproc", "2", "--run-dir", "runs/demix", *overrides], work)
    run = work / "runs" / "demix"
    assert (run / "model" / "meta.json").is_file() and (run / "metrics.jsonl").is_file()

    _run(
        ["launcher.evaluation.evaluate", "runs/demix/model", "--max-blocks", "2", "--cached-blocks", "2"],
        work,
    )
    ev = json.loads((run / "model" / "eval" / "eval.json").read_text())
    doms = ev["domains"]
    assert doms["fortunes"]["role"] == "novel" and doms["prose"]["role"] == "train"

    _run(["launcher.report", "runs/demix", "--out", "report"], work)
    report = (work / "report" / "report.md").read_text()
    assert (work / "report" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "fortunes" in report and "tokens/s" in report

    for path in [*run.rglob("*.yaml"), *run.rglob("*.json"), run / "command.sh", *work.glob("report/*.md")]:
        if path.is_file():
            assert "artifacts/demo" not in path.read_text(errors="replace"), path
