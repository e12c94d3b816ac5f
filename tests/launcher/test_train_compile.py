"""`train.compile: true` (launcher/train.py compile_model): the same training as eager, the same state-dict keys.

One rank trains a tiny dense model (whole blocks compiled) and a tiny CSE model (attention and expert MLPs compiled,
routing eager) for four steps, eagerly and compiled. CSE clusters after the first step, with an evaluation forward
before it: its clustering captures the layers' inputs with forward hooks added then, which a compiled caller would
have ignored (torch._dynamo skips guards on module hooks).

Tolerance: everything is fp32; inductor fuses the LayerNorms, GELU, bias and residual adds into C++ kernels that sum
in another order, ~1e-7 relative per op. Measured here: at most 4.4e-8 relative in the loss over the four steps (dense
and CSE). rtol 1e-5 leaves room for other x86 CPUs (inductor vectorises for the CPU's own SIMD width, which changes
the summation order again), while a real fault (a block not run, a stale routing, hooks skipped) moves the loss by
more than 1e-3 or fails outright.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.harness.multirank import run_ranks

RTOL = 1e-5
_CXX = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(
    not _CXX,
    reason="torch.compile (inductor) on CPU builds C++ kernels: no C++ compiler "
    "(g++, c++, clang++ or $CXX) on this machine",
)

_CSE_SETS = [
    "model.ffn.num_experts=4",
    "model.ffn.cse.num_samples=16",
    "model.ffn.cse.dbscan_eps=0.0",
    "model.ffn.cse.dbscan_auto=target",
    "model.ffn.cse.min_clusters=2",
    "model.ffn.cse.dbscan_min_samples=2",
    "model.ffn.cse.warmup_fraction=0.25",
]


def _train(rank: int, world: int, tokens: str, kind: str, compiled: bool, run_dir: str) -> dict:
    import torch

    from launcher.config import load_run_config
    from launcher.plan import make_plan
    from launcher.train import Trainer, train_step
    from model.cse import cse_layers

    sets = [
        "model.preset=tiny",
        "model.n_layers=2",
        "model.d_model=64",
        "model.n_heads=2",
        "model.seq_len=32",
        "model.dropout=0.0",
        f"model.ffn.kind={kind}",
        f"data.path={tokens}",
        "data.tokenizer=gpt2",
        "data.domains=[cooking,sailing]",
        "data.mixture=natural",
        "train.steps=4",
        "train.micro_batch=2",
        "train.grad_accum=2",
        f"train.compile={str(compiled).lower()}",
        "logging.wandb_mode=disabled",
        "logging.progress_bar=false",
        *(_CSE_SETS if kind == "cse" else []),
    ]
    plan = make_plan(load_run_config(None, sets), world)
    trainer = Trainer.setup(plan, Path(run_dir), resume="never")
    model = trainer.bundle.engine.module
    losses = []
    for s in range(4):
        if s == 1:  # an evaluation forward before CSE's hooks are added (at the clustering, just below)
            model.eval()
            with torch.no_grad():
                b = trainer.batches(s)[0]
                model(b["tokens"], b["expert_ids"], targets_BT=b["targets"], return_logits=False)
            model.train()
        out = train_step(trainer.bundle, plan.cfg, trainer.batches(s), len(plan.catalog.train_domains))
        losses.append(float(out.domain_sums[0].sum() / out.domain_sums[1].sum()))
        if trainer.hook is not None:
            trainer.hook.after_step(s + 1, lambda i, d=s + 1: trainer.batches(d, i, 1)[0])
    return {
        "losses": losses,
        "keys": list(model.state_dict()),
        "clusters": [m.active for m in cse_layers(model)],
        "compiled": sorted(n for n, m in model.named_modules() if m._compiled_call_impl is not None),
    }


@pytest.mark.parametrize("kind", ["dense", "cse"])
def test_compiled_training_matches_eager(tiny_tokens, kind: str) -> None:
    eager, compiled = (
        run_ranks(_train, 1, args=(str(tiny_tokens), kind, c, tempfile.mkdtemp()))[0] for c in (False, True)
    )
    assert eager["compiled"] == []
    want = (
        ["blocks.0", "blocks.1"]
        if kind == "dense"
        else [
            f"blocks.{i}.{part}" for i in (0, 1) for part in ["attn"] + [f"ffn.experts.{e}" for e in range(4)]
        ]
    )
    assert compiled["compiled"] == want
    assert compiled["keys"] == eager["keys"] and not any("_orig_mod" in k for k in compiled["keys"])
    assert compiled["clusters"] == eager["clusters"]
    if kind == "cse":
        assert any(k >= 2 for k in compiled["clusters"]), compiled["clusters"]  # the hooks fired, routing ran
    worst = max(abs(c / e - 1) for c, e in zip(compiled["losses"], eager["losses"]))
    print(
        f"{kind}: losses eager {eager['losses']}, compiled {compiled['losses']}, "
        f"largest relative difference {worst:.2e}"
    )
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=RTOL)
    assert len(set(eager["losses"])) == 4  # it trained


def test_compile_must_be_a_bool() -> None:
    from launcher.config import ConfigError, load_run_config

    assert load_run_config(None, []).train.compile is False
    assert load_run_config(None, ["train.compile=true"]).train.compile is True
    for bad in ("1", "fast"):
        with pytest.raises(ConfigError, match=r"train\.compile=.*expected true or false"):
            load_run_config(None, [f"train.compile={bad}"])
