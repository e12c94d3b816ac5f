"""The FLOPs formulas of model/accounting.py against the FLOPs the real model executes.

`torch.utils.flop_counter.FlopCounterMode` counts every matmul-like aten op (mm, addmm, bmm, baddbmm,
convolutions, the fused SDPA kernels) that a forward + backward of a real `model.gpt.GPT` runs; it does not
count elementwise work (LayerNorm, GELU, softmax, masking, the loss, embedding lookups, the optimizer). We
compare that count with `accounting.flops_per_update` (per update of B sequences; per token is the same ratio)
for every FFN kind (dense, demix, gshard, cse) at three scaled-down sizes, in both conventions:

  * no_recompute: a plain forward + backward must count `FlopsReport.no_recompute` (3 passes of every matmul);
  * recompute: the same model with parallel.activation_recompute (what train.activation_checkpointing=full
    applies) must count `FlopsReport.recompute` (4 passes of the layers, 3 of the logit layer).

The counted total must be within 1 % of the formula, and equal to it exactly once the few matmuls the formula
leaves out on purpose are added back one by one (GShard's gate, CSE's dispatch projection). These reference runs
use the math SDPA kernel (the attention's own two matmuls, forward and backward, as the formula counts them),
full recomputation (checkpoint early stop off) and, for GShard, a capacity that drops no route.

`test_default_execution_itemised` then runs what training runs by default (fused SDPA kernel, GShard capacity
factor 1.0 that drops routes, PyTorch's checkpoint early stop) and checks that the difference to the formula is
exactly the sum of the itemised terms listed in the "Checked against the running model" section of
model/accounting.py; `test_deepspeed_gshard_layer_executes_capacity` does the same for the distributed GShard
layer (DeepSpeed's MoE, capacity-padded expert batches). `test_wrong_formulas_are_caught` shows the 1 %
criterion rejects the usual mistakes (no 2x backward, causal halving, unpadded vocabulary, top-1 for top-2, ...).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import pytest
import torch
import torch.utils.checkpoint

try:
    from torch.utils.flop_counter import FlopCounterMode
except ImportError:  # torch < 2.1
    pytest.skip(
        "torch.utils.flop_counter is unavailable in this torch (needs torch >= 2.1): the FLOPs formulas "
        "cannot be checked against the running model",
        allow_module_level=True,
    )

from launcher.config import load_run_config
from model import accounting as acc
from model.config import GShardConfig, ModelConfig
from model.cse import cse_layers
from model.gpt import GPT
from model.gshard import GShardFFN, expert_capacity
from parallel.activation_recompute import apply_activation_recompute

aten = torch.ops.aten
TOL = 0.01  # the criterion: counted matmul FLOPs within 1 % of the formula


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The models are tiny: one intra-op thread is fastest and does not fight other processes for the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _sdpa_fwd(q, k, v) -> int:
    """The counter's formula for a fused SDPA forward: QKᵀ and A·V over the full s x s (causal mask ignored)."""
    b, h, s_q, d = q
    return 2 * (2 * b * h * s_q * k[2] * d)


def _sdpa_bwd(g, q, k, v) -> int:
    """The counter's formula for a fused SDPA backward: dV, dP, dQ, dK and the recomputed QKᵀ (5 matmuls)."""
    return 5 * (2 * q[0] * q[1] * q[2] * k[2] * q[3])


# torch registers FLOP formulas for the CUDA SDPA kernels (flash, efficient, cuDNN) but not for the CPU
# flash kernel; count it with the same formulas so that a CPU run counts what a GPU run does.
CPU_SDPA = {}
if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
    CPU_SDPA = {
        aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *a, out_shape=None, **kw: _sdpa_fwd(
            q, k, v
        ),
        aten._scaled_dot_product_flash_attention_for_cpu_backward: lambda g, q, k, v, *a, out_shape=None, **kw: (
            _sdpa_bwd(g, q, k, v)
        ),
    }


@dataclass(frozen=True)
class Size:
    n_layers: int
    d_model: int
    seq_len: int
    vocab: int  # unpadded; the model pads it to a multiple of 128
    batch: int  # sequences per update (one micro-batch, no accumulation)

    def __str__(self) -> str:
        return f"l{self.n_layers}-h{self.d_model}-s{self.seq_len}-V{self.vocab}-B{self.batch}"


SIZES = (Size(2, 64, 64, 500, 4), Size(4, 128, 128, 1000, 2), Size(2, 256, 256, 300, 2))
KINDS = {"dense": 0, "demix": 3, "gshard": 4, "cse": 3}  # kind -> experts per expert layer


def build(kind: str, size: Size, *extra: str, experts: int | None = None) -> tuple[ModelConfig, GPT]:
    cfg = load_run_config(
        None,
        [
            "model.preset=tiny",
            f"model.n_layers={size.n_layers}",
            f"model.d_model={size.d_model}",
            "model.n_heads=4",
            f"model.seq_len={size.seq_len}",
            f"model.vocab_size={size.vocab}",
            f"model.ffn.kind={kind}",
            f"model.ffn.num_experts={KINDS[kind] if experts is None else experts}",
            "model.dropout=0.0",
            *extra,
        ],
    ).model
    torch.manual_seed(0)
    model = GPT(cfg, init_seed=0).train()
    # clustered: sequences are dispatched by distance (cdist), not all to expert 0
    for layer in cse_layers(model):
        p = cfg.ffn.cse.projection_dim
        layer.set_clusters(
            torch.randn(3, p, generator=torch.Generator().manual_seed(layer.layer_idx)), torch.ones(3)
        )
    return cfg, model


@dataclass
class Counted:
    total: int
    by_op: dict[str, int]
    dropped_routes: (
        int  # GShard routes over capacity, summed over expert layers (plain layer runs kept ones only)
    )
    fused_sdpa: bool  # attention ran a fused SDPA kernel (its backward recomputes QKᵀ)


def count(
    model: GPT, size: Size, *, math_sdpa: bool, recompute: bool = False, early_stop: bool = True
) -> Counted:
    """FLOPs of one forward + backward of `size.batch` sequences (one update), as the counter sees them."""
    if recompute:
        apply_activation_recompute(model)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, size.vocab, (size.batch, size.seq_len), generator=gen)
    domains = torch.arange(size.batch) % max(1, model.cfg.ffn.num_experts)  # DEMix: several experts run
    with contextlib.ExitStack() as stack:
        if math_sdpa:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        if not early_stop:
            stack.enter_context(torch.utils.checkpoint.set_checkpoint_early_stop(False))
        fc = stack.enter_context(FlopCounterMode(display=False, custom_mapping=CPU_SDPA))
        out = model(tokens, domains, targets_BT=tokens)
        loss = out.loss if out.aux_loss is None else out.loss + out.aux_loss
        loss.backward()
    by_op = {str(k): v for k, v in fc.get_flop_counts()["Global"].items()}
    k = model.cfg.ffn.gshard.top_k
    s_tokens = size.batch * size.seq_len
    dropped = sum(
        round(float(v) * k * s_tokens)
        for name, v in out.ffn_stats.items()
        if name.endswith("dropped_fraction")
    )
    fused = any("attention" in op and "backward" in op for op in by_op)
    return Counted(fc.get_total_flops(), by_op, dropped, fused)


def report(cfg: ModelConfig, size: Size) -> acc.FlopsReport:
    # the padded vocabulary: the tied head multiplies by every row of the embedding, padding included
    return acc.flops_per_update(cfg, size.batch, vocab_size=cfg.padded_vocab_size())


# Matmuls the formula leaves out on purpose, added back explicitly (see accounting's "Checked against ...").


def cse_projection_flops(cfg: ModelConfig, size: Size, forwards: int) -> int:
    """CSE's dispatch embedding mean_t(x) · M (B x D x P), detached: forward only (again in a recompute)."""
    if cfg.ffn.kind != "cse":
        return 0
    return forwards * len(cfg.moe_layer_ids()) * 2 * size.batch * cfg.d_model * cfg.ffn.cse.projection_dim


def passes(recompute: bool) -> tuple[str, int]:
    """(the FLOPs convention, forward passes of the transformer layers) of a run."""
    return ("recompute", 2) if recompute else ("no_recompute", 1)


def rel(a: float, b: float) -> float:
    return a / b - 1.0


# --------------------------------------------------------------------------------------------------------------
# The formula against the counted model, kind by kind, size by size
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recompute", [False, True], ids=["no_recompute", "recompute"])
@pytest.mark.parametrize("size", SIZES, ids=str)
@pytest.mark.parametrize("kind", list(KINDS))
def test_counted_flops_match_formula(kind: str, size: Size, recompute: bool) -> None:
    # GShard: capacity factor E / k makes C = S, so no route is dropped and every token runs k experts.
    extra = ["model.ffn.gshard.capacity_factor=2.0"] if kind == "gshard" else []
    cfg, model = build(kind, size, *extra)
    got = count(model, size, math_sdpa=True, recompute=recompute, early_stop=False)
    assert got.dropped_routes == 0 and not got.fused_sdpa
    rep = report(cfg, size)
    conv, n_fwd = passes(recompute)
    formula = rep.get(conv)
    extras = rep.router_flops(conv) + cse_projection_flops(cfg, size, n_fwd)
    ratio = got.total / formula
    print(
        f"{kind} {size} {conv}: counted/formula = {ratio:.6f} (counted {got.total}, formula {formula}, "
        f"left-out matmuls {extras}: router {rep.router_flops(conv)}, CSE projection "
        f"{cse_projection_flops(cfg, size, n_fwd)})"
    )
    assert abs(ratio - 1) < TOL, (
        f"{kind} {size} {conv}: counted {got.total} vs formula {formula} ({ratio:.4f})"
    )
    # every counted matmul is accounted for: the formula plus the itemised left-out ones, exactly
    assert got.total == formula + extras, got.by_op


def test_one_expert_gshard_runs_its_expert_once_per_token() -> None:
    """E = 1 (a one-GPU GShard run, e.g. the sweep's tiny-gshard-w1): the layer is the dense FFN, k = min(top_k, E)."""
    size = SIZES[1]
    cfg, model = build("gshard", size, experts=1)
    got = count(model, size, math_sdpa=True)
    rep = report(cfg, size)
    assert got.total == rep.no_recompute + rep.router_flops("no_recompute")
    dense_cfg, _ = build("dense", size)
    assert rep.no_recompute == report(dense_cfg, size).no_recompute


# --------------------------------------------------------------------------------------------------------------
# What a training step executes by default, term by term
# --------------------------------------------------------------------------------------------------------------


def default_execution_terms(cfg: ModelConfig, size: Size, got: Counted, recompute: bool) -> dict[str, int]:
    """Every difference between the counted FLOPs of a default run and `FlopsReport`, by cause."""
    rep = report(cfg, size)
    conv, n_fwd = passes(recompute)
    n_pass = 4 if recompute else 3
    b, s, h, f = size.batch, size.seq_len, cfg.d_model, cfg.d_ffn
    terms = {
        "router": rep.router_flops(conv),
        "cse_projection": cse_projection_flops(cfg, size, n_fwd),
        # fused SDPA backward recomputes the scores QKᵀ: one more B·s²·h matmul per layer
        "sdpa_score_recompute": cfg.n_layers * 2 * b * s * s * h if got.fused_sdpa else 0,
        # the plain GShard layer runs each kept route once; a dropped route runs no expert
        "gshard_dropped_routes": -got.dropped_routes * n_pass * 2 * (2 * h * f),
        # non-reentrant checkpoint stops recomputing after the last tensor backward needs: a block ending in a
        # plain MLP (the dense FFN) does not recompute fc2 (its output is not saved by anything after it)
        "checkpoint_early_stop": 0,
    }
    if recompute:
        dense_blocks = cfg.n_layers - len(cfg.moe_layer_ids())
        terms["checkpoint_early_stop"] = -dense_blocks * 2 * b * s * f * h
    return terms


@pytest.mark.parametrize("recompute", [False, True], ids=["no_recompute", "recompute"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_default_execution_itemised(kind: str, recompute: bool) -> None:
    size = SIZES[1]
    cfg, model = build(kind, size)  # GShard at its default capacity factor 1.0 (training): routes get dropped
    assert cfg.ffn.gshard.capacity_factor == 1.0
    got = count(model, size, math_sdpa=False, recompute=recompute)
    rep = report(cfg, size)
    formula = rep.get("recompute" if recompute else "no_recompute")
    terms = default_execution_terms(cfg, size, got, recompute)
    print(
        f"{kind} {size} {'recompute' if recompute else 'no_recompute'} default kernels: counted/formula = "
        f"{got.total / formula:.6f}; terms relative to the formula: "
        + ", ".join(f"{k} {v / formula:+.4%}" for k, v in terms.items() if v)
    )
    if kind == "gshard":
        assert got.dropped_routes > 0  # the case being checked: capacity factor 1.0 drops routes
    if CPU_SDPA or got.fused_sdpa:
        assert got.fused_sdpa
    assert got.total == formula + sum(terms.values()), (terms, got.by_op)


def test_deepspeed_gshard_layer_executes_capacity() -> None:
    """The training GShard layer (DeepSpeed MoE, parallel/gshard.py) runs every expert on its whole capacity
    buffer, E·C rows with C = ceil(k·S/E·capacity_factor), dropped or empty slots included: at capacity factor 1
    that is k·S rows, the formula's count, however many routes are dropped; above 1 the formula undercounts."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (the distributed GShard layer)")
    from parallel.gshard import DistributedGShardFFN, gshard_layout

    size = SIZES[1]
    for factor in (1.0, 1.25):
        cfg, model = build(
            "gshard",
            size,
            "model.ffn.gshard.experts_per_rank=4",
            f"model.ffn.gshard.capacity_factor={factor}",
        )
        layout = gshard_layout(cfg, world_size=1, rank=0)  # ep_size 1: no all-to-all, no process group
        for block in model.blocks:
            if isinstance(block.ffn, GShardFFN):
                block.ffn = DistributedGShardFFN(block.ffn, cfg, layout)
        got = count(model, size, math_sdpa=True)
        rep = report(cfg, size)
        g, e, s_tok, h, f = (
            cfg.ffn.gshard,
            layout.num_experts,
            size.batch * size.seq_len,
            cfg.d_model,
            cfg.d_ffn,
        )
        n_moe = len(cfg.moe_layer_ids())
        rows = e * expert_capacity(s_tok, e, g.top_k, factor, g.min_capacity)
        terms = {
            "router": rep.router_flops("no_recompute"),
            "capacity_padding": n_moe * 3 * (rows - g.top_k * s_tok) * 2 * (2 * h * f),
            "stats_gate": n_moe
            * 2
            * s_tok
            * h
            * e,  # DistributedGShardFFN's no-grad gate for routing statistics
            "gating_einsums": n_moe
            * 2
            * 2
            * (2 * s_tok * e),  # DeepSpeed's gates·mask "se,se->s", forward + backward
        }
        print(
            f"deepspeed gshard {size} capacity factor {factor}: "
            f"counted/formula = {got.total / rep.no_recompute:.6f}; "
            + ", ".join(f"{k} {v / rep.no_recompute:+.4%}" for k, v in terms.items())
        )
        assert got.total == rep.no_recompute + sum(terms.values()), (terms, got.by_op)
        if factor == 1.0:
            assert terms["capacity_padding"] == 0 and abs(got.total / rep.no_recompute - 1) < TOL


# --------------------------------------------------------------------------------------------------------------
# The check can fail: the usual mistakes miss the counted FLOPs by more than 1 %
# --------------------------------------------------------------------------------------------------------------


def test_wrong_formulas_are_caught() -> None:
    size = SIZES[2]  # l=2, h=256, s=256, V=300 (padded 384)
    cfg, model = build("dense", size)
    counted = count(model, size, math_sdpa=True).total
    rep = report(cfg, size)
    b, s, h, l = size.batch, size.seq_len, cfg.d_model, cfg.n_layers
    wrong = {
        "forward + backward as 2 forwards (missing the 2x backward)": rep.no_recompute * 2 // 3,
        "recompute convention for a run without recompute": rep.recompute,
        "causal-halved attention scores": rep.no_recompute - 3 * l * 2 * b * s * s * h,
        "unpadded vocabulary in the logit layer": acc.flops_per_update(cfg, size.batch).no_recompute,
        "logit layer left out": rep.no_recompute
        - 3 * acc.logit_forward_flops(cfg, b, s, cfg.padded_vocab_size()),
    }
    g_size = SIZES[1]
    g_cfg, g_model = build("gshard", g_size, "model.ffn.gshard.capacity_factor=2.0")
    g_counted = count(g_model, g_size, math_sdpa=True).total
    top1 = replace(g_cfg, ffn=replace(g_cfg.ffn, gshard=GShardConfig(top_k=1)))
    g_wrong = {"GShard top-2 counted as one expert per token": report(top1, g_size).no_recompute}
    cases = [(n, v, counted) for n, v in wrong.items()] + [(n, v, g_counted) for n, v in g_wrong.items()]
    for name, value, truth in cases:
        print(f"{name}: {rel(value, truth):+.2%}")
        assert abs(rel(value, truth)) > TOL, name
    assert (
        abs(rel(rep.no_recompute, counted)) < TOL
        and abs(rel(report(g_cfg, g_size).no_recompute, g_counted)) < TOL
    )


@pytest.mark.gpu
def test_default_execution_itemised_on_cuda() -> None:
    """The fused CUDA attention kernel (memory-efficient in fp32) counts as the itemisation says."""
    size = SIZES[1]
    cfg, model = build("dense", size)
    model.cuda()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, size.vocab, (size.batch, size.seq_len), generator=gen).cuda()
    with FlopCounterMode(display=False) as fc:
        out = model(tokens, targets_BT=tokens)
        (out.loss if out.aux_loss is None else out.loss + out.aux_loss).backward()
    by_op = {str(k): v for k, v in fc.get_flop_counts()["Global"].items()}
    k, s_tok = cfg.ffn.gshard.top_k, size.batch * size.seq_len
    dropped = sum(
        round(float(v) * k * s_tok) for n, v in out.ffn_stats.items() if n.endswith("dropped_fraction")
    )
    got = Counted(
        fc.get_total_flops(), by_op, dropped, any("attention" in op and "backward" in op for op in by_op)
    )
    assert got.fused_sdpa, by_op
    rep = report(cfg, size)
    assert got.total == rep.no_recompute + sum(default_execution_terms(cfg, size, got, False).values()), by_op
