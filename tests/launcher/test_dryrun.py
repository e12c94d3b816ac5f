"""The dry run: config + layout + meta-device model for 128 GPUs, in-process, with no GPU and no process group."""

from __future__ import annotations

import json
import time

import pytest

from launcher.dryrun import main

XL_DEMIX = ["--set", "model.preset=gpt3-xl", "model.ffn.kind=demix", "parallel.tensor_parallel=2"]


def _run(tmp_path, *argv, **kw):
    out = tmp_path / "summary.json"
    rc = main([*argv, "--out", str(out)], **kw)
    return rc, (json.loads(out.read_text()) if out.exists() else None)


def test_gpt3_xl_demix_128_gpus_tp2(tmp_path, capsys):
    start = time.perf_counter()
    rc, s = _run(tmp_path, "--world-size", "128", "--domains", "8", *XL_DEMIX)
    elapsed = time.perf_counter() - start
    assert rc == 0 and elapsed < 5.0, elapsed
    assert s["model"] == {"name": "gpt3-xl", "ffn": "demix", "num_experts": 8}  # num_experts=0 -> 8 domains
    topo = s["topology"]
    assert (topo["world_size"], topo["tensor_parallel"], topo["data_parallel"]) == (128, 2, 64)
    assert topo["allocation"] == [8] * 8 and topo["domains"][7]["global_ranks"] == "112-127"
    first, last = s["ranks"]
    assert (first["rank"], first["expert_ids"], first["shard_index"], first["num_shards"]) == (0, [0], 0, 8)
    assert (last["rank"], last["expert_ids"], last["tp_rank"], last["shard_index"]) == (127, [7], 1, 7)
    assert first["expert_groups"] == {"0": list(range(0, 16, 2))}
    assert last["expert_groups"] == {"7": list(range(113, 128, 2))}
    p = first["params"]
    assert p["shared"] + p["expert"] == p["total"] and p["per_expert"] == 24 * (2 * 2048 * 8192 + 8192 + 2048)
    assert p["model_all_experts"] == p["shared"] + 8 * p["per_expert"]
    assert p["total"] // 2 < p["per_tp_rank"] < p["total"]
    assert s["deepspeed_equivalent"]["ep_size"] == 8
    printed = capsys.readouterr().out
    assert "tp 2 x dp 64" in printed and "rank 127" in printed and "sharded layers / 2" in printed


def test_gpt3_xl_dense_128_gpus(tmp_path):
    rc, s = _run(
        tmp_path,
        "--world-size",
        "128",
        "--set",
        "model.preset=gpt3-xl",
        "parallel.tensor_parallel=2",
        "data.mixture=natural",
    )
    assert rc == 0
    first, last = s["ranks"]
    assert first["expert_ids"] == last["expert_ids"] == [] and s["deepspeed_equivalent"] is None
    assert first["params"]["total"] == first["params"]["shared"] == last["params"]["total"]
    # dense: every rank reads its own shard of the mix
    assert (last["shard_index"], last["num_shards"]) == (
        63,
        64,
    )


def test_gpt3_xl_gshard_128_gpus_tp2_one_whole_expert_per_gpu(tmp_path, capsys):
    rc, s = _run(
        tmp_path,
        "--world-size",
        "128",
        "--set",
        "model.preset=gpt3-xl",
        "model.ffn.kind=gshard",
        "parallel.tensor_parallel=2",
        "data.mixture=natural",
    )
    assert rc == 0 and s["model"]["num_experts"] == 128  # one per GPU, tensor-parallel ranks included
    first, last = s["ranks"]
    assert (first["expert_ids"], last["expert_ids"]) == ([0], [127])
    assert first["expert_groups"]["expert_parallel"] == list(range(128))
    assert last["expert_groups"]["expert_data_parallel"] == [127]
    p = first["params"]
    ffn = 2 * 2048 * 8192 + 8192 + 2048
    assert p["expert"] == 12 * ffn  # one whole expert in each of the 12 MoE layers (every other layer)
    # TP shards attention, the 12 dense FFNs and the embedding; gates and experts stay whole on every TP rank
    attn = 3 * 2048 * 2048 + 3 * 2048 + 2048 * 2048
    assert p["tp_sharded"] == 24 * attn + 12 * (ffn - 2048) + 50432 * 2048  # 50257 padded to 256 x 197
    assert "all-to-all over 128 ranks" in capsys.readouterr().out
    rc, _ = _run(
        tmp_path,
        "--world-size",
        "12",
        "--set",
        "model.preset=tiny",
        "model.ffn.kind=gshard",
        "model.ffn.num_experts=8",
        "parallel.tensor_parallel=2",
        "data.mixture=natural",
    )
    assert rc == 2


def test_more_domains_than_ranks_and_named_uneven_domains(tmp_path):
    rc, s = _run(tmp_path, "--world-size", "3", "--set", "model.preset=tiny", "model.ffn.kind=demix")
    assert rc == 0 and [r["expert_ids"] for r in s["ranks"]] == [[0, 1, 2], [6, 7]]
    rc, s = _run(
        tmp_path,
        "--world-size",
        "16",
        "--set",
        "model.preset=tiny",
        "model.ffn.kind=demix",
        "data.domains=[web,news,code]",
        "parallel.allocation=[8,4,4]",
    )
    assert rc == 0 and s["model"]["num_experts"] == 3
    last = s["ranks"][-1]
    assert last["domain_names"] == ["code"] and (last["shard_index"], last["num_shards"]) == (3, 4)


def test_deepspeed_config_seam(tmp_path):
    seen = {}

    def fake_generator(cfg, topo):
        seen["world"] = topo.world_size
        return {"train_micro_batch_size_per_gpu": cfg.train.micro_batch}

    rc, s = _run(
        tmp_path,
        "--world-size",
        "8",
        "--set",
        "model.preset=tiny",
        "data.mixture=natural",
        deepspeed_config=fake_generator,
    )
    assert rc == 0 and seen == {"world": 8}
    assert json.loads((tmp_path / "deepspeed_config.json").read_text()) == {
        "train_micro_batch_size_per_gpu": 2
    }


def test_default_out_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["--world-size", "4", "--set", "model.preset=tiny", "data.mixture=natural"]) == 0
    assert (tmp_path / "runs" / "dryrun" / "summary.json").is_file()


@pytest.mark.parametrize(
    "argv, needles",
    [
        (
            ["--world-size", "100", "--domains", "8", *XL_DEMIX[:3]],
            [
                "1 problem(s)",
                "100 data-parallel ranks",
                "8 domains",
                "100 % 8 = 4",
                "parallel.allocation",
                "96 or 104",
            ],
        ),
        (
            [
                "--world-size",
                "128",
                "--set",
                "model.preset=gpt3-medium",
                "model.ffn.kind=demix",
                "parallel.tensor_parallel=3",
            ],
            [
                "3 problem(s)",
                "model.n_heads=16 is not divisible by tensor_parallel=3",
                "ffn width 4096",
                "world_size=128 is not divisible by tensor_parallel=3",
            ],
        ),
        (
            [
                "--world-size",
                "16",
                "--domains",
                "4",
                "--set",
                "model.preset=tiny",
                "model.ffn.kind=demix",
                "data.domains=[a,b]",
                "model.ffn.num_experts=5",
                "parallel.allocation=[4,4,4]",
            ],
            [
                "--domains 4 disagrees with data.domains",
                "num_experts=5 but there are 2 domains",
                "allocation=[4, 4, 4] has 3 entries but needs 2",
            ],
        ),
        (
            ["--world-size", "8", "--set", "model.preset=tiny", "parallel.allocation=[4,4]"],
            ["only used with model.ffn.kind=demix"],
        ),
        (
            ["--world-size", "8", "--set", "model.preset=nope", "train.steps=0"],
            ["model.preset='nope'", "train.steps=0"],
        ),
        # the trainer's own rule (one planning module): a token-routed model reads the natural mix
        (
            ["--world-size", "8", "--set", "model.preset=tiny", "model.ffn.kind=gshard"],
            ["1 problem(s)", "data.mixture=by_domain gives each rank one domain; for kind='gshard'"],
        ),
    ],
    ids=[
        "world100-8domains",
        "tp3-16heads",
        "domain-mismatch",
        "dense-allocation",
        "bad-config",
        "gshard-by-domain",
    ],
)
def test_bad_layouts_list_every_problem(tmp_path, capsys, argv, needles):
    rc, s = _run(tmp_path, *argv)
    err = capsys.readouterr().err
    assert rc == 2 and s is None
    for needle in needles:
        assert needle in err, (needle, err)


def test_cse_dry_run_plans_as_the_trainer_does(tmp_path):
    """The dry run and the trainer share launcher/plan.py: CSE's expert slots (max_clusters) are resolved and
    its ranks read every domain, as in a real launch."""
    rc, s = _run(
        tmp_path,
        "--world-size",
        "4",
        "--set",
        "model.preset=tiny",
        "model.ffn.kind=cse",
        "data.mixture=natural",
        "model.ffn.cse.max_clusters=6",
    )
    assert rc == 0 and s["model"] == {"name": "tiny", "ffn": "cse", "num_experts": 6}
    first, last = s["ranks"]
    assert (first["num_shards"], last["shard_index"]) == (4, 3)


def test_memory_table_for_gpt3_xl_demix_on_128_v100(tmp_path, capsys):
    """Per-GPU memory by ZeRO stage against a V100 32 GB, with the verdict, and model states at ZeRO 2 within 10 %
    of DeepSpeed's own estimator."""
    rc, s = _run(tmp_path, "--world-size", "128", "--device", "v100", *XL_DEMIX, "train.precision=fp16")
    assert rc == 0
    mem = s["memory"]
    assert mem["gpu_memory_gib"] == 32 and [r["zero_stage"] for r in mem["rows"]] == [0, 1, 2]
    # 8 data-parallel ranks/domain
    assert mem["params"]["expert_replicas"] == 8 and mem["params"]["dp_size"] == 64
    z0, z1, z2 = mem["rows"]
    assert z0["model_states"] > z1["model_states"] > z2["model_states"]
    assert z2["deepspeed_estimate"] == pytest.approx(z2["model_states"], rel=0.10)
    assert all(r["fits_recompute"] is True for r in mem["rows"])
    printed = capsys.readouterr().out
    assert (
        "memory per GPU" in printed
        and "V100 SXM2 32 GiB" in printed
        and "estimate_zero2_model_states" in printed
    )


def test_memory_table_says_no_when_it_does_not_fit(tmp_path, capsys):
    # 10 GB: at 16 GB ZeRO 2 fits (14.2 GiB) since its reduce buckets follow the model (parallel/engine.py
    # bucket_elements: 2 x 4e7 fp32 gradients, 0.3 GiB) instead of DeepSpeed's default 2 x 5e8 (3.7 GiB)
    rc, s = _run(
        tmp_path,
        "--world-size",
        "8",
        "--gpu-memory-gb",
        "10",
        "--set",
        "model.preset=gpt3-xl",
        "data.mixture=natural",
        "train.precision=fp32",
        "train.micro_batch=8",
        "model.seq_len=256",
    )
    assert rc == 0
    assert [r["fits_no_recompute"] for r in s["memory"]["rows"]] == [False, False, False]
    assert "NO" in capsys.readouterr().out


def test_memory_arithmetic_matches_the_papers_formulas():
    """ZeRO eq. Z with DeepSpeed's multipliers, Korthikanti et al.'s eq. A1/A2 (parallel/memory.py)."""
    from model.config import ModelConfig
    from parallel.memory import RankParams, activation_bytes, deepspeed_zero2_estimate, model_state_bytes

    p = RankParams(shared=1_000_000, expert=0, dp_size=4, expert_replicas=1)
    assert sum(model_state_bytes(p, "fp16", 0).values()) == 20_000_000  # (2 + 2 + 16) Psi
    assert sum(model_state_bytes(p, "fp16", 1).values()) == 4_000_000 + 16_000_000 / 4
    assert (
        sum(model_state_bytes(p, "fp16", 2).values())
        == 2_000_000 + 18_000_000 / 4
        == deepspeed_zero2_estimate(p)
    )
    assert sum(model_state_bytes(p, "fp32", 2).values()) == 4_000_000 + 12_000_000 / 4
    # experts over their group
    demix = RankParams(shared=1_000_000, expert=500_000, dp_size=8, expert_replicas=2)
    assert model_state_bytes(demix, "fp16", 1)["optimizer"] == 16 * 1_000_000 / 8 + 16 * 500_000 / 2
    # bf16 reduced in fp32 at ZeRO 2: DeepSpeed's grad_accum_dtype fp32 holds the gradient partition in fp32
    assert (
        model_state_bytes(p, "bf16", 2, "fp32")["grads"]
        == 4 * 1_000_000 / 4
        == 2 * model_state_bytes(p, "bf16", 2)["grads"]
    )
    # ZeRO 1: .grad stays bf16
    assert model_state_bytes(p, "bf16", 1, "fp32") == model_state_bytes(p, "bf16", 1)
    m = ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=32, vocab_size=1000)
    s, b, h, a, v = 32, 3, 64, 4, m.padded_vocab_size(1)
    per_layer = s * b * h * (34 + 5 * a * s / h)
    assert activation_bytes(m, 3, 1, False, "fp16") == pytest.approx(2 * per_layer + 6 * s * b * v)
    assert activation_bytes(m, 3, 1, True, "fp16") == pytest.approx(
        2 * 2 * s * b * h + per_layer + 6 * s * b * v
    )
    assert activation_bytes(m, 3, 1, False, "fp32") == pytest.approx(2 * 2 * per_layer + 6 * s * b * v)


def test_memory_activations_traced_from_the_rank_model_and_labelled(tmp_path, capsys):
    """Activations come from a fake-tensor trace of this rank's model (here a DEMix rank holding two domains),
    smaller than the formula's O(s^2) attention term; tensor parallel falls back to the formula and says why."""
    from launcher.config import load_run_config
    from parallel.memory import activation_bytes

    argv = [
        "--world-size",
        "2",
        "--set",
        "model.preset=tiny",
        "model.ffn.kind=demix",
        "data.domains=[a,b,c,d]",
        "train.precision=bf16",
        "train.micro_batch=4",
    ]
    rc, s = _run(tmp_path, *argv)
    assert rc == 0 and s["memory"]["activations"]["method"] == "traced"
    assert s["memory"]["activations"]["fallback_reason"] is None
    printed = capsys.readouterr().out
    assert "activations: traced" in printed
    rows = s["memory"]["rows"]
    assert rows[0]["activations_recompute"] < rows[0]["activations_no_recompute"]
    assert rows[1]["activations_no_recompute"] != activation_bytes(
        load_run_config(None, argv[3:]).model, 4, 1, False, "bf16"
    )
    rc, s = _run(
        tmp_path,
        *argv[:2],
        "--set",
        "model.preset=tiny",
        "parallel.tensor_parallel=2",
        "data.mixture=natural",
    )
    assert rc == 0 and s["memory"]["activations"]["method"] == "formula"
    assert "tensor_parallel=2" in s["memory"]["activations"]["fallback_reason"]
    assert "activations: formula" in capsys.readouterr().out


def test_memory_rows_follow_the_runs_gradient_reduction_settings():
    """The dry run's rows use the run's parallel.grad_reduce, parallel.bucket_elements and train.grad_reduce_dtype
    (parallel/memory.py `buffer_bytes`, `model_state_bytes`), not DeepSpeed's defaults."""
    from model.config import ModelConfig
    from parallel.memory import RankParams, buffer_bytes, memory_rows

    p = RankParams(shared=100_000_000, expert=0, dp_size=4, expert_replicas=1)  # several 4e7-element buckets
    m = ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=32, vocab_size=1000)
    rows = {
        opts: memory_rows(p, m, 1, 1, "bf16", None, **dict(opts))
        for opts in (
            (),
            (("grad_reduce", "after_backward"),),
            (("bucket_override", 1_000_000),),
            (("grad_reduce_dtype", "fp32"),),
        )
    }
    default, after, small, fp32 = rows.values()
    for zero in (0, 1, 2):
        assert after[zero]["buffers"] == buffer_bytes("bf16", zero, p, "after_backward")
        assert small[zero]["buffers"] == buffer_bytes("bf16", zero, p, bucket_override=1_000_000)
        assert fp32[zero]["buffers"] == buffer_bytes("bf16", zero, p, grad_reduce_dtype="fp32")
    assert small[1]["buffers"] < default[1]["buffers"] and fp32[1]["buffers"] > default[1]["buffers"]
    assert after[0]["buffers"] != default[0]["buffers"]
    assert fp32[2]["grads"] == 2 * default[2]["grads"] and fp32[1]["grads"] == default[1]["grads"]


# ---------------------------------------------------------------------------------------------------------------
# The data: read as launch reads it when the run names it, invented (and said so) when it does not
# ---------------------------------------------------------------------------------------------------------------

SMALL = [
    "model.preset=tiny",
    "model.n_layers=2",
    "model.d_model=32",
    "model.n_heads=2",
    "model.seq_len=32",
    "model.ffn.kind=demix",
    "data.tokenizer=gpt2",
]


def test_dry_run_plans_the_prepared_datas_own_domains(tmp_path, tiny_tokens, capsys):
    """data.path (in a --set, the config or --data) is read with launch's planner: the token manifest's training
    domains become the experts, the held-out ones are listed as novel, the tokenizer's vocabulary is reported."""
    rc, s = _run(tmp_path, "--world-size", "3", "--set", *SMALL, f"data.path={tiny_tokens}")
    printed = capsys.readouterr().out
    assert rc == 0 and s["domains"] == ["cooking", "finance", "sailing"] and s["model"]["num_experts"] == 3
    assert s["data"]["source"] == "manifest" and s["data"]["tokenizer_vocab_size"] == 50257
    assert [r["domain_names"] for r in s["ranks"]] == [["cooking"], ["sailing"]]
    assert (
        "training domains: cooking, finance, sailing" in printed
        and "gpt2 tokenizer, 50,257 tokens" in printed
    )
    assert "invented" not in printed and "domain0" not in printed
    config = tmp_path / "run.yaml"
    config.write_text(f"data: {{path: {tiny_tokens}, domains: [sailing, cooking]}}\n")
    rc, s = _run(tmp_path, str(config), "--world-size", "2", "--set", *SMALL)
    assert rc == 0 and s["domains"] == ["sailing", "cooking"] and s["data"]["novel_domains"] == ["finance"]
    assert "novel (held out): finance" in capsys.readouterr().out
    rc, s = _run(tmp_path, "--world-size", "3", "--data", str(tiny_tokens), "--set", *SMALL)
    assert rc == 0 and s["domains"] == ["cooking", "finance", "sailing"]
    rc, _ = _run(tmp_path, "--world-size", "3", "--data", str(tiny_tokens), "--domains", "8", "--set", *SMALL)
    assert rc == 2 and "--domains 8 disagrees with the 3 training domains" in capsys.readouterr().err


def test_dry_run_without_data_says_it_invented_the_domains(tmp_path, capsys):
    rc, s = _run(tmp_path, "--world-size", "4", "--set", "model.preset=tiny", "data.mixture=natural")
    printed = capsys.readouterr().out
    assert rc == 0 and s["data"]["source"] == "invented" and s["domains"][0] == "domain0"
    assert "domains domain0..domain7 are invented" in printed and "not checked against a tokenizer" in printed
    assert any("invented" in n for n in s["notes"])
    # a config naming data that is not here: refused as launch refuses it, with the way out
    rc, _ = _run(
        tmp_path,
        "--world-size",
        "4",
        "--set",
        "model.preset=tiny",
        "data.mixture=natural",
        f"data.path={tmp_path / 'nowhere'}",
    )
    err = capsys.readouterr().err
    assert rc == 2 and "manifest.json not found" in err and "--no-data" in err
    rc, s = _run(
        tmp_path,
        "--world-size",
        "4",
        "--no-data",
        "--set",
        "model.preset=tiny",
        "data.mixture=natural",
        f"data.path={tmp_path / 'nowhere'}",
    )
    assert rc == 0 and s["data"]["source"] == "invented"


def _launch_dry_run(tmp_path, config, *sets):
    from launcher.launch import main as launch

    argv = ["--nproc", "1", "--dry-run", "--run-dir", str(tmp_path / "run")] + (
        ["--config", config] if config else []
    )
    return launch([*argv, *[a for s in sets for a in ("--set", s)]])


@pytest.mark.parametrize(
    "config, sets, fix",
    [
        (None, [*SMALL, "model.vocab_size=8200"], "--set model.vocab_size=50304"),
        # the demo's tiny configs (vocab 8200, for the 8,192-token sentencepiece demo data) over GPT-2 tokens
        (
            "configs/demo/demix.yaml",
            ["data.tokenizer=gpt2", "model.seq_len=32"],
            "--set model.vocab_size=50304",
        ),
        (
            "configs/demo/domain-token.yaml",
            ["data.tokenizer=gpt2", "model.seq_len=32"],
            "--set model.vocab_size=50304",
        ),
    ],
    ids=["vocab-8200", "tiny-demix-config", "tiny-domain-token-config"],
)
def test_vocab_smaller_than_the_tokenizer_fails_with_the_fix_in_dryrun_and_launch(
    tmp_path, tiny_tokens, capsys, config, sets, fix
):
    """One rule (launcher/plan.py `vocab_problems`) for the dry run and launch --dry-run, with the same fix."""
    world = "1" if config and "domain-token" in config else "3"
    rc, s = _run(
        tmp_path,
        *([config] if config else []),
        "--world-size",
        world,
        "--data",
        str(tiny_tokens),
        "--set",
        *sets,
    )
    dry_err = capsys.readouterr().err
    assert rc == 2 and s is None
    assert "model.vocab_size=8200 (padded 8320) is smaller than the" in dry_err and fix in dry_err, dry_err
    assert (
        _launch_dry_run(
            tmp_path, config, f"data.path={tiny_tokens}", *sets, f"logging.out_dir={tmp_path / 'run'}"
        )
        == 2
    )
    launch_err = capsys.readouterr().err
    line = next(x for x in dry_err.splitlines() if "vocab_size=8200" in x)
    assert line in launch_err.splitlines(), (line, launch_err)
    if config and "domain-token" in config:
        assert "50260 token ids" in line and "50257 tokenizer tokens + 3 domain tokens" in line
    # the fix it names works
    rc, _ = _run(
        tmp_path,
        *([config] if config else []),
        "--world-size",
        world,
        "--data",
        str(tiny_tokens),
        "--set",
        *sets,
        fix.split()[-1],
    )
    assert rc == 0, capsys.readouterr().err
