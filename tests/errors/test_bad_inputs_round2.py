"""The second catalogue of bad inputs: code execution through host names and task folders, silent
nonsense from numeric options, tracebacks and hangs from config text and wrongly shaped JSON.

Each case runs the CLI's real `main(argv)` in this process, as tests/errors/test_bad_inputs.py does, and must end in one
clear error (the expected text, exit status 2, "error" and no traceback on stderr) with nothing in the case's
folder or the shared inputs created or changed, and no code run: payloads create the file PWNED in the case's
folder, which must never appear. Each class is fixed at one shared rule, and the mutation tests disable that rule
(monkeypatched to accept everything, wherever it was imported; class 3's back to the writers' old behaviour: no
cleanup, no translation) to show that the class's cases then fail:

* class 1 (hosts)       data/argtypes.py `host_problem` (hostfiles, --include/--exclude, --master-addr, the
                        scheduler's MASTER_ADDR / SLURM node list); task folders: harness `verify_tasks_dir`;
* class 2 (outputs)     data/cli.py `check_output_dir` (launch --run-dir through launcher/rundir.py and its
                        marker, evaluate --out, experts report --out, cluster_domains --out, and the older writers);
                        with data/atomic.py `output_path_problem` it also refuses, before any work, an output path
                        that cannot become a directory (a dangling symbolic link, a file: btx, zero_to_fp32);
* class 3 (failures)    data/atomic.py `staged_dir` (`discard_on_failure` for the trainer's collective writers) and
                        `disk_full_error`: every writer that stages its output (checkpoints, btx, zero_to_fp32,
                        hf_export, evaluate, experts report, harness tasks, prepare, ingest, cluster_domains)
                        removes what it staged when it fails midway, and a full disk (`_disk_full`: the case folder's
                        filesystem full after a few bytes) is "no space left on device writing OUT" with the mount
                        point and free bytes; cluster_domains checks every record before fitting (a check of its own);
* class 4 (numbers)     data/argtypes.py `check_range` (every numeric option's argparse type; merge weights and
                        priors through model/mixture.py `mixture_weights`);
* class 5 (data)        data/catalog.py `token_file_problems` (every token file of the training domains exists
                        with the size its manifest recorded; every run's plan loads the catalog); ingest's and
                        prepare's own checks (unreadable domain folders and files are problems, prepare reads
                        exactly the valid, case-distinct domains ingest's manifest lists);
* class 6 (config text) data/readers.py `load_yaml` (every YAML read) and `shape_problems` (every JSON object read).

Later classes, each one shared check (not in the mutation runs): 7 token ids against the model's vocabulary
(launcher/checkpoint_data.py `check_token_ids`), 8 weights against their config (launcher/checkpoint.py
`check_weight_shapes`), 9 text that is not UTF-8 (data/readers.py `decode_utf8`), 10 a --baseline module that
cannot be imported (data/cli.py `import_module_file`).
"""

from __future__ import annotations

import ast
import builtins
import errno
import importlib
import importlib.util
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.conftest import write_corpus
from tests.errors.test_bad_inputs import _config, _fake_state, _ingest, _run_overrides, _snapshot

REPO = Path(__file__).resolve().parents[2]
PWNED = "PWNED"  # what every payload would create in the case's folder

Argv = Callable[[SimpleNamespace, Path], list[str]]


# ---------------------------------------------------------------- the world the cases run against -------------


def _checkpoint(
    out: Path, tokens: Path, kind: str, seq_len: int = 32, n_layers: int = 2, d_model: int = 32
) -> Path:
    """A random GPT saved as a consolidated checkpoint with the meta the trainer writes (conftest's, any context)."""
    from dataclasses import replace

    from data.catalog import tokenizer_fingerprint
    from launcher.checkpoint import save_consolidated
    from launcher.config import RunConfig
    from model.config import FFNConfig, ModelConfig
    from model.gpt import GPT

    tok = json.loads((tokens / "gpt2" / "manifest.json").read_text())["tokenizer"]
    domains = ["cooking", "sailing", "finance"]
    cfg = RunConfig(
        model=ModelConfig(
            n_layers=n_layers,
            d_model=d_model,
            n_heads=2,
            seq_len=seq_len,
            vocab_size=50257,
            ffn=FFNConfig(kind=kind, num_experts=len(domains) if kind == "demix" else 0),
        )
    )
    cfg = replace(cfg, data=replace(cfg.data, path=str(tokens), tokenizer="gpt2"))
    extra = {
        "tokenizer": "gpt2",
        "vocab_size": tok["vocab_size"],
        "tokenizer_sha256": tokenizer_fingerprint(tok),
        "bos_id": tok["bos_id"],
        "eod_id": tok["eod_id"],
    }
    return save_consolidated(
        out,
        GPT(cfg.model, init_seed=0).state_dict(),
        cfg,
        domains if kind == "demix" else [],
        step=3,
        extra=extra,
    )


@pytest.fixture(scope="module")
def world(tiny_tokens, tmp_path_factory) -> SimpleNamespace:
    from launcher.plan import make_plan

    root = tmp_path_factory.mktemp("bad_inputs_2")
    return SimpleNamespace(
        root=root,
        tokens=tiny_tokens,
        corpus=write_corpus(root, docs_per_domain=8),
        ckpt=_checkpoint(root / "demix", tiny_tokens, "demix"),
        long=_checkpoint(root / "long", tiny_tokens, "dense", seq_len=4096, n_layers=1, d_model=16),
        plan=make_plan(_config(tiny_tokens, root / "unused"), 2),
    )


@pytest.fixture(scope="module")
def tasks(world) -> Path:
    """A task folder `harness tasks` wrote (lm-eval is imported only by the cases that need it)."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed")
    from launcher.harness import write_tasks

    write_tasks(world.tokens, "gpt2", world.root / "tasks", max_docs=2)
    return world.root / "tasks"


# ---------------------------------------------------------------- the catalogue ---------------------------------


@dataclass
class Case:
    name: str
    cls: int  # the class: 1 hosts, 2 outputs, 3 failures midway, 4 numbers, 5 data against its manifest,
    # 6 config text
    module: str
    argv: Argv
    expect: str  # a substring of the error message
    setup: Callable[[SimpleNamespace, Path], None] | None = None
    env: dict[str, str] | None = None  # environment variables set for the call
    harness: bool = False  # needs lm-eval (and the task folder, copied to d/tasks)
    mutable: bool = (
        True  # safe to run with its rule disabled (the mutation tests); False: would hang, train or be slow
    )
    rule: int | None = (
        None  # the mutation that disables its guard (default: its class's); 0: a check of its own
    )
    fault: Callable[[pytest.MonkeyPatch, SimpleNamespace, Path], None] | None = (
        None  # applied for the call only,
    )
    # after the setup (e.g. `_disk_full`); the expected text may name "{d}", the case's folder

    def __post_init__(self) -> None:
        self.rule = self.cls if self.rule is None else self.rule


LAUNCH, TRAIN, EVAL, GEN, GATE, EXPERTS, HF = (
    "launcher.launch",
    "launcher.train",
    "launcher.evaluation.evaluate",
    "launcher.evaluation.generate",
    "launcher.evaluation.gating",
    "launcher.modular.experts",
    "launcher.modular.hf_export",
)
HARNESS, DRYRUN, FLOPS, Z2F, BTX, FIGURES = (
    "launcher.harness",
    "launcher.dryrun",
    "launcher.flops",
    "launcher.zero_to_fp32",
    "launcher.modular.btx",
    "launcher.evaluation.figures",
)
ANONYMISE, ANONYMISE_SPEED = "data.anonymise", "experiments.anonymise_speed"
PREPARE, INGEST, CLUSTER, COSTMODEL, HF_TOK = (
    "data.prepare",
    "data.ingest",
    "data.cluster_domains",
    "benchmarks.costmodel",
    "launcher.modular.hf_tokenizer",
)

BOMB = "".join(
    [  # 9 levels of 9 aliases: 9**9 (387 million) strings from 330 bytes of YAML
        'extra_deepspeed:\n  a: &a ["x","x","x","x","x","x","x","x","x"]\n',
        *(f"  {chr(98 + i)}: &{chr(98 + i)} [{','.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8)),
    ]
)


def _payload(d: Path) -> str:
    return f"touch${{IFS}}{d / PWNED}"


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


def _hosts(*lines: str) -> Callable:
    """Setup: d/hosts with these lines ({P} = a payload creating d/PWNED)."""
    return lambda w, d: (d / "hosts").write_text("".join(line.format(P=_payload(d)) + "\n" for line in lines))


def _launch_hosts(*more: str) -> Argv:
    return lambda w, d: [
        "--hostfile",
        str(d / "hosts"),
        "--dry-run",
        "--run-dir",
        str(d / "run"),
        *_run_overrides(w.tokens, d / "run"),
        *more,
    ]


def _file(name: str, text: str) -> Callable:
    """Setup: d/<name> holding `text` ({M} = the path of the file a payload would create)."""

    def setup(w, d):
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text.replace("{M}", str(d / PWNED)))

    return setup


def _bytes(name: str, data: bytes) -> Callable:
    """Setup: d/<name> holding exactly `data`."""
    return lambda w, d: (d / name).write_bytes(data)


def _small_vocab_ckpt(w: SimpleNamespace, d: Path) -> None:
    """Setup: d/ckpt, the world's checkpoint cut to a model of 256 token ids, with no tokenizer record (a
    checkpoint from elsewhere): only the model's vocabulary tells that GPT-2 tokens do not fit it."""
    from dataclasses import replace

    from launcher.checkpoint import load_consolidated, save_consolidated

    c = load_consolidated(w.ckpt)
    state = {**c.state_dict, "wte.weight": c.state_dict["wte.weight"][:256].clone()}
    cfg = replace(c.cfg, model=replace(c.cfg.model, vocab_size=256))
    save_consolidated(d / "ckpt", state, cfg, c.domains, c.step)


def _copy_ckpt(edit: Callable[[dict], None], src: str = "ckpt") -> Callable:
    """Setup: d/ckpt, a copy of the world's checkpoint whose meta.json `edit` changed."""

    def setup(w, d):
        shutil.copytree(getattr(w, src), d / "ckpt")
        meta = json.loads((d / "ckpt" / "meta.json").read_text())
        edit(meta)
        (d / "ckpt" / "meta.json").write_text(json.dumps(meta))

    return setup


def _state_meta(edit: Callable[[dict], None]) -> Callable:
    """Setup: a training state in d/run (the launch's own layout) whose meta.json `edit` changed."""

    def setup(w, d):
        state = _fake_state(d / "run", 2, w.plan)
        meta = json.loads((state / "meta.json").read_text())
        edit(meta)
        (state / "meta.json").write_text(json.dumps(meta))

    return setup


def _prior(probs, **over) -> Callable:
    from model.mixture import CACHED_PRIOR_FORMAT

    rec = {
        "format": CACHED_PRIOR_FORMAT,
        "domains": ["cooking", "sailing", "finance"],
        "probs": probs,
        "blocks": 4,
        "decay": 0.3,
        **over,
    }
    return lambda w, d: (d / "prior.json").write_text(json.dumps(rec))


def _tamper(rel: str, text: str) -> Callable:
    """Setup: d/tasks, a copy of the task folder with `rel` (re)written to `text` ({M} = the marker's path)."""

    def setup(w, d):
        shutil.copytree(w.tasks, d / "tasks")
        (d / "tasks" / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / "tasks" / rel).write_text(text.format(M=str(d / PWNED)))

    return setup


def _tokens(edit: Callable[[Path], None]) -> Callable:
    """Setup: d/tokens, a copy of the prepared tokens; `edit` gets its gpt2/ folder (the manifest's root)."""

    def setup(w, d):
        shutil.copytree(w.tokens, d / "tokens", symlinks=True)
        edit(d / "tokens" / "gpt2")

    return setup


def _launch_tokens(*more: str) -> Argv:
    return lambda w, d: [
        "--nproc",
        "2",
        "--dry-run",
        "--run-dir",
        str(d / "run"),
        *_run_overrides(d / "tokens", d / "run"),
        *more,
    ]


def _truncate(rel: str, keep: float = 0.5) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        data = (root / rel).read_bytes()
        (root / rel).write_bytes(data[: int(len(data) * keep)])

    return edit


def _manifest(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    return lambda root: _edit(root / "manifest.json", fn)


def _text_domain(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "a.txt").write_text("a readable document")


def _prepare(corpus: str) -> Argv:
    return lambda w, d: ["--corpus", str(d / corpus), "--out", str(d / "out"), "--workers", "1"]


def _ingested(w: SimpleNamespace, out: Path) -> None:
    """`data.ingest` of the test corpus into `out` (its manifest lists the domains it wrote)."""
    from data.ingest import ingest

    ingest(w.corpus, out)


def _check(w, d) -> list[str]:
    return ["check", str(w.ckpt), "--tasks-dir", str(d / "tasks"), "--data", str(w.tokens)]


# ---- class 3: a writer failing midway (a full disk), an output path that cannot be a directory


class _FullDiskFile:
    """A file opened for writing on a filesystem with `left[0]` bytes free: a write that fits is written, the one
    that does not writes what fits and fails with ENOSPC, as a full filesystem does."""

    def __init__(self, f: Any, left: list[int]) -> None:
        self._f, self._left = f, left

    def write(self, data: Any) -> int:
        n = len(data.encode("utf-8")) if isinstance(data, str) else memoryview(data).nbytes
        if n > self._left[0]:
            fit, self._left[0] = self._left[0], 0
            if fit:
                self._f.write(
                    data[:fit] if isinstance(data, str) else bytes(memoryview(data).cast("B")[:fit])
                )
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._left[0] -= n
        return self._f.write(data)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __enter__(self) -> _FullDiskFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def _disk_full(room: int) -> Callable:
    """Fault: the filesystem of the case's folder is full after `room` more bytes. Simulated at the lowest write
    the project's Python code reaches, `open` (pathlib, json, torch.save through a file, numpy, matplotlib and
    megatron's index builder all use it): files opened for writing under the folder take bytes until then."""

    def fault(m: pytest.MonkeyPatch, w: SimpleNamespace, d: Path) -> None:
        left, real_open, root = [room], io.open, os.path.realpath(d)

        def full_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            f = real_open(file, mode, *args, **kwargs)
            if (
                isinstance(file, (str, os.PathLike))
                and any(c in mode for c in "wax+")
                and os.path.realpath(file).startswith(root + os.sep)
            ):
                return _FullDiskFile(f, left)
            return f

        m.setattr(builtins, "open", full_open)
        m.setattr(io, "open", full_open)

    return fault


def _dangling(name: str = "out") -> Callable:
    """Setup: d/<name>, a symbolic link to a folder that does not exist."""
    return lambda w, d: (d / name).symlink_to(d / "gone" / "ckpt")


def _training_state(w: SimpleNamespace, d: Path, reshape: tuple[str, tuple[int, ...]] | None = None) -> None:
    """Setup: d/run, a run directory whose training state holds the world's DEMix model (what zero_to_fp32 reads);
    `reshape` (name, shape): that parameter's file holds zeros of another shape."""
    import torch

    from launcher.checkpoint import load_consolidated
    from launcher.state_discovery import TRAINING_FORMAT

    c = load_consolidated(w.ckpt)
    model = c.build_model()
    params = dict(model.named_parameters())
    state = d / "run" / "checkpoints" / "step_00000003"
    for name, p in params.items():
        (state / "zero" / name).mkdir(parents=True)
        value = torch.zeros(reshape[1]) if reshape and reshape[0] == name else p.detach().float()
        torch.save({"param": value, "cat_dim": 0}, state / "zero" / name / "fp32.pt")
    buffers = {k: v for k, v in model.state_dict().items() if k not in params}
    torch.save({"step": 3, "buffers": buffers}, state / "trainer.pt")
    files = {str(p.relative_to(state)): p.stat().st_size for p in sorted(state.rglob("*")) if p.is_file()}
    layout = {
        "domains": c.domains,
        "expert_domains": c.domains,
        "tokenizer": "gpt2",
        "tokenizer_sha256": c.meta["tokenizer_sha256"],
    }
    (state / "meta.json").write_text(
        json.dumps(
            {
                "format": TRAINING_FORMAT,
                "step": 3,
                "layout": layout,
                "params": sorted(params),
                "files": files,
                "vocab_size": c.meta["vocab_size"],
                "config": c.meta["config"],
            }
        )
    )
    (d / "run" / "checkpoints" / "latest").write_text(state.name + "\n")


def _corpus_line(line: str | bytes) -> Callable:
    """Setup: d/corpus, a copy of the world's corpus with `line` added to cooking.jsonl (its 9th line)."""

    def setup(w, d):
        shutil.copytree(w.corpus, d / "corpus")
        with open(d / "corpus" / "cooking.jsonl", "ab") as f:
            f.write((line if isinstance(line, bytes) else line.encode()) + b"\n")

    return setup


FULL = (
    "no space left on device writing {d}/out ([Errno 28] No space left on device): the filesystem mounted at"
)
_STATE = "run/checkpoints/step_00000003"


_DROP_FFN = lambda m: m["config"]["model"].pop("ffn")  # noqa: E731
_PY_UTILS = "open({M!r}, 'w').close()\n"

CASES: list[Case] = [
    # ---- class 1: a host name (or a task folder) that would run code; hosts listed twice; slots and ports
    Case(
        "launch-hostfile-proxycommand",
        1,
        LAUNCH,
        _launch_hosts(),
        "starts with '-'",
        setup=_hosts("node0 slots=2", "-oProxyCommand={P} slots=2"),
    ),
    Case(
        "launch-hostfile-command-substitution",
        1,
        LAUNCH,
        _launch_hosts(),
        "is not a host name or IP address",
        setup=_hosts("$({P}) slots=2"),
    ),
    Case(
        "launch-hostfile-shell-separator",
        1,
        LAUNCH,
        _launch_hosts(),
        "';', '_', '{', '}'",
        setup=_hosts("node0;{P} slots=2"),
    ),
    Case(
        "launch-hostfile-duplicate-host",
        1,
        LAUNCH,
        _launch_hosts(),
        "is listed again (first on line 1)",
        rule=0,
        setup=_hosts("node0 slots=2", "node1 slots=1", "node0 slots=2"),
    ),
    Case(
        "launch-hostfile-zero-slots",
        1,
        LAUNCH,
        _launch_hosts(),
        "slots='0' must be a positive integer",
        rule=0,
        setup=_hosts("node0 slots=0"),
    ),
    Case(
        "launch-include-option-like-host",
        1,
        LAUNCH,
        lambda w, d: _launch_hosts(f"--include=-oProxyCommand={_payload(d)}")(w, d),
        "argument --include",
        setup=_hosts("node0 slots=2"),
    ),
    Case(
        "launch-exclude-command-substitution",
        1,
        LAUNCH,
        lambda w, d: _launch_hosts(f"--exclude=node0@$({_payload(d)})")(w, d),
        "argument --exclude",
        setup=_hosts("node0 slots=2", "node1 slots=2"),
    ),
    Case(
        "launch-master-addr-option",
        1,
        LAUNCH,
        lambda w, d: _launch(f"--master-addr=-oProxyCommand={_payload(d)}")(w, d),
        "argument --master-addr",
    ),
    Case("launch-master-addr-path", 1, LAUNCH, _launch("--master-addr", "../../tmp"), "contains '/'"),
    Case(
        "launch-master-port-out-of-range",
        1,
        LAUNCH,
        _launch("--master-port", "70000"),
        rule=4,
        expect="argument --master-port/--port: '70000' is not an integer in [1, 65535]",
    ),
    Case(
        "launch-ssh-port-zero",
        1,
        LAUNCH,
        _launch_hosts("--ssh-port", "0"),
        "argument --ssh-port",
        rule=4,
        setup=_hosts("node0 slots=2"),
    ),
    Case(
        "train-master-addr-with-space",
        1,
        TRAIN,
        lambda w, d: ["--master-addr", "node0 -oProxyCommand=x", "--run-dir", str(d / "run")],
        "argument --master-addr",
        mutable=False,
    ),
    Case(
        "train-slurm-nodelist-option-like",
        1,
        TRAIN,
        lambda w, d: ["--run-dir", str(d / "run")],
        "the first host of SLURM node list",
        mutable=False,
        env={
            "SLURM_PROCID": "0",
            "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_JOB_ID": "7",
            "SLURM_JOB_NODELIST": "-oProxyCommand=x,node1",
        },
    ),
    Case(
        "train-mpi-master-addr-path",
        1,
        TRAIN,
        lambda w, d: ["--run-dir", str(d / "run")],
        "MASTER_ADDR from Open MPI's environment",
        env={
            "OMPI_COMM_WORLD_RANK": "0",
            "OMPI_COMM_WORLD_SIZE": "2",
            "MASTER_ADDR": "../../home",
            "MASTER_PORT": "29500",
        },
        mutable=False,
    ),
    Case(
        "harness-check-changed-utils",
        1,
        HARNESS,
        _check,
        "changed: utils.py",
        harness=True,
        setup=_tamper("utils.py", _PY_UTILS),
    ),
    Case(
        "harness-check-added-module",
        1,
        HARNESS,
        _check,
        "added: evil.py",
        harness=True,
        mutable=False,
        setup=_tamper("evil.py", _PY_UTILS),
    ),
    Case(
        "harness-check-added-bytecode",
        1,
        HARNESS,
        _check,
        "added: __pycache__/utils.cpython",
        harness=True,
        mutable=False,
        setup=_tamper(f"__pycache__/utils.cpython-{sys.version_info.major}{sys.version_info.minor}.pyc", "x"),
    ),
    Case(
        "harness-check-changed-task-yaml",
        1,
        HARNESS,
        _check,
        "changed: demix_ppl.yaml",
        harness=True,
        mutable=False,
        setup=_tamper("demix_ppl.yaml", "group: demix_ppl\ntask: [x]\nfoo: !function evil.f\n"),
    ),
    # ---- class 4: numeric options out of their range, NaN, empty tables, a context too long
    Case(
        "eval-max-blocks-negative",
        4,
        EVAL,
        lambda w, d: [str(w.ckpt), "--data", str(w.tokens), "--max-blocks", "-1", "--out", str(d / "out")],
        "argument --max-blocks",
    ),
    Case(
        "eval-batch-size-zero",
        4,
        EVAL,
        lambda w, d: [str(w.ckpt), "--data", str(w.tokens), "--batch-size", "0", "--out", str(d / "out")],
        "'0' is not an integer >= 1",
    ),
    Case(
        "eval-decay-nan",
        4,
        EVAL,
        lambda w, d: [str(w.ckpt), "--data", str(w.tokens), "--decay", "nan", "--out", str(d / "out")],
        "NaN and infinity are refused",
    ),
    Case(
        "eval-seq-len-beyond-context",
        4,
        EVAL,
        lambda w, d: [str(w.ckpt), "--data", str(w.tokens), "--seq-len", "64", "--out", str(d / "out")],
        "--seq-len 64 is beyond the model's context (32 tokens",
    ),
    Case(
        "eval-unknown-domain",
        4,
        EVAL,
        lambda w, d: [str(w.ckpt), "--data", str(w.tokens), "--domains", "cookng", "--out", str(d / "out")],
        "--domains ['cookng'] are not in",
    ),
    Case(
        "eval-table-without-rows",
        4,
        EVAL,
        lambda w, d: [str(w.long), "--data", str(w.tokens), "--out", str(d / "out")],
        "every table would have no rows",
    ),
    Case(
        "experts-add-dev-blocks-zero",
        4,
        EXPERTS,
        lambda w, d: [
            "add",
            str(w.ckpt),
            "--domain",
            "finance",
            "--out",
            str(d / "out"),
            "--dev-blocks",
            "0",
        ],
        "argument --dev-blocks",
    ),
    Case(
        "generate-max-new-tokens-negative",
        4,
        GEN,
        lambda w, d: [str(w.ckpt), "--expert", "cooking", "--data", str(w.tokens), "--max-new-tokens", "-5"],
        "argument --max-new-tokens",
    ),
    Case(
        "generate-top-p-zero",
        4,
        GEN,
        lambda w, d: [str(w.ckpt), "--expert", "cooking", "--data", str(w.tokens), "--top-p", "0"],
        "is not a finite number in (0, 1]",
    ),
    Case(
        "generate-prior-all-zeros",
        4,
        GEN,
        lambda w, d: [str(w.ckpt), "--mixture", "--prior", str(d / "prior.json"), "--data", str(w.tokens)],
        "need at least one weight > 0",
        rule=0,
        setup=_prior([0, 0, 0]),
    ),
    Case(
        "generate-prior-negative",
        4,
        GEN,
        lambda w, d: [str(w.ckpt), "--mixture", "--prior", str(d / "prior.json"), "--data", str(w.tokens)],
        "probs[1]=-0.5: must be",
        setup=_prior([1.0, -0.5, 0.5]),
    ),
    Case(
        "hf-export-merge-weight-nan",
        4,
        HF,
        lambda w, d: [
            str(w.ckpt),
            "--merge-weights",
            "cooking=nan,sailing=1",
            "--out",
            str(d / "out"),
            "--no-tokenizer",
        ],
        "NaN and infinity are refused",
    ),
    Case(
        "gating-batches-zero",
        4,
        GATE,
        lambda w, d: [str(w.ckpt), "--data", str(w.tokens), "--out", str(d / "out"), "--batches", "0"],
        "argument --batches",
    ),
    Case(
        "gating-seq-len-beyond-context",
        4,
        GATE,
        lambda w, d: [str(w.ckpt), "--data", str(w.tokens), "--out", str(d / "out"), "--seq-len", "33"],
        "beyond the model's context",
        rule=0,
    ),
    Case(
        "dryrun-gpu-memory-nan",
        4,
        DRYRUN,
        lambda w, d: [
            "--world-size",
            "2",
            "--gpu-memory-gb",
            "nan",
            "--out",
            str(d / "out" / "x.json"),
            *_run_overrides(w.tokens, d / "r"),
        ],
        "argument --gpu-memory-gb",
    ),
    Case(
        "flops-seconds-infinite",
        4,
        FLOPS,
        lambda w, d: ["--config", "tiny", "--seconds-per-update", "inf"],
        "argument --seconds-per-update",
    ),
    Case(
        "prepare-seed-negative",
        4,
        PREPARE,
        lambda w, d: ["--corpus", str(w.corpus), "--out", str(d / "out"), "--seed", "-1"],
        "argument --seed",
    ),
    Case(
        "prepare-valid-fraction-one",
        4,
        PREPARE,
        lambda w, d: ["--corpus", str(w.corpus), "--out", str(d / "out"), "--valid-fraction", "1"],
        "argument --valid-fraction",
    ),
    Case(
        "ingest-max-report-negative",
        4,
        INGEST,
        lambda w, d: [str(w.corpus), "--out", str(d / "out"), "--max-report", "-3"],
        "argument --max-report",
    ),
    Case(
        "cluster-k-zero",
        4,
        CLUSTER,
        lambda w, d: ["--corpus", str(w.corpus), "--k", "0", "--out", str(d / "out")],
        "argument --k",
    ),
    Case(
        "btx-router-entropy-one",
        4,
        BTX,
        lambda w, d: [str(w.ckpt), "--out", str(d / "out"), "--router-entropy", "1"],
        "is not a finite number in (0, 1)",
    ),
    Case(
        "hf-tokenizer-max-docs-zero",
        4,
        HF_TOK,
        lambda w, d: ["check", "--data", str(w.tokens), "--max-docs", "0"],
        "argument --max-docs",
    ),
    Case(
        "costmodel-overlap-above-one",
        4,
        COSTMODEL,
        lambda w, d: ["--paper", "--no-write", "--overlap", "1.5"],
        "argument --overlap",
    ),
    # ---- class 2: outputs that would replace a user's files (data/cli.py `check_output_dir`, every writer)
    Case(
        "launch-run-dir-with-users-config",
        2,
        LAUNCH,
        _launch(),
        "already holds config.yaml",
        setup=_file("run/config.yaml", "my: notes\n"),
    ),
    Case(
        "launch-run-dir-with-users-command",
        2,
        LAUNCH,
        _launch(),
        "already holds command.sh",
        setup=_file("run/command.sh", "echo mine\n"),
    ),
    Case(
        "launch-run-dir-with-users-metrics",
        2,
        LAUNCH,
        _launch(),
        "already holds metrics.jsonl",
        setup=_file("run/metrics.jsonl", '{"kind": "mine"}\n'),
    ),
    Case(
        "launch-run-dir-with-users-deepspeed-json",
        2,
        LAUNCH,
        _launch(),
        "already holds deepspeed_config.json",
        setup=_file("run/deepspeed_config.json", "{}"),
    ),
    Case(
        "launch-run-dir-marker-of-another-tool",
        2,
        LAUNCH,
        _launch(),
        "holds a demix_run.json this tool did not",
        setup=_file("run/demix_run.json", '{"format": "other/1"}'),
    ),
    Case(
        "launch-run-dir-a-file",
        2,
        LAUNCH,
        _launch(),
        "is a file, not a directory",
        setup=_file("run", "mine\n"),
    ),
    Case(
        "launch-run-dir-is-the-tokens",
        2,
        LAUNCH,
        lambda w, d: [
            "--nproc",
            "2",
            "--dry-run",
            "--run-dir",
            str(d / "tokens"),
            *_run_overrides(d / "tokens", d / "tokens"),
        ],
        "would overwrite the input",
        setup=_tokens(lambda r: None),
    ),
    Case(
        "eval-out-with-users-report",
        2,
        EVAL,
        lambda w, d: [str(w.ckpt), "--data", str(w.tokens), "--out", str(d / "mine")],
        "already holds eval.md",
        setup=_file("mine/eval.md", "# my notes\n"),
    ),
    Case(
        "eval-out-with-foreign-eval-json",
        2,
        EVAL,
        lambda w, d: [str(w.ckpt), "--data", str(w.tokens), "--out", str(d / "mine")],
        "holds a eval.json this tool",
        setup=_file("mine/eval.json", '{"format": "someone-else"}'),
    ),
    Case(
        "eval-out-inside-the-tokens",
        2,
        EVAL,
        lambda w, d: [str(w.ckpt), "--data", str(d / "tokens"), "--out", str(d / "tokens" / "gpt2")],
        "would overwrite the input",
        setup=_tokens(lambda r: None),
    ),
    Case(
        "experts-report-remove-over-users-md",
        2,
        EXPERTS,
        lambda w, d: ["report", "remove", str(w.ckpt), "--data", str(w.tokens), "--out", str(d / "mine")],
        "already holds remove.md",
        setup=_file("mine/remove.md", "# mine\n"),
    ),
    Case(
        "cluster-out-with-users-report",
        2,
        CLUSTER,
        lambda w, d: ["--corpus", str(w.corpus), "--k", "2", "--out", str(d / "out")],
        "already holds cluster_report.json",
        setup=_file("out/cluster_report.json", "{}"),
    ),
    # ---- class 3: a writer that fails midway leaves nothing and names a full disk; an output path that cannot be a
    # directory is refused before the work (class 2's rule); records are checked before the expensive fit
    Case(
        "btx-upcycle-out-dangling-symlink",
        3,
        BTX,
        lambda w, d: [str(w.ckpt), "--out", str(d / "out"), "--router-init", "zero"],
        "--out {d}/out is a dangling symbolic link",
        rule=2,
        setup=_dangling(),
    ),
    Case(
        "btx-upcycle-out-a-file",
        3,
        BTX,
        lambda w, d: [str(w.ckpt), "--out", str(d / "out"), "--router-init", "zero"],
        "--out {d}/out is a file, not a directory",
        rule=2,
        setup=_file("out", "mine\n"),
    ),
    Case(
        "btx-branch-out-dangling-symlink",
        3,
        BTX,
        lambda w, d: ["branch", str(w.long), "--out", str(d / "out"), "--domains", "cooking,sailing"],
        "--out {d}/out is a dangling symbolic link",
        rule=2,
        setup=_dangling(),
    ),
    Case(
        "z2f-out-dangling-symlink",
        3,
        Z2F,
        lambda w, d: [str(d / _STATE), "--out", str(d / "out")],
        "--out {d}/out is a dangling symbolic link",
        rule=2,
        setup=lambda w, d: [_training_state(w, d), _dangling()(w, d)],
    ),
    Case(
        "z2f-disk-full",
        3,
        Z2F,
        lambda w, d: [str(d / _STATE), "--out", str(d / "out")],
        FULL,
        setup=_training_state,
        fault=_disk_full(4096),
    ),
    Case(
        "btx-upcycle-disk-full",
        3,
        BTX,
        lambda w, d: [str(w.ckpt), "--out", str(d / "out"), "--router-init", "zero"],
        FULL,
        fault=_disk_full(4096),
    ),
    Case(
        "cluster-record-without-id",
        3,
        CLUSTER,
        lambda w, d: ["--corpus", str(d / "corpus"), "--k", "2", "--out", str(d / "out")],
        "cooking.jsonl:9: the record has no 'id'",
        rule=0,
        setup=_corpus_line('{"domain": "cooking", "text": "Boil the water."}'),
    ),
    Case(
        "cluster-record-not-an-object",
        3,
        CLUSTER,
        lambda w, d: ["--corpus", str(d / "corpus"), "--k", "2", "--out", str(d / "out")],
        "cooking.jsonl:9: the record is list, not an object",
        rule=0,
        setup=_corpus_line('["cooking", "Boil."]'),
    ),
    Case(
        "cluster-disk-full",
        3,
        CLUSTER,
        lambda w, d: ["--corpus", str(w.corpus), "--k", "2", "--out", str(d / "out")],
        FULL,
        fault=_disk_full(2048),
    ),
    Case(
        "hf-export-disk-full",
        3,
        HF,
        lambda w, d: [
            str(w.ckpt),
            "--domain",
            "cooking",
            "--out",
            str(d / "out"),
            "--no-tokenizer",
            "--no-check",
        ],
        FULL,
        fault=_disk_full(256),
    ),
    Case(
        "eval-out-disk-full",
        3,
        EVAL,
        lambda w, d: [
            str(w.ckpt),
            "--data",
            str(w.tokens),
            "--out",
            str(d / "out"),
            "--max-blocks",
            "2",
            "--cached-blocks",
            "2",
        ],
        FULL,
        fault=_disk_full(256),
    ),
    Case(
        "experts-report-disk-full",
        3,
        EXPERTS,
        lambda w, d: [
            "report",
            "remove",
            str(w.ckpt),
            "--data",
            str(w.tokens),
            "--out",
            str(d / "out"),
            "--max-blocks",
            "2",
            "--cached-blocks",
            "2",
        ],
        FULL,
        fault=_disk_full(256),
    ),
    Case(
        "prepare-disk-full",
        3,
        PREPARE,
        lambda w, d: ["--corpus", str(w.corpus), "--out", str(d / "out"), "--workers", "1"],
        FULL.replace("{d}/out", "{d}/out/gpt2"),
        fault=_disk_full(4096),
    ),
    Case(
        "ingest-disk-full",
        3,
        INGEST,
        lambda w, d: [str(w.corpus), "--out", str(d / "out")],
        FULL,
        fault=_disk_full(2048),
    ),
    Case(
        "harness-tasks-disk-full",
        3,
        HARNESS,
        lambda w, d: ["tasks", "--data", str(w.tokens), "--out", str(d / "out"), "--max-docs", "2"],
        FULL,
        harness=True,
        fault=_disk_full(1024),
    ),
    # ---- class 5: token files that do not match their manifest (data/catalog.py `token_file_problems`)
    Case(
        "launch-token-bin-missing",
        5,
        LAUNCH,
        _launch_tokens(),
        "cooking/train.bin is missing",
        setup=_tokens(lambda r: (r / "cooking/train.bin").unlink()),
    ),
    Case(
        "launch-token-bin-truncated",
        5,
        LAUNCH,
        _launch_tokens(),
        "cooking/train.bin has",
        setup=_tokens(_truncate("cooking/train.bin")),
    ),
    Case(
        "launch-token-idx-truncated",
        5,
        LAUNCH,
        _launch_tokens(),
        "sailing/train.idx has",
        setup=_tokens(_truncate("sailing/train.idx", 0.9)),
    ),
    Case(
        "launch-token-valid-bin-missing",
        5,
        LAUNCH,
        _launch_tokens(),
        "cooking/valid.bin is missing",
        setup=_tokens(lambda r: (r / "cooking/valid.bin").unlink()),
    ),
    Case(
        "launch-token-bin-grown",
        5,
        LAUNCH,
        _launch_tokens(),
        "sailing/train.bin has",
        setup=_tokens(lambda r: (r / "sailing/train.bin").open("ab").write(b"\0" * 64)),
    ),
    Case(
        "launch-token-domain-folder-deleted",
        5,
        LAUNCH,
        _launch_tokens(),
        "sailing/train.bin is missing",
        setup=_tokens(lambda r: shutil.rmtree(r / "sailing")),
    ),
    Case(
        "launch-token-bin-dangling-symlink",
        5,
        LAUNCH,
        _launch_tokens(),
        "cooking/train.bin is missing",
        setup=_tokens(
            lambda r: [
                (r / "cooking/train.bin").unlink(),
                (r / "cooking/train.bin").symlink_to(r / "gone.bin"),
            ]
        ),
    ),
    Case(
        "launch-token-bin-a-folder",
        5,
        LAUNCH,
        _launch_tokens(),
        "cooking/test.bin is missing",
        setup=_tokens(lambda r: [(r / "cooking/test.bin").unlink(), (r / "cooking/test.bin").mkdir()]),
    ),
    Case(
        "launch-token-bin-of-another-domain",
        5,
        LAUNCH,
        _launch_tokens(),
        "cooking/train.bin has",
        setup=_tokens(lambda r: shutil.copyfile(r / "finance/train.bin", r / "cooking/train.bin")),
    ),
    Case(
        "launch-token-manifest-names-outside",
        5,
        LAUNCH,
        _launch_tokens(),
        "names a file outside",
        setup=_tokens(_manifest(lambda m: m["counts"]["cooking"]["train"].update(bin="../../../etc/passwd"))),
    ),
    Case(
        "launch-token-idx-emptied",
        5,
        LAUNCH,
        _launch_tokens(),
        "sailing/test.idx has 0 bytes",
        setup=_tokens(lambda r: (r / "sailing/test.idx").write_bytes(b"")),
    ),
    Case(
        "launch-token-valid-idx-truncated",
        5,
        LAUNCH,
        _launch_tokens("--resume", "never"),
        "cooking/valid.idx has",
        setup=_tokens(_truncate("cooking/valid.idx", 0.5)),
    ),
    # ---- class 5, ingest and prepare: a corpus whose files do not match what is read (their own checks: data/ingest.py
    # `read_text_dir` reports what it cannot read, data/prepare.py `_corpus_files` checks the domains before any work)
    Case(
        "ingest-domain-folder-dangling-symlink",
        5,
        INGEST,
        _ingest("src", "--on-error", "fail"),
        "unreadable_domain (a dangling symbolic link",
        rule=0,
        setup=lambda w, d: [_text_domain(d / "src" / "news"), (d / "src" / "sport").symlink_to(d / "gone")],
    ),
    Case(
        "ingest-txt-dangling-symlink",
        5,
        INGEST,
        _ingest("src", "--on-error", "fail"),
        "unreadable_file",
        rule=0,
        setup=lambda w, d: [
            _text_domain(d / "src" / "news"),
            (d / "src" / "news" / "b.txt").symlink_to(d / "gone"),
        ],
    ),
    Case(
        "ingest-txt-is-a-folder",
        5,
        INGEST,
        _ingest("src", "--on-error", "fail"),
        "unreadable_file",
        rule=0,
        setup=lambda w, d: [_text_domain(d / "src" / "news"), (d / "src" / "news" / "b.txt").mkdir()],
    ),
    Case(
        "prepare-domains-differ-in-case",
        5,
        PREPARE,
        _prepare("corpus"),
        "name domains that differ only in case",
        rule=0,
        setup=lambda w, d: [
            shutil.copytree(w.corpus, d / "corpus"),
            shutil.copyfile(d / "corpus/cooking.jsonl", d / "corpus/Cooking.jsonl"),
        ],
    ),
    Case(
        "prepare-domain-file-bad-name",
        5,
        PREPARE,
        _prepare("corpus"),
        "my news.jsonl: 'my news': a domain name",
        rule=0,
        setup=lambda w, d: [
            shutil.copytree(w.corpus, d / "corpus"),
            shutil.copyfile(d / "corpus/cooking.jsonl", d / "corpus/my news.jsonl"),
        ],
    ),
    Case(
        "prepare-file-not-in-ingest-manifest",
        5,
        PREPARE,
        _prepare("ing"),
        "stale.jsonl not listed in",
        rule=0,
        setup=lambda w, d: [
            _ingested(w, d / "ing"),
            shutil.copyfile(d / "ing/cooking.jsonl", d / "ing/stale.jsonl"),
        ],
    ),
    Case(
        "prepare-ingest-manifest-file-missing",
        5,
        PREPARE,
        _prepare("ing"),
        "sailing.jsonl is missing",
        rule=0,
        setup=lambda w, d: [_ingested(w, d / "ing"), (d / "ing/sailing.jsonl").unlink()],
    ),
    # ---- class 6: YAML that escapes as a traceback or never returns; JSON of the wrong shape
    Case(
        "launch-set-unclosed-list",
        6,
        LAUNCH,
        _launch(**{"train.steps": "[1"}),
        "--set 'train.steps=[1' is not valid YAML",
    ),
    Case(
        "launch-set-python-tag",
        6,
        LAUNCH,
        lambda w, d: _launch(**{"train.steps": f"!!python/object/apply:os.system ['touch {d / PWNED}']"})(
            w, d
        ),
        "tags that build objects (!!python/...) are refused",
    ),
    Case(
        "launch-config-alias-bomb",
        6,
        LAUNCH,
        lambda w, d: ["--config", str(d / "bomb.yaml"), *_launch()(w, d)],
        "bomb.yaml is not valid YAML: its aliases expand it beyond",
        mutable=False,
        setup=_file("bomb.yaml", BOMB),
    ),
    Case(
        "launch-config-recursive-alias",
        6,
        LAUNCH,
        lambda w, d: ["--config", str(d / "c.yaml"), *_launch()(w, d)],
        "a node that contains it",
        mutable=False,
        setup=_file("c.yaml", "extra_deepspeed: &a {x: *a}\n"),
    ),
    Case(
        "launch-config-python-tag",
        6,
        LAUNCH,
        lambda w, d: ["--config", str(d / "c.yaml"), *_launch()(w, d)],
        "c.yaml is not valid YAML: could not determine a constructor",
        setup=_file("c.yaml", "train: !!python/object/apply:os.system ['touch {M}']\n"),
    ),
    Case(
        "dryrun-set-broken-mapping",
        6,
        DRYRUN,
        lambda w, d: ["--world-size", "2", "--out", str(d / "out" / "x.json"), "--set", "model.n_layers={"],
        "--set 'model.n_layers={'",
    ),
    Case(
        "flops-config-alias-bomb",
        6,
        FLOPS,
        lambda w, d: ["--config", str(d / "bomb.yaml")],
        "an alias bomb?",
        mutable=False,
        setup=_file("bomb.yaml", BOMB),
    ),
    Case(
        "costmodel-cluster-file-python-tag",
        6,
        COSTMODEL,
        lambda w, d: ["--paper", "--no-write", "--cluster-file", str(d / "c.yaml")],
        "c.yaml is not valid YAML",
        setup=_file("c.yaml", "name: !!python/object/apply:os.system ['touch {M}']\n"),
    ),
    Case(
        "eval-meta-without-ffn",
        6,
        EVAL,
        lambda w, d: [str(d / "ckpt"), "--data", str(w.tokens), "--out", str(d / "out")],
        "meta.json (consolidated checkpoint metadata) "
        "does not have the expected shape: config.model.ffn is missing",
        setup=_copy_ckpt(_DROP_FFN),
    ),
    Case(
        "eval-meta-domains-a-string",
        6,
        EVAL,
        lambda w, d: [str(d / "ckpt"), "--data", str(w.tokens), "--out", str(d / "out")],
        'domains is "cooking" (str), expected a list',
        setup=_copy_ckpt(lambda m: m.update(domains="cooking")),
    ),
    Case(
        "eval-meta-a-list",
        6,
        EVAL,
        lambda w, d: [str(d / "ckpt"), "--data", str(w.tokens)],
        "meta.json (consolidated checkpoint metadata) does not have the expected shape: the top level is list",
        setup=lambda w, d: [
            shutil.copytree(w.ckpt, d / "ckpt"),
            (d / "ckpt" / "meta.json").write_text("[1, 2]"),
        ],
    ),
    Case(
        "launch-init-from-without-ffn",
        6,
        LAUNCH,
        lambda w, d: _launch(**{"train.init_from": str(d / "ckpt")})(w, d),
        "config.model.ffn is missing",
        setup=_copy_ckpt(_DROP_FFN),
    ),
    Case(
        "launch-resume-layout-a-list",
        6,
        LAUNCH,
        _launch(),
        "layout is [] (list), expected an object",
        setup=_state_meta(lambda m: m.update(layout=[])),
    ),
    Case(
        "z2f-state-without-params",
        6,
        Z2F,
        lambda w, d: [str(d / "run" / "checkpoints" / "step_00000002"), "--out", str(d / "out")],
        "(training state metadata) does not have the expected shape: params is missing",
        setup=_state_meta(lambda m: m.pop("params")),
    ),
    Case(
        "experts-add-meta-without-data",
        6,
        EXPERTS,
        lambda w, d: ["add", str(d / "ckpt"), "--domain", "finance", "--out", str(d / "out")],
        "config.data is missing",
        setup=_copy_ckpt(lambda m: m["config"].pop("data")),
    ),
    Case(
        "generate-prior-a-list",
        6,
        GEN,
        lambda w, d: [str(w.ckpt), "--mixture", "--prior", str(d / "prior.json"), "--data", str(w.tokens)],
        "prior.json (cached prior) does not have the expected shape",
        setup=lambda w, d: (d / "prior.json").write_text("[0.5, 0.5]"),
    ),
    Case(
        "hf-export-eval-json-entry-a-list",
        6,
        HF,
        lambda w, d: [
            str(w.ckpt),
            "--domain",
            "cooking",
            "--out",
            str(d / "out"),
            "--eval-json",
            str(d / "eval.json"),
        ],
        "eval.json (the source's evaluation): an entry of the wrong shape",
        rule=0,
        setup=lambda w, d: (d / "eval.json").write_text('{"domains": {"cooking": []}}'),
    ),
    Case(
        "launch-token-manifest-counts-a-list",
        6,
        LAUNCH,
        lambda w, d: _launch(**{"data.path": str(d / "tokens")})(w, d),
        "counts is [] (list), expected an object",
        setup=lambda w, d: [
            shutil.copytree(w.tokens, d / "tokens"),
            _edit(d / "tokens/gpt2/manifest.json", lambda m: m.update(counts=[])),
        ],
    ),
    Case(
        "figures-eval-json-not-an-object",
        6,
        FIGURES,
        lambda w, d: [str(d / "eval.json"), "--out", str(d / "out")],
        "eval.json (an evaluation) does not have the expected shape",
        setup=lambda w, d: (d / "eval.json").write_text('"x"'),
    ),
    Case(
        "harness-check-record-domains-a-list",
        6,
        HARNESS,
        _check,
        "domains is [] (list), expected an object",
        harness=True,
        setup=lambda w, d: [
            shutil.copytree(w.tasks, d / "tasks"),
            _edit(d / "tasks/demix_tasks.json", lambda m: m.update(domains=[])),
        ],
    ),
    # ---- class 9 (text encoding): a file that is not UTF-8 is named with its line and byte offset
    # (data/readers.py `decode_utf8` / `not_utf8_at`, as ingest reports it)
    Case(
        "anonymise-evaluate-not-utf8",
        9,
        ANONYMISE,
        lambda w, d: ["--evaluate", str(d / "l.jsonl")],
        "{d}/l.jsonl:2: not UTF-8 at byte offset 40: b'\\xe9",
        setup=_bytes("l.jsonl", b'{"text": "a", "spans": []}\n{"text": "caf\xe9", "spans": []}\n'),
    ),
    Case(
        "cluster-corpus-not-utf8",
        9,
        CLUSTER,
        lambda w, d: ["--corpus", str(d / "corpus"), "--k", "2", "--out", str(d / "out")],
        "cooking.jsonl:9: not UTF-8 at byte offset",
        setup=_corpus_line(b'{"id": "x", "domain": "cooking", "text": "caf\xe9"}'),
    ),
    Case(
        "launch-hostfile-not-utf8",
        9,
        LAUNCH,
        _launch_hosts(),
        "{d}/hosts:2: not UTF-8 at byte offset 15",
        setup=_bytes("hosts", b"node0 slots=1\nn\xf6de slots=1\n"),
    ),
    Case(
        "launch-config-not-utf8",
        9,
        LAUNCH,
        lambda w, d: ["--config", str(d / "run.yaml"), "--dry-run", "--run-dir", str(d / "run")],
        "{d}/run.yaml:2: not UTF-8 at byte offset 23",
        setup=_bytes("run.yaml", b"model: {}\ndata: {path: \xff}\n"),
    ),
    # ---- class 10 (user modules): a --baseline module that cannot be imported is one line naming it and the error
    # (data/cli.py `import_module_file`), exit status 2
    Case(
        "anonymise-baseline-raises-on-import",
        10,
        ANONYMISE,
        lambda w, d: ["--evaluate", str(d / "l.jsonl"), "--baseline", str(d / "old.py")],
        "--baseline {d}/old.py: importing it failed: RuntimeError: boom (line 2)",
        setup=lambda w, d: [
            (d / "l.jsonl").write_text('{"text": "a", "spans": []}\n'),
            (d / "old.py").write_text('x = 1\nraise RuntimeError("boom")\n'),
        ],
    ),
    Case(
        "anonymise-baseline-missing-import",
        10,
        ANONYMISE,
        lambda w, d: ["--evaluate", str(d / "l.jsonl"), "--baseline", str(d / "old.py")],
        "importing it failed: ModuleNotFoundError: No module named 'no_such_module_here' (line 1)",
        setup=lambda w, d: [
            (d / "l.jsonl").write_text('{"text": "a", "spans": []}\n'),
            (d / "old.py").write_text("import no_such_module_here\n"),
        ],
    ),
    Case(
        "anonymise-speed-baseline-raises-on-import",
        10,
        ANONYMISE_SPEED,
        lambda w, d: ["--baseline", str(d / "old.py"), "--mb", "0.01", "--out", str(d / "out.md")],
        "--baseline {d}/old.py: importing it failed: NameError: name 'undefined_name' is not defined (line 1)",
        setup=_file("old.py", "undefined_name\n"),
    ),
    # ---- class 8 (weights against their config): consolidated weights are checked against the config's shapes
    # by every writer and reader (launcher/checkpoint.py `check_weight_shapes`), the first mismatch named
    Case(
        "z2f-param-shape-disagrees-with-config",
        8,
        Z2F,
        lambda w, d: [str(d / _STATE), "--out", str(d / "out")],
        "the weights do not match the config: wpe.weight: shape [16, 32], the config's [32, 32]",
        setup=lambda w, d: _training_state(w, d, reshape=("wpe.weight", (16, 32))),
    ),
    Case(
        "eval-ckpt-shape-disagrees-with-config",
        8,
        EVAL,
        lambda w, d: [str(d / "ckpt"), "--data", str(w.tokens), "--out", str(d / "out")],
        "the weights do not match the config: wpe.weight: shape [32, 32], the config's [64, 32]",
        setup=_copy_ckpt(lambda m: m["config"]["model"].update(seq_len=64)),
    ),
    Case(
        "experts-add-ckpt-shape-disagrees-with-config",
        8,
        EXPERTS,
        lambda w, d: ["add", str(d / "ckpt"), "--domain", "law", "--out", str(d / "out")],
        "the weights do not match the config: wpe.weight: shape [32, 32], the config's [64, 32]",
        setup=_copy_ckpt(lambda m: m["config"]["model"].update(seq_len=64)),
    ),
    Case(
        "generate-ckpt-vocab-rows-fewer-than-config",
        8,
        GEN,
        lambda w, d: [str(d / "ckpt"), "--prompt", "hi", "--max-new-tokens", "1"],
        "wte.weight: shape [50304, 32], fewer rows than the config's model.vocab_size=60000",
        setup=_copy_ckpt(lambda m: m["config"]["model"].update(vocab_size=60000)),
    ),
    # ---- class 7 (token ids against the model): every entry point that feeds prepared tokens to a model checks
    # the data's ids against the model's vocabulary before loading a tensor (launcher/checkpoint_data.py
    # `check_token_ids`, through `check_checkpoint_data` and the evaluation context)
    Case(
        "eval-tokens-beyond-model-vocab",
        7,
        EVAL,
        lambda w, d: [str(d / "ckpt"), "--data", str(w.tokens), "--out", str(d / "out")],
        "tokens use ids up to 50256 (a vocabulary of 50257), beyond the model's vocabulary of 256 ids",
        setup=lambda w, d: _small_vocab_ckpt(w, d),
    ),
    Case(
        "generate-tokens-beyond-model-vocab",
        7,
        GEN,
        lambda w, d: [str(d / "ckpt"), "--data", str(w.tokens), "--prompt", "hi", "--max-new-tokens", "1"],
        "beyond the model's vocabulary of 256 ids",
        setup=lambda w, d: _small_vocab_ckpt(w, d),
    ),
    Case(
        "btx-tokens-beyond-model-vocab",
        7,
        BTX,
        lambda w, d: [str(d / "ckpt"), "--out", str(d / "out"), "--data", str(w.tokens)],
        "beyond the model's vocabulary of 256 ids",
        setup=lambda w, d: _small_vocab_ckpt(w, d),
    ),
    Case(
        "experts-add-tokens-beyond-model-vocab",
        7,
        EXPERTS,
        lambda w, d: [
            "add",
            str(d / "ckpt"),
            "--domain",
            "law",
            "--out",
            str(d / "out"),
            "--data",
            str(w.tokens),
        ],
        "beyond the model's vocabulary of 256 ids",
        setup=lambda w, d: _small_vocab_ckpt(w, d),
    ),
]


def _edit(path: Path, fn) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


# ---------------------------------------------------------------- running a case ------------------------------


@dataclass
class Outcome:
    rc: int | None
    err: str
    error: BaseException | None = None  # an exception that escaped main (a traceback for the user)


def _run(case: Case, w: SimpleNamespace, d: Path, monkeypatch) -> Outcome:
    """Set the case up in `d`, run its CLI's main in this process (from `d`), return what it did."""
    if case.setup:
        case.setup(w, d)
    argv = case.argv(w, d)
    # A launcher environment of its own only: rank variables left in this process by earlier tests (a CLI that
    # joined ranks in-process) would make the trainer read them instead of the case's scheduler variables.
    from launcher.distributed import SCHEDULER_ENVS

    for k in {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        *(v for names in SCHEDULER_ENVS for v in names[1:] if v),
    } | {k for k in os.environ if k.startswith("SLURM_")}:
        monkeypatch.delenv(k, raising=False)
    for k, v in (case.env or {}).items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(d)
    main = importlib.import_module(case.module).main
    if case.fault:  # last: the setup and the imports run on a sound disk
        case.fault(monkeypatch, w, d)
    err, out, environ = io.StringIO(), io.StringIO(), dict(os.environ)
    try:
        with redirect_stderr(err), redirect_stdout(out):
            rc = main(argv)
    except SystemExit as e:  # argparse's usage errors
        rc = e.code
    except Exception as e:  # noqa: BLE001 - what the user would see as a traceback
        return Outcome(None, err.getvalue(), e)
    finally:  # a CLI that got as far as joining ranks set RANK, MASTER_ADDR, ... for this process
        os.environ.clear()
        os.environ.update(environ)
    return Outcome(rc, err.getvalue())


def _passes(case: Case, o: Outcome, d: Path) -> bool:
    expect = case.expect.replace("{d}", str(d))
    return o.error is None and o.rc == 2 and expect in o.err and "error" in o.err and "Traceback" not in o.err


def _world(case: Case, world, request) -> SimpleNamespace:
    if case.harness:
        return SimpleNamespace(**vars(world), tasks=request.getfixturevalue("tasks"))
    return world


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_one_clear_error_runs_nothing_and_changes_nothing(
    case, world, tmp_path, monkeypatch, request
):
    w, d = _world(case, world, request), tmp_path
    if case.setup:  # the snapshot is taken after the setup, which writes the bad input itself
        case.setup(w, d)
    before = _snapshot(d, w.root, w.tokens)
    t0 = time.perf_counter()
    o = _run(Case(**{**vars(case), "setup": None}), w, d, monkeypatch)
    assert o.error is None, f"{type(o.error).__name__} escaped main: {o.error}"
    assert _passes(case, o, d), f"exit {o.rc}; expected {case.expect!r} in stderr:\n{o.err}"
    assert time.perf_counter() - t0 < 30, "refused, but only after expensive work"
    assert not (d / PWNED).exists(), "the payload ran"
    after = _snapshot(d, w.root, w.tokens)
    changed = [p for p, h in before.items() if after.get(p) != h]
    created = sorted(set(after) - set(before))
    assert not changed and not created, f"changed {changed[:5]}, created {created[:5]}"


def test_the_catalogue_covers_every_class_and_cli():
    assert len({c.name for c in CASES}) == len(CASES)
    for cls in (1, 2, 3, 4, 5, 6):
        assert sum(c.cls == cls for c in CASES) >= 10, cls
    assert {c.module for c in CASES} >= {
        LAUNCH,
        TRAIN,
        EVAL,
        GEN,
        GATE,
        EXPERTS,
        HF,
        HARNESS,
        DRYRUN,
        FLOPS,
        Z2F,
        BTX,
        FIGURES,
        PREPARE,
        INGEST,
        CLUSTER,
        COSTMODEL,
        HF_TOK,
    }


SUBPROCESS_CASES = ["launch-hostfile-proxycommand", "launch-set-python-tag", "eval-meta-without-ffn"]


@pytest.mark.parametrize("name", SUBPROCESS_CASES)
def test_as_a_command_no_traceback_and_nothing_runs(name, world, tmp_path):
    """The same cases as `python -m <module>`: what a user sees is one error line, exit status 2."""
    case = next(c for c in CASES if c.name == name)
    if case.setup:
        case.setup(world, tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", case.module, *case.argv(world, tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and case.expect in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / PWNED).exists()


# ---------------------------------------------------------------- mutation: each class has one rule --------------


def _disable(monkeypatch, module: str, name: str, replacement) -> None:
    """Replace `module.name` by `replacement` there and in every module that imported it by name."""
    original = getattr(importlib.import_module(module), name)
    for mod in list(sys.modules.values()):
        if getattr(mod, "__dict__", {}).get(name) is original:
            monkeypatch.setattr(mod, name, replacement)


def _plain_yaml(text: str, source: str):
    import yaml

    return yaml.safe_load(text)


@contextmanager
def _old_staged_dir(final: Path, manifest: str | None = None, shared: bool = False) -> Iterator[Path]:
    """The writers before the class-3 rule: a temporary sibling, published on success, left behind on a failure."""
    from data.atomic import atomic_dir, commit_dir

    tmp = atomic_dir(Path(final))
    yield tmp
    commit_dir(tmp, Path(final))


@contextmanager
def _no_cleanup(final: Path, *staged: Path, made: list | None = None) -> Iterator[None]:
    yield


MUTATIONS = {
    1: [
        ("data.argtypes", "host_problem", lambda name: None),
        ("launcher.harness", "verify_tasks_dir", lambda tasks_dir: {}),
    ],
    4: [
        ("data.argtypes", "check_range", lambda value, rng: None),
        ("launcher.evaluation.evaluate", "check_eval_request", lambda *a, **k: None),
    ],
    2: [("data.cli", "check_output_dir", lambda *a, **k: None)],
    3: [
        ("data.atomic", "staged_dir", _old_staged_dir),
        ("data.atomic", "discard_on_failure", _no_cleanup),
        ("data.atomic", "disk_full_error", lambda *a, **k: None),
    ],
    5: [("data.catalog", "token_file_problems", lambda *a, **k: [])],
    6: [("data.readers", "load_yaml", _plain_yaml), ("data.readers", "shape_problems", lambda *a, **k: [])],
}


@pytest.mark.parametrize("cls", sorted(MUTATIONS))
def test_without_the_shared_rule_the_cases_of_its_class_fail(cls, world, tmp_path, monkeypatch, request):
    """The control: with the class's rule disabled (accepting everything), every case of the class that can safely run
    unguarded (no hang, no training) no longer gets its clear error - so it is that rule which refuses them. Class 3:
    with the writers' old behaviour (no cleanup, no translation) every failure also leaves files behind."""
    lm_eval = importlib.util.find_spec("lm_eval") is not None
    cases = [c for c in CASES if c.rule == cls and c.mutable and (lm_eval or not c.harness)]
    for module in {c.module for c in cases} | {m for m, _, _ in MUTATIONS[cls]}:
        importlib.import_module(module)  # imported before the rule is patched in every importer
    for module, name, replacement in MUTATIONS[cls]:
        _disable(monkeypatch, module, name, replacement)
    left_behind = []
    for case in cases:
        d, w = tmp_path / case.name, _world(case, world, request)
        d.mkdir()
        if case.setup:
            case.setup(w, d)
        before = set(_snapshot(d))
        with monkeypatch.context() as m:
            o = _run(Case(**{**vars(case), "setup": None}), w, d, m)
        assert not _passes(case, o, d), (
            f"{case.name} is still refused with its rule disabled: something else guards it"
        )
        if case.name == "harness-check-changed-utils":
            assert (d / PWNED).exists(), "unverified, lm-eval imports the changed utils.py: its code runs"
        if set(_snapshot(d)) - before:
            left_behind.append(case.name)
    assert len(cases) >= 8, [c.name for c in cases]
    # every writer failing on a full disk: no "no space left on device writing OUT", and a half output
    if cls == 3:
        assert len(cases) == (9 if lm_eval else 8), [c.name for c in cases]
        assert left_behind == [c.name for c in cases]


# ---------------------------------------------------------------- the rules themselves ---------------------------


def test_host_rule():
    from data.argtypes import check_host_filter, host_problem

    for good in (
        "node0",
        "gpu-003.cluster.local",
        "localhost",
        "10.0.0.1",
        "::1",
        "fe80::1",
        "a" * 63,
        "123",
        "n1.",
    ):
        assert host_problem(good) is None, good
    for bad in (
        "",
        "-oProxyCommand=x",
        "node 0",
        "a;b",
        "$(x)",
        "`x`",
        "a/b",
        "..",
        "a..b",
        "-a",
        "a-",
        "a" * 64,
        "nöde",
        "a\nb",
        "a,b",
        "a:b",
        "a@b",
        "*",
        "~",
        "a|b",
        "a&b",
        "'a'",
        '"a"',
        "a" * 254,
    ):
        assert host_problem(bad), bad
    assert check_host_filter("node0@node1:0,2") == "node0@node1:0,2"
    for bad in ("node0:x", "-o@node1", "node0:0;1", "a b"):
        with pytest.raises(ValueError):
            check_host_filter(bad)


def test_range_rule():
    import argparse

    from data import argtypes as at

    assert at.positive_int("3") == 3 and at.nonneg_int("0") == 0 and at.port("65535") == 65535
    assert (
        at.unit_left_open("1") == 1.0
        and at.open_unit("0.5") == 0.5
        and at.random_seed(str(2**32 - 1)) == 2**32 - 1
    )
    for rng, text in (
        (at.positive_int, "0"),
        (at.positive_int, "-1"),
        (at.positive_int, "1.5"),
        (at.port, "0"),
        (at.port, "65536"),
        (at.random_seed, "-1"),
        (at.positive_float, "0"),
        (at.finite_float, "nan"),
        (at.finite_float, "inf"),
        (at.finite_float, "-inf"),
        (at.finite_float, "1e999"),
        (at.unit_left_open, "0"),
        (at.open_unit, "1"),
        (at.unit_right_open, "1"),
        (at.nonneg_float, "-0.1"),
        (at.unit_closed, "1.01"),
        (at.nonneg_int, "x"),
    ):
        with pytest.raises(argparse.ArgumentTypeError):
            rng(text)
    with pytest.raises(ValueError, match="decay='nan' is not a finite number"):
        at.unit_left_open.parse("nan", "decay")


def test_mixture_weights_rule():
    from model.mixture import mixture_weights

    assert mixture_weights([1, 3], "w") == [0.25, 0.75] and mixture_weights([0, 2.0], "w") == [0.0, 1.0]
    for bad in (
        [0, 0],
        [],
        [float("nan"), 1],
        [float("inf"), 1],
        [-1, 2],
        [1e308, 1e308],
        ["a", 1],
        [True, 1],
    ):
        with pytest.raises(ValueError):
            mixture_weights(bad, "w")


def test_yaml_rule_is_fast_safe_and_names_the_source():
    from data.readers import InputFileError, load_yaml

    # within budget
    assert load_yaml("a: &x [1, 2]\nb: *x\n<<: {c: 3}\n", "s") == {
        "a": [1, 2],
        "b": [1, 2],
        "c": 3,
    }
    t0 = time.perf_counter()
    for text, why in (
        (BOMB, "alias bomb"),
        ("&a [*a]", "contains it"),
        ("!!python/object/apply:os.system [x]", "refused"),
        ("[1", "expected ',' or ']'"),
        ("a: 1\n---\nb: 2\n", "single document"),
        ("!!python/name:os.system", "refused"),
    ):
        with pytest.raises(InputFileError, match=r"^--set 'k=v' is not valid YAML") as e:
            load_yaml(text, "--set 'k=v'")
        assert why in str(e.value), (text, str(e.value))
    assert time.perf_counter() - t0 < 2


def test_json_shape_rule():
    from data.readers import shape_problems

    shape = {
        "format": str,
        "layout": dict,
        "config": {"model": {"ffn": {"kind": str}}},
        "step?": int,
        "x?": float,
    }
    ok = {"format": "f", "layout": {}, "config": {"model": {"ffn": {"kind": "demix"}}}, "x": 1}
    assert shape_problems(ok, shape) == []
    assert shape_problems({**ok, "layout": []}, shape) == ["layout is [] (list), expected an object"]
    assert shape_problems({**ok, "config": {"model": {}}}, shape) == ["config.model.ffn is missing"]
    assert shape_problems({**ok, "step": True}, shape) == ["step is true (bool), expected an integer"]
    assert shape_problems([], shape) == ["the top level is list, expected an object"]


# ---------------------------------------------------------------- the chokepoints --------------------------------


def _project_files():
    for pkg in ("data", "model", "parallel", "launcher", "benchmarks", "experiments", "scripts"):
        yield from sorted((REPO / pkg).rglob("*.py"))


def test_every_yaml_read_goes_through_the_one_loader():
    """data/readers.py `load_yaml` is the only YAML parser in the project (safe, alias-budgeted, errors named)."""
    hits = []
    for path in _project_files():
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if any(
                f"yaml.{f}(" in code
                for f in (
                    "load",
                    "safe_load",
                    "full_load",
                    "unsafe_load",
                    "load_all",
                    "safe_load_all",
                    "compose",
                    "parse",
                )
            ):
                hits.append(f"{path.relative_to(REPO)}:{i}")
    assert hits == [f"data/readers.py:{_line_of(REPO / 'data/readers.py', 'yaml.load(')}"], hits


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line.split("#")[0])


def test_every_numeric_option_has_a_typed_range():
    """No CLI parses a number with a bare int/float (data/argtypes.py's types check the range at parse time);
    `choices=` lists are ranges of their own."""
    bare = []
    for path in _project_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                kw = {k.arg: k.value for k in node.keywords}
                if (
                    isinstance(kw.get("type"), ast.Name)
                    and kw["type"].id in ("int", "float")
                    and "choices" not in kw
                ):
                    bare.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not bare, bare


# ---------------------------------------------------------------- DeepSpeed's runner: what reaches a shell -------


def test_the_ssh_check_would_run_an_option_like_host(tmp_path):
    """The control for class 1: DeepSpeed's runner checks the first host with
    `shlex.split(f"ssh -o PasswordAuthentication=no {first_host} hostname")` (runner.py); a host named
    -oProxyCommand=... becomes an ssh option and ssh runs the command here. The host rule refuses that name."""
    from data.argtypes import host_problem

    if not shutil.which("ssh"):
        pytest.skip("no ssh client")
    host = f"-oProxyCommand=touch${{IFS}}{tmp_path / PWNED}"
    subprocess.run(
        shlex.split(f"ssh -o PasswordAuthentication=no {host} hostname"),
        capture_output=True,
        timeout=60,
        env={**os.environ, "HOME": str(tmp_path)},
    )
    assert (tmp_path / PWNED).exists(), "the control did not run the payload"
    assert "starts with '-'" in host_problem(host)


PDSH_WORDS = [
    "--set",
    "data.path=/runs/$(touch PWNED)",
    "--set",
    "x=`touch PWNED`",
    "a;touch PWNED",
    "data.domains=[a, b]",
    'q="quoted with space $(touch PWNED)"',
    "back\\slash \\$HOME",
    "it's",
    "*",
    "",
    "tab\there",
    "~root",
]


def _remote_shell_words(words: list[str], cwd: Path, check: bool = True) -> list[str]:
    """What the remote shell pdsh runs makes of `words` after DeepSpeed's PDSHRunner prepared them (its own
    parse_user_args: double quotes around words with a space), the command joined with spaces as pdsh sends it."""
    from deepspeed.launcher.multinode_runner import PDSHRunner

    runner = PDSHRunner(SimpleNamespace(user_args=list(words), user_script="x", launcher_args=""), "")
    script = "printf '%s\\0' " + " ".join(runner.user_arguments)
    out = subprocess.run(["sh", "-c", script], cwd=cwd, capture_output=True, text=True, check=check).stdout
    return out.split("\0")[:-1]


def test_pdsh_words_reach_the_remote_shell_unchanged(tmp_path):
    """With the pdsh launcher on several hosts, DeepSpeed pastes the trainer's arguments (paths, --set values) into a
    shell command line; `pdsh_word` writes them so that shell gives back exactly what was meant, runs nothing."""
    from launcher.launch import pdsh_word

    assert _remote_shell_words([pdsh_word(w) for w in PDSH_WORDS], tmp_path) == PDSH_WORDS
    assert not (tmp_path / PWNED).exists()
    # the control: DeepSpeed's own quoting runs the payloads (without "it's", whose lone quote breaks the line)
    _remote_shell_words([w for w in PDSH_WORDS if "'" not in w], tmp_path, check=False)
    assert (tmp_path / PWNED).exists()


def test_launch_encodes_the_trainer_arguments_only_for_pdsh_on_several_hosts(tmp_path):
    from launcher.launch import build_command, parse_args

    (tmp_path / "hosts").write_text("node0 slots=1\nnode1 slots=1\n")
    sets = ["--set", "data.path=/d/$(x)"]
    pdsh = build_command(parse_args(["--hostfile", str(tmp_path / "hosts"), *sets]), tmp_path / "run", 29500)
    assert "'data.path=/d/$(x)'" in pdsh
    for extra in (["--launcher", "openmpi"], ["--include", "node0"], ["--no-ssh", "--node-rank", "0"]):
        cmd = build_command(
            parse_args(["--hostfile", str(tmp_path / "hosts"), *extra, *sets]), tmp_path / "run", 29500
        )
        # argv of mpirun/srun or a local launch: no shell, no quoting
        assert "data.path=/d/$(x)" in cmd, extra
    assert "data.path=/d/$(x)" in build_command(parse_args(["--nproc", "2", *sets]), tmp_path / "run", 29500)
