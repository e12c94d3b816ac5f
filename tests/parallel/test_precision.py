"""Plan-time checks added for the GPU path: precision the device lacks, unequal data per domain announced."""

from __future__ import annotations

import pytest
import torch

from launcher.dryrun import main as dryrun
from model.accounting import lookup_device
from parallel.precision import cpu_supports_fp16, device_precision_problems, local_precision_problems
from parallel.topology import build_topology, domain_data_shares, unequal_data_note


@pytest.mark.parametrize(
    "device,precision,ok",
    [
        ("v100", "bf16", False),
        ("v100", "fp16", True),
        ("v100", "fp32", True),
        ("a100", "bf16", True),
        ("h100", "bf16", True),
        ("h100", "fp16", True),
        ("cpu", "bf16", True),
    ],
)
def test_named_device_precision(device, precision, ok):
    problems = device_precision_problems(precision, lookup_device(device))
    assert (problems == []) == ok, problems
    if not ok:
        assert "V100" in problems[0] and "fp16" in problems[0]  # says what to use instead


def test_this_machine_precision_follows_deepspeeds_rules():
    assert local_precision_problems("fp32") == [] and local_precision_problems("bf16") == []
    if torch.cuda.is_available():
        pytest.skip("the CPU rules apply to CPU machines")
    fp16 = local_precision_problems("fp16")
    assert (fp16 == []) == cpu_supports_fp16()
    if fp16:
        assert "oneDNN" in fp16[0] and "bf16" in fp16[0]


@pytest.mark.parametrize(
    "name,capability,bf16_ok",
    [
        ("Tesla V100-SXM2-32GB", (7, 0), False),
        ("Tesla T4", (7, 5), False),
        ("NVIDIA A100-SXM4-80GB", (8, 0), True),
        ("NVIDIA H100 80GB HBM3", (9, 0), True),
    ],
)
def test_bf16_needs_compute_capability_8(monkeypatch, name, capability, bf16_ok):
    """torch.cuda.is_bf16_supported() is True on sm70 through emulation (stubbed here as torch answers there):
    the rule is the compute capability, and the refusal names the fix."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    problems = local_precision_problems("bf16")
    assert (problems == []) == bf16_ok, problems
    if not bf16_ok:
        assert (
            name in problems[0]
            and f"{capability[0]}.{capability[1]}" in problems[0]
            and "fp16" in problems[0]
        )
    assert local_precision_problems("fp16") == [] and local_precision_problems("fp32") == []


@pytest.mark.parametrize(
    "world,domains,alloc,shares",
    [
        (4, 2, None, [0.5, 0.5]),
        (1, 2, None, [0.5, 0.5]),
        (2, 4, None, [0.25] * 4),
        (2, 3, None, [0.25, 0.25, 0.5]),  # the domain alone on its rank reads twice as much
        (3, 2, [2, 1], [2 / 3, 1 / 3]),
        (6, 8, None, [1 / 12] * 4 + [1 / 6] * 4),
    ],
)
def test_domain_data_shares(world, domains, alloc, shares):
    topo = build_topology(world, 1, domains, alloc)
    assert domain_data_shares(topo) == pytest.approx(shares)
    note = unequal_data_note(topo)
    assert (note is None) == (max(shares) == pytest.approx(min(shares)))
    if note and (world, domains) == (2, 3):
        assert "unequal data" in note and "domain2 50.0%" in note


def test_dry_run_announces_unequal_shares_and_refuses_bf16_on_v100(tmp_path, capsys):
    argv = [
        "--world-size",
        "6",
        "--out",
        str(tmp_path / "s.json"),
        "--set",
        "model.preset=gpt3-large",
        "model.ffn.kind=demix",
    ]
    assert dryrun(argv) == 0
    assert "domains get unequal data" in capsys.readouterr().out
    assert dryrun([*argv, "train.precision=bf16", "--device", "v100"]) == 2
    assert "V100 SXM2 has no bf16" in capsys.readouterr().err


def test_paper_configs_use_fp16_for_v100():
    from pathlib import Path

    from launcher.config import load_run_config

    for path in sorted(Path(__file__).resolve().parents[2].glob("configs/gpt3-small-*.yaml")):
        cfg = load_run_config(str(path), [], check=False)
        assert cfg.train.precision == "fp16", path
        assert device_precision_problems(cfg.train.precision, lookup_device("v100")) == []
