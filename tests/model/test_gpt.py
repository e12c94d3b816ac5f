"""The plain GPT and its feed-forward seam on one process."""

import pytest
import torch

from launcher.config import load_run_config
from model.gpt import GPT


def _cfg(kind="dense", experts=0, **over):
    sets = [
        "model.preset=tiny",
        "model.n_layers=2",
        "model.vocab_size=300",
        "model.seq_len=32",
        f"model.ffn.kind={kind}",
        f"model.ffn.num_experts={experts}",
    ] + [f"model.{k}={v}" for k, v in over.items()]
    return load_run_config(None, sets).model


def test_forward_shapes_and_loss_is_log_vocab_at_init():
    torch.manual_seed(0)
    m = GPT(_cfg())
    x = torch.randint(0, 300, (3, 16))
    y = torch.randint(0, 300, (3, 16))
    out = m(x, targets_BT=y)
    assert out.logits.shape == (3, 16, m.vocab_size) and m.vocab_size == 384  # padded to 128
    assert out.token_loss.shape == (3, 16)
    assert abs(out.loss.item() - torch.log(torch.tensor(384.0)).item()) < 0.1


def test_demix_with_one_domain_equals_dense():
    torch.manual_seed(0)
    dense = GPT(_cfg("dense"))
    demix = GPT(_cfg("demix", experts=1))
    sd = {k.replace("ffn.mlp.", "ffn.experts.0."): v for k, v in dense.state_dict().items()}
    demix.load_state_dict(sd)
    x = torch.randint(0, 300, (2, 16))
    d = torch.zeros(2, dtype=torch.long)
    torch.testing.assert_close(dense(x).logits, demix(x, d).logits)


def test_demix_routes_each_sequence_to_its_domain_expert():
    torch.manual_seed(0)
    full = GPT(_cfg("demix", experts=3))
    x = torch.randint(0, 300, (3, 16))
    d = torch.tensor([2, 0, 1])
    mixed = full(x, d).logits
    for b in range(3):
        # a model holding only the expert of domain d_b gives the same logits for sequence b
        sub = GPT(_cfg("demix", experts=3), expert_ids=[int(d[b])])
        sub.load_state_dict(
            {
                k: v
                for k, v in full.state_dict().items()
                if ".experts." not in k or f".experts.{int(d[b])}." in k
            }
        )
        torch.testing.assert_close(sub(x[b : b + 1], d[b : b + 1]).logits, mixed[b : b + 1])
    # experts really differ: swapping domains changes the output
    assert not torch.allclose(full(x, torch.tensor([0, 0, 0])).logits, mixed)


def test_demix_gradients_reach_only_the_experts_used():
    torch.manual_seed(0)
    m = GPT(_cfg("demix", experts=3))
    x = torch.randint(0, 300, (2, 16))
    m(x, torch.tensor([1, 1]), targets_BT=x).loss.backward()
    norms = {e: sum(float(p.grad.abs().sum()) for p in ps) for e, ps in m.expert_parameters().items()}
    assert norms[1] > 0 and norms[0] == 0 and norms[2] == 0


def test_missing_expert_is_a_clear_error():
    m = GPT(_cfg("demix", experts=4), expert_ids=[1, 2])
    x = torch.randint(0, 300, (2, 8))
    with pytest.raises(ValueError, match=r"domain ids \[3\] have no expert"):
        m(x, torch.tensor([1, 3]))
    with pytest.raises(ValueError, match="pass domain_ids"):
        m(x)
    with pytest.raises(ValueError, match="out of range"):
        GPT(_cfg("demix", experts=2), expert_ids=[5])


def test_loss_mask_excludes_positions():
    torch.manual_seed(0)
    m = GPT(_cfg())
    x = torch.randint(0, 300, (2, 16))
    mask = torch.ones(2, 16)
    mask[:, 0] = 0
    out = m(x, targets_BT=x, loss_mask_BT=mask)
    full = m(x, targets_BT=x)
    torch.testing.assert_close(out.loss, full.token_loss[:, 1:].mean())


def test_meta_device_build_of_xl_demix_is_instant():
    cfg = load_run_config(
        None, ["model.preset=gpt3-xl", "model.ffn.kind=demix", "model.ffn.num_experts=8"]
    ).model
    with torch.device("meta"):
        m = GPT(cfg, expert_ids=[3])
    assert all(p.is_meta for p in m.parameters())
    assert list(m.expert_parameters()) == [3]
