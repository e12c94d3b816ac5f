"""The throughput sweep (benchmarks/sweep.py) and its report (benchmarks/report.py): config validation,
failed points recorded without stopping the sweep, rendering from a hand-written results.json, and one real
point through the launcher (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from benchmarks import report, sweep
from launcher.typed import ConfigError

ROOT = Path(__file__).resolve().parents[2]
GOOD = {"name": "t", "base_config": "configs/demo/dense.yaml", "sizes": [{"name": "tiny", "preset": "tiny"}]}


# ---------------------------------------------------------------------------- config


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "sweeps").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_sweep_configs_load(path: Path) -> None:
    cfg = sweep.load_sweep(path)
    ids = [p.id for p in sweep.points(cfg)]
    assert len(ids) == len(set(ids)) > 0


def test_cpu_sweep_is_the_make_bench_grid() -> None:
    cfg = sweep.load_sweep(ROOT / "configs" / "sweeps" / "cpu.yaml")
    assert [p.id for p in sweep.points(cfg)] == [
        f"tiny-{a}-w{w}" for a in ("dense", "demix", "gshard") for w in (1, 2, 4)
    ]


def test_bad_keys_and_types_are_listed_at_once() -> None:
    raw = {
        **GOOD,
        "sizes": [{"name": "a", "preset": "huge", "bogus": 1}],
        "steps": "ten",
        "archs": ["dense", "moe"],
        "world_sizes": [0, 2],
        "colour": "red",
        "launch": {"timeout": 5},
    }
    with pytest.raises(ConfigError) as e:
        sweep.sweep_from_dict(raw)
    text = str(e.value)
    for needle in (
        "sizes[0].bogus: unknown key",
        "steps='ten': expected an integer",
        "colour: unknown key",
        "launch.timeout: unknown key",
        "sizes[0].preset='huge'",
        "'moe' is not an architecture",
        "world_sizes=[0, 2]",
    ):
        assert needle in text, needle
    assert len(e.value.problems) == 7


def test_model_override_typos_are_caught_before_any_run() -> None:
    raw = {**GOOD, "sizes": [{"name": "a", "preset": "tiny", "model": {"n_layer": 2, "d_model": "big"}}]}
    with pytest.raises(ConfigError) as e:
        sweep.sweep_from_dict(raw)
    assert len(e.value.problems) == 2  # once per size, not once per architecture
    assert "size a: model.n_layer: unknown key" in str(e.value) and "model.d_model='big'" in str(e.value)


def test_too_few_intervals_for_warmup_exclusion() -> None:
    with pytest.raises(ConfigError, match="need >= 2 logged intervals"):
        sweep.sweep_from_dict({**GOOD, "steps": 4, "log_interval": 4})


def test_point_overrides_and_multinode_command() -> None:
    cfg = sweep.sweep_from_dict(
        {
            **GOOD,
            "sizes": [{"name": "s", "preset": "tiny", "model": {"n_layers": 2}}],
            "zero_stages": [1],
            "launch": {"hostfile": "hosts", "gpus_per_node": 8},
        }
    )
    pt = sweep.Point("s", "demix", 16, 1, None)
    assert pt.id == "s-demix-w16-z1"
    cmd = sweep.launch_command(cfg, pt, Path("d"))
    assert cmd[cmd.index("--num-nodes") + 1] == "2" and cmd[cmd.index("--nproc") + 1] == "8"
    sets = [cmd[i + 1] for i, c in enumerate(cmd) if c == "--set"]
    assert {
        "model.preset=tiny",
        "model.n_layers=2",
        "model.ffn.kind=demix",
        "data.mixture=by_domain",
        "parallel.zero_stage=1",
    } <= set(sets)


def test_scaling_maths() -> None:
    rows = [
        {
            "size": "s",
            "arch": "dense",
            "zero_stage": None,
            "tensor_parallel": None,
            "status": "ok",
            "world_size": w,
            "tokens_per_s": tok,
            "step_time_s": st,
        }
        for w, tok, st in ((1, 100.0, 1.0), (4, 200.0, 2.0))
    ]
    rows.append({**rows[0], "world_size": 2, "status": "failed"})
    sweep.add_scaling(rows, cores=2)
    four = rows[1]
    assert four["scaling_efficiency"] == pytest.approx(0.5)  # 200/4 vs 100/1
    assert four["core_efficiency"] == pytest.approx(1.0)  # 200 vs 100 x min(4, 2)
    assert four["overhead_share"] == pytest.approx(0.5)
    assert rows[2]["scaling_efficiency"] is None


# ---------------------------------------------------------------------------- failed points


def test_failed_point_is_recorded_and_the_sweep_continues(tmp_path: Path, monkeypatch) -> None:
    """tensor_parallel=3 is impossible for the tiny model (4 heads): the launcher rejects it in seconds. The
    other point is stubbed so no training runs; both end up in results.json."""
    cfg = sweep.sweep_from_dict({**GOOD, "archs": ["dense"], "tensor_parallel": [3, 1], "steps": 2})
    real = sweep._run_logged

    def fake_or_real(cmd, log, timeout_s):
        if "parallel.tensor_parallel=3" in cmd:
            return real(cmd, log, timeout_s)
        run_dir = Path(cmd[cmd.index("--run-dir") + 1])
        recs = [{"kind": "start", "device": "cpu"}] + [
            {
                "kind": "train",
                "step": s,
                "loss": 5.0,
                "tokens_per_s": 1000.0 * s,
                "step_time_s": 1.0 / s,
                "tflops_per_gpu_recompute": 0.02,
                "tflops_per_gpu_no_recompute": 0.015,
                "tflops_per_gpu": 0.015,
                "mfu": None,
                "peak_mem_gb": 0.5 + s,
                "comm/data_parallel/all_reduce/seconds": 0.1,
                "comm/data_parallel/all_reduce/bytes": 1000.0,
            }
            for s in (1, 2)
        ]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        log.write_text("fine\n")
        return 0, 0.1, False

    monkeypatch.setattr(sweep, "_run_logged", fake_or_real)
    res = sweep.run_sweep(cfg, tmp_path / "sw")
    by_id = {r["id"]: r for r in res["points"]}
    bad, good = by_id["tiny-dense-w1-tp3"], by_id["tiny-dense-w1-tp1"]
    assert bad["status"] == "failed" and "tensor_parallel=3" in bad["error"]
    assert good["status"] == "ok" and good["tokens_per_s"] == 2000.0  # first interval left out
    assert good["peak_mem_gb"] == 2.5
    assert good["comm_share"] == pytest.approx(0.1 / 0.5) and good["comm_bytes"] == {
        "data_parallel/all_reduce": 1000.0
    }
    assert (
        json.loads((tmp_path / "sw" / "results.json").read_text())["points"][0]["id"] == "tiny-dense-w1-tp3"
    )

    # A rerun with --reuse keeps the finished point (marked, with its own timings) and retries the failed one.
    calls = []
    monkeypatch.setattr(sweep, "_run_logged", lambda cmd, log, t: calls.append(cmd) or (2, 0.0, False))
    res = sweep.run_sweep(cfg, tmp_path / "sw", reuse=True)
    assert len(calls) == 1 and "parallel.tensor_parallel=3" in calls[0]
    kept = {r["id"]: r for r in res["points"]}["tiny-dense-w1-tp1"]
    assert kept["reused_from"] == good["finished"] and kept["tokens_per_s"] == 2000.0
    assert res["reused"] == [{"id": "tiny-dense-w1-tp1", "reused_from": good["finished"]}]


# ---------------------------------------------------------------------------- report


def _row(arch: str, world: int, tok: float, status: str = "ok") -> dict:
    base = {
        "id": f"tiny-{arch}-w{world}",
        "size": "tiny",
        "arch": arch,
        "world_size": world,
        "zero_stage": None,
        "tensor_parallel": None,
        "status": status,
        "error": None,
        "comm_share": None,
        "model": {"n_layers": 4, "d_model": 128},
        "num_experts": {"dense": 0, "demix": 8, "gshard": world}[arch],
        "total_params": 1.9e6,
        "tflops_per_update": 0.015 * world,
        "micro_batch": 4,
        "grad_accum": 1,
    }
    if status != "ok":
        return {**base, "error": "exit code 2\nerror: 1 problem(s) in run:\n  - boom"}
    return {
        **base,
        "tokens_per_s": tok,
        "tokens_per_s_per_rank": tok / world,
        "step_time_s": 1024 * world / tok,
        "tflops_per_gpu_recompute": 0.03,
        "tflops_per_gpu_no_recompute": 0.025,
        "mfu": None,
        "peak_mem_gb": 0.7,
        "final_loss": 8.5,
    }


def test_report_renders_from_hand_written_results(tmp_path: Path) -> None:
    rows = [
        _row("dense", 1, 3000),
        _row("dense", 2, 5000),
        _row("demix", 1, 3100),
        _row("demix", 2, 5600),
        _row("gshard", 1, 2500),
        _row("gshard", 2, 0, status="failed"),
    ]
    sweep.add_scaling(rows, cores=2)
    results = {
        "sweep": {"name": "hand", "base_config": "configs/demo/dense.yaml", "steps": 8, "log_interval": 1},
        "command": "python -m benchmarks.sweep x",
        "machine": {"cores": 2},
        "wall_s": 1.0,
        "points": rows,
    }
    (tmp_path / "results.json").write_text(json.dumps(results))
    out = tmp_path / "out"
    paths = report.render(tmp_path, out, costmodel=report.COSTMODEL_JSON)
    md, page = paths["md"].read_text(), paths["html"].read_text()
    assert (out / "results.json").is_file() and (out / "scaling_tokens.png").read_bytes()[:4] == b"\x89PNG"
    # Tables 2/9 layout: rows size, column groups per architecture, both FLOP conventions labelled.
    for needle in (
        "Tables 2/9 layout",
        "| size | layers, d | Dense experts",
        "DEMix TFLOPs/update",
        "GShard TFLOPs/GPU rec.",
        "Dense TFLOPs/GPU no-rec.",
        "| tiny | 4, 128 |",
        "Scaling with world size",
        "Failed points",
        "boom",
        "Cost model vs DEMix Tables 2/9",
    ):
        assert needle in md, needle
    recorded = json.loads(Path(report.COSTMODEL_JSON).read_text())["rows"]
    err = next(r["rel_err"] for r in recorded if r["size"] == "1.3B" and r["arch"] == "gshard")
    # the 12-row cost-model table, with errors
    assert md.count("| 1.3B | GShard | 128 |") == 1 and f"{err:+.1%}" in md
    assert "scaling eff." in md and "83.3%" in md  # dense at 2 ranks: (5000/2)/(3000/1)
    assert '<img alt="' in page and "data:image/png;base64," in page and "<table>" in page
    assert 'src="scaling' not in page  # self-contained: no file references


def test_report_shows_measured_vs_modelled_bytes_and_prices_measured_bytes(tmp_path: Path) -> None:
    from benchmarks import costmodel

    rows = [_row("dense", 2, 5000), _row("gshard", 2, 4000), _row("dense", 4, 9000)]
    rows[1]["model"] = {**rows[1]["model"], "ffn": {"kind": "gshard", "num_experts": 2}}
    for r in rows:
        r.update(precision="fp32", activation_checkpointing="none", zero_stage_run=0, tensor_parallel_run=1)
        cfg = report._point_model(r, padded=True)
        opts = costmodel.CostOptions(4, 1, "fp32", "fp32", "none")
        r["comm_bytes"] = costmodel.comm_bytes_per_update(cfg, r["world_size"], opts)
    rows[2]["comm_bytes"]["data_parallel/all_reduce"] *= (
        1.25  # a trainer that sent a quarter more than modelled
    )
    sweep.add_scaling(rows, cores=2)
    results = {"sweep": {"name": "hand", "cluster": "v100-dgx1"}, "machine": {"cores": 2}, "points": rows}
    (tmp_path / "results.json").write_text(json.dumps(results))
    md = report.render(tmp_path, tmp_path / "out", costmodel=None)["md"].read_text()
    assert "Communication per update: measured vs cost model" in md
    # dense w2 all-reduce; gshard w2 all-reduce, local all-reduce, all-to-all
    assert md.count("| equal |") == 4
    assert "| tiny-dense-w4 | data_parallel/all_reduce |" in md and "+25.0%" in md
    # the cluster prediction priced the measured bytes
    assert "bytes from" in md and md.count("| measured |") == 3


def test_report_cli_rerenders_without_training(tmp_path: Path, capsys) -> None:
    (tmp_path / "results.json").write_text(
        json.dumps({"sweep": {"name": "x"}, "points": [_row("dense", 1, 1000)]})
    )
    assert report.main([str(tmp_path), "--costmodel", ""]) == 0
    assert "Cost model" not in (tmp_path / "report.md").read_text()
    assert report.main([str(tmp_path / "missing")]) == 2


# ---------------------------------------------------------------------------- one real point


@pytest.mark.slow
def test_one_real_point_through_the_launcher(tmp_path: Path, tiny_tokens: Path) -> None:
    # The session's small prepared corpus (GPT-2 BPE), so this runs on a fresh clone without `make data`.
    cfg = sweep.sweep_from_dict(
        {
            **GOOD,
            "archs": ["dense"],
            "steps": 2,
            "set": [
                "train.eval_batches=1",
                "logging.wandb_mode=disabled",
                f"data.path={tiny_tokens}",
                "data.tokenizer=gpt2",
                "model.vocab_size=50264",
                "model.seq_len=32",
                "model.d_model=64",
                "model.n_heads=2",
                "model.n_layers=2",
            ],
            "launch": {"timeout_s": 240},
        }
    )
    res = sweep.run_sweep(cfg, tmp_path / "sw")
    (row,) = res["points"]
    assert row["status"] == "ok", row["error"]
    assert "--master-port" in row["command"]  # rendezvous on the port the sweep reserved for it
    assert (
        row["intervals"] == 1
        and row["tokens_per_s"] > 0
        and row["tflops_per_gpu_recompute"] > row["tflops_per_gpu_no_recompute"]
    )
    assert row["tflops_per_update"] == pytest.approx(
        row["tflops_per_gpu_recompute"] * row["step_time_s"], rel=1e-6
    )
    assert not (
        tmp_path / "sw" / row["id"] / "checkpoints"
    ).exists()  # cleaned: benchmarks need no checkpoints
    assert yaml.safe_load((tmp_path / "sw" / row["id"] / "config.yaml").read_text())["train"]["steps"] == 2


def test_report_warns_when_the_machine_was_busy() -> None:
    assert report.external_load_note({"cores": 2, "loadavg_1m": 0.5, "loadavg_1m_end": 1.2}) == ""
    note = report.external_load_note({"cores": 2, "loadavg_1m": 1.8, "loadavg_1m_end": 6.3})
    assert "shared with other jobs" in note and "6.3" in note
