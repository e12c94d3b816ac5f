"""HFU counts the LM head's forward that the chunked loss recomputes in backward; MFU does not.

The trainer's head + loss (model/gpt.py `chunked_token_loss`) runs in checkpointed chunks of max(1, 2^26 // V_local)
tokens once a micro-batch has more tokens than that, and backward recomputes each chunk's logits: 2·B·s·h·V more
FLOPs per update. The logged record is checked against a count by hand, and the rule (`head_recomputed`) against the
matmuls the running model executes (torch's FlopCounterMode).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from model import accounting as acc

PEAK = 989.0  # h100-sxm, bf16 dense TFLOP/s


def _plan(ac: str, seq_len: int, tp: int = 1):
    from data.catalog import Catalog
    from launcher.config import load_run_config
    from launcher.plan import Plan, plan_layout

    cfg = load_run_config(
        None,
        [
            "model.preset=tiny",
            "model.n_layers=2",
            "model.d_model=64",
            "model.n_heads=2",
            f"model.seq_len={seq_len}",
            "model.vocab_size=50257",
            "train.micro_batch=2",
            "train.grad_accum=4",
            "train.precision=bf16",
            f"train.activation_checkpointing={ac}",
            f"parallel.tensor_parallel={tp}",
            "data.mixture=natural",
        ],
        check=False,
    )
    layout = plan_layout(cfg, tp, ["a"])
    assert not layout.problems, layout.problems
    return Plan(layout.cfg, Catalog(cfg.data.path, "random", 50257, 0, ("a",), (), {}), layout.topo, notes=())


# (activation checkpointing, seq_len, tensor parallel, does the head recompute): 2 x 1024 tokens per micro-batch
# against chunks of 2^26 // 50304 = 1334 rows (tp 1) or 2^26 // 25216 = 2661 rows (tp 2: half the padded vocabulary
# 50432 per rank); 2 x 512 = 1024 tokens fit one chunk.
CASES = [
    ("none", 1024, 1, True),
    ("full", 1024, 1, True),
    ("none", 512, 1, False),
    ("full", 512, 1, False),
    ("none", 1024, 2, False),
]


@pytest.mark.parametrize("ac, seq_len, tp, head", CASES, ids=[f"{a}-s{s}-tp{t}" for a, s, t, _ in CASES])
def test_logged_hfu_adds_the_recomputed_head_forward_and_mfu_does_not(
    monkeypatch, ac, seq_len, tp, head
) -> None:
    import launcher.train as train

    plan = _plan(ac, seq_len, tp)
    monkeypatch.setattr(train, "device_name", lambda: "h100-sxm")
    rec = train.throughput_record(plan, seconds=2.0, steps=4)
    # By hand (F = 4h; V unpadded, the paper's, as the record counts it): B = 2 x 4 sequences per update.
    B, s, l, h, V = 8, seq_len, 2, 64, 50257
    layer = l * (24 * B * s * h * h + 4 * B * s * s * h)
    logit = 2 * B * s * h * V
    model = 3 * layer + 3 * logit
    hardware = (4 if ac == "full" else 3) * layer + (4 if head else 3) * logit

    def tflops(flops: int) -> float:  # TFLOP/s per GPU: 4 updates in 2 s on tp ranks
        return flops / (0.5 * tp) / 1e12

    assert acc.head_recomputed(2 * seq_len, plan.cfg.model.padded_vocab_size(tp) // tp, 1 << 26) == head
    assert rec["mfu"] == pytest.approx(tflops(model) / PEAK, rel=1e-12)
    assert rec["hfu"] == pytest.approx(tflops(hardware) / PEAK, rel=1e-12)
    assert rec["tflops_per_gpu"] == pytest.approx(tflops(hardware), rel=1e-12)
    # conventions unchanged
    assert rec["tflops_per_gpu_no_recompute"] == pytest.approx(tflops(model), rel=1e-12)
    assert rec["tflops_per_gpu_recompute"] == pytest.approx(tflops(4 * layer + 3 * logit), rel=1e-12)


def test_head_recompute_rule() -> None:
    assert (
        acc.head_recomputed(1334, 50304, 1 << 26) is False
        and acc.head_recomputed(1335, 50304, 1 << 26) is True
    )
    assert acc.head_recomputed(2, 10**9, 1 << 26) is True  # a vocabulary over the budget: chunks of one row
    assert acc.head_recomputed(1, 10**9, 1 << 26) is False
    rep = acc.flops_per_update(_plan("none", 512).cfg.model, 8, vocab_size=50257)
    assert rep.hardware(False, False) == rep.no_recompute and rep.hardware(True, False) == rep.recompute
    assert rep.hardware(True, True) - rep.recompute == rep.logit_forward == 2 * 8 * 512 * 64 * 50257


@pytest.mark.parametrize("chunk_rows", [100, 256], ids=["chunked-recomputes", "one-chunk"])
def test_running_model_executes_what_hardware_flops_count(chunk_rows: int) -> None:
    """A training forward + backward (`return_logits=False`, the trainer's path) of a real GPT counts exactly
    `FlopsReport.hardware(False, head_recomputed(...))` matmul FLOPs: with 256 tokens in chunks of 100 the head's
    forward runs twice, in one chunk of 256 once (math SDPA: the attention's own matmuls, as the formula counts)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from launcher.config import load_run_config
    from model.gpt import GPT

    cfg = load_run_config(
        None,
        [
            "model.preset=tiny",
            "model.n_layers=2",
            "model.d_model=64",
            "model.n_heads=4",
            "model.seq_len=64",
            "model.vocab_size=500",
            "model.dropout=0.0",
            "data.mixture=natural",
        ],
    ).model
    torch.manual_seed(0)
    model = GPT(cfg, init_seed=0).train()
    V = cfg.padded_vocab_size()  # 512: the head multiplies by every row
    model.loss_chunk_logits = chunk_rows * V
    tokens = torch.randint(0, 500, (4, 64), generator=torch.Generator().manual_seed(1))
    with contextlib.ExitStack() as stack:
        stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        counter = stack.enter_context(FlopCounterMode(display=False))
        model(tokens, targets_BT=tokens, return_logits=False).loss.backward()
    head = acc.head_recomputed(4 * 64, V, model.loss_chunk_logits)
    assert head == (chunk_rows < 256)
    rep = acc.flops_per_update(cfg, 4, vocab_size=V)
    assert counter.get_total_flops() == rep.hardware(False, head)
    assert counter.get_total_flops() - rep.no_recompute == (2 * 4 * 64 * 64 * V if head else 0)
