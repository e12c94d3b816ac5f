"""GShard on DeepSpeed's MoE layer, on real processes over gloo, checked against the plain single-process layer.

One spawn per world size runs several layouts in turn (process start-up dominates on CPU). For each layout:
the freshly built distributed model computes what the plain model computes on the same tokens (forward parity,
all experts gathered back equal the plain weights); after a few optimizer steps through
launcher.ffn_kinds (build_engine) + launcher.train.train_step, non-expert parameters are identical on every rank, each
expert is identical within its expert-data-parallel group and differs across experts, the gathered state dict loads into
a plain GPT that computes what the distributed model computes, and every parameter equals a single-process
reference (mean over ranks of loss + aux loss, one global clip norm, the same AdamW).

With tensor parallelism (tp=2) the same checks run per data-parallel rank: both TP ranks of a group see that
group's tokens, experts stay whole (each GPU its own), DeepSpeed splits every expert's capacity slots over the TP
group, and the reference rounds the capacity up to a multiple of tp as the distributed gate does. A capacity
factor giving an odd C (11 slots, rounded to 12) makes tokens drop, so the rounding and the split are exercised.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.harness.multirank import run_ranks

STEPS, GAS, MB, SEQ, VOCAB = 2, 2, 2, 16, 256
# Adam normalises each element's update to about lr (1e-2) whatever its gradient's size, so float noise in tiny
# gradients (summed in another order across the all-to-all) shows up as ~1e-4; a wrong route or weight shows as
# ~lr. The gradient scale itself is checked sharply by the global grad norm (rel 1e-4).
ATOL = 3e-4


def _cfg(experts: int, zero: int, policy: str = "all", tp: int = 1):
    from launcher.config import load_run_config

    odd_capacity = (
        ["model.ffn.gshard.capacity_factor=0.6875", "model.ffn.gshard.min_capacity=1"] if tp > 1 else []
    )
    return load_run_config(
        None,
        odd_capacity
        + [
            f"parallel.tensor_parallel={tp}",
            "model.preset=tiny",
            "model.n_layers=2",
            f"model.vocab_size={VOCAB}",
            f"model.seq_len={SEQ}",
            "model.ffn.kind=gshard",
            f"model.ffn.num_experts={experts}",
            f"model.ffn.gshard.second_expert_policy={policy}",
            "model.ffn.gshard.aux_loss_weight=0.1",
            f"parallel.zero_stage={zero}",
            f"train.micro_batch={MB}",
            f"train.grad_accum={GAS}",
            f"train.steps={STEPS}",
            "train.lr=1e-2",
            "train.warmup_fraction=0.0",
            "train.clip_grad=0.5",
            "train.weight_decay=0.1",
        ],
    )


def _batch(rank: int, step: int, micro: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * rank + 100 * step + micro)
    tokens = torch.randint(0, VOCAB, (MB, SEQ + 1), generator=g)
    return {
        "tokens": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "domain_ids": torch.zeros(MB, dtype=torch.long),
        "expert_ids": torch.zeros(MB, dtype=torch.long),
        "loss_mask": torch.ones(MB, SEQ),
    }


def _capacity_like_tp(model: torch.nn.Module, tp: int) -> None:
    """Make a plain GPT's GShard layers round C up to a multiple of tp, as a tensor-parallel run's gate does."""
    for m in model.modules():
        if hasattr(m, "capacity_multiple"):
            m.capacity_multiple = tp


def _expert_id(name: str) -> int:
    return int(name.split(".experts.")[1].split(".")[0])


def _run_layout(rank: int, world: int, experts: int, zero: int, policy: str, tp: int = 1) -> dict:
    from launcher.ffn_kinds import ffn_kind
    from launcher.train import train_step
    from model.gpt import GPT
    from parallel.groups import ProcessGroups
    from parallel.gshard import DistributedGShardFFN
    from parallel.topology import build_topology
    from tests.harness.full_state import gather_gshard_state_dict

    cfg = _cfg(experts, zero, policy, tp)
    groups = ProcessGroups.create(build_topology(world, tp, 1))
    dp_rank, tp_rank = groups.dp_rank, groups.tp_rank
    model = GPT(cfg.model, init_seed=0, tensor_parallel=tp)
    plain = copy.deepcopy(model)
    _capacity_like_tp(plain, tp)
    bundle = ffn_kind(cfg).build_engine(model, cfg, groups)
    assert sum(isinstance(m, DistributedGShardFFN) for m in model.modules()) == 1
    out: dict = {"tp_rank": tp_rank, "dp_rank": dp_rank}

    def shard(logits):  # this TP rank's vocabulary columns of the plain model's logits
        v = logits.shape[-1] // tp
        return logits[..., tp_rank * v : (tp_rank + 1) * v]

    # forward parity on this rank's tokens (training mode: training capacity, seeded second-expert sampling)
    b = _batch(dp_rank, 99, 0)
    with torch.no_grad():
        torch.manual_seed(7)
        d = model(b["tokens"], targets_BT=b["targets"])
        torch.manual_seed(7)
        p = plain(b["tokens"], targets_BT=b["targets"])
    out["fwd"] = [(d.logits, shard(p.logits)), (d.aux_loss, p.aux_loss), (d.loss, p.loss)]
    out["dropped"] = float(d.ffn_stats["layer1/dropped_fraction"])
    init, want = gather_gshard_state_dict(model, groups), plain.state_dict()
    out["init_gathered_equal"] = init.keys() == want.keys() and all(
        torch.equal(v, want[k]) for k, v in init.items()
    )
    out["losses"] = []
    for step in range(STEPS):
        res = train_step(bundle, cfg, [_batch(dp_rank, step, m) for m in range(GAS)], 1)
        out["losses"].append(float(res.domain_sums[0].sum() / res.domain_sums[1].sum()))
    out["norm"] = float(res.grad_norm)
    out["local"] = {}  # this rank's parameters under plain names (experts by global id)
    sd = gather_gshard_state_dict(model, groups)
    layer = model.blocks[1].ffn
    for j, e in enumerate(layer.layout.local_experts):
        for n, t in layer.moe.deepspeed_moe.experts.deepspeed_experts[j].state_dict().items():
            out["local"][f"blocks.1.ffn.experts.{e}.{n}"] = t.detach().clone()
    out["gathered"] = sd
    out["edp_ranks"] = layer.layout.edp_ranks
    # the gathered state dict loads into a plain GPT that computes what the distributed model computes
    consolidated = GPT(cfg.model, init_seed=1, tensor_parallel=tp)
    consolidated.load_state_dict(sd, strict=True)
    model.eval(), consolidated.eval()
    with torch.no_grad():
        out["eval"] = (model(b["tokens"]).logits, shard(consolidated(b["tokens"]).logits))
    return out


def _worker(rank: int, world: int, layouts: list[tuple]) -> list[dict]:
    return [_run_layout(rank, world, *lay) for lay in layouts]


def _reference(experts: int, world: int, tp: int = 1) -> tuple[dict[str, torch.Tensor], float]:
    """One process, all experts: mean over ranks of (loss + aux loss) on each rank's own tokens (so each rank's
    capacity applies to its own tokens, as in the distributed run), one global clip, the same AdamW."""
    from model.gpt import GPT
    from parallel.ds_config import lr_lambda

    cfg = _cfg(experts, 0, tp=tp)
    model = GPT(cfg.model, init_seed=0, tensor_parallel=tp)
    _capacity_like_tp(model, tp)
    world //= tp  # one token stream per data-parallel rank
    params = dict(model.named_parameters())
    t = cfg.train
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": t.weight_decay},
            {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        eps=t.eps,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.train))
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        for r in range(world):
            for m in range(GAS):
                b = _batch(r, step, m)
                o = model(b["tokens"], targets_BT=b["targets"])
                ((o.loss + o.aux_loss) / (GAS * world)).backward()
        norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in params.values())).float()
        torch.nn.utils.clip_grad_norm_(list(params.values()), t.clip_grad)
        opt.step()
        sched.step()
    return {k: v.detach() for k, v in model.state_dict().items()}, float(norm)


def _check(results: list[dict], experts: int, world: int, policy: str, tp: int = 1) -> None:
    for r, res in enumerate(results):
        for got, want in res["fwd"]:
            torch.testing.assert_close(
                got, want, rtol=1e-5, atol=1e-5, msg=f"rank {r}: distributed != plain forward"
            )
        assert res["init_gathered_equal"], f"rank {r}: gathered initial weights differ from the plain model"
        assert all(torch.isfinite(torch.tensor(res["losses"])))
        torch.testing.assert_close(res["eval"][0], res["eval"][1], rtol=1e-5, atol=1e-5)
    # The reference draws no second-expert samples: compare with it only for the deterministic policy.
    ref, ref_norm = _reference(experts, world, tp) if policy == "all" else (None, None)
    first = results[0]["gathered"]
    for k, v in first.items():
        if ".experts." not in k:
            for r, res in enumerate(results):  # dense parameters (and the gate) identical on every rank
                assert torch.equal(res["gathered"][k], v), f"{k} differs on rank {r}"
        if ref is not None:
            torch.testing.assert_close(
                v, ref[k], rtol=1e-3, atol=ATOL, msg=f"{k} vs the single-process reference"
            )
    for r, res in enumerate(results):
        if ref is not None:
            assert res["norm"] == pytest.approx(ref_norm, rel=1e-4), f"rank {r} grad norm"
        for k, v in res["local"].items():
            if ref is not None:
                torch.testing.assert_close(v, ref[k], rtol=1e-3, atol=ATOL, msg=f"rank {r} {k} vs reference")
            for q in res["edp_ranks"]:  # identical within the expert-data-parallel group
                assert torch.equal(results[q]["local"][k], v), f"{k}: rank {q} != rank {r}"
    for r, res in enumerate(results):  # the TP ranks of a group compute one loss on the same tokens
        same = [q for q in results if q["dp_rank"] == res["dp_rank"]]
        assert all(q["losses"] == res["losses"] for q in same), f"rank {r}: TP ranks disagree on the loss"
    w = [first[f"blocks.1.ffn.experts.{e}.fc1.weight"] for e in range(experts)]
    assert all(not torch.allclose(w[0], w[e]) for e in range(1, experts)), "experts should differ"


@pytest.mark.slow
def test_gshard_2_ranks_ep2_zero0_and_zero2() -> None:
    layouts = [(2, 0, "all"), (2, 2, "sampling")]
    results = run_ranks(_worker, 2, args=(layouts,))
    for i, (experts, _, policy) in enumerate(layouts):
        per_rank = [res[i] for res in results]
        assert [r["edp_ranks"] for r in per_rank] == [(0,), (1,)]
        _check(per_rank, experts, 2, policy)


@pytest.mark.slow
def test_gshard_4_ranks_ep4_zero1_and_ep2_replicated_zero0() -> None:
    layouts = [(4, 1, "all"), (2, 0, "random")]
    results = run_ranks(_worker, 4, args=(layouts,))
    assert [res[0]["edp_ranks"] for res in results] == [(0,), (1,), (2,), (3,)]
    assert [res[1]["edp_ranks"] for res in results] == [(0, 2), (1, 3), (0, 2), (1, 3)]  # DeepSpeed's E+D
    for i, (experts, _, policy) in enumerate(layouts):
        _check([res[i] for res in results], experts, 4, policy)


@pytest.mark.slow
def test_gshard_tensor_parallel_2_ranks_all_to_all_inside_the_tp_group() -> None:
    """tp=2, dp=1: one whole expert per GPU (E=2), so the all-to-all runs between the two TP ranks, each sending
    its half of every expert's (odd, rounded-up) capacity; ZeRO 0 and 2 against the reference, ZeRO 1 with the
    sampled second expert (both TP ranks must draw the same samples)."""
    layouts = [(2, 0, "all", 2), (2, 2, "all", 2), (2, 1, "sampling", 2)]
    # all-to-all and TP gathers as NCCL needs
    results = run_ranks(_worker, 2, args=(layouts,), device_strict=True)
    assert [res[0]["edp_ranks"] for res in results] == [(0,), (1,)]
    assert results[0][0]["dropped"] > 0, "the odd capacity should drop tokens"
    for i, (experts, _, policy, tp) in enumerate(layouts):
        _check([res[i] for res in results], experts, 2, policy, tp)


@pytest.mark.slow
def test_gshard_tensor_parallel_4_ranks_ep_across_tp_lanes_zero1_and_replicated_zero0() -> None:
    """tp=2, dp=2: E=4 (one per GPU, expert-parallel group = the whole world across both TP lanes) at ZeRO 1;
    E=2 (expert-parallel groups = the TP groups, experts replicated over the data-parallel ranks) at ZeRO 0 with
    the random second-expert policy."""
    layouts = [(4, 1, "all", 2), (2, 0, "random", 2)]
    results = run_ranks(_worker, 4, args=(layouts,))
    assert [res[0]["edp_ranks"] for res in results] == [(0,), (1,), (2,), (3,)]
    assert [res[1]["edp_ranks"] for res in results] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    for i, (experts, _, policy, tp) in enumerate(layouts):
        _check([res[i] for res in results], experts, 4, policy, tp)


def _routing_check_worker(rank: int, world: int) -> list[bool]:
    import torch.distributed as dist

    from parallel.gshard import _check_same_routing

    idx = torch.tensor([[0, 1, 1, 0], [1, 0, -1, 1]], dtype=torch.int32)
    loc = torch.tensor([[0, 0, 1, 1], [2, 2, 0, 3]], dtype=torch.int32)
    outcomes = []
    for other in (loc, loc.flip(1)):  # the same routing, then rank 1 routes differently
        try:
            _check_same_routing(idx, loc if rank == 0 else other, dist.group.WORLD)
            outcomes.append(True)
        except RuntimeError as e:
            assert "differs across the tensor-parallel ranks" in str(e)
            outcomes.append(False)
    return outcomes


def test_diverged_routing_across_tensor_parallel_ranks_is_an_error() -> None:
    assert run_ranks(_routing_check_worker, 2) == [[True, False], [True, False]]
