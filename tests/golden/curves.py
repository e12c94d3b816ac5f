"""Golden loss curves, kept as torchtitan keeps them: the exact losses of the first `STEPS` optimizer steps of a tiny
Dense, DEMix and GShard run on `WORLD` gloo ranks, stored in tests/golden/<kind>.json and compared with `==`.

A CPU run with one thread per rank is deterministic (same data order, same seeded init, the same reductions in the
same order), so a change to the numerics - the model, its init, the data pipeline, the optimizer recipe, the gradient
reduction - moves some loss in its last bits and fails the comparison (a one-ulp move of one init weight does:
`NUDGE`); `record` (the command `RECORD_COMMAND`) writes the files again after a deliberate change.

The runs go through the real trainer (`launcher.train.train` on ranks forked by tests/harness/multirank.py, as
tests/e2e/test_train.py `reference_run` does), all architectures one after another in the same ranks to share the
start-up. The corpus is the `tiny_tokens` fixture's (tests/conftest.py), fingerprinted in the record so that a change
to it is named as such.
"""

from __future__ import annotations

import hashlib
import json
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

GOLDEN_DIR = Path(__file__).resolve().parent
KINDS: tuple[str, ...] = ("dense", "demix", "gshard")
STEPS = 8
WORLD = 2
RECORD_COMMAND = "python -m tests.golden.record"
FORMAT = "demix-golden-curve/1"
# data.path in the stored overrides: the corpus is built per session (tiny_tokens), its content is `corpus_sha256`
TOKENS_PLACEHOLDER = "<tiny_tokens>"
# The element the self-test moves by one ulp after initialisation (tests/golden/test_golden_curves.py): a weight
# every token's forward pass goes through. Measured on the dense run: +1 ulp here changes the losses from step 2 on,
# whereas +1 ulp at wte.weight[0, 0] (token 0's embedding, a token the tiny corpus never holds: it only enters the
# softmax) or at a zero-initialised bias (+1 ulp of 0.0 is a subnormal) leaves all 8 fp32 losses unchanged.
NUDGE = ("blocks.0.attn.qkv.weight", 0)  # (parameter name, index into the flattened tensor)


class GoldenMismatch(AssertionError):
    """A run's losses (or its inputs) differ from the golden record."""


def overrides(kind: str, tokens: str = TOKENS_PLACEHOLDER) -> list[str]:
    """The run's `--set` overrides: the tiny model the other multi-rank tests use, fp32, a fixed seed."""
    return [
        "model.preset=tiny",
        "model.n_layers=2",
        "model.d_model=64",
        "model.n_heads=2",
        "model.seq_len=32",
        f"model.ffn.kind={kind}",
        f"data.path={tokens}",
        "data.tokenizer=gpt2",
        f"data.mixture={'by_domain' if kind == 'demix' else 'natural'}",
        f"train.steps={STEPS}",
        "train.micro_batch=2",
        "train.grad_accum=2",
        "train.lr=3e-3",
        "train.seed=1234",
        "train.precision=fp32",
        "train.eval_batches=1",
        "train.save_interval=0",
        "parallel.zero_stage=0",
        "logging.log_interval=1",
        "logging.wandb_mode=disabled",
        "logging.progress_bar=false",
    ]


def build_corpus(root: Path) -> Path:
    """The `tiny_tokens` fixture's corpus under `root` (tests/conftest.py `build_tiny_tokens`); returns the tokens
    root. For the recording, which runs outside pytest; the test uses the fixture itself."""
    from tests.conftest import build_tiny_tokens

    return build_tiny_tokens(root)


def corpus_sha256(tokens: Path) -> str:
    """One digest of the prepared token files (every domain's .bin and .idx, by relative path); the manifest is left
    out: it names the folder the corpus was built in."""
    h = hashlib.sha256()
    for p in sorted((Path(tokens) / "gpt2").glob("*/*")):
        if p.suffix in (".bin", ".idx"):
            h.update(p.relative_to(tokens).as_posix().encode() + b"\0")
            h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def environment() -> dict[str, str]:
    """What the last bits of a CPU run depend on besides the code: torch, DeepSpeed, the CPU's kernel family."""
    from importlib.metadata import version

    import torch

    cpu, vendor = platform.machine(), "unknown"
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        names = [ln for ln in info if ln.startswith("model name")]
        cpu = names[0].split(":", 1)[1].strip() if names else cpu
        vendors = [ln for ln in info if ln.startswith("vendor_id")]
        vendor = vendors[0].split(":", 1)[1].strip() if vendors else vendor
    except OSError:
        pass
    return {
        "torch": torch.__version__,
        "deepspeed": version("deepspeed"),
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_vendor": vendor,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


# What the last bits of the losses depend on besides the code: a recording is only compared where these are the same.
KERNEL_KEYS = ("torch", "deepspeed", "cpu_vendor", "cpu_capability")


def other_kernels(recorded: dict[str, str], now: dict[str, str] | None = None) -> str | None:
    """Why this machine cannot be held to `recorded` bit for bit (torch or DeepSpeed of another version, another CPU
    vendor or kernel family: AVX2 and AVX-512 sum in another order), or None when it can. Tests must pass on any x86
    CPU: there the exact comparison is skipped with this reason, and the one-ulp self-test still runs."""
    now = environment() if now is None else now
    differ = [
        f"{k} {recorded.get(k)!r} -> {now.get(k)!r}" for k in KERNEL_KEYS if recorded.get(k) != now.get(k)
    ]
    if not differ:
        return None
    return (
        f"the golden curves were recorded with other kernels ({'; '.join(differ)}): the last bits legitimately "
        f"differ; record them on this machine with `{RECORD_COMMAND}` to compare here"
    )


def _nudge_init(name: str, index: int) -> Any:
    """Patch `GPT.reset_parameters` so that element `index` of parameter `name` ends one ulp higher; returns the
    original to restore."""
    import torch

    from model.gpt import GPT

    original = GPT.reset_parameters

    def nudged(self: Any, seed: int) -> None:
        original(self, seed)
        with torch.no_grad():
            flat = dict(self.named_parameters())[name].view(-1)
            flat[index] = torch.nextafter(flat[index], torch.tensor(float("inf"), dtype=flat.dtype))

    GPT.reset_parameters = nudged
    return original


def train_runs(rank: int, world: int, tokens: str, out: str, runs: Sequence[tuple]) -> None:
    """On each rank (tests/harness/multirank.py): train every `(label, kind, nudge)` run in turn into `out/label`,
    through the real trainer; `nudge` is None or `(parameter name, flat index)` moved by one ulp after init."""
    from launcher.config import load_run_config
    from launcher.plan import make_plan
    from launcher.train import train
    from model.gpt import GPT

    for label, kind, nudge in runs:
        original = _nudge_init(*nudge) if nudge else None
        try:
            plan = make_plan(load_run_config(None, overrides(kind, tokens), check=False), world)
            train(plan, Path(out) / label, resume="never")
        finally:
            if original is not None:
                GPT.reset_parameters = original


def run_curves(tokens: Path, out: Path, runs: Sequence[tuple]) -> dict[str, list[float]]:
    """`train_runs` on `WORLD` forked ranks (one start-up for all runs); returns each label's training losses in
    step order (steps 1..STEPS)."""
    from launcher.metrics import read_metrics
    from tests.harness.multirank import run_ranks

    run_ranks(train_runs, WORLD, args=(str(tokens), str(out), list(runs)))
    curves = {}
    for label, _, _ in runs:
        recs = [r for r in read_metrics(Path(out) / label / "metrics.jsonl") if r.get("kind") == "train"]
        assert [r["step"] for r in recs] == list(range(1, STEPS + 1)), (label, [r["step"] for r in recs])
        curves[label] = [float(r["loss"]) for r in recs]
    return curves


def path_of(kind: str, golden_dir: Path = GOLDEN_DIR) -> Path:
    return Path(golden_dir) / f"{kind}.json"


def _shown(path: Path) -> str:
    """`path` relative to the repository when inside it (as messages name files)."""
    try:
        return path.relative_to(GOLDEN_DIR.parents[1]).as_posix()
    except ValueError:
        return str(path)


def make_record(
    kind: str, losses: Sequence[float], tokens: Path, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """The golden file's content for `kind`: the losses (hex, exact; decimal for reading), what produced them
    (`env`: `environment()` unless given)."""
    return {
        "format": FORMAT,
        "about": (
            f"Training losses of the first {len(losses)} steps of a tiny {kind} run on {WORLD} gloo ranks (CPU, "
            "fp32), compared exactly by tests/golden/test_golden_curves.py. 'hex' is the value (float.hex); "
            "'decimal' is its repr, for reading."
        ),
        "kind": kind,
        "world_size": WORLD,
        "steps": len(losses),
        "losses": [{"step": i + 1, "hex": v.hex(), "decimal": repr(v)} for i, v in enumerate(losses)],
        "overrides": overrides(kind),
        "corpus": {
            "built_by": "tests/conftest.py tiny_tokens (write_corpus, prepare_corpus with the gpt2 tokenizer)",
            "sha256": corpus_sha256(tokens),
        },
        "recorded_with": environment() if env is None else env,
        "record_command": RECORD_COMMAND,
    }


def write_record(record: dict[str, Any], golden_dir: Path = GOLDEN_DIR) -> Path:
    path = path_of(record["kind"], golden_dir)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def load_record(kind: str, golden_dir: Path = GOLDEN_DIR) -> dict[str, Any]:
    path = path_of(kind, golden_dir)
    if not path.is_file():
        raise GoldenMismatch(f"no golden curve {path}: record it with `{RECORD_COMMAND}`")
    return json.loads(path.read_text())


def _fmt(v: float | None) -> str:
    return "(none)" if v is None else f"{v!r} ({v.hex()})"


def compare(
    kind: str,
    got: Sequence[float],
    golden: dict[str, Any] | None = None,
    tokens: Path | None = None,
    env: dict[str, str] | None = None,
) -> None:
    """Raise GoldenMismatch unless `got` (losses of steps 1..) equals the golden record exactly (`==`, every step),
    and, with `tokens`, the corpus is the recorded one. The message names every differing step (expected, got,
    difference), what differs in the inputs, the versions and CPU that differ from the recording's (a torch upgrade
    or another CPU's kernels legitimately move the last bits), and the command that records the curves again."""
    golden = load_record(kind) if golden is None else golden
    want = [float.fromhex(e["hex"]) for e in golden["losses"]]
    problems = []
    for i in range(max(len(want), len(got))):
        w = want[i] if i < len(want) else None
        g = float(got[i]) if i < len(got) else None
        if w != g:
            diff = f", diff {g - w:+.3e}" if w is not None and g is not None else ""
            problems.append(f"  step {i + 1}: expected {_fmt(w)}, got {_fmt(g)}{diff}")
    causes = []
    if golden.get("overrides") != overrides(kind):
        causes.append(
            f"the run's overrides (tests/golden/curves.py `overrides`) are not the recorded ones:\n"
            f"    recorded {golden.get('overrides')}\n    now      {overrides(kind)}"
        )
    if tokens is not None and golden.get("corpus", {}).get("sha256") != corpus_sha256(tokens):
        causes.append(
            "the tiny corpus (tests/conftest.py tiny_tokens) is not the recorded one (its sha256 differs)"
        )
    if not problems and not causes:
        return
    env = environment() if env is None else env
    recorded = golden.get("recorded_with", {})
    notes = [
        f"recorded with {key} {recorded.get(key)!r}, running {env.get(key)!r}"
        for key in ("torch", "deepspeed", "cpu", "cpu_capability")
        if recorded.get(key) != env.get(key)
    ]
    where = _shown(path_of(kind))
    lines = (
        [f"{kind}: the losses differ from the golden curve {where} at {len(problems)} step(s):", *problems]
        if problems
        else [f"{kind}: every loss equals the golden curve {where}, but it was recorded from other inputs:"]
    )
    lines += [f"input changed: {c}" for c in causes]
    lines += [f"note: {n}" for n in notes]
    lines.append(
        "If this change of numerics is deliberate (model, init, data, recipe, a torch upgrade), record the curves "
        f"again with `{RECORD_COMMAND}` and commit tests/golden/*.json (docs/testing.md, golden loss curves)."
    )
    raise GoldenMismatch("\n".join(lines))
