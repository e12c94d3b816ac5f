"""Gradient reduction overlapping the backward, on real processes over gloo.

ZeRO 0 issues its all-reduces from gradient hooks while the accumulation boundary's backward runs
(parallel/demix_sync.py `OverlappedGradReduce`), ZeRO 1/2 through DeepSpeed's `overlap_comm`; `parallel.grad_reduce:
after_backward` keeps DeepSpeed's reduce-after-backward. On two ranks (a sum of two is the same in either order) the
two give bitwise the same training, for DEMix with unequal experts per rank, fp16 (DeepSpeed's CPU guard lifted as in
tests/multirank/test_device_placement.py) and GShard; a recorder of the collectives against the backward's progress
shows the all-reduces are issued during the backward, and that the same check fails on the after-backward run (its
control). The parity of both with a single-process reference is tests/multirank/test_demix_sync.py's (small buckets
at 4 ranks).
Also: the bucket rule, the generated DeepSpeed keys, and bf16 at ZeRO 1/2 reducing in fp32.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.harness.multirank import run_ranks
from tests.multirank.test_demix_sync import _batch, _cfg

STEPS, GAS = 2, 2
BUCKET = 20_000  # a few of the tiny model's matrices per bucket

# (name, ffn kind, domains, ZeRO stage, precision)
VARIANTS = [
    ("demix3-z0", "demix", 3, 0, "fp32"),  # rank 0 holds experts 0 and 1, rank 1 expert 2
    ("demix3-z0-fp16", "demix", 3, 0, "fp16"),
    ("demix2-z1", "demix", 2, 1, "fp32"),
    ("demix2-z2", "demix", 2, 2, "fp32"),
    ("gshard-z0", "gshard", 1, 0, "fp32"),  # one expert per rank: DeepSpeed's expert group of one rank
]


def _train(
    rank: int,
    world: int,
    kind: str,
    domains: int,
    zero: int,
    precision: str,
    grad_reduce: str,
    prologue: bool = True,
) -> dict:
    """A few steps of one variant; the collectives and the backward's progress recorded in the last micro-batch.
    `prologue=False` removes parallel/engine.py's `attach_backward_prologue` hook (the bug it fixes, planted)."""
    import torch.distributed as dist

    from launcher.ffn_kinds import ffn_kind
    from launcher.train import train_step
    from model.gpt import GPT
    from parallel.demix_sync import is_expert_param
    from parallel.groups import ProcessGroups
    from parallel.memory import RankParams, buffer_bytes
    from parallel.topology import build_topology

    extra = (
        f"parallel.grad_reduce={grad_reduce}",
        f"parallel.bucket_elements={BUCKET}",
        f"train.precision={precision}",
        f"train.steps={STEPS}",
        f"train.grad_accum={GAS}",
        "model.ffn.gshard.second_expert_policy=all",
        *((f"model.ffn.num_experts={world}",) if kind == "gshard" else ()),
    )
    cfg = _cfg(kind, domains, zero, extra=extra)
    topo = build_topology(world, 1, domains if kind == "demix" else 1)
    info = topo.rank_info(rank)
    groups = ProcessGroups.create(topo)
    torch.manual_seed(0)
    model = GPT(cfg.model, expert_ids=list(info.domains) if kind == "demix" else None, init_seed=0)
    bundle = ffn_kind(cfg).build_engine(model, cfg, groups)
    if not prologue:
        model._forward_hooks.clear()  # only attach_backward_prologue's hook sits on the GPT module itself
    events: list = []

    ipg: list = []  # ZeRO 1/2: DeepSpeed's reduce buckets, as the backward reaches the embedding

    def marker(name: str):  # a forward hook noting when the backward reaches the module's output
        def note(grad) -> None:
            events.append(name)
            buckets = getattr(bundle.engine.optimizer, "ipg_buckets", {})
            ipg.append(sum(buf.numel() * buf.element_size() for b in buckets.values() for buf in b.buffer))

        def hook(module, args, out) -> None:
            out.register_hook(note)

        return hook

    model.ln_f.register_forward_hook(marker("backward:head"))
    model.wte.register_forward_hook(marker("backward:embedding"))
    original = dist.all_reduce

    def recorded(tensor, *args, **kwargs):
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(world))
        events.append(("all_reduce", ranks, tensor.numel()))
        return original(tensor, *args, **kwargs)

    norms = []
    dist.all_reduce = recorded
    try:
        for step in range(STEPS):
            doms = info.domains if kind == "demix" else (0,)
            events.clear()
            out = train_step(bundle, cfg, [_batch(info.dp_rank, step, m, doms) for m in range(GAS)], domains)
            norms.append(float(out.grad_norm))
    finally:
        dist.all_reduce = original
    sd = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    trainable = [p for p in model.parameters() if p.requires_grad]
    expert = sum(p.numel() for p in trainable if is_expert_param(p))
    rank_params = RankParams(sum(p.numel() for p in trainable) - expert, expert, world, 1)
    return {
        "sd": sd,
        "norms": norms,
        "events": list(events),
        "plan": bundle.grad_reduce,
        "hooked": bundle.reducer is not None,
        "overlap_comm": getattr(bundle.engine.optimizer, "overlap_comm", None),
        "buffers": max(ipg)
        if zero
        else (
            bundle.reducer.peak_in_flight * (2 if precision == "fp16" else 4)
            if bundle.reducer is not None
            else None
        ),
        "buffer_bytes": buffer_bytes(precision, zero, rank_params, grad_reduce, BUCKET),
    }


def _variants(rank: int, world: int) -> dict:
    from deepspeed.accelerator import get_accelerator

    # torch's CPU fp16 kernels work on any x86 CPU; DeepSpeed's CPU accelerator refuses fp16 where oneDNN lacks it.
    type(get_accelerator()).is_fp16_supported = lambda self: True
    out = {
        (name, mode): _train(rank, world, kind, domains, zero, precision, mode)
        for name, kind, domains, zero, precision in VARIANTS
        for mode in ("overlap", "after_backward")
    }
    out[("demix2-z1", "no_prologue")] = _train(rank, world, "demix", 2, 1, "fp32", "overlap", prologue=False)
    return out


def reduced_during_backward(events: list) -> bool:
    """Whether a gradient all-reduce (more than the one-element norm) was issued after the last micro-batch's
    backward reached the model's head and before it reached the embedding, i.e. while layers were still
    differentiated."""
    head = max(i for i, e in enumerate(events) if e == "backward:head")
    embedding = max(i for i, e in enumerate(events) if e == "backward:embedding")
    return any(isinstance(e, tuple) and e[2] > 1 for e in events[head:embedding])


def _gradient_collectives(events: list, ranks: tuple) -> list:
    return [e[2] for e in events if isinstance(e, tuple) and e[1] == ranks and e[2] > 1]


def test_the_backward_check_sees_an_all_reduce_inside_the_backward_only():
    """The control of `reduced_during_backward`: an all-reduce between the head's and the embedding's gradient
    counts; one after the embedding's (reduce after backward) or the one-element norm does not."""
    ar = ("all_reduce", (0, 1), 1000)
    assert reduced_during_backward(["backward:head", ar, "backward:embedding"])
    assert not reduced_during_backward(["backward:head", "backward:embedding", ar])
    assert not reduced_during_backward(["backward:head", ("all_reduce", (0, 1), 1), "backward:embedding", ar])
    assert not reduced_during_backward(
        [ar, "backward:head", "backward:embedding", "backward:head", "backward:embedding"]
    )


@pytest.mark.slow
def test_overlapped_reduction_equals_reduction_after_backward_and_runs_inside_it():
    results = run_ranks(_variants, 2, timeout=600)
    # the control of the parity check: without DeepSpeed's backward prologue, ZeRO 1's overlap_comm reduces the
    # first micro-batch's partial gradients (a stale accumulation-boundary flag) and the training differs
    planted, after = results[0][("demix2-z1", "no_prologue")], results[0][("demix2-z1", "after_backward")]
    assert planted["norms"] != after["norms"]
    for name, _kind, _domains, zero, _precision in VARIANTS:
        over, after = [r[(name, "overlap")] for r in results], [r[(name, "after_backward")] for r in results]
        for rank in range(2):
            assert over[rank]["norms"] == after[rank]["norms"], name
            for k, v in after[rank]["sd"].items():
                assert torch.equal(over[rank]["sd"][k], v), f"{name}: rank {rank} {k} differs"
        plan = over[0]["plan"]
        assert plan.overlap and plan.elements == BUCKET and plan.max_rank_params > 3 * BUCKET, (name, plan)
        assert over[0]["hooked"] is (zero == 0) and not after[0]["hooked"]
        for rank in range(2):  # parallel/memory.py counts the buckets the reduction holds
            if zero:  # DeepSpeed's contiguous reduce buckets: two with overlap_comm, one without
                assert over[rank]["buffers"] == over[rank]["buffer_bytes"] == 2 * BUCKET * 4, name
                assert after[rank]["buffers"] == after[rank]["buffer_bytes"] == BUCKET * 4, name
            else:  # the flat copies in flight: at most two buckets' worth
                assert 0 < over[rank]["buffers"] <= over[rank]["buffer_bytes"], (name, over[rank]["buffers"])
        if zero:
            assert over[0]["overlap_comm"] is True and after[0]["overlap_comm"] is False
            continue
        # ZeRO 0: the hooks issue the all-reduces while the backward runs; after_backward issues them all after it
        for rank in range(2):
            assert reduced_during_backward(over[rank]["events"]), (name, rank, over[rank]["events"])
            assert not reduced_during_backward(after[rank]["events"]), (name, rank)  # the check can fail
        # the data-parallel group sees the same gradient collectives, in the same order, on both ranks
        dp = [_gradient_collectives(r[(name, "overlap")]["events"], (0, 1)) for r in results]
        assert dp[0] == dp[1] and len(dp[0]) >= 3, (name, dp)


def _bf16(rank: int, world: int) -> dict:
    from deepspeed.accelerator import get_accelerator

    if not get_accelerator().is_bf16_supported():
        return {"skip": f"DeepSpeed's {get_accelerator().device_name()} accelerator has no bf16 here"}
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from launcher.ffn_kinds import ffn_kind
    from launcher.train import train_step
    from model.gpt import GPT
    from parallel.groups import ProcessGroups
    from parallel.topology import build_topology

    topo = build_topology(world, 1, 2)
    info = topo.rank_info(rank)
    out = {}
    for zero in (1, 2):
        for precision, dtype in (("fp32", None), ("bf16", "fp32")):
            extra = [f"train.precision={precision}", "train.steps=2"] + (
                [f"train.grad_reduce_dtype={dtype}"] if dtype else []
            )
            cfg = _cfg("demix", 2, zero, extra=tuple(extra))
            torch.manual_seed(0)
            model = GPT(cfg.model, expert_ids=list(info.domains), init_seed=0)
            bundle = ffn_kind(cfg).build_engine(model, cfg, ProcessGroups.create(topo))
            engine = bundle.engine
            norms = [
                float(
                    train_step(
                        bundle, cfg, [_batch(info.dp_rank, s, m, info.domains) for m in range(2)], 2
                    ).grad_norm
                )
                for s in range(2)
            ]
            out[(zero, precision)] = {
                "norms": norms,
                "zero_optimizer": type(engine.optimizer) is DeepSpeedZeroOptimizer,
                "comm": engine.communication_data_type,
                "accum": getattr(engine.optimizer, "gradient_accumulation_dtype", None),
                "keys": {
                    k: bundle.deepspeed_config.get(k) for k in ("communication_data_type", "data_types")
                },
            }
    return out


@pytest.mark.slow
def test_bf16_zero_1_and_2_reduce_gradients_in_fp32_and_train():
    """`train.grad_reduce_dtype: fp32` with bf16: ZeRO 2 accumulates and reduces in fp32, ZeRO 1 reduces in fp32 (and
    stays on DeepSpeed's ZeRO optimizer: its BF16_Optimizer would miscount DEMix experts in the clip norm); both train,
    with the gradient norms of an fp32 run up to bf16's forward rounding."""
    results = run_ranks(_bf16, 2)
    if "skip" in results[0]:
        pytest.skip(results[0]["skip"])
    for r in results:
        for zero in (1, 2):
            got, ref = r[(zero, "bf16")], r[(zero, "fp32")]
            assert got["zero_optimizer"] and got["comm"] == torch.float32
            assert got["keys"]["communication_data_type"] == "fp32"
            assert got["keys"]["data_types"] == ({"grad_accum_dtype": "fp32"} if zero == 2 else None)
            assert got["accum"] == (torch.float32 if zero == 2 else torch.bfloat16)
            assert got["norms"] == pytest.approx(ref["norms"], rel=3e-2), (zero, got["norms"], ref["norms"])
            assert all(n == n for n in got["norms"])


def test_bucket_rule_bounds_small_models_and_keeps_large_buckets_bandwidth_bound():
    from parallel.grad_reduce import DEEPSPEED_BUCKET_ELEMENTS, bucket_elements

    assert bucket_elements(1_000_001, 4) == 1_000_002  # a tiny model: one bucket of its own size (even)
    assert bucket_elements(125_000_000, 8) == 40_000_000  # gpt3-small on 8 ranks: Megatron-core's floor
    assert bucket_elements(1_300_000_000, 128) == 128_000_000  # 1e6 elements per rank's share of the ring
    assert bucket_elements(10**10, 1024) == DEEPSPEED_BUCKET_ELEMENTS  # never above DeepSpeed's default
    assert bucket_elements(10**9, 8, override=12_345) == 12_346  # parallel.bucket_elements wins


def test_generated_config_overlap_buckets_and_reduce_dtype():
    from launcher.config import load_run_config
    from parallel.ds_config import deepspeed_config, extra_deepspeed_problems
    from parallel.grad_reduce import GradReducePlan

    def ds(*sets, plan=None):
        cfg = load_run_config(None, list(sets))
        return deepspeed_config(cfg.train, cfg.parallel, cfg.extra_deepspeed, plan)

    plan = GradReducePlan(elements=40_000_000, overlap=True, max_rank_params=10**9, uniform=True)
    z = ds("parallel.zero_stage=2", plan=plan)["zero_optimization"]
    assert z["overlap_comm"] is True and z["reduce_bucket_size"] == z["allgather_bucket_size"] == 40_000_000
    one = GradReducePlan(elements=1_000_000, overlap=False, max_rank_params=1_000_000, uniform=True)
    assert ds("parallel.zero_stage=1", plan=one)["zero_optimization"]["overlap_comm"] is False
    # without the model (the launcher's JSON): the typed settings alone
    z = ds("parallel.zero_stage=1")["zero_optimization"]
    assert z["overlap_comm"] is True and "reduce_bucket_size" not in z
    z = ds("parallel.zero_stage=1", "parallel.grad_reduce=after_backward", "parallel.bucket_elements=999")[
        "zero_optimization"
    ]
    assert z["overlap_comm"] is False and z["reduce_bucket_size"] == 1000
    assert "overlap_comm" not in ds("parallel.zero_stage=0")["zero_optimization"]
    # bf16's fp32 reduction: ZeRO 2 both keys, ZeRO 1 the communication dtype only, ZeRO 0 (autocast, fp32 grads) none
    z2 = ds("parallel.zero_stage=2", "train.precision=bf16", "train.grad_reduce_dtype=fp32")
    assert z2["communication_data_type"] == "fp32" and z2["data_types"] == {"grad_accum_dtype": "fp32"}
    z1 = ds("parallel.zero_stage=1", "train.precision=bf16", "train.grad_reduce_dtype=fp32")
    assert z1["communication_data_type"] == "fp32" and "data_types" not in z1
    z0 = ds("parallel.zero_stage=0", "train.precision=bf16", "train.grad_reduce_dtype=fp32")
    assert "communication_data_type" not in z0 and "data_types" not in z0
    default = ds("parallel.zero_stage=2", "train.precision=bf16")
    assert "communication_data_type" not in default and "data_types" not in default
    # the framework owns the keys: extra_deepspeed may not set them
    owned = extra_deepspeed_problems(
        {
            "zero_optimization": {"overlap_comm": False, "reduce_bucket_size": 1},
            "communication_data_type": "fp32",
            "data_types": {"grad_accum_dtype": "fp32"},
        }
    )
    assert len(owned) == 4 and any("parallel.grad_reduce" in m for m in owned)
    assert any("train.grad_reduce_dtype" in m for m in owned)


def test_grad_reduce_settings_are_validated():
    from launcher.config import ConfigError, load_run_config

    with pytest.raises(ConfigError) as e:
        load_run_config(
            None,
            [
                "parallel.grad_reduce=sometimes",
                "parallel.bucket_elements=0",
                "train.grad_reduce_dtype=fp8",
                "train.precision=bf16",
            ],
        )
    msg = str(e.value)
    assert "parallel.grad_reduce='sometimes'" in msg and "overlap, after_backward" in msg
    assert "parallel.bucket_elements=0" in msg and "train.grad_reduce_dtype='fp8'" in msg
    with pytest.raises(ConfigError, match="applies to train.precision=bf16 only"):
        load_run_config(None, ["train.grad_reduce_dtype=fp32", "train.precision=fp32"])
    assert (
        load_run_config(
            None, ["train.grad_reduce_dtype=fp32", "train.precision=bf16"]
        ).train.grad_reduce_dtype
        == "fp32"
    )


def test_cost_model_overlap_follows_the_trainers_reduction():
    """benchmarks/costmodel/ with the trainer's `parallel.grad_reduce`: after_backward leaves the whole all-reduce
    exposed; overlap hides up to the last micro-batch's backward, never the last bucket; a model inside one bucket
    hides nothing; the paper fit's fixed fraction is unchanged."""
    from benchmarks import costmodel as cm
    from launcher.config import load_run_config
    from parallel.grad_reduce import bucket_elements

    cluster = cm.load_cluster("v100-dgx1")
    eff = cm.Efficiency(0.4, 0.0)

    def model(*sets):
        return load_run_config(None, list(sets)).model

    def options(*sets, **changes):
        cfg = load_run_config(None, list(sets))
        return cm.trainer_cost_options(cfg.train, cfg.parallel, **changes)

    xl = model("model.preset=gpt3-xl", "model.ffn.kind=demix", "model.ffn.num_experts=8")
    after = cm.predict(
        xl, 128, cluster, eff, options("train.precision=fp16", "parallel.grad_reduce=after_backward")
    )
    over = cm.predict(xl, 128, cluster, eff, options("train.precision=fp16"))
    assert after.allreduce_s == over.allreduce_s > 0
    assert after.step_s == pytest.approx(after.compute_s + after.allreduce_s)
    hidden = after.step_s - over.step_s
    backward = over.compute_s / 8 * 2 / 3  # the last of 8 micro-batches, no recompute
    assert 0 < hidden <= min(backward, over.allreduce_s) + 1e-12
    bucket = bucket_elements(cm.params_per_gpu(xl, 128), 128) * 2
    assert bucket == 128_000_000 * 2  # 1e6 elements per rank at 128 ranks
    # the exposed part is max(last bucket, all-reduce - backward)
    o = options("train.precision=fp16")
    assert cm.exposed_allreduce_seconds(10.0, 1.0, 4.0, o) == 6.0
    assert cm.exposed_allreduce_seconds(10.0, 1.0, 20.0, o) == 1.0
    assert cm.exposed_allreduce_seconds(10.0, 1.0, 4.0, replace(o, grad_reduce="after_backward")) == 10.0
    # a model smaller than one bucket: its single bucket is issued when the backward ends
    tiny = model("model.preset=tiny")
    one = cm.predict(tiny, 16, cluster, eff, options("train.precision=fp16"))
    assert one.step_s == pytest.approx(one.compute_s + one.allreduce_s)
    # trainer dtypes: bf16 at ZeRO 0 reduces fp32 gradients (autocast), at ZeRO 2 bf16 unless asked for fp32
    assert options("train.precision=bf16").grad_dtype == "fp32"
    assert options("train.precision=bf16", "parallel.zero_stage=2").grad_dtype == "bf16"
    assert (
        options("train.precision=bf16", "parallel.zero_stage=2", "train.grad_reduce_dtype=fp32").grad_dtype
        == "fp32"
    )
    # the paper fit's fixed fraction stays what it was
    fixed = cm.predict(xl, 128, cluster, eff, cm.CostOptions(overlap=0.5))
    assert fixed.step_s == pytest.approx(fixed.compute_s + 0.5 * fixed.allreduce_s)
    assert "grad_reduce='sometimes'" in " ".join(cm.CostOptions(grad_reduce="sometimes").problems())
