"""Direct tests of the engine's pure parts, in one process with no process group: the generated DeepSpeed config
and the keys the framework owns (parallel/ds_config.py), the learning-rate schedule, the gradient bucket plan
(parallel/grad_reduce.py), the optimizer's parameter groups and their chunking (parallel/optim_groups.py), the
expert gradient scale (parallel/demix_sync.py), and AdamW's options and gradient clipping (parallel/engine.py).
Real models, configs and DeepSpeed functions throughout; the multi-rank behaviour is in test_demix_sync.py and
test_grad_overlap.py."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn as nn

from launcher.config import ConfigError, load_run_config
from model.gpt import GPT
from parallel.config import ParallelConfig, TrainConfig
from parallel.demix_sync import ExpertGradScale, is_expert_param, tag_expert_parameters
from parallel.ds_config import OWNED_DEEPSPEED_KEYS, deepspeed_config, extra_deepspeed_problems, lr_lambda
from parallel.engine import adamw_options, clip_grads_
from parallel.grad_reduce import GradReducePlan, bucket_elements, plan_grad_reduce
from parallel.groups import ProcessGroups
from parallel.optim_groups import _exactly, _greedy_chunks, _split_max_numel, optimizer_param_groups
from parallel.topology import build_topology

# ------------------------------------------------------------------------------------------------------------
# deepspeed_config
# ------------------------------------------------------------------------------------------------------------


def _ds(train: dict[str, Any] | None = None, parallel: dict[str, Any] | None = None, **kw: Any) -> dict:
    return deepspeed_config(TrainConfig(**(train or {})), ParallelConfig(**(parallel or {})), **kw)


def _leaves(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        path = f"{prefix}.{k}" if prefix else k
        out.update(_leaves(v, path) if isinstance(v, dict) and v else {path: v})
    return out


def test_zero0_fp32_config_is_exactly_the_documented_one():
    assert _ds({"micro_batch": 3, "grad_accum": 5, "clip_grad": 0.7}) == {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 5,
        "gradient_clipping": 0.0,  # ZeRO 0: the trainer clips with the global norm itself
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
    }


def test_zero2_bf16_reduced_in_fp32_with_a_bucket_size():
    ds = _ds(
        {
            "micro_batch": 4,
            "grad_accum": 3,
            "clip_grad": 0.5,
            "precision": "bf16",
            "grad_reduce_dtype": "fp32",
        },
        {"zero_stage": 2, "bucket_elements": 1001},
    )
    assert ds["gradient_clipping"] == 0.5  # ZeRO 1/2 clip with their own (global) norm
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (4, 3)
    assert ds["zero_optimization"] == {
        "stage": 2,
        "reduce_scatter": True,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 1002,  # rounded up to even
        "allgather_bucket_size": 1002,
    }
    assert ds["bf16"] == {"enabled": True}
    assert ds["communication_data_type"] == "fp32"
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"}
    assert "torch_autocast" not in ds and "fp16" not in ds


def test_bf16_by_stage():
    zero1 = _ds({"precision": "bf16", "grad_reduce_dtype": "fp32"}, {"zero_stage": 1})
    assert zero1["bf16"] == {"enabled": True} and zero1["communication_data_type"] == "fp32"
    assert "data_types" not in zero1  # ZeRO 1 accumulates micro-batches in bf16 .grad (see deepspeed_config)
    plain = _ds({"precision": "bf16"}, {"zero_stage": 2})
    assert "communication_data_type" not in plain and "data_types" not in plain
    zero0 = _ds({"precision": "bf16"}, {"zero_stage": 0})
    assert zero0["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}  # autocast over fp32 weights
    assert "bf16" not in zero0


def test_fp16_config():
    for zero in (0, 1, 2):
        ds = _ds({"precision": "fp16"}, {"zero_stage": zero})
        assert ds["fp16"] == {
            "enabled": True,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
        }
        assert "bf16" not in ds and "torch_autocast" not in ds


def test_bucket_keys_and_overlap_without_and_with_a_plan():
    bare = _ds(parallel={"zero_stage": 1, "grad_reduce": "after_backward"})["zero_optimization"]
    assert bare["overlap_comm"] is False
    assert "reduce_bucket_size" not in bare and "allgather_bucket_size" not in bare  # DeepSpeed's defaults
    # The plan (agreed by the ranks from the model) decides over parallel.grad_reduce / bucket_elements.
    plan = GradReducePlan(elements=777, overlap=False, max_rank_params=777, uniform=True)
    planned = _ds(parallel={"zero_stage": 2, "bucket_elements": 10}, grad_reduce=plan)["zero_optimization"]
    assert (planned["overlap_comm"], planned["reduce_bucket_size"], planned["allgather_bucket_size"]) == (
        False,
        778,
        778,
    )
    # ZeRO 0 reduces through OverlappedGradReduce: no ZeRO keys at all.
    assert _ds(parallel={"zero_stage": 0}, grad_reduce=plan)["zero_optimization"] == {"stage": 0}


def test_extra_deepspeed_is_merged_inside_sections():
    extra = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}, "comms_logger": {"enabled": True}}
    ds = _ds(parallel={"zero_stage": 2}, extra=extra)
    assert ds["zero_optimization"]["stage"] == 2 and ds["zero_optimization"]["overlap_comm"] is True
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert ds["comms_logger"] == {"enabled": True}
    assert extra == {
        "zero_optimization": {"offload_optimizer": {"device": "cpu"}},
        "comms_logger": {"enabled": True},
    }


def test_owned_keys_are_refused_with_the_typed_setting_to_use():
    problems = extra_deepspeed_problems(
        {
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
            "data_types": {"grad_accum_dtype": "fp32"},
            "flops_profiler": {"enabled": True},
        }
    )
    assert problems == [
        "extra_deepspeed.gradient_clipping is set by the framework: use train.clip_grad",
        "extra_deepspeed.zero_optimization.stage is set by the framework: use parallel.zero_stage",
        "extra_deepspeed.data_types.grad_accum_dtype is set by the framework: use "
        + OWNED_DEEPSPEED_KEYS["data_types.grad_accum_dtype"],
    ]
    assert extra_deepspeed_problems({"fp16": {"enabled": False}}, prefix="x") == [
        "x.fp16 is set by the framework: use train.precision"
    ]


def test_run_config_refuses_owned_keys_and_passes_the_others(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "model: {preset: tiny}\nextra_deepspeed: {gradient_accumulation_steps: 4, bf16: {enabled: true}}\n"
    )
    with pytest.raises(ConfigError) as err:
        load_run_config(bad)
    assert sorted(p for p in err.value.problems if p.startswith("extra_deepspeed")) == [
        "extra_deepspeed.bf16 is set by the framework: use train.precision",
        "extra_deepspeed.gradient_accumulation_steps is set by the framework: use train.grad_accum",
    ]
    good = tmp_path / "good.yaml"
    good.write_text(
        "model: {preset: tiny}\nextra_deepspeed: {zero_optimization: {offload_optimizer: {device: cpu}}}\n"
    )
    cfg = load_run_config(good)
    ds = deepspeed_config(cfg.train, cfg.parallel, cfg.extra_deepspeed)
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}


SWEEP = [
    ({"precision": p, "micro_batch": mb, "grad_accum": ga, "clip_grad": c, "grad_reduce_dtype": d}, par)
    for p, d in (("fp32", None), ("fp16", None), ("bf16", None), ("bf16", "fp32"))
    for mb, ga, c in ((1, 1, 0.1), (4, 8, 1.0))
    for par in (
        {"zero_stage": 0},
        {"zero_stage": 1, "bucket_elements": 64},
        {"zero_stage": 2, "grad_reduce": "after_backward", "bucket_elements": 4096},
    )
]


def test_every_key_the_typed_config_changes_is_owned():
    """A key whose value follows the typed config must be one `extra_deepspeed` cannot override."""
    values: dict[str, set] = {}
    for train, par in SWEEP:
        for path, v in _leaves(_ds(train, par)).items():
            values.setdefault(path, set()).add(repr(v))
    varying = sorted(path for path, vs in values.items() if len(vs) > 1)
    assert {"gradient_clipping", "zero_optimization.stage", "zero_optimization.reduce_bucket_size"} <= set(
        varying
    )
    for path in varying:
        assert any(path == k or path.startswith(k + ".") for k in OWNED_DEEPSPEED_KEYS), path


# ------------------------------------------------------------------------------------------------------------
# lr_lambda
# ------------------------------------------------------------------------------------------------------------


def _lr(schedule: str, warmup_fraction: float = 0.2) -> Any:
    return lr_lambda(
        TrainConfig(steps=100, lr=1e-3, min_lr=1e-4, warmup_fraction=warmup_fraction, schedule=schedule)
    )


def test_linear_warmup_then_polynomial_decay_to_min_lr():
    fn = _lr("polynomial")  # warm-up 20 steps, decay over 80, floor min_lr / lr = 0.1
    assert fn(0) == pytest.approx(1 / 20)
    assert fn(9) == pytest.approx(10 / 20)
    assert fn(19) == pytest.approx(1.0)
    assert fn(20) == pytest.approx(1.0)
    assert fn(60) == pytest.approx(0.1 + 0.9 * 0.5)
    assert fn(100) == pytest.approx(0.1)
    assert fn(150) == pytest.approx(0.1)  # past the end: stays at min_lr


def test_cosine_and_constant_schedules():
    cos = _lr("cosine")
    assert cos(19) == pytest.approx(1.0)
    assert cos(40) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert cos(60) == pytest.approx(0.55)
    assert cos(100) == pytest.approx(0.1)
    const = _lr("constant")
    assert [const(s) for s in (0, 19, 20, 99)] == pytest.approx([0.05, 1.0, 1.0, 1.0])
    no_warmup = _lr("polynomial", warmup_fraction=0.0)
    assert no_warmup(0) == pytest.approx(1.0) and no_warmup(50) == pytest.approx(0.1 + 0.9 * 0.5)


def test_lr_lambda_drives_a_real_scheduler():
    t = TrainConfig(steps=10, lr=2e-3, min_lr=0.0, warmup_fraction=0.2)
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(2))], **adamw_options(t, "cpu"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(t))
    seen = []
    for _ in range(10):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    fn = lr_lambda(t)
    assert seen == pytest.approx([2e-3 * fn(s) for s in range(10)])
    assert seen[:3] == pytest.approx([1e-3, 2e-3, 2e-3])


# ------------------------------------------------------------------------------------------------------------
# bucket size and the gradient-reduction plan
# ------------------------------------------------------------------------------------------------------------


def test_bucket_elements_rule():
    assert bucket_elements(1_000_000, 8) == 1_000_000  # bounded by the rank's parameters
    assert bucket_elements(10**9, 8) == 40_000_000  # Megatron-core's floor
    assert bucket_elements(10**9, 64) == 64_000_000  # 1e6 per data-parallel rank
    assert bucket_elements(10**10, 1000) == 500_000_000  # never above DeepSpeed's default
    assert bucket_elements(10**9, 8, override=1001) == 1002  # the override, rounded up to even
    assert bucket_elements(3, 1) == 4


def _one_rank_groups(domains: int = 1) -> ProcessGroups:
    """This process's groups as data (a one-rank world needs no process group)."""
    return ProcessGroups(build_topology(1, 1, domains), 0, None, (0,), None, (0,), None, (0,))


def _gpt(kind: str = "dense", experts: int = 0, expert_ids: list[int] | None = None) -> GPT:
    cfg = load_run_config(
        None,
        [
            "model.preset=tiny",
            "model.n_layers=2",
            "model.vocab_size=300",
            "model.seq_len=32",
            f"model.ffn.kind={kind}",
            f"model.ffn.num_experts={experts}",
        ],
    )
    return GPT(cfg.model, expert_ids=expert_ids, init_seed=0)


def test_plan_grad_reduce_on_one_rank():
    model = _gpt()
    P = sum(p.numel() for p in model.parameters() if p.requires_grad)
    groups = _one_rank_groups()
    zero0 = plan_grad_reduce(model, ParallelConfig(zero_stage=0), groups)
    assert zero0 == GradReducePlan(elements=P + P % 2, overlap=True, max_rank_params=P, uniform=True)
    # ZeRO 1/2 with one bucket holding the whole rank: nothing to overlap.
    assert plan_grad_reduce(model, ParallelConfig(zero_stage=1), groups).overlap is False
    quarter = plan_grad_reduce(model, ParallelConfig(zero_stage=2, bucket_elements=P // 4), groups)
    assert (quarter.elements, quarter.overlap) == (P // 4 + (P // 4) % 2, True)
    after = plan_grad_reduce(model, ParallelConfig(zero_stage=0, grad_reduce="after_backward"), groups)
    assert after.overlap is False


# ------------------------------------------------------------------------------------------------------------
# expert tagging, gradient scale, optimizer groups
# ------------------------------------------------------------------------------------------------------------


def test_expert_grad_scale_factors():
    scale = ExpertGradScale(dp_size=8, group_size=2, scaling="domain_mean")
    assert scale.factor(0) == 4.0  # N_dp / R_e before any step's tokens are known
    scale.set_step_tokens({0: 30.0, 1: 10.0, 2: 0.0}, total=40.0)
    assert scale.factor(0) == pytest.approx(4 * 40 / 30) and scale.factor(1) == pytest.approx(16.0)
    assert scale.factor(2) == 4.0  # no tokens this step: the base factor
    assert scale.hook(1)(torch.ones(2)).tolist() == pytest.approx([16.0, 16.0])
    fairseq = ExpertGradScale(dp_size=8, group_size=2, scaling="global")
    fairseq.set_step_tokens({0: 30.0}, total=40.0)
    assert fairseq.factor(0) == 1.0


def _ids(groups: list[dict]) -> list[int]:
    return [id(p) for g in groups for p in g["params"]]


def test_optimizer_groups_of_a_dense_model():
    model = _gpt()
    groups = optimizer_param_groups(model, weight_decay=0.1)
    assert [(g["name"], g["weight_decay"]) for g in groups] == [("decay", 0.1), ("no_decay", 0.0)]
    assert all(p.dim() >= 2 for p in groups[0]["params"]) and all(p.dim() < 2 for p in groups[1]["params"])
    ids = _ids(groups)
    assert len(ids) == len(set(ids)) and set(ids) == {id(p) for p in model.parameters()}


def test_optimizer_groups_of_a_demix_rank_put_every_parameter_in_exactly_one_group():
    model = _gpt("demix", 4, expert_ids=[1, 2])  # a rank holding two of four domains
    groups = _one_rank_groups(domains=4)
    scale = tag_expert_parameters(model, groups, "domain_mean")
    assert scale.base == 1.0  # one rank: N_dp / R_e = 1
    experts = {id(p) for params in model.expert_parameters().values() for p in params}
    assert experts and all(is_expert_param(p) == (id(p) in experts) for p in model.parameters())
    out = optimizer_param_groups(model, weight_decay=0.1)
    ids = _ids(out)
    assert len(ids) == len(set(ids)) and set(ids) == {id(p) for p in model.parameters()}
    names = [g["name"] for g in out]
    assert names[:2] == ["decay", "no_decay"] and set(names[2:]) == {groups.expert_group_name}
    assert not any(id(p) in experts for g in out[:2] for p in g["params"])
    assert {id(p) for g in out[2:] for p in g["params"]} == experts
    assert all(g.get("moe") for g in out[2:])
    # one chunk per base group (the tiny experts are far under DeepSpeed's threshold), decay values kept
    assert [g["weight_decay"] for g in out[2:]] == [0.1, 0.0]
    # frozen shared parameters (DEMix-DAPT): their groups are dropped, as DeepSpeed drops them
    for p in model.parameters():
        p.requires_grad_(id(p) in experts)
    assert [g["name"] for g in optimizer_param_groups(model, 0.1)] == [groups.expert_group_name] * 2


def _params(*sizes: int) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(n)) for n in sizes]


def _sizes(chunks: list[list[nn.Parameter]]) -> list[list[int]]:
    return [[p.numel() for p in c] for c in chunks]


def test_greedy_chunks_follow_deepspeeds_split():
    assert _split_max_numel() == 178_956_971  # DeepSpeed 0.19.8's default max_group_size
    ps = _params(4, 4, 4, 4)
    assert _sizes(_greedy_chunks(ps, 8)) == [[4, 4], [4, 4]]
    assert _sizes(_greedy_chunks(ps, None)) == [[4, 4, 4, 4]]
    assert _sizes(_greedy_chunks(ps, 3)) == [[4], [4], [4], [4]]  # a tensor over the limit stands alone
    assert _sizes(_greedy_chunks(_params(5, 2, 2, 9), 9)) == [[5, 2, 2], [9]]


@pytest.mark.parametrize(
    "sizes, limit, count, want",
    [
        ((4, 4, 4, 4), 8, 3, [[4], [4], [4, 4]]),  # split the largest chunk (the first of equals) in two
        ((1, 1, 6), 8, 2, [[1, 1], [6]]),  # split by size, keeping order
        ((4, 4, 4, 4), 3, 2, [[4, 4], [4, 4]]),  # merge the smallest adjacent pairs
        ((1, 9, 1, 1), 1, 3, [[1], [9], [1, 1]]),
        ((4, 4), 8, 1, [[4, 4]]),  # already there
    ],
)
def test_exactly_makes_the_agreed_number_of_chunks(sizes, limit, count, want):
    ps = _params(*sizes)
    out = _exactly(_greedy_chunks(ps, limit), count)
    assert _sizes(out) == want
    assert [id(p) for c in out for p in c] == [id(p) for p in ps]  # every tensor once, in order


def test_exactly_cannot_make_more_chunks_than_tensors():
    with pytest.raises(ValueError, match="cannot split 2 expert tensors into 3 optimizer groups"):
        _exactly(_greedy_chunks(_params(4, 4), None), 3)


# ------------------------------------------------------------------------------------------------------------
# AdamW options and clipping
# ------------------------------------------------------------------------------------------------------------


def test_adamw_options():
    t = TrainConfig(lr=3e-4, beta1=0.8, beta2=0.9, eps=1e-6)
    assert adamw_options(t, "cpu") == {"lr": 3e-4, "betas": (0.8, 0.9), "eps": 1e-6}
    assert adamw_options(t, "cuda") == {"lr": 3e-4, "betas": (0.8, 0.9), "eps": 1e-6, "fused": True}


def test_clip_grads_scales_by_max_norm_over_norm():
    lin = nn.Linear(3, 2)
    lin.weight.grad, lin.bias.grad = torch.full((2, 3), 2.0), torch.full((2,), -1.0)
    clip_grads_(lin, max_norm=1.0, norm=torch.tensor(4.0))
    coef = 1.0 / (4.0 + 1e-6)
    assert lin.weight.grad.flatten().tolist() == pytest.approx([2.0 * coef] * 6)
    assert lin.bias.grad.tolist() == pytest.approx([-coef] * 2)
    clip_grads_(lin, max_norm=1.0, norm=torch.tensor(0.5))  # under the limit: unchanged (coefficient 1)
    assert lin.bias.grad.tolist() == pytest.approx([-coef] * 2)
