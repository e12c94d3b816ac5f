"""The chunked LM loss (model/gpt.py: chunked_token_loss): same loss and gradients as the whole-vocabulary
loss, and no B x T x V tensor ever exists when logits are not returned."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from launcher.config import load_run_config
from model.gpt import GPT, TokenCrossEntropy, chunked_token_loss

B, T = 3, 16  # N = 48 rows; vocabulary padded to 384


def _model(kind: str = "dense", experts: int = 0) -> GPT:
    sets = [
        "model.preset=tiny",
        "model.n_layers=2",
        "model.d_model=64",
        "model.n_heads=2",
        "model.vocab_size=300",
        "model.seq_len=32",
        f"model.ffn.kind={kind}",
        f"model.ffn.num_experts={experts}",
    ]
    torch.manual_seed(0)
    return GPT(load_run_config(None, sets).model, init_seed=0)


def _batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 300, (B, T), generator=g)
    y = torch.randint(0, 300, (B, T), generator=g)
    y[0, 3] = y[2, 15] = -100  # F.cross_entropy's ignore index: loss 0, no gradient
    mask = torch.ones(B, T)
    mask[:, 0] = 0  # e.g. a prepended domain token
    mask[1, 5:9] = 0
    return x, y, mask


def _run(model: GPT, chunk_rows: int, return_logits: bool, autocast: bool = False, domains=None):
    model.zero_grad(set_to_none=True)
    model.loss_chunk_logits = chunk_rows * model.vocab_size  # `chunk_rows` tokens per chunk
    x, y, mask = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x, domains, targets_BT=y, loss_mask_BT=mask, return_logits=return_logits)
    (out.loss * 3.0 + out.token_loss[:, 1].sum()).backward()  # a general upstream gradient, not just d(mean)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.token_loss.detach(), grads


def _compare(ref, got, rtol, atol):
    """Elementwise within rtol, plus `atol` relative to the tensor's largest entry (summation-order noise
    on near-zero gradient entries)."""
    assert got[2].keys() == ref[2].keys()
    for name, a, b in [("loss", got[0], ref[0]), ("token_loss", got[1], ref[1])] + [
        (n, got[2][n], ref[2][n]) for n in ref[2]
    ]:
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol * float(b.abs().max()), msg=name)


@pytest.mark.parametrize("return_logits", [False, True])
def test_chunked_loss_equals_whole_vocabulary_loss_fp32(return_logits):
    model = _model()
    ref = _run(model, B * T, return_logits=True)  # one chunk: today's code path exactly
    assert ref[1][0, 3] == 0 and ref[1][1, 6] == 0  # ignored target, masked token
    for rows in (1, 5, 7, 16, 47):  # 5, 7, 47 do not divide the 48 rows
        _compare(ref, _run(model, rows, return_logits), rtol=1e-5, atol=1e-5)


def test_chunked_loss_under_bf16_autocast():
    model = _model()
    ref = _run(model, B * T, return_logits=True, autocast=True)
    for rows in (7, 16):
        got = _run(model, rows, return_logits=False, autocast=True)
        assert got[0].dtype == torch.float32 and all(g.dtype == torch.float32 for g in got[2].values())
        _compare(ref, got, rtol=2e-2, atol=2e-4)


def test_chunked_loss_demix_several_domains():
    model = _model("demix", experts=2)
    dom = torch.tensor([0, 1, 1])
    _compare(_run(model, B * T, True, domains=dom), _run(model, 7, False, domains=dom), rtol=1e-5, atol=1e-5)


def test_chunked_token_loss_function_on_hidden_states():
    """The helper alone: per-token loss and d/dh, d/dW against F.cross_entropy on full fp32 logits."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 9, 16, generator=g, requires_grad=True)
    W = torch.randn(50, 16, generator=g, requires_grad=True)
    y = torch.randint(0, 50, (2, 9), generator=g)
    y[1, 2] = -100
    w_BT = torch.rand(2, 9, generator=g)
    ref = F.cross_entropy(F.linear(h, W).reshape(18, 50), y.reshape(-1), reduction="none").view(2, 9)
    ref_grads = torch.autograd.grad((ref * w_BT).sum(), (h, W))
    loss_fn = TokenCrossEntropy()
    for rows in (1, 4, 5, 17):
        got = chunked_token_loss(lambda h_, t_: loss_fn(F.linear(h_, W), t_), h, y, rows)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        for a, b in zip(torch.autograd.grad((got * w_BT).sum(), (h, W)), ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # evaluation: chunked, no checkpoint
        torch.testing.assert_close(
            chunked_token_loss(lambda h_, t_: loss_fn(F.linear(h_, W), t_), h, y, 4), ref
        )


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("autocast", [False, True])
def test_no_full_vocabulary_tensor_exists(autocast):
    model = _model()
    rows = 7
    with _LargestTensor() as seen:
        _run(model, rows, return_logits=False, autocast=autocast)
    V = model.vocab_size
    # a chunk's logits, or the embedding (V x D) and its gradient
    assert seen.largest <= max(rows * V, V * 64)
    with _LargestTensor() as seen:
        _run(model, B * T, return_logits=False, autocast=autocast)
    assert seen.largest >= B * T * V  # the check would see a full-vocabulary tensor
