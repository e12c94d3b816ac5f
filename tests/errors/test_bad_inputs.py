"""A catalogue of bad inputs across every entry point: each gets one clear error, a non-zero exit, no traceback,
before any expensive work, and no file that existed before it changes.

Every case runs the CLI's real `main(argv)` in this process on real files (a prepared corpus, consolidated
checkpoints, training states). "Before any expensive work" is checked by what the case leaves behind: no output
is created (a refused run writes nothing), and the shared inputs (corpus, tokens, checkpoints) are unchanged
byte for byte. Loading never executes code: a malicious pickle in every file the project loads is refused.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.conftest import write_corpus

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- the world the cases run against -------------


def _run_overrides(tokens: Path, out: Path, **sets: str) -> list[str]:
    base = {
        "model.preset": "tiny",
        "model.n_layers": "2",
        "model.d_model": "32",
        "model.n_heads": "2",
        "model.seq_len": "32",
        "model.ffn.kind": "demix",
        "data.path": str(tokens),
        "data.tokenizer": "gpt2",
        "data.domains": "[cooking, sailing]",
        "data.mixture": "by_domain",
        "train.steps": "2",
        "logging.wandb_mode": "disabled",
        "logging.progress_bar": "false",
        "logging.out_dir": str(out),
    }
    base.update(sets)
    return [a for k, v in base.items() for a in ("--set", f"{k}={v}")]


def _config(tokens: Path, out: Path, **sets: str):
    from launcher.config import load_run_config

    args = _run_overrides(tokens, out, **sets)
    return load_run_config(None, args[1::2])


def _fake_state(run: Path, step: int, plan, params: tuple[str, ...] = ("wte.weight",)) -> Path:
    """A training state as `save_training_state` lays it out (meta.json with the plan's layout and file sizes),
    with tiny tensors: enough for everything that checks a state before training (launch never reads tensors)."""
    from launcher.state import layout_identity
    from launcher.state_discovery import TRAINING_FORMAT

    d = run / "checkpoints" / f"step_{step:08d}"
    for name in params:
        (d / "zero" / name).mkdir(parents=True)
        torch.save({"param": torch.zeros(2), "cat_dim": 0}, d / "zero" / name / "fp32.pt")
    torch.save({"step": step}, d / "trainer.pt")
    files = {str(p.relative_to(d)): p.stat().st_size for p in sorted(d.rglob("*")) if p.is_file()}
    (d / "meta.json").write_text(
        json.dumps(
            {
                "format": TRAINING_FORMAT,
                "step": step,
                "layout": layout_identity(plan),
                "params": list(params),
                "files": files,
                "config": {},
            }
        )
    )
    (run / "checkpoints" / "latest").write_text(d.name + "\n")
    return d


@pytest.fixture(scope="module")
def world(tiny_tokens, tmp_path_factory) -> SimpleNamespace:
    from data.catalog import load_catalog
    from data.prepare import prepare_corpus
    from launcher.checkpoint import save_consolidated
    from launcher.plan import make_plan
    from model.gpt import GPT

    root = tmp_path_factory.mktemp("bad_inputs")
    corpus = write_corpus(root, docs_per_domain=30)
    cat = load_catalog(tiny_tokens, "gpt2", ["cooking", "sailing"])
    extra = {"tokenizer": "gpt2", "vocab_size": cat.vocab_size, "tokenizer_sha256": cat.tokenizer_sha256}
    plan = make_plan(_config(tiny_tokens, root / "unused"), 2)
    cfg = plan.cfg
    ckpt = save_consolidated(
        root / "demix", GPT(cfg.model, init_seed=0).state_dict(), cfg, ["cooking", "sailing"], 3, extra=extra
    )
    dense_cfg = make_plan(
        _config(tiny_tokens, root / "unused", **{"model.ffn.kind": "dense", "data.mixture": "natural"}), 2
    ).cfg
    dense = save_consolidated(
        root / "dense", GPT(dense_cfg.model, init_seed=0).state_dict(), dense_cfg, [], 3, extra=extra
    )
    sp = root / "sp_tokens"  # the same corpus under another tokenizer (a real, trained sentencepiece model)
    prepare_corpus(
        corpus,
        sp,
        tokenizer="sentencepiece",
        sp_vocab_size=400,
        workers=1,
        progress=False,
        valid_fraction=0.15,
        test_fraction=0.15,
    )
    return SimpleNamespace(
        root=root, corpus=corpus, tokens=tiny_tokens, ckpt=ckpt, dense=dense, sp=sp, plan=plan, cfg=cfg
    )


def _snapshot(*roots: Path) -> dict[str, str]:
    out = {}
    for root in roots:
        for p in sorted(Path(root).rglob("*")):
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "<dir>"
    return out


def _call(module: str, argv: list[str], capsys) -> tuple[int, str]:
    main = importlib.import_module(module).main
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's usage errors
        rc = e.code
    return rc, capsys.readouterr().err


# ---------------------------------------------------------------- the catalogue ---------------------------------

Argv = Callable[[SimpleNamespace, Path], list[str]]


@dataclass
class Case:
    name: str
    module: str
    argv: Argv
    expect: str  # a substring of the error message
    setup: Callable[[SimpleNamespace, Path], None] | None = None
    code: int = 2
    writes: bool = False  # a handled case that goes on and writes its outputs (a warning, exit 0)
    # paths (relative to the case directory) that must not exist afterwards
    absent: tuple[str, ...] = ("out",)


def _jsonl(path: Path, records: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(
        b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records)
    )


def _doc(domain, text="some words of text", **kw):
    return {"id": kw.get("id", "x"), "domain": domain, "text": text}


def _copytree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_json(path: Path, fn) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def _truncate(path: Path, keep: int = 20) -> None:
    path.write_bytes(path.read_bytes()[:keep])


INGEST, PREPARE, LAUNCH, EVAL = (
    "data.ingest",
    "data.prepare",
    "launcher.launch",
    "launcher.evaluation.evaluate",
)
EXPERTS, HF, Z2F, GEN, GATE = (
    "launcher.modular.experts",
    "launcher.modular.hf_export",
    "launcher.zero_to_fp32",
    "launcher.evaluation.generate",
    "launcher.evaluation.gating",
)
CLUSTER, DRYRUN, FLOPS = "data.cluster_domains", "launcher.dryrun", "launcher.flops"


def _ingest(src: str, *more: str) -> Argv:
    return lambda w, d: [str(d / src), "--out", str(d / "out"), *more]


def _launch(*more: str, **sets: str) -> Argv:
    return lambda w, d: [
        "--nproc",
        "2",
        "--dry-run",
        "--run-dir",
        str(d / "run"),
        *_run_overrides(w.tokens, d / "run", **sets),
        *more,
    ]


def _state_for(**sets: str):
    """Setup: a training state in d/run written by a run with these settings (default: the launch's own)."""

    def setup(w, d):
        from launcher.plan import make_plan

        cfg = _config(w.tokens, d / "run", **sets)
        _fake_state(d / "run", 2, make_plan(cfg, 2))

    return setup


def _drop_sums(ckpt: Path) -> None:
    meta = json.loads((ckpt / "meta.json").read_text())
    meta.pop("sha256", None)
    (ckpt / "meta.json").write_text(json.dumps(meta))


def _bad_ckpt(edit) -> Callable:
    def setup(w, d):
        edit(_copytree(w.ckpt, d / "ckpt"))

    return setup


def _other_tokenizer_tokens(w, d):
    """d/tokens/gpt2: the sentencepiece-made tokens presented under the name the checkpoint expects."""
    (d / "tokens").mkdir()
    _copytree(w.sp / "sentencepiece", d / "tokens" / "gpt2")


CASES: list[Case] = [
    # ---- data.ingest
    Case("ingest-missing-source", INGEST, _ingest("nope.jsonl"), "no such file or directory"),
    Case(
        "ingest-all-lines-bad-fail",
        INGEST,
        _ingest("c.jsonl", "--on-error", "fail"),
        "c.jsonl:2: invalid_json",
        setup=lambda w, d: _jsonl(d / "c.jsonl", [_doc("news"), b"{not json"]),
    ),
    Case(
        "ingest-domain-escapes-out",
        INGEST,
        _ingest("c.jsonl", "--on-error", "fail"),
        "invalid_domain_name",
        setup=lambda w, d: _jsonl(d / "c.jsonl", [_doc("../x")]),
    ),
    Case(
        "ingest-domain-with-separator",
        INGEST,
        _ingest("c.jsonl", "--on-error", "fail"),
        "c.jsonl:1: invalid_domain_name",
        setup=lambda w, d: _jsonl(d / "c.jsonl", [_doc("a/b")]),
    ),
    Case(
        "ingest-domains-differ-in-case",
        INGEST,
        _ingest("c.jsonl", "--on-error", "fail"),
        "c.jsonl:2: domain_case_clash",
        setup=lambda w, d: _jsonl(d / "c.jsonl", [_doc("news"), _doc("News")]),
    ),
    Case(
        "ingest-non-utf8-line",
        INGEST,
        _ingest("c.jsonl", "--on-error", "fail"),
        "c.jsonl:1: non_utf8",
        setup=lambda w, d: _jsonl(d / "c.jsonl", [b'{"domain": "a", "text": "caf\xe9"}']),
    ),
    Case(
        "ingest-missing-text-field",
        INGEST,
        _ingest("c.jsonl", "--on-error", "fail", "--text-field", "body"),
        "missing_text",
        setup=lambda w, d: _jsonl(d / "c.jsonl", [_doc("news")]),
    ),
    Case(
        "ingest-empty-domain-folder",
        INGEST,
        _ingest("src", "--on-error", "fail"),
        "empty_domain",
        setup=lambda w, d: [
            (d / "src" / "news").mkdir(parents=True),
            (d / "src" / "empty").mkdir(),
            (d / "src" / "news" / "a.txt").write_text("hello world"),
        ],
    ),
    Case(
        "ingest-domain-folder-bad-name",
        INGEST,
        _ingest("src", "--on-error", "fail"),
        "invalid_domain_name",
        setup=lambda w, d: [
            (d / "src" / "my news").mkdir(parents=True),
            (d / "src" / "my news" / "a.txt").write_text("x y"),
        ],
    ),
    Case(
        "ingest-out-is-a-file",
        INGEST,
        _ingest("c.jsonl"),
        "is a file, not a directory",
        absent=(),
        setup=lambda w, d: [_jsonl(d / "c.jsonl", [_doc("news")]), (d / "out").write_text("mine")],
    ),
    Case(
        "ingest-out-foreign-manifest",
        INGEST,
        _ingest("c.jsonl"),
        "did not write",
        absent=(),
        setup=lambda w, d: [
            _jsonl(d / "c.jsonl", [_doc("news")]),
            (d / "out").mkdir(),
            (d / "out" / "manifest.json").write_text('{"mine": 1}'),
        ],
    ),
    Case(
        "ingest-out-foreign-jsonl",
        INGEST,
        _ingest("c.jsonl"),
        "already holds news.jsonl",
        absent=(),
        setup=lambda w, d: [
            _jsonl(d / "c.jsonl", [_doc("news")]),
            _jsonl(d / "out" / "news.jsonl", [{"mine": 1}]),
        ],
    ),
    Case(
        "ingest-out-is-the-source",
        INGEST,
        lambda w, d: [str(d / "src"), "--out", str(d / "src")],
        "would overwrite the input",
        absent=(),
        setup=lambda w, d: _jsonl(d / "src" / "news.jsonl", [_doc("news")]),
    ),
    Case(
        "ingest-bad-on-error",
        INGEST,
        _ingest("c.jsonl", "--on-error", "ignore"),
        "invalid choice",
        setup=lambda w, d: _jsonl(d / "c.jsonl", [_doc("news")]),
    ),
    # ---- data.prepare
    Case(
        "prepare-missing-corpus",
        PREPARE,
        lambda w, d: ["--corpus", str(d / "nope"), "--out", str(d / "out")],
        "no <domain>.jsonl files",
    ),
    Case(
        "prepare-unknown-domain",
        PREPARE,
        lambda w, d: ["--corpus", str(w.corpus), "--out", str(d / "out"), "--domains", "cooking,knitting"],
        "no JSONL for domains ['knitting']",
    ),
    Case(
        "prepare-fractions-sum-over-one",
        PREPARE,
        lambda w, d: [
            "--corpus",
            str(w.corpus),
            "--out",
            str(d / "out"),
            "--valid-fraction",
            "0.6",
            "--test-fraction",
            "0.5",
        ],
        "sum < 1",
    ),
    Case(
        "prepare-anonymise-off-typo",
        PREPARE,
        lambda w, d: [
            "--corpus",
            str(w.corpus),
            "--out",
            str(d / "out"),
            "--anonymise",
            "--anonymise-off",
            "cookng",
        ],
        "unknown domains",
    ),
    Case(
        "prepare-bad-tokenizer",
        PREPARE,
        lambda w, d: ["--corpus", str(w.corpus), "--out", str(d / "out"), "--tokenizer", "bert"],
        "invalid choice",
    ),
    Case(
        "prepare-out-foreign-manifest",
        PREPARE,
        lambda w, d: ["--corpus", str(w.corpus), "--out", str(d / "out")],
        "did not write",
        absent=(),
        setup=lambda w, d: [
            (d / "out" / "gpt2").mkdir(parents=True),
            (d / "out" / "gpt2" / "manifest.json").write_text("{}"),
        ],
    ),
    Case(
        "prepare-out-foreign-domain-folder",
        PREPARE,
        lambda w, d: ["--corpus", str(w.corpus), "--out", str(d / "out")],
        "already holds cooking",
        absent=(),
        setup=lambda w, d: [
            (d / "out" / "gpt2" / "cooking").mkdir(parents=True),
            (d / "out" / "gpt2" / "cooking" / "notes.txt").write_text("mine"),
        ],
    ),
    Case(
        "prepare-bad-lines-fail",
        PREPARE,
        lambda w, d: ["--corpus", str(d / "c"), "--out", str(d / "out"), "--on-error", "fail"],
        "c/news.jsonl:2",
        setup=lambda w, d: _jsonl(d / "c" / "news.jsonl", [_doc("news"), {"domain": "news"}]),
    ),
    Case(
        "prepare-broken-corpus-manifest",
        PREPARE,
        lambda w, d: ["--corpus", str(d / "c"), "--out", str(d / "out")],
        "is not valid JSON",
        setup=lambda w, d: [
            _jsonl(d / "c" / "news.jsonl", [_doc("news")]),
            (d / "c" / "manifest.json").write_text("{oops"),
        ],
    ),
    # ---- launcher.launch (validation before anything starts: --dry-run so a case that passed would start nothing)
    Case(
        "launch-missing-config",
        LAUNCH,
        lambda w, d: ["--config", str(d / "nope.yaml"), "--dry-run"],
        "nope.yaml",
        absent=("run",),
    ),
    Case(
        "launch-wrong-type",
        LAUNCH,
        _launch(**{"model.n_heads": "two"}),
        "model.n_heads='two': expected an integer",
        absent=("run",),
    ),
    Case("launch-nan-lr", LAUNCH, _launch(**{"train.lr": "nan"}), "train.lr", absent=("run",)),
    Case(
        "launch-unknown-key",
        LAUNCH,
        _launch(**{"train.learning_rate": "0.1"}),
        "unknown key",
        absent=("run",),
    ),
    Case(
        "launch-missing-data",
        LAUNCH,
        lambda w, d: _launch(**{"data.path": str(d / "none")})(w, d),
        "prepare the data first",
        absent=("run",),
    ),
    Case(
        "launch-unknown-domain",
        LAUNCH,
        _launch(**{"data.domains": "[cooking, knitting]"}),
        "['knitting'] are not in",
        absent=("run",),
    ),
    Case(
        "launch-impossible-layout",
        LAUNCH,
        lambda w, d: ["--nproc", "3", *_launch(**{"parallel.tensor_parallel": "2"})(w, d)[2:]],
        "not divisible by tensor_parallel=2",
        absent=("run",),
    ),
    Case(
        "launch-zero-processes",
        LAUNCH,
        lambda w, d: ["--nproc", "0", *_launch()(w, d)[2:]],
        "argument --nproc: '0' is not an integer >= 1",
        absent=("run",),
    ),
    Case(
        "launch-no-ssh-without-hostfile",
        LAUNCH,
        _launch("--no-ssh", "--node-rank", "0"),
        "--hostfile",
        absent=("run",),
    ),
    Case(
        "launch-resume-other-n-heads",
        LAUNCH,
        _launch(**{"model.n_heads": "4"}),
        "written for another model",
        absent=("run/config.yaml",),
        setup=_state_for(),
    ),
    Case(
        "launch-resume-other-domains",
        LAUNCH,
        _launch(**{"data.domains": "[cooking, finance]"}),
        "domains",
        absent=("run/config.yaml",),
        setup=_state_for(),
    ),
    Case(
        "launch-resume-all-states-damaged",
        LAUNCH,
        _launch(),
        "no intact training state",
        absent=("run/config.yaml",),
        setup=lambda w, d: [
            _state_for()(w, d),
            _truncate(d / "run/checkpoints/step_00000002/zero/wte.weight/fp32.pt"),
        ],
    ),
    Case(
        "launch-resume-truncated-newest-falls-back",
        LAUNCH,
        _launch(),
        "step_00000004 is damaged",
        code=0,
        writes=True,
        absent=(),
        setup=lambda w, d: [
            _state_for()(w, d),
            _fake_state(d / "run", 4, w.plan),
            _truncate(d / "run/checkpoints/step_00000004/trainer.pt"),
        ],
    ),
    Case(
        "launch-resume-pointer-escapes",
        LAUNCH,
        _launch(),
        "not an intact training state here",
        code=0,
        writes=True,
        absent=(),
        setup=lambda w, d: [_state_for()(w, d), (d / "run/checkpoints/latest").write_text("../../../etc\n")],
    ),
    Case(
        "launch-resume-old-format",
        LAUNCH,
        lambda w, d: _launch("--resume", str(d / "old"))(w, d),
        "older format",
        absent=("run",),
        setup=lambda w, d: [(d / "old").mkdir(), (d / "old" / "meta.json").write_text('{"format": 1}')],
    ),
    Case(
        "launch-resume-missing-path",
        LAUNCH,
        lambda w, d: _launch("--resume", str(d / "missing"))(w, d),
        "is not a training state",
        absent=("run",),
    ),
    Case(
        "launch-init-from-missing",
        LAUNCH,
        lambda w, d: _launch(**{"train.init_from": str(d / "nope")})(w, d),
        "not a consolidated checkpoint",
        absent=("run",),
    ),
    Case(
        "launch-init-from-other-tokenizer",
        LAUNCH,
        lambda w, d: _launch(**{"train.init_from": str(d / "ckpt")})(w, d),
        "another tokenizer",
        absent=("run",),
        setup=_bad_ckpt(lambda c: _edit_json(c / "meta.json", lambda m: m.update(tokenizer_sha256="f" * 64))),
    ),
    Case(
        "launch-tokens-manifest-broken",
        LAUNCH,
        lambda w, d: _launch(**{"data.path": str(d / "tokens")})(w, d),
        "(token manifest) is not valid JSON",
        absent=("run",),
        setup=lambda w, d: [
            (d / "tokens" / "gpt2").mkdir(parents=True),
            (d / "tokens" / "gpt2" / "manifest.json").write_text('{"domains": ['),
        ],
    ),
    Case(
        "launch-roles-lost-with-relative-corpus",
        LAUNCH,
        lambda w, d: _launch(**{"data.path": str(d / "tokens"), "data.domains": "null"})(w, d),
        "train/novel roles",
        absent=("run",),
        setup=lambda w, d: [
            _copytree(w.tokens, d / "tokens"),
            _edit_json(
                d / "tokens/gpt2/manifest.json",
                lambda m: [m.pop("roles"), m["corpus"].update(dir="relative/corpus", manifest_sha256="ab")],
            ),
        ],
    ),
    # ---- launcher.evaluation.evaluate
    Case(
        "eval-missing-checkpoint",
        EVAL,
        lambda w, d: [str(d / "nope"), "--data", str(w.tokens)],
        "is not a consolidated checkpoint",
    ),
    Case(
        "eval-checkpoint-is-a-file",
        EVAL,
        lambda w, d: [str(d / "f"), "--data", str(w.tokens)],
        "is not a consolidated checkpoint",
        setup=lambda w, d: (d / "f").write_text("x"),
    ),
    Case(
        "eval-missing-data",
        EVAL,
        lambda w, d: [str(w.ckpt), "--data", str(d / "none"), "--out", str(d / "out")],
        "prepare the data first",
    ),
    Case(
        "eval-data-of-another-tokenizer",
        EVAL,
        lambda w, d: [str(w.ckpt), "--data", str(d / "tokens"), "--out", str(d / "out")],
        "made by tokenizer",
        setup=_other_tokenizer_tokens,
    ),
    Case(
        "eval-meta-not-json",
        EVAL,
        lambda w, d: [str(d / "ckpt"), "--data", str(w.tokens), "--out", str(d / "out")],
        "meta.json (consolidated checkpoint metadata) is not valid JSON",
        setup=_bad_ckpt(lambda c: (c / "meta.json").write_text("{")),
    ),
    Case(
        "eval-missing-expert-shard",
        EVAL,
        lambda w, d: [str(d / "ckpt"), "--data", str(w.tokens), "--out", str(d / "out")],
        "expert_0001.pt",
        setup=_bad_ckpt(lambda c: (c / "experts" / "expert_0001.pt").unlink()),
    ),
    Case(
        "eval-truncated-model",
        EVAL,
        lambda w, d: [str(d / "ckpt"), "--data", str(w.tokens), "--out", str(d / "out")],
        "does not match the sha256",
        setup=_bad_ckpt(lambda c: _truncate(c / "model.pt", 100)),
    ),
    Case(
        "eval-truncated-model-without-checksums",
        EVAL,  # a checkpoint written before shards had checksums
        lambda w, d: [str(d / "ckpt"), "--data", str(w.tokens), "--out", str(d / "out")],
        "cannot be read as weights",
        setup=_bad_ckpt(lambda c: [_truncate(c / "model.pt", 100), _drop_sums(c)]),
    ),
    Case("eval-unknown-mode", EVAL, lambda w, d: [str(w.ckpt), "--modes", "naive,best"], "unknown modes"),
    # ---- launcher.modular.experts
    Case(
        "experts-remove-over-input",
        EXPERTS,
        lambda w, d: ["remove", str(d / "ckpt"), "--experts", "cooking", "--out", str(d / "ckpt")],
        "is the input checkpoint",
        setup=_bad_ckpt(lambda c: None),
    ),
    Case(
        "experts-remove-over-foreign-dir",
        EXPERTS,
        lambda w, d: ["remove", str(w.ckpt), "--experts", "cooking", "--out", str(d / "out")],
        "not a consolidated checkpoint; it is left alone",
        absent=(),
        setup=lambda w, d: [(d / "out").mkdir(), (d / "out" / "thesis.tex").write_text("mine")],
    ),
    Case(
        "experts-remove-unknown",
        EXPERTS,
        lambda w, d: ["remove", str(w.ckpt), "--experts", "knitting", "--out", str(d / "out")],
        "no expert named ['knitting']",
    ),
    Case(
        "experts-remove-all",
        EXPERTS,
        lambda w, d: ["remove", str(w.ckpt), "--experts", "cooking,sailing", "--out", str(d / "out")],
        "would leave no expert",
    ),
    Case(
        "experts-remove-from-dense",
        EXPERTS,
        lambda w, d: ["remove", str(w.dense), "--experts", "cooking", "--out", str(d / "out")],
        "needs a DEMix checkpoint",
    ),
    Case(
        "experts-add-domain-not-in-data",
        EXPERTS,
        lambda w, d: ["add", str(w.ckpt), "--domain", "knitting", "--out", str(d / "out")],
        "'knitting' is not in",
    ),
    Case(
        "experts-add-existing-domain",
        EXPERTS,
        lambda w, d: ["add", str(w.ckpt), "--domain", "cooking", "--out", str(d / "out")],
        "already has an expert",
    ),
    Case(
        "experts-add-unknown-source",
        EXPERTS,
        lambda w, d: [
            "add",
            str(w.ckpt),
            "--domain",
            "finance",
            "--source",
            "knitting",
            "--out",
            str(d / "out"),
        ],
        "--source 'knitting'",
    ),
    Case(
        "experts-add-other-tokenizer-data",
        EXPERTS,
        lambda w, d: [
            "add",
            str(w.ckpt),
            "--domain",
            "finance",
            "--data",
            str(d / "tokens"),
            "--out",
            str(d / "out"),
        ],
        "made by tokenizer",
        setup=_other_tokenizer_tokens,
    ),
    Case(
        "experts-report-missing-args",
        EXPERTS,
        lambda w, d: ["report", "adapt", "--out", str(d / "out")],
        "report adapt needs",
    ),
    # ---- launcher.modular.hf_export
    Case(
        "hf-export-out-foreign",
        HF,
        lambda w, d: [str(w.ckpt), "--domain", "cooking", "--out", str(d / "out")],
        "already holds config.json",
        absent=(),
        setup=lambda w, d: [(d / "out").mkdir(), (d / "out" / "config.json").write_text("{}")],
    ),
    Case(
        "hf-export-out-is-input",
        HF,
        lambda w, d: [str(d / "ckpt"), "--domain", "cooking", "--out", str(d / "ckpt")],
        "would overwrite the input",
        absent=(),
        setup=_bad_ckpt(lambda c: None),
    ),
    Case(
        "hf-export-demix-needs-domain",
        HF,
        lambda w, d: [str(w.ckpt), "--out", str(d / "out")],
        "needs --domain",
    ),
    Case(
        "hf-export-unknown-domain",
        HF,
        lambda w, d: [str(w.ckpt), "--domain", "knitting", "--out", str(d / "out")],
        "no expert for 'knitting'",
    ),
    Case(
        "hf-export-bad-weights",
        HF,
        lambda w, d: [str(w.ckpt), "--merge-weights", "cooking=x", "--out", str(d / "out")],
        "is not NAME=WEIGHT",
    ),
    Case(
        "hf-export-missing-prior",
        HF,
        lambda w, d: [str(w.ckpt), "--merge-prior", str(d / "p.json"), "--out", str(d / "out")],
        "p.json",
    ),
    # ---- launcher.zero_to_fp32
    Case(
        "z2f-out-exists",
        Z2F,
        lambda w, d: [str(d / "run"), "--out", str(d / "run")],
        "exists",
        absent=(),
        setup=_state_for(),
    ),
    Case("z2f-not-a-state", Z2F, lambda w, d: [str(d), "--out", str(d / "out")], "neither a training state"),
    Case(
        "z2f-truncated-shard",
        Z2F,
        lambda w, d: [str(d / "run/checkpoints/step_00000002"), "--out", str(d / "out")],
        "is damaged",
        setup=lambda w, d: [
            _state_for()(w, d),
            _truncate(d / "run/checkpoints/step_00000002/zero/wte.weight/fp32.pt"),
        ],
    ),
    # ---- generation, gating, clustering, dry run, FLOPs
    Case(
        "generate-unknown-expert",
        GEN,
        lambda w, d: [str(w.ckpt), "--expert", "knitting", "--data", str(w.tokens)],
        "--expert 'knitting'",
    ),
    Case(
        "gating-other-tokenizer-data",
        GATE,
        lambda w, d: [str(w.ckpt), "--data", str(d / "tokens"), "--out", str(d / "out")],
        "made by tokenizer",
        setup=_other_tokenizer_tokens,
    ),
    Case(
        "cluster-missing-corpus",
        CLUSTER,
        lambda w, d: ["--corpus", str(d / "nope"), "--k", "2", "--out", str(d / "out")],
        "no JSONL",
    ),
    Case(
        "cluster-out-is-corpus",
        CLUSTER,
        lambda w, d: ["--corpus", str(d / "c"), "--k", "2", "--out", str(d / "c")],
        "would overwrite the input",
        absent=(),
        setup=lambda w, d: _jsonl(d / "c" / "news.jsonl", [_doc("news")]),
    ),
    Case(
        "dryrun-impossible-world",
        DRYRUN,
        lambda w, d: [
            "--world-size",
            "3",
            "--out",
            str(d / "out" / "x.json"),
            *_run_overrides(w.tokens, d / "run", **{"parallel.tensor_parallel": "2"}),
        ],
        "not divisible by tensor_parallel=2",
    ),
    Case("flops-missing-config", FLOPS, lambda w, d: ["--config", str(d / "nosuch.yaml")], "no such file"),
    Case(
        "flops-zero-gpus",
        FLOPS,
        lambda w, d: ["--config", "tiny", "--gpus", "0"],
        "argument --gpus: '0' is not an integer >= 1",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_one_clear_error_and_changes_nothing(case: Case, world, tmp_path, capsys, monkeypatch):
    d = tmp_path
    if case.setup:
        case.setup(world, d)
    argv = case.argv(world, d)
    before = _snapshot(d, world.root, world.tokens)
    monkeypatch.chdir(d)
    rc, err = _call(case.module, argv, capsys)
    assert rc == case.code, f"exit {rc}, expected {case.code}; stderr:\n{err}"
    assert case.expect in err, f"expected {case.expect!r} in stderr:\n{err}"
    assert "Traceback" not in err
    if case.code:
        assert "error" in err, err
    after = _snapshot(d, world.root, world.tokens)
    changed = [p for p, h in before.items() if after.get(p) != h]
    assert not changed, f"pre-existing files changed or vanished: {changed[:5]}"
    if not case.writes:
        created = sorted(set(after) - set(before))
        assert not created, f"a refused command wrote {created[:5]}"
    for rel in case.absent:
        assert not (d / rel).exists(), f"{rel} was created"


def test_the_catalogue_covers_sixty_cases_and_every_entry_point():
    assert len(CASES) >= 60
    assert len({c.name for c in CASES}) == len(CASES)
    assert {c.module for c in CASES} >= {
        INGEST,
        PREPARE,
        LAUNCH,
        EVAL,
        EXPERTS,
        HF,
        Z2F,
        GEN,
        GATE,
        CLUSTER,
        DRYRUN,
    }


def test_debug_shows_the_traceback(world, tmp_path, capsys):
    from launcher.evaluation.evaluate import main

    with pytest.raises(Exception, match="not a consolidated checkpoint"):
        main([str(tmp_path / "nope"), "--debug"])


# ---------------------------------------------------------------- loading never executes code --------------------


class _Payload:
    """Pickles to a call of os.system: a loader that unpickles arbitrary objects runs it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant(path: Path, marker: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"param": _Payload(marker)}, path)


LOADERS = [
    "consolidated-model",
    "consolidated-expert-shard",
    "state-fp32",
    "state-trainer",
    "state-rng",
    "init-from-weights",
]


@pytest.mark.parametrize("which", LOADERS)
def test_a_malicious_pickle_is_refused_by_every_loader(which, world, tmp_path):
    from launcher.checkpoint import CheckpointError, load_consolidated
    from launcher.state import _restore_rng, load_init_weights, load_training_state
    from launcher.zero_to_fp32 import convert

    marker = tmp_path / "pwned"
    ckpt = _copytree(world.ckpt, tmp_path / "ckpt")
    # whoever can plant a file can edit meta.json: the weights-only load must refuse it alone
    _drop_sums(ckpt)
    state = _fake_state(tmp_path / "run", 2, world.plan)
    if which == "consolidated-model":
        _plant(ckpt / "model.pt", marker)
        call = lambda: load_consolidated(ckpt)  # noqa: E731
    elif which == "consolidated-expert-shard":
        _plant(ckpt / "experts" / "expert_0001.pt", marker)
        call = lambda: load_consolidated(ckpt)  # noqa: E731
    elif which == "state-fp32":
        _plant(state / "zero" / "wte.weight" / "fp32.pt", marker)
        _edit_json(
            state / "meta.json",
            lambda m: m["files"].update(
                {"zero/wte.weight/fp32.pt": (state / "zero/wte.weight/fp32.pt").stat().st_size}
            ),
        )
        call = lambda: convert(state, tmp_path / "out")  # noqa: E731
    elif which == "state-trainer":
        _plant(state / "trainer.pt", marker)
        call = lambda: load_training_state(state, None, world.plan, 0)  # noqa: E731  (refused before the engine is used)
    elif which == "state-rng":
        _plant(state / "rng" / "rank00000.pt", marker)
        meta = {"layout": {"world_size": world.plan.topo.world_size}}
        call = lambda: _restore_rng(state, meta, world.plan, 0, 2)  # noqa: E731
    else:
        from model.gpt import GPT

        _plant(ckpt / "model.pt", marker)
        cfg = _config(world.tokens, tmp_path / "r", **{"train.init_from": str(ckpt)})
        call = lambda: load_init_weights(GPT(cfg.model, init_seed=0), cfg)  # noqa: E731
    with pytest.raises(CheckpointError, match="nothing in it was executed"):
        call()
    assert not marker.exists(), "the pickle's code ran"


def test_the_payload_would_run_under_a_plain_load(tmp_path):
    """The control: the same file does run code when unpickled without weights_only (so the tests above can fail)."""
    marker = tmp_path / "pwned"
    _plant(tmp_path / "x.pt", marker)
    torch.load(tmp_path / "x.pt", weights_only=False)
    assert marker.exists()


def test_every_torch_load_in_the_project_is_the_weights_only_one():
    """One chokepoint: `launcher.checkpoint.load_weights_only` is the only caller of torch.load, and passes
    weights_only=True; no pickle.load / np.load with pickles anywhere."""
    hits = []
    for pkg in ("data", "model", "parallel", "launcher", "benchmarks", "experiments", "scripts"):
        for path in (REPO / pkg).rglob("*.py"):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#")[0]
                if "torch.load(" in code or "pickle.load" in code or "allow_pickle=True" in code:
                    hits.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert hits == [
        'launcher/checkpoint.py:{}: return torch.load(path, map_location="cpu", weights_only=True)'.format(
            next(
                i
                for i, l in enumerate((REPO / "launcher/checkpoint.py").read_text().splitlines(), 1)
                if "torch.load(" in l.split("#")[0]
            )
        )
    ], hits


def test_a_clusterer_with_pickled_arrays_is_refused(tmp_path):
    from data.cluster_domains import FORMAT, Clusterer

    marker = tmp_path / "pwned"
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "meta.json").write_text(json.dumps({"format": FORMAT, "options": {}, "vocabulary": {}}))
    obj = np.empty(1, dtype=object)
    obj[0] = _Payload(marker)
    np.savez(tmp_path / "c" / "arrays.npz", idf_V=obj, components_SV=obj, centres_KS=obj)
    with pytest.raises(ValueError, match="allow_pickle"):
        Clusterer.load(tmp_path / "c")
    assert not marker.exists()


def test_a_malicious_latest_pointer_never_becomes_a_path(world, tmp_path, capsys):
    from launcher.state_discovery import latest_checkpoint

    state = _fake_state(tmp_path / "run", 2, world.plan)
    for bad in ("../../../../etc/passwd", "/etc", "step_00000002/../../x", "step_2", "\x00"):
        (tmp_path / "run" / "checkpoints" / "latest").write_text(bad)
        assert latest_checkpoint(tmp_path / "run") == state
        assert "not an intact training state here" in capsys.readouterr().err


def test_relative_paths_are_resolved_before_the_ranks_start(world, tmp_path, monkeypatch, capsys):
    """Launching from another directory with relative --config, --run-dir and data.path: the command the ranks
    run (in the repository root) names the same files as absolute paths."""
    from launcher.launch import main

    (tmp_path / "cfg.yaml").write_text("train:\n  steps: 2\n")
    os.symlink(world.tokens, tmp_path / "toks")
    monkeypatch.chdir(tmp_path)
    args = [
        "--config",
        "cfg.yaml",
        "--run-dir",
        "myrun",
        "--nproc",
        "2",
        "--dry-run",
        *_run_overrides(Path("toks"), Path("myrun")),
    ]
    assert main(args) == 0, capsys.readouterr().err
    script = (tmp_path / "myrun" / "command.sh").read_text()
    assert f"--config {tmp_path / 'cfg.yaml'}" in script and f"--run-dir {tmp_path / 'myrun'}" in script
    assert f'data.path="{tmp_path / "toks"}"' in script, script
