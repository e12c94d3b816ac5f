"""model/batched.py: the blocked target-logit LM head and the batched all-experts pass against the references
(float64 log-softmax of full logits; GPT.forward per expert), and its peak memory."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launcher.config import load_run_config
from model.batched import (
    expert_log_likelihoods,
    sequential_log_likelihoods,
    shared_trunk_features,
    target_log_probs,
)
from model.gpt import GPT
from model.mlp import DenseFFN

ROOT = Path(__file__).resolve().parents[2]


def _cfg(kind="demix", experts=3, d=32, seq=32):
    return load_run_config(
        None,
        [
            "model.preset=tiny",
            "model.n_layers=2",
            f"model.d_model={d}",
            "model.n_heads=2",
            f"model.seq_len={seq}",
            f"model.ffn.kind={kind}",
            f"model.ffn.num_experts={experts if kind == 'demix' else 0}",
        ],
    )


def _head_case(n=300):
    model = GPT(_cfg().model, init_seed=1).eval()
    g = torch.Generator().manual_seed(0)
    h_ND = 40 * torch.randn(n, model.cfg.d_model, generator=g)  # logits of std ~4.5: peaked softmaxes
    targets_N = torch.randint(0, model.vocab_size, (n,), generator=g)
    with torch.no_grad():
        ref_N = torch.log_softmax(model.lm_head(h_ND).double(), dim=-1).gather(1, targets_N[:, None])[:, 0]
    return model, h_ND, targets_N, ref_N


@pytest.mark.parametrize(
    "budget,rows",
    [
        (None, 1024),  # the default block: 300 rows x 1747 entries
        (50_000, 1024),  # 300 x 166 (a partial last vocabulary block)
        (3_000, 50),  # 50 x 60: several row blocks, hundreds of vocabulary blocks
        (60_000, 7),  # 7 x 8571: a partial last row block and a partial last vocabulary block
        (1 << 30, 1 << 20),  # one block: all rows, the whole vocabulary
    ],
)
def test_target_logit_head_equals_full_log_softmax(budget, rows):
    model, h_ND, targets_N, ref_N = _head_case()
    with torch.no_grad():
        out_N = target_log_probs(model, h_ND, targets_N, budget, rows)
    assert out_N.dtype == torch.float32 and out_N.shape == ref_N.shape
    assert (out_N.double() - ref_N).abs().max() <= 1e-5
    assert ref_N.min() < -20  # the case is not trivially flat


def test_rows_outside_float32_exp_range_take_the_shifted_log_sum_exp():
    """The head sums exp(l) unshifted; rows with a logit beyond exp's float32 range (inf) or a target logit below
    -50 (underflow could matter) are recomputed by torch.logsumexp, so they are exact too (module docstring)."""
    model, h_ND, targets_N, _ = _head_case(n=64)
    h_ND = h_ND.clone()
    h_ND[:16] *= 40  # logits of std ~180: exp overflows to inf on the fast path
    W = model.lm_head.embedding[0].weight
    h_ND[16:24] = (
        -3
        * h_ND[16:24].norm(dim=1, keepdim=True)
        * W[targets_N[16:24]]
        / W[targets_N[16:24]].norm(dim=1, keepdim=True)
    )
    with torch.no_grad():
        logits = model.lm_head(h_ND).double()
        ref_N = torch.log_softmax(logits, dim=-1).gather(1, targets_N[:, None])[:, 0]
        out_N = target_log_probs(model, h_ND, targets_N, 3_000, 50)
    # both cases hit
    assert logits[:16].amax() > 89 and logits[16:24].gather(1, targets_N[16:24, None]).max() < -50
    assert torch.isfinite(out_N).all()
    assert ((out_N.double() - ref_N).abs() / ref_N.abs().clamp(min=1)).max() <= 1e-5


def test_untied_head_takes_the_whole_row_path():
    """A head that is not the plain tied one (e.g. vocab-parallel) is called as a module, whole rows at a time."""
    model, h_ND, targets_N, ref_N = _head_case()

    class PlainHead(torch.nn.Module):
        def __init__(self, w):
            super().__init__()
            self.w = [w]
            self.calls = 0

        def forward(self, h):
            self.calls += 1
            return h @ self.w[0].t()

    model.lm_head = PlainHead(model.wte.weight)
    with torch.no_grad():
        out_N = target_log_probs(model, h_ND, targets_N, 50 * model.vocab_size)
    assert model.lm_head.calls == 6  # 300 rows, 50 per call
    assert (out_N.double() - ref_N).abs().max() <= 1e-5


def test_dense_layers_before_the_first_expert_layer_run_once():
    """The fan-out at the first expert layer when layers before it are dense (shared by every expert)."""
    cfg = _cfg(experts=3)
    model = GPT(cfg.model, init_seed=2).eval()
    model.blocks[0].ffn = DenseFFN(cfg.model)
    calls = []
    model.blocks[0].ffn.register_forward_hook(lambda mod, inp, out: calls.append(inp[0].shape[0]))
    x = torch.randint(0, 1000, (2, 33), generator=torch.Generator().manual_seed(3))
    ll = expert_log_likelihoods(model, x[:, :-1], x[:, 1:], [2, 0, 1], logit_budget=20_000)
    assert calls == [2]  # one pass over B = 2 sequences, not E * B
    ref = sequential_log_likelihoods(model, x[:, :-1], x[:, 1:], [2, 0, 1])
    assert (ll - ref).abs().max() <= 1e-5
    assert not ll.is_inference()  # callers may update it in place (generation accumulates into it)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resettable VmHWM")
def test_peak_memory_is_bounded_not_e_b_t_v():
    """One batched pass over E x B x T = 4 x 8 x 128 tokens, whose float32 logits would take 786 MiB, stays within
    a few MiB above the resident size (the head's 2 MiB block and the activations), measured in a fresh process."""
    cmd = [
        sys.executable,
        "-m",
        "experiments.mixing_throughput",
        "--layers",
        "1",
        "--d-model",
        "32",
        "--heads",
        "2",
        "--seq-len",
        "128",
        "--batch",
        "8",
        "--probe-memory",
        "batched",
        "--probe-experts",
        "4",
    ]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT)}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=True)
    peak = json.loads(res.stdout.strip().splitlines()[-1])["peak_extra_mib"]
    assert 0 < peak < 24, peak


@pytest.mark.parametrize("fanout", [1, 200, 1 << 20])  # one expert per group, groups of 2 (and 1), one group
def test_experts_fan_out_in_groups(fanout):
    model = GPT(_cfg(experts=3).model, init_seed=4).eval()
    x = torch.randint(0, 1000, (3, 33), generator=torch.Generator().manual_seed(5))  # B*T = 96
    ref = sequential_log_likelihoods(model, x[:, :-1], x[:, 1:], [2, 0, 1])
    ll = expert_log_likelihoods(model, x[:, :-1], x[:, 1:], [2, 0, 1], fanout_tokens=fanout)
    assert ll.shape == (3, 3, 32) and (ll - ref).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="non-empty subset"):
        expert_log_likelihoods(model, x[:, :-1], x[:, 1:], [], fanout_tokens=fanout)
    with pytest.raises(ValueError, match="non-empty subset"):
        expert_log_likelihoods(model, x[:, :-1], x[:, 1:], [0, 7], fanout_tokens=fanout)


@pytest.mark.parametrize("dense_first", [False, True])
def test_shared_trunk_features_are_the_first_expert_layers_ffn_input(dense_first):
    """f(x) is what the first DEMix block's ln2 gives in GPT.forward (a forward hook on the real model), whatever
    expert it routes to; with a dense block first, the input of the second block's FFN."""
    cfg = _cfg(experts=3)
    model = GPT(cfg.model, init_seed=6).eval()
    if dense_first:
        model.blocks[0].ffn = DenseFFN(cfg.model)
    first = 1 if dense_first else 0
    seen = []
    model.blocks[first].ln2.register_forward_hook(lambda mod, inp, out: seen.append(out.detach().clone()))
    x = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        f_BTD = shared_trunk_features(model, x)
        for j in (0, 2):
            model(x, torch.full((2,), j))
    assert f_BTD.shape == (2, 32, cfg.model.d_model) and len(seen) == 3
    # seen[0]: shared_trunk_features's own call of ln2; seen[1:], GPT.forward routed to experts 0 and 2
    assert all(torch.equal(s, f_BTD) for s in seen)


def test_shared_trunk_features_ignore_the_experts_held():
    """Two models with the same shared weights and different expert subsets (an owner's model, the merged one)
    compute the same features, bit for bit; a model with no DEMix layer has none."""
    cfg = _cfg(experts=3)
    full = GPT(cfg.model, init_seed=8).eval()
    other = GPT(cfg.model, expert_ids=[1], init_seed=99).eval()
    shared = {k: v for k, v in full.state_dict().items() if ".experts." not in k}
    other.load_state_dict({**other.state_dict(), **shared})
    assert not torch.equal(  # the experts really differ
        other.blocks[0].ffn.experts["1"].fc1.weight, full.blocks[0].ffn.experts["0"].fc1.weight
    )
    x = torch.randint(0, 1000, (3, 32), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert torch.equal(shared_trunk_features(full, x), shared_trunk_features(other, x))
    with pytest.raises(ValueError, match="no DEMix layer"):
        shared_trunk_features(GPT(_cfg("dense").model, init_seed=1), x)
