"""FLOPs and parameter accounting (model/accounting.py) and its command (launcher/flops.py).

Checks the counts against real modules, the closed forms of Narayanan et al. (2021) eq. (3), the
paper's Tables 2 and 9, device-peak lookup and MFU, and the `--json` command output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from launcher import flops as flops_cli
from launcher.config import load_run_config
from model import accounting as acc
from model.config import GShardConfig, ModelConfig
from model.gpt import GPT

ROOT = Path(__file__).resolve().parents[2]


def preset(name: str, kind: str = "dense", num_experts: int = 0) -> ModelConfig:
    return load_run_config(
        None, [f"model.preset={name}", f"model.ffn.kind={kind}", f"model.ffn.num_experts={num_experts}"]
    ).model


def built_params(cfg: ModelConfig, device: str = "cpu") -> int:
    with torch.device(device):
        model = GPT(cfg)
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------- parameters


@pytest.mark.parametrize(
    "name,kind,experts,device",
    [
        ("tiny", "dense", 0, "cpu"),
        ("tiny", "demix", 8, "cpu"),
        ("tiny", "demix", 3, "meta"),
        ("gpt3-small", "dense", 0, "meta"),
        ("gpt3-small", "demix", 8, "meta"),
    ],
)
def test_param_count_equals_built_model(name: str, kind: str, experts: int, device: str) -> None:
    cfg = preset(name, kind, experts)
    counted = acc.param_counts(cfg, vocab_size=cfg.padded_vocab_size()).total
    assert counted == built_params(cfg, device)
    # the default (unpadded) count differs by exactly the padding rows of the tied embedding
    assert counted - acc.param_counts(cfg).total == (cfg.padded_vocab_size() - cfg.vocab_size) * cfg.d_model


@pytest.mark.parametrize("kind,experts", [("gshard", 4), ("cse", 3)])
def test_param_count_equals_built_model_other_kinds(kind: str, experts: int) -> None:
    cfg = preset("tiny", kind, experts)
    try:
        n = built_params(cfg, "meta")
    except ValueError as e:
        if "no builder registered" in str(e):
            pytest.skip(f"{kind} layer not registered in model/ffn.py yet")
        raise
    assert acc.param_counts(cfg, vocab_size=cfg.padded_vocab_size()).total == n


def test_gpt2_small_param_count() -> None:
    # GPT-2 small (vocab 50257, 1024 positions, tied head) is famously 124,439,808 parameters.
    cfg = preset("gpt3-small")
    assert acc.param_counts(cfg, vocab_size=50257).total == 124_439_808


def test_active_and_expert_params() -> None:
    dense = acc.param_counts(preset("gpt3-small"))
    demix = acc.param_counts(preset("gpt3-small", "demix", 8))
    gshard = acc.param_counts(preset("gpt3-small", "gshard", 32))
    cse = acc.param_counts(preset("gpt3-small", "cse", 4))
    ffn = 2 * 768 * 3072 + 3072 + 768
    assert demix.per_expert_ffn == ffn
    assert demix.active == dense.total == dense.shared and dense.expert == 0
    assert demix.total == dense.total + 7 * 12 * ffn and demix.expert == 8 * 12 * ffn
    # GShard: 6 expert layers (every other one) of 32 experts, a 768 x 32 gate each; a token runs 2 experts
    assert gshard.expert_layers == 6 and gshard.num_experts == 32
    assert gshard.total == dense.total + 31 * 6 * ffn + 6 * 768 * 32
    assert gshard.active == dense.total + 6 * ffn + 6 * 768 * 32
    assert cse.total == dense.total + 3 * 2 * ffn and cse.active == dense.total
    assert gshard.total == gshard.shared + gshard.expert


# ---------------------------------------------------------------------------- FLOPs


def narayanan_flops(
    global_batch: int,
    seq_len: int,
    n_layers: int,
    d_model: int,
    vocab_size: int,
    convention: str = "recompute",
) -> int:
    """The closed form of Narayanan et al. (2021), eq. (3), for a dense GPT with F = 4h:

        recompute:    96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))
        no_recompute: 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))

    Evaluated in exact rational arithmetic; the result is always an integer.
    """
    b, s, l, h, v = global_batch, seq_len, n_layers, d_model, vocab_size
    if convention == "recompute":
        f = 96 * b * s * l * h * h * (1 + Fraction(s, 6 * h) + Fraction(v, 16 * l * h))
    elif convention == "no_recompute":
        f = 72 * b * s * l * h * h * (1 + Fraction(s, 6 * h) + Fraction(v, 12 * l * h))
    else:
        raise ValueError(f"FLOPs convention {convention!r}: choose one of {', '.join(acc.FLOP_CONVENTIONS)}")
    assert f.denominator == 1, "eq. (3) expands to integer terms"
    return int(f)


SHAPES = [(512, 1024, 12, 768, 50264), (2048, 1024, 24, 2048, 50264), (3, 17, 5, 40, 101)]


@pytest.mark.parametrize("b,s,l,h,v", SHAPES)
def test_dense_flops_equal_narayanan_closed_form(b: int, s: int, l: int, h: int, v: int) -> None:
    cfg = ModelConfig(n_layers=l, d_model=h, n_heads=1, seq_len=s, vocab_size=v)
    rep = acc.flops_per_update(cfg, b)
    assert rep.recompute == narayanan_flops(b, s, l, h, v, "recompute")
    assert rep.no_recompute == narayanan_flops(b, s, l, h, v, "no_recompute")
    # the expanded paper form: 96·B·s·l·h² + 16·B·s²·l·h + 6·B·s·h·V
    assert rep.recompute == 96 * b * s * l * h * h + 16 * b * s * s * l * h + 6 * b * s * h * v
    # no recompute = 3/4 of the layer term, the same logit term
    logit = 6 * b * s * h * v
    assert 4 * (rep.no_recompute - logit) == 3 * (rep.recompute - logit)
    assert rep.get("recompute") == rep.recompute and rep.get("no_recompute") == rep.no_recompute


def test_moe_flops() -> None:
    b = 512
    dense = acc.flops_per_update(preset("gpt3-small"), b)
    assert acc.flops_per_update(preset("gpt3-small", "demix", 8), b) == dense
    assert acc.flops_per_update(preset("gpt3-small", "cse", 4), b).recompute == dense.recompute
    gshard = acc.flops_per_update(preset("gpt3-small", "gshard", 32), b)
    s, l, h = 1024, 12, 768
    # PAPER.md: top-2 every other layer adds 96·B·s·l·h²·(1/3) = 32·B·s·l·h² (recompute), 24·B·s·l·h² (not)
    assert gshard.recompute - dense.recompute == 32 * b * s * l * h * h
    assert gshard.no_recompute - dense.no_recompute == 24 * b * s * l * h * h
    assert gshard.router == 4 * 6 * 2 * b * s * h * 32 and dense.router == 0
    top1 = preset("gpt3-small", "gshard", 32)
    top1 = replace(top1, ffn=replace(top1.ffn, gshard=GShardConfig(top_k=1)))
    assert acc.flops_per_update(top1, b).recompute == dense.recompute


def test_flops_errors() -> None:
    cfg = ModelConfig()
    with pytest.raises(ValueError):
        acc.flops_per_update(cfg, 0)
    with pytest.raises(ValueError):
        acc.flops_per_update(cfg, 1).get("megatron")
    with pytest.raises(ValueError):
        narayanan_flops(1, 1, 1, 1, 1, "both")


def test_tflops_per_gpu() -> None:
    assert acc.tflops_per_gpu(1e15, 2.0, 10) == pytest.approx(50.0)
    with pytest.raises(ValueError):
        acc.tflops_per_gpu(1e15, 0.0, 10)
    with pytest.raises(ValueError):
        acc.tflops_per_gpu(1e15, 1.0, 0)


# ---------------------------------------------------------------------------- the paper's tables

PAPER_DENSE_TFLOPS = {"125M": 556, "350M": 3279, "760M": 13637, "1.3B": 23250}
PAPER_GSHARD_TFLOPS = {"125M": 675, "350M": 4120, "760M": 17400, "1.3B": 30000}
PAPER_PARAMS = {
    "dense": {"125M": 125e6, "350M": 350e6, "760M": 760e6, "1.3B": 1.3e9},
    "demix": {"125M": 512e6, "350M": 1.8e9, "760M": 3.8e9, "1.3B": 7.0e9},
    "gshard": {"125M": 1e9, "350M": 6.7e9, "760M": 29.5e9, "1.3B": 52.5e9},
}
PAPER_GPUS = {"125M": 32, "350M": 64, "760M": 128, "1.3B": 128}


@pytest.fixture(scope="module")
def paper_rows() -> list[dict]:
    return acc.paper_rows(flops_cli.paper_configs())


def test_paper_tables_reproduced(paper_rows: list[dict]) -> None:
    assert len(paper_rows) == 12
    for row in paper_rows:
        size, arch = row["size"], row["arch"]
        assert row["gpus"] == PAPER_GPUS[size]
        assert row["experts"] == {"dense": 0, "demix": 8, "gshard": PAPER_GPUS[size]}[arch]
        if arch == "gshard":
            assert row["tflops_per_update"] == pytest.approx(PAPER_GSHARD_TFLOPS[size], rel=5e-3)
        else:
            assert int(row["tflops_per_update"]) == PAPER_DENSE_TFLOPS[size]
        assert row["total_params"] == pytest.approx(PAPER_PARAMS[arch][size], rel=0.05)


def test_json_command() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "launcher.flops", "--paper", "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    rows = json.loads(out.stdout)  # stdout must be nothing but the JSON list
    assert isinstance(rows, list) and len(rows) == 12
    assert {(r["size"], r["arch"]) for r in rows} == {
        (s, a) for s in PAPER_GPUS for a in ("dense", "demix", "gshard")
    }
    for r in rows:
        assert isinstance(r["total_params"], int) and isinstance(r["tflops_per_update"], float)
        assert r["tflops_per_update_no_recompute"] < r["tflops_per_update"]
    small = next(r for r in rows if (r["size"], r["arch"]) == ("125M", "dense"))
    assert small["total_params"] == 124_445_184 and int(small["tflops_per_update"]) == 556


def test_config_command(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--config",
        "gpt3-small",
        "--set",
        "model.ffn.kind=gshard",
        "--gpus",
        "32",
        "--micro-batch",
        "2",
        "--grad-accum",
        "8",
        "--seconds-per-update",
        "45.0",
        "--device",
        "Tesla V100-SXM2-32GB",
        "--precision",
        "fp16",
        "--json",
    ]
    assert flops_cli.main(argv) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["experts"] == 32  # derived: one expert per GPU
    assert int(row["tflops_per_update"]) == 675
    assert row["tflops_per_gpu"] == pytest.approx(row["tflops_per_update"] / 45.0 / 32)
    assert row["mfu"] == pytest.approx(row["tflops_per_gpu"] / 125.0)
    assert flops_cli.main(["--config", "tiny", "--set", "model.ffn.kind=demix"]) == 2  # experts not derivable


# ---------------------------------------------------------------------------- devices and MFU


@pytest.mark.parametrize(
    "name,key",
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H100 NVL", "h100-nvl"),
        ("H100", "h100-sxm"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA A100 80GB PCIe", "a100"),
        ("NVIDIA A10", "a10"),
        ("Tesla V100-SXM2-32GB", "v100-sxm2"),
        ("Tesla V100-PCIE-16GB", "v100-pcie"),
        ("Tesla V100S-PCIE-32GB", "v100s"),
        ("v100", "v100-sxm2"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("AMD Instinct MI250X / MI250", "mi250x"),
        ("AMD Instinct MI300X", "mi300x"),
        ("cpu", "cpu"),
    ],
)
def test_device_name_matching(name: str, key: str) -> None:
    assert acc.lookup_device(name).key == key


@pytest.mark.parametrize("name", ["NVIDIA A10G", "NVIDIA L40", "NVIDIA GH200 480GB", "Quadro P1000"])
def test_unknown_devices_do_not_match(name: str) -> None:
    assert acc.match_device_name(name) is None
    assert acc.mfu(10.0, name, "bf16") is None
    with pytest.raises(ValueError, match="unknown device"):
        acc.lookup_device(name)


def test_peaks_and_mfu() -> None:
    assert acc.peak_tflops("v100", "fp16") == 125.0
    assert acc.peak_tflops("a100", "bfloat16") == 312.0 and acc.peak_tflops("a100", "tf32") == 156.0
    assert acc.peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert acc.peak_tflops("h100-pcie", "bf16") == 756.0
    assert acc.peak_tflops("mi300x", "fp16") == 1307.0
    assert acc.mfu(31.0, "v100", "fp16") == pytest.approx(0.248)
    assert acc.mfu(494.5, "h100-sxm", "bf16") == pytest.approx(0.5)
    assert acc.mfu(1.0, "cpu", "fp32") is None
    assert acc.mfu(1.0, "v100", "bf16") is None  # V100 has no bf16 tensor cores
    with pytest.raises(ValueError, match="precision"):
        acc.mfu(1.0, "a100", "int3")


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_logged_mfu_counts_model_flops_and_hfu_the_executed_ones(monkeypatch, recompute: str) -> None:
    """With activation recompute the hardware runs a second forward of every layer: MFU must not count it (it was
    logged as MFU before, overstating it by ~4/3), HFU does."""
    import launcher.train as train
    from benchmarks.gpu_throughput import plan_random_tokens

    cfg = load_run_config(
        None, ["model.preset=tiny", f"train.activation_checkpointing={recompute}"], check=False
    )
    plan = plan_random_tokens(cfg, ["a"])
    monkeypatch.setattr(train, "device_name", lambda: "h100-sxm")
    rec = train.throughput_record(plan, seconds=2.0, steps=4)
    peak = acc.peak_tflops("h100-sxm", cfg.train.precision)
    assert rec["mfu"] == pytest.approx(rec["tflops_per_gpu_no_recompute"] / peak)
    assert rec["hfu"] == pytest.approx(rec["tflops_per_gpu"] / peak)
    assert (rec["hfu"] > rec["mfu"]) == (recompute == "full")  # the tiny preset's vocabulary makes it < 4/3
