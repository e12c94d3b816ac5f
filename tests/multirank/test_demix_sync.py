"""DEMix gradient synchronisation on real processes over gloo, checked against a single-process reference.

After a few optimizer steps at ZeRO 0/1/2: shared parameters are identical on all ranks; each expert is
identical within its domain group and differs across groups; and every parameter equals a single-process
reference that follows the definition, whatever the layout: a shared parameter's gradient is the mean over
all the step's tokens, expert e's gradient the mean over the step's tokens of domain e; one global norm
clips both; the same AdamW and schedule apply.

Layouts: ranks per domain (4 ranks/2 domains, 8 ranks/4 domains/tp 2) and domains per rank (1 rank/2
domains, 2 ranks/4 domains, 2 ranks/3 domains: ranks holding different numbers of experts, with DeepSpeed's
expert-group split threshold lowered so the tiny model's experts split into optimizer groups as gpt3-large's do).
"""

from __future__ import annotations

import pytest
import torch

from tests.harness.multirank import run_ranks

STEPS, GAS, MB, SEQ, VOCAB = 3, 2, 2, 16, 256


def _cfg(
    kind: str,
    domains: int,
    zero: int,
    tp: int = 1,
    scaling: str = "domain_mean",
    clip: float = 0.05,
    extra: tuple = (),
):
    from launcher.config import load_run_config

    return load_run_config(
        None,
        [
            "model.preset=tiny",
            "model.n_layers=2",
            f"model.vocab_size={VOCAB}",
            f"model.seq_len={SEQ}",
            "model.n_heads=4",
            f"model.ffn.kind={kind}",
            f"model.ffn.num_experts={domains if kind == 'demix' else 0}",
            f"parallel.zero_stage={zero}",
            f"parallel.tensor_parallel={tp}",
            f"parallel.expert_grad_scaling={scaling}",
            f"train.micro_batch={MB}",
            f"train.grad_accum={GAS}",
            f"train.steps={STEPS}",
            "train.lr=1e-2",
            "train.warmup_fraction=0.34",
            f"train.clip_grad={clip}",
            "train.weight_decay=0.1",
            *extra,
        ],
    )


def _batch(dp_rank: int, step: int, micro: int, domains: tuple) -> dict[str, torch.Tensor]:
    """A micro-batch whose sequences cycle through the rank's domains (as the by_domain sampler does)."""
    g = torch.Generator().manual_seed(10_000 * dp_rank + 100 * step + micro)
    tokens = torch.randint(0, VOCAB, (MB, SEQ + 1), generator=g)
    doms = torch.tensor([domains[i % len(domains)] for i in range(MB)])
    return {
        "tokens": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "domain_ids": doms,
        "expert_ids": doms,  # one expert per domain, in the domains' order
        "loss_mask": torch.ones(MB, SEQ),
    }


def _lower_split_threshold(numel: int) -> None:
    """DeepSpeed splits each rank's expert parameters into optimizer groups of at most ~179M elements (a
    gpt3-large expert is 453M): lower that default so the tiny model's experts split the same way."""
    from deepspeed.moe import utils as moe_utils

    moe_utils.split_params_into_different_moe_groups_for_optimizer.__defaults__ = (numel,)


def _worker(
    rank: int,
    world: int,
    kind: str,
    domains: int,
    zeros: tuple,
    tp: int,
    scaling: str,
    split_numel: int = 0,
    extra: tuple = (),
):
    """Train the same run once per ZeRO stage in this process (one spawn amortises the imports)."""
    if split_numel:
        _lower_split_threshold(split_numel)
    from launcher.ffn_kinds import ffn_kind
    from launcher.train import train_step
    from model.gpt import GPT
    from parallel.groups import ProcessGroups
    from parallel.tensor_parallel import gather_full_state_dict
    from parallel.topology import build_topology

    topo = build_topology(world, tp, domains if kind == "demix" else 1)
    info = topo.rank_info(rank)
    results = {}
    for zero in zeros:
        cfg = _cfg(kind, domains, zero, tp, scaling, extra=extra)
        groups = ProcessGroups.create(topo)
        torch.manual_seed(0)
        model = GPT(cfg.model, expert_ids=list(info.domains) if kind == "demix" else None, tensor_parallel=tp)
        bundle = ffn_kind(cfg).build_engine(model, cfg, groups)
        norms = []
        for step in range(STEPS):
            doms = info.domains if kind == "demix" else (0,)
            out = train_step(bundle, cfg, [_batch(info.dp_rank, step, m, doms) for m in range(GAS)], domains)
            norms.append(float(out.grad_norm))
        sd = (
            gather_full_state_dict(model, groups.tp_group)
            if tp > 1
            else {k: v.detach().clone() for k, v in model.state_dict().items()}
        )
        sd = {k: v for k, v in sd.items() if not k.endswith("_extra_state")}
        results[zero] = {
            "sd": sd,
            "domains": info.domains,
            "dp_rank": info.dp_rank,
            "norms": norms,
            "groups": len(bundle.engine.optimizer.param_groups),
            "grad_reduce": bundle.grad_reduce,
            "overlap_comm": getattr(bundle.engine.optimizer, "overlap_comm", None),
        }
    return results


def _reference(kind: str, domains: int, world_dp: int, dp_domains: list, scaling: str, tp: int = 1):
    """Single process, all experts: the gradient means and the global clip, applied by hand."""
    from model.gpt import GPT
    from parallel.ds_config import lr_lambda

    cfg = _cfg(kind, domains, 0, 1, scaling)
    torch.manual_seed(0)
    model = GPT(cfg.model, tensor_parallel=tp)  # same padded vocab as the distributed run
    params = dict(model.named_parameters())
    decay = [p for p in params.values() if p.dim() >= 2]
    no_decay = [p for p in params.values() if p.dim() < 2]
    t = cfg.train
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        eps=t.eps,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.train))
    dp_domains = [d if isinstance(d, tuple) else (d,) for d in dp_domains]
    ranks_of = {d: [r for r in range(world_dp) if d in dp_domains[r]] for ds in dp_domains for d in ds}
    norms = []
    for step in range(STEPS):
        batches = [_batch(r, step, m, dp_domains[r]) for r in range(world_dp) for m in range(GAS)]
        if scaling == "domain_mean":
            _definition_grads(model, params, batches)
        else:  # the fairseq reference: each rank's mean-loss gradient, summed over its domain, / all ranks
            per_rank = []
            for r in range(world_dp):
                model.zero_grad(set_to_none=True)
                for m in range(GAS):
                    b = _batch(r, step, m, dp_domains[r])
                    (model(b["tokens"], b["domain_ids"], targets_BT=b["targets"]).loss / GAS).backward()
                per_rank.append(
                    {
                        n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
                        for n, p in params.items()
                    }
                )
            for n, p in params.items():
                ranks = (
                    ranks_of[int(n.split(".experts.")[1].split(".")[0])]
                    if ".experts." in n
                    else range(world_dp)
                )
                p.grad = sum(per_rank[r][n] for r in ranks) / world_dp
        norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in params.values())).float()
        norms.append(float(norm))
        coef = torch.clamp(t.clip_grad / (norm + 1e-6), max=1.0)
        for p in params.values():
            p.grad.mul_(coef)
        opt.step()
        sched.step()
    return {k: v.detach() for k, v in model.state_dict().items()}, norms


def _definition_grads(model, params: dict, batches: list) -> None:
    """Set p.grad by the definition: shared = mean over every token of the step (all ranks, all micro-batches);
    expert e = mean over the step's tokens of domain e. One backward for the shared mean, one per domain."""

    def token_losses():
        return [(model(b["tokens"], b["domain_ids"], targets_BT=b["targets"]).token_loss, b) for b in batches]

    model.zero_grad(set_to_none=True)
    losses = token_losses()
    (sum(tl.sum() for tl, _ in losses) / sum(tl.numel() for tl, _ in losses)).backward()
    grads = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in params.items()}
    for d in sorted({int(x) for b in batches for x in b["domain_ids"]}):
        model.zero_grad(set_to_none=True)
        losses = token_losses()
        n_d = sum(int((b["domain_ids"] == d).sum()) * tl.shape[1] for tl, b in losses)
        (sum(tl[b["domain_ids"] == d].sum() for tl, b in losses) / n_d).backward()
        for n, p in params.items():
            if f".experts.{d}." in n:
                grads[n] = p.grad.clone()
    for n, p in params.items():
        p.grad = grads[n]


def _check(results, ref_sd, ref_norms, atol=2e-5):
    shared = [k for k in ref_sd if ".experts." not in k]
    for r, res in enumerate(results):
        for k in shared:
            torch.testing.assert_close(
                res["sd"][k], results[0]["sd"][k], rtol=0, atol=0, msg=f"shared {k} differs on rank {r}"
            )
            torch.testing.assert_close(
                res["sd"][k], ref_sd[k], rtol=1e-4, atol=atol, msg=f"shared {k} vs reference"
            )
        for k, v in res["sd"].items():
            if ".experts." in k:
                torch.testing.assert_close(
                    v, ref_sd[k], rtol=1e-4, atol=atol, msg=f"rank {r} {k} vs reference"
                )
        assert res["norms"] == pytest.approx(ref_norms, rel=1e-4)


def _check_groups(results, expert_groups):
    """Each expert identical within its domain group, different across groups."""
    for d, ranks in expert_groups.items():
        keys = [k for k in results[ranks[0]]["sd"] if f".experts.{d}." in k]
        assert keys
        for r in ranks[1:]:
            assert all(torch.equal(results[ranks[0]]["sd"][k], results[r]["sd"][k]) for k in keys)
    k0 = next(k for k in results[expert_groups[0][0]]["sd"] if ".experts.0." in k)
    assert not torch.allclose(
        results[expert_groups[0][0]]["sd"][k0],
        results[expert_groups[1][0]]["sd"][k0.replace(".experts.0.", ".experts.1.")],
    )


# A few of the tiny model's matrices per gradient bucket: several buckets, reduced while the backward runs.
SMALL_BUCKET = 20_000


@pytest.mark.slow
def test_demix_4_ranks_2_domains_zero_0_1_2_match_reference():
    """With small gradient buckets: ZeRO 0 reduces them from the backward's hooks, ZeRO 1/2 with overlap_comm."""
    per_rank = run_ranks(
        _worker,
        4,
        args=("demix", 2, (0, 1, 2), 1, "domain_mean", 0, (f"parallel.bucket_elements={SMALL_BUCKET}",)),
    )
    ref_sd, ref_norms = _reference("demix", 2, 4, [0, 0, 1, 1], "domain_mean")
    for zero in (0, 1, 2):
        results = [r[zero] for r in per_rank]
        assert [r["domains"] for r in results] == [(0,), (0,), (1,), (1,)]
        assert results[0]["grad_reduce"].overlap and results[0]["grad_reduce"].elements == SMALL_BUCKET
        assert results[0]["overlap_comm"] is (True if zero else None)
        _check(results, ref_sd, ref_norms)
        _check_groups(results, {0: [0, 1], 1: [2, 3]})


@pytest.mark.slow
def test_demix_8_ranks_4_domains_tensor_parallel_2_zero_0_1_2_match_reference():
    per_rank = run_ranks(_worker, 8, args=("demix", 4, (0, 1, 2), 2, "domain_mean"), timeout=900)
    # 8 ranks, tp 2 -> 4 data-parallel ranks, one per domain; tp pairs (0,1), (2,3), ...
    ref_sd, ref_norms = _reference("demix", 4, 4, [0, 1, 2, 3], "domain_mean", tp=2)
    for zero in (0, 1, 2):
        results = [r[zero] for r in per_rank]
        assert [r["domains"] for r in results] == [(0,), (0,), (1,), (1,), (2,), (2,), (3,), (3,)]
        # Tensor-parallel reductions sum in another order; Adam amplifies those last bits on tiny gradients.
        _check(results, ref_sd, ref_norms, atol=1e-4)
        _check_groups(results, {d: [2 * d, 2 * d + 1] for d in range(4)})


@pytest.mark.slow
def test_global_scaling_reproduces_the_reference_code():
    results = [r[0] for r in run_ranks(_worker, 4, args=("demix", 2, (0,), 1, "global"))]
    ref_sd, ref_norms = _reference("demix", 2, 4, [0, 0, 1, 1], "global")
    _check(results, ref_sd, ref_norms)


@pytest.mark.slow
def test_dense_4_ranks_matches_reference():
    results = [r[1] for r in run_ranks(_worker, 4, args=("dense", 1, (1,), 1, "domain_mean"))]
    ref_sd, ref_norms = _reference("dense", 1, 4, [0, 0, 0, 0], "domain_mean")
    _check(results, ref_sd, ref_norms)


@pytest.mark.slow
def test_demix_2_ranks_4_domains_several_domains_per_rank_matches_reference():
    """Fewer data-parallel ranks than domains: each rank holds two experts and mixes their sequences."""
    per_rank = run_ranks(_worker, 2, args=("demix", 4, (0, 1, 2), 1, "domain_mean"))
    ref_sd, ref_norms = _reference("demix", 4, 2, [(0, 1), (2, 3)], "domain_mean")
    for zero in (0, 1, 2):
        results = [r[zero] for r in per_rank]
        assert [r["domains"] for r in results] == [(0, 1), (2, 3)]
        _check(results, ref_sd, ref_norms)


@pytest.mark.slow
def test_demix_1_rank_2_domains_zero_0_1_2_matches_reference():
    """One rank holding both experts: each expert still gets its own domain's mean gradient."""
    per_rank = run_ranks(_worker, 1, args=("demix", 2, (0, 1, 2), 1, "domain_mean"))
    ref_sd, ref_norms = _reference("demix", 2, 1, [(0, 1)], "domain_mean")
    for zero in (0, 1, 2):
        results = [r[zero] for r in per_rank]
        assert results[0]["domains"] == (0, 1)
        _check(results, ref_sd, ref_norms)


@pytest.mark.slow
def test_demix_2_ranks_3_domains_unequal_experts_split_groups_zero_0_1_2_match_reference():
    """Rank 0 holds two experts, rank 1 one; DeepSpeed's split threshold is lowered to two expert matrices, so
    rank 0's experts make twice as many optimizer groups as rank 1's (4 vs 2 decay groups; ZeRO 1/2 deadlocked
    on that): rank 1 must split its experts into as many groups as rank 0."""
    matrix = 4 * 128 * 128  # one fc weight of the tiny model (d_model 128, ffn 4x)
    per_rank = run_ranks(
        _worker,
        2,
        args=(
            "demix",
            3,
            (0, 1, 2),
            1,
            "domain_mean",
            2 * matrix,
            (f"parallel.bucket_elements={SMALL_BUCKET}",),
        ),
        timeout=300,
        device_strict=True,
    )
    ref_sd, ref_norms = _reference("demix", 3, 2, [(0, 1), (2,)], "domain_mean")
    for zero in (0, 1, 2):
        results = [r[zero] for r in per_rank]
        assert [r["domains"] for r in results] == [(0, 1), (2,)]
        plan = results[0]["grad_reduce"]
        # unequal experts per rank: ZeRO 0 overlaps with small buckets; ZeRO 1/2 reduce the whole rank in one bucket
        assert not plan.uniform and plan.overlap is (zero == 0)
        assert plan.elements == (
            SMALL_BUCKET if zero == 0 else plan.max_rank_params + plan.max_rank_params % 2
        )
        # shared x2, expert decay x4, no-decay
        assert results[0]["groups"] == results[1]["groups"] == 2 + 4 + 1
        _check(results, ref_sd, ref_norms)


def test_expert_groups_split_and_merge_keep_order_and_threshold():
    """The helpers behind equal optimizer-group counts: refining splits the largest chunk (sizes only shrink),
    merging joins the smallest neighbours; both keep parameter order and make exactly the count asked for."""
    from parallel.optim_groups import _exactly, _greedy_chunks

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (4, 4, 1, 4, 4, 1)]
    greedy = _greedy_chunks(params, 8)
    assert [[p.numel() for p in c] for c in greedy] == [[4, 4], [1, 4], [4, 1]]
    for count in (1, 2, 3, 4, 5, 6):
        chunks = _exactly(greedy, count)
        assert len(chunks) == count and all(chunks)
        assert [p for c in chunks for p in c] == params  # order kept, nothing lost
        if count >= 3:
            assert max(sum(p.numel() for p in c) for c in chunks) <= 8
    with pytest.raises(ValueError, match="cannot split"):
        _exactly(greedy, 7)
