"""Tensor parallelism applied from outside: TP=2 (and TP=4) equals TP=1 on real gloo processes.

Each multi-rank run builds, on every rank, a plain GPT from one seed and a deep copy that
`apply_tensor_parallel` shards; both see the same batch. The worker returns relative errors
(max |tp - ref| / max |ref|) and the checks below assert on them, so a failure names the tensor.
All scenarios of one world size share one spawn (process start-up and imports dominate the time).
"""

from __future__ import annotations

import copy

import pytest
import torch

from launcher.config import load_run_config
from model.config import ModelConfig
from model.gpt import GPT
from tests.harness.multirank import run_ranks

TOL = 1e-5  # relative, float32
VOCAB = 512
B, T = 4, 32


def _cfg(kind: str = "dense", experts: int = 0, **over) -> ModelConfig:
    sets = [
        "model.preset=tiny",
        "model.n_layers=2",
        f"model.vocab_size={VOCAB}",
        f"model.seq_len={T}",
        "model.dropout=0.0",
        f"model.ffn.kind={kind}",
        f"model.ffn.num_experts={experts}",
    ]
    sets += [f"model.{k}={v}" for k, v in over.items()]
    return load_run_config(None, sets).model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _all_gather_last_dim(t: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(group.size())]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _randomised(model: GPT, seed: int) -> GPT:
    """Noise on every parameter: biases start at zero and LayerNorms at 1/0, where a misplaced shard hides."""
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    return model


def _scenario(cfg: ModelConfig, expert_ids, domains, group, seed: int, perturb: bool = False) -> dict:
    """One parity check on one TP group: forward, loss, every gradient, replicated grads, checkpoint round trip."""
    import torch.distributed as dist

    from parallel.tensor_parallel import apply_tensor_parallel, gather_full_state_dict
    from tests.harness.full_state import gather_full_grads, replicated_parameter_names, shard_full_state_dict

    tp = group.size()
    torch.manual_seed(seed)
    ref = _randomised(GPT(cfg, expert_ids, tensor_parallel=tp), seed)
    tpm = apply_tensor_parallel(copy.deepcopy(ref), group)
    g = torch.Generator().manual_seed(seed + 1)  # same batch on every rank of the group
    tokens = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.2).long()
    dom = None if domains is None else torch.tensor(domains)

    r = ref(tokens, dom, targets, mask)
    r.loss.backward()
    t = tpm(tokens, dom, targets, mask)
    t.loss.backward()

    res: dict = {"local_vocab": t.logits.shape[-1], "full_vocab": r.logits.shape[-1]}
    res["logits"] = _rel(_all_gather_last_dim(t.logits, group), r.logits)
    res["loss"] = _rel(t.loss.detach(), r.loss.detach())
    res["token_loss"] = _rel(t.token_loss.detach(), r.token_loss.detach())
    full_grads = gather_full_grads(tpm, group)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    res["grad_names_equal"] = sorted(full_grads) == sorted(ref_grads)
    res["grad_shapes_equal"] = all(full_grads[n].shape == ref_grads[n].shape for n in ref_grads)
    res["grads"] = {n: _rel(full_grads[n], ref_grads[n]) for n in ref_grads}
    res["zero_grads"] = [n for n, gr in ref_grads.items() if gr is None or not bool(gr.abs().gt(0).any())]

    # Replicated params: gradients identical on every rank of the group.
    replicated = replicated_parameter_names(tpm)
    res["replicated"] = replicated
    mismatch = {}
    for name, p in tpm.named_parameters():
        if name in replicated:
            diff = (
                (_all_gather_last_dim(p.grad.unsqueeze(-1), group) - p.grad.unsqueeze(-1)).abs().max().item()
            )
            if diff != 0.0:
                mismatch[name] = diff
    res["replicated_grad_mismatch"] = mismatch
    res["sharded_flags_ok"] = all(hasattr(p, "tensor_model_parallel") for p in tpm.parameters())

    # Consolidated checkpoint: loads strictly into a plain GPT and equals the reference weights.
    full = gather_full_state_dict(tpm, group)
    plain = GPT(cfg, expert_ids, tensor_parallel=tp)
    plain.load_state_dict(full, strict=True)
    ref_state = ref.state_dict()
    res["consolidated"] = max((v - ref_state[k]).abs().max().item() for k, v in plain.state_dict().items())
    # ... and shards back into a differently initialised TP model.
    torch.manual_seed(seed + 7)
    other = apply_tensor_parallel(GPT(cfg, expert_ids, tensor_parallel=tp), group)
    other.load_state_dict(shard_full_state_dict(other, full, group), strict=True)
    res["reshard"] = max(
        (full[k] - v).abs().max().item() for k, v in gather_full_state_dict(other, group).items()
    )

    if perturb:  # a negative control: the comparison must see a change in one shard on one rank
        with torch.no_grad():
            if group.rank() == group.size() - 1:
                tpm.blocks[0].ffn.mlp.fc1.weight[0, 0] += 0.1
        t2 = tpm(tokens, dom, targets, mask)
        res["perturbed_logits"] = _rel(_all_gather_last_dim(t2.logits, group), r.logits)
    dist.barrier(group=group)
    return res


def _autocast_scenario(cfg: ModelConfig, group, seed: int) -> dict:
    """CPU bf16 autocast (DeepSpeed's torch_autocast on CPU): runs, fp32 master grads, close to TP=1 autocast.
    Also: a TP model deep-copies once the group is put in the memo (a ProcessGroup cannot be copied)."""
    from parallel.tensor_parallel import apply_tensor_parallel
    from tests.harness.full_state import gather_full_grads

    torch.manual_seed(seed)
    ref = GPT(cfg, tensor_parallel=group.size())
    tpm = apply_tensor_parallel(copy.deepcopy(ref), group)
    g = torch.Generator().manual_seed(seed + 1)
    tokens, targets = (torch.randint(0, cfg.vocab_size, (B, T), generator=g) for _ in range(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        t, r = tpm(tokens, targets_BT=targets), ref(tokens, targets_BT=targets)
    t.loss.backward()
    r.loss.backward()
    full = gather_full_grads(tpm, group)
    twin = copy.deepcopy(tpm, {id(group): group})
    return {
        "loss": _rel(t.loss.detach(), r.loss.detach()),
        "grad_norm_rel": max(
            ((full[n] - p.grad).norm() / p.grad.norm()).item() for n, p in ref.named_parameters()
        ),
        "grad_dtypes": sorted({str(p.grad.dtype) for p in tpm.parameters()}),
        "deepcopy_loss": _rel(
            twin(tokens, targets_BT=targets).loss.detach(), tpm(tokens, targets_BT=targets).loss.detach()
        ),
    }


def _chunked_loss_scenario(cfg: ModelConfig, group, seed: int) -> dict:
    """The chunked vocab-parallel loss (return_logits=False, 7 tokens per chunk: 128 rows do not divide) against
    the same TP model's unchunked loss and against TP=1, with a loss mask and ignored targets."""
    from parallel.tensor_parallel import apply_tensor_parallel
    from tests.harness.full_state import gather_full_grads

    torch.manual_seed(seed)
    ref = _randomised(GPT(cfg, tensor_parallel=group.size()), seed)
    whole = apply_tensor_parallel(copy.deepcopy(ref), group)
    chunked = apply_tensor_parallel(copy.deepcopy(ref), group)
    chunked.loss_chunk_logits = 7 * chunked.lm_head.embedding[0].weight.shape[0]
    g = torch.Generator().manual_seed(seed + 1)
    tokens, targets = (torch.randint(0, cfg.vocab_size, (B, T), generator=g) for _ in range(2))
    targets[0, :3] = -100
    mask = (torch.rand(B, T, generator=g) > 0.2).long()
    outs = {}
    for name, m in (("ref", ref), ("whole", whole), ("chunked", chunked)):
        o = m(tokens, targets_BT=targets, loss_mask_BT=mask, return_logits=name != "chunked")
        (o.loss + 0.5 * o.token_loss[:, -1].sum()).backward()  # a general upstream gradient
        grads = gather_full_grads(m, group) if m is not ref else {n: p.grad for n, p in m.named_parameters()}
        outs[name] = (o.loss.detach(), o.token_loss.detach(), grads)

    def rel(a: str, b: str) -> float:
        (la, ta, ga), (lb, tb, gb) = outs[a], outs[b]
        return max([_rel(la, lb), _rel(ta, tb)] + [_rel(ga[n], gb[n]) for n in gb])

    return {
        "chunked_vs_whole": rel("chunked", "whole"),
        "chunked_vs_tp1": rel("chunked", "ref"),
        "rows": chunked._loss_chunk_rows(),
        "ignored_loss": outs["chunked"][1][0, :3].abs().max().item(),
    }


def _megatron_ce_crosscheck(seed: int) -> float:
    """Our explicit-group cross-entropy against megatron-core's global-state one (same TP=world layout)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy as megatron_ce

    from parallel.tensor_parallel import vocab_parallel_cross_entropy

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=torch.distributed.get_world_size())
    try:
        g = torch.Generator().manual_seed(seed)
        dev = torch.device("cpu")  # the training device here: named, as the trainer names it (device-strict)
        # identical on all ranks, then each takes its shard
        logits = torch.randn(3, 5, 64, generator=g, device=dev)
        targets = torch.randint(0, 64, (3, 5), generator=g, device=dev)
        group = parallel_state.get_tensor_model_parallel_group()
        local = logits.chunk(group.size(), dim=-1)[group.rank()]
        a = local.clone().requires_grad_()
        b = local.clone().requires_grad_()
        la = vocab_parallel_cross_entropy(a, targets, group)
        lb = megatron_ce(b.clone(), targets)
        (la * torch.arange(15.0).view(3, 5)).sum().backward()
        (lb * torch.arange(15.0).view(3, 5)).sum().backward()
        full_loss = torch.nn.functional.cross_entropy(
            logits.view(15, 64), targets.view(15), reduction="none"
        ).view(3, 5)
        return max(
            (la - lb).abs().max().item(),
            (a.grad - b.grad).abs().max().item(),
            (la - full_loss).abs().max().item(),
        )
    finally:
        parallel_state.destroy_model_parallel()


def _tp2_worker(rank: int, world: int, dense: ModelConfig, demix: ModelConfig) -> dict:
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    from megatron.core import parallel_state

    out = {
        "dense": _scenario(dense, None, None, group, seed=1, perturb=True),
        "demix": _scenario(demix, None, [0, 2, 1, 2], group, seed=2),
        "demix_subset": _scenario(demix, [1, 2], [2, 1, 1, 2], group, seed=3),
        "autocast": _autocast_scenario(dense, group, seed=8),
        "chunked_loss": _chunked_loss_scenario(dense, group, seed=9),
        "global_state_untouched": not parallel_state.model_parallel_is_initialized(),
    }
    out["megatron_ce"] = _megatron_ce_crosscheck(seed=4)
    return out


def _world4_worker(rank: int, world: int, dense: ModelConfig, demix: ModelConfig) -> dict:
    """TP=4 over the whole world, then two TP=2 groups ({0,1}, {2,3}) whose group ranks differ from
    global ranks, each data-parallel replica holding other experts and another batch."""
    import torch.distributed as dist

    tp4 = dist.new_group([0, 1, 2, 3])
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    tp2 = pairs[rank // 2]
    experts, domains = ([0, 1], [1, 0, 0, 1]) if rank < 2 else ([2], [2, 2, 2, 2])
    return {
        "tp4_dense": _scenario(dense, None, None, tp4, seed=5),
        "tp4_demix": _scenario(demix, None, [2, 0, 1, 0], tp4, seed=6),
        "tp2_in_world4": _scenario(demix, experts, domains, tp2, seed=7 + rank // 2),
    }


def _check_parity(res: dict, tp: int) -> None:
    assert res["full_vocab"] == res["local_vocab"] * tp
    assert res["grad_names_equal"] and res["grad_shapes_equal"]
    assert res["zero_grads"] == [], (
        f"reference gradients that are all zero (a vacuous comparison): {res['zero_grads']}"
    )
    for key in ("logits", "loss", "token_loss"):
        assert res[key] < TOL, f"{key}: relative error {res[key]:.3g}"
    bad = {n: e for n, e in res["grads"].items() if not e < TOL}
    assert not bad, f"gradients differ from TP=1: {bad}"
    assert res["sharded_flags_ok"]
    assert res["consolidated"] == 0.0 and res["reshard"] == 0.0


@pytest.fixture(scope="module")
def tp2() -> list[dict]:
    return run_ranks(_tp2_worker, 2, args=(_cfg("dense"), _cfg("demix", 3)), timeout=300, device_strict=True)


@pytest.fixture(scope="module")
def world4() -> list[dict]:
    return run_ranks(_world4_worker, 4, args=(_cfg("dense"), _cfg("demix", 3)), timeout=300)


# ---------------------------------------------------------------- multi-rank (2 processes)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["dense", "demix", "demix_subset"])
def test_tp2_matches_tp1_forward_loss_and_every_gradient(tp2, scenario):
    for rank_res in tp2:
        _check_parity(rank_res[scenario], tp=2)


@pytest.mark.slow
def test_tp2_parity_check_detects_a_changed_shard(tp2):
    for rank_res in tp2:
        assert rank_res["dense"]["perturbed_logits"] > 100 * TOL


@pytest.mark.slow
def test_replicated_params_have_identical_grads_on_tp_ranks(tp2):
    for rank_res in tp2:
        for scenario in ("dense", "demix", "demix_subset"):
            res = rank_res[scenario]
            assert res["replicated_grad_mismatch"] == {}
            names = set(res["replicated"])
            assert {"wpe.weight", "ln_f.weight", "blocks.0.ln1.bias", "blocks.1.attn.proj.bias"} <= names
            assert not any(
                n.endswith(("qkv.weight", "qkv.bias", "fc1.weight", "fc1.bias", "wte.weight")) for n in names
            )
    assert "blocks.0.ffn.mlp.fc2.bias" in tp2[0]["dense"]["replicated"]
    assert "blocks.1.ffn.experts.2.fc2.bias" in tp2[0]["demix"]["replicated"]


@pytest.mark.slow
def test_tp_layers_never_touch_megatron_global_state_and_loss_matches_megatron(tp2):
    for rank_res in tp2:
        assert rank_res["global_state_untouched"]
        assert rank_res["megatron_ce"] < 1e-5


@pytest.mark.slow
def test_tp2_runs_under_cpu_bf16_autocast_and_deep_copies(tp2):
    for rank_res in tp2:
        res = rank_res["autocast"]
        assert res["grad_dtypes"] == ["torch.float32"]
        # bf16 matmuls, different reduction split
        assert res["loss"] < 1e-3 and res["grad_norm_rel"] < 5e-2, res
        assert res["deepcopy_loss"] == 0.0


@pytest.mark.slow
def test_tp2_chunked_vocab_parallel_loss_matches_whole_and_tp1(tp2):
    for rank_res in tp2:
        res = rank_res["chunked_loss"]
        assert res["rows"] == 7 and res["ignored_loss"] == 0.0
        assert res["chunked_vs_whole"] < TOL and res["chunked_vs_tp1"] < TOL, res


# ---------------------------------------------------------------- multi-rank (4 processes)


@pytest.mark.slow
@pytest.mark.parametrize("scenario,tp", [("tp4_dense", 4), ("tp4_demix", 4), ("tp2_in_world4", 2)])
def test_tp4_and_tp2_subgroups_match_tp1(world4, scenario, tp):
    for rank_res in world4:
        _check_parity(rank_res[scenario], tp=tp)
        assert rank_res[scenario]["replicated_grad_mismatch"] == {}


# ---------------------------------------------------------------- pure: layouts


class _FakeGroup:
    """Enough of a ProcessGroup for the layout checks, which run before any communication."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


def test_heads_not_divisible_by_tp_is_a_value_error_naming_the_numbers():
    from parallel.tensor_parallel import apply_tensor_parallel

    cfg = _cfg(n_heads=6, d_model=192)  # 6 heads over 4 ranks
    with pytest.raises(ValueError, match=r"n_heads=6 is not divisible by tensor_parallel=4"):
        apply_tensor_parallel(GPT(cfg, tensor_parallel=4), _FakeGroup(4))


def test_ffn_width_not_divisible_by_tp_is_a_value_error_naming_the_numbers():
    from parallel.tensor_parallel import check_tensor_parallel_layout

    cfg = _cfg(n_heads=3, d_model=96, ffn_mult=1)  # d_ffn = 96: 96 % 64 != 0, heads 3 % 64 too
    with pytest.raises(ValueError) as e:
        check_tensor_parallel_layout(cfg, 64)
    assert "d_ffn=96" in str(e.value) and "tensor_parallel=64" in str(e.value) and "n_heads=3" in str(e.value)


def test_unpadded_vocab_is_a_value_error_pointing_at_the_padding():
    from parallel.tensor_parallel import apply_tensor_parallel

    cfg = _cfg(make_vocab_size_divisible_by=1, vocab_size=511)
    model = GPT(cfg)  # vocab 511, odd
    with pytest.raises(
        ValueError,
        match=r"padded vocabulary 511 is not divisible by tensor_parallel=2.*GPT\(cfg, tensor_parallel=2\)",
    ):
        apply_tensor_parallel(model, _FakeGroup(2))
    assert GPT(cfg, tensor_parallel=2).vocab_size % 2 == 0


def test_a_good_layout_has_no_problems():
    from parallel.tensor_parallel import tensor_parallel_problems

    assert tensor_parallel_problems(_cfg(), 4) == []
    assert tensor_parallel_problems(_cfg(), 0) == ["tensor_parallel=0: must be >= 1"]
