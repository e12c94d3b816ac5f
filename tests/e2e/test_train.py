"""The trainer end to end through the real launcher (deepspeed, gloo, separate processes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]


def _overrides(tokens: Path, kind: str = "demix", steps: int = 6, zero: int = 1) -> list[str]:
    sets = [
        "model.preset=tiny",
        "model.n_layers=2",
        "model.d_model=64",
        "model.n_heads=2",
        "model.seq_len=32",
        f"model.ffn.kind={kind}",
        f"data.path={tokens}",
        "data.tokenizer=gpt2",
        f"data.mixture={'by_domain' if kind == 'demix' else 'natural'}",
        f"train.steps={steps}",
        "train.micro_batch=2",
        "train.grad_accum=2",
        "train.lr=3e-3",
        "train.eval_batches=2",
        "train.save_interval=2",
        f"parallel.zero_stage={zero}",
        "logging.log_interval=1",
        "logging.wandb_mode=disabled",
        "logging.progress_bar=false",
    ]
    return [a for s in sets for a in ("--set", s)]


def _launch(
    args: list[str], env_extra: dict | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.launch", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"launch failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def _train_ranks(rank: int, world: int, args: list[str], run_dir: str) -> None:
    """The trainer on `world` ranks forked by tests/harness/multirank.py, with overrides as the launcher takes them
    (`--set` pairs) or plain: the uninterrupted reference a launched run is compared with (the same `train`, without
    the launcher's start-up)."""
    from launcher.config import load_run_config
    from launcher.plan import make_plan
    from launcher.train import train

    sets = [a for a in args if a != "--set"]
    train(make_plan(load_run_config(None, sets, check=False), world), Path(run_dir), resume="never")


def reference_run(args: list[str], world: int, run_dir: Path) -> Path:
    """`_train_ranks` on `world` ranks into `run_dir`; returns it."""
    from tests.harness.multirank import run_ranks

    run_ranks(_train_ranks, world, args=(args, str(run_dir)))
    return run_dir


def _launch_and_kill_when(args: list[str], now) -> subprocess.Popen:
    """Launch, and SIGKILL the whole process group (launcher and every rank) as soon as `now()` is true."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher.launch", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if now():
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.002)
    proc.wait(timeout=60)
    return proc


def _launch_and_kill_after_step(args: list[str], run_dir: Path, step: int) -> subprocess.Popen:
    """SIGKILL as soon as rank 0 has logged training step `step` (metrics.jsonl is line-buffered): a crash
    between two checkpoints."""
    metrics = run_dir / "metrics.jsonl"
    return _launch_and_kill_when(
        args, lambda: metrics.is_file() and f'"kind": "train", "step": {step},' in metrics.read_text()
    )


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "train"}


def unpublished_problems(run: Path, step: int, latest: str) -> list[str]:
    """What is wrong after a kill during the save of `step`, for "a half-written state is never published": the
    state of `step` exists, or the `latest` pointer names another state than `latest` (the one before)."""
    ck = run / "checkpoints"
    problems = [f"{ck / f'step_{step:08d}'} exists"] if (ck / f"step_{step:08d}").exists() else []
    pointer = (ck / "latest").read_text().strip() if (ck / "latest").is_file() else None
    if pointer != latest:
        problems.append(f"latest is {pointer}, not {latest}")
    return problems


@pytest.mark.long
@pytest.mark.slow
def test_killed_run_resumes_on_the_uninterrupted_trajectory(tiny_tokens, tmp_path):
    """3 domains on 3 ranks, ZeRO 1: SIGKILL after step 3 (checkpoint at step 2), resume; SIGKILL again while the
    step-4 checkpoint is being written, resume; the losses are the uninterrupted run's (the same trainer on 3
    forked ranks, `reference_run`), exactly.

    Two controls on the same runs: the first kill is the control of the preemption test's checks
    (tests/e2e/test_preemption.py `saved_preemption_problems`: a SIGKILLed run loses the steps after its last
    save, and they say so), and the finished resume that of the kill-during-save checks (`unpublished_problems`:
    once the save of step 4 completed, they see it published)."""
    from tests.e2e.test_preemption import saved_preemption_problems

    full, killed = tmp_path / "full", tmp_path / "killed"
    reference_run(_overrides(tiny_tokens), 3, full)
    proc = _launch_and_kill_after_step(
        ["--nproc", "3", "--run-dir", str(killed), *_overrides(tiny_tokens)], killed, 3
    )
    assert proc.returncode != 0
    assert (killed / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    lost = saved_preemption_problems(proc.returncode, "", killed)  # the control: steps 3.. are lost, and seen
    assert any(p.startswith("steps lost: trained to step ") and p.endswith(" step 2") for p in lost), lost
    assert not (killed / "model").exists()  # the run really died before the end
    port = (killed / "command.sh").read_text().split("--master_port ")[1].split()[0]
    # even SIGKILL leaks no shm
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    writing = killed / "checkpoints" / ".step_00000004.tmp"
    proc = _launch_and_kill_when(
        ["--nproc", "3", "--run-dir", str(killed), *_overrides(tiny_tokens)], writing.is_dir
    )
    assert proc.returncode != 0 and writing.is_dir(), (
        "the kill did not land inside the step-4 checkpoint write"
    )
    assert unpublished_problems(killed, 4, "step_00000002") == []  # a half-written state is never published
    _launch(
        [
            "--nproc",
            "3",
            "--run-dir",
            str(killed),
            *_overrides(tiny_tokens),
            "--set",
            "train.keep_checkpoints=2",
        ]
    )
    # the control: the resumed run's save of step 4 completed, and the same checks see it published
    assert unpublished_problems(killed, 4, "step_00000002") == [
        f"{killed / 'checkpoints' / 'step_00000004'} exists",
        "latest is step_00000006, not step_00000002",
    ]
    a, b = _losses(full), _losses(killed)
    assert sorted(a) == list(range(1, 7))
    assert max(abs(a[s] - b[s]) for s in range(1, 7)) == 0.0, (a, b)  # steps 3.. recomputed after each resume
    assert a[6] < a[1]  # it learns
    starts = [r for r in read_metrics(killed / "metrics.jsonl") if r.get("kind") == "start"]
    assert starts[-1]["resumed_from"].endswith("step_00000002")
    steps = [r["step"] for r in read_metrics(killed / "metrics.jsonl") if r.get("kind") == "train"]
    assert steps == list(range(1, 7))  # one record per step: the replayed step 3 is not logged twice
    # the consolidated export holds every expert and names the domains
    meta = json.loads((killed / "model" / "meta.json").read_text())
    assert meta["domains"] == ["cooking", "finance", "sailing"] and meta["experts"]["2"] == "sailing"
    # the ids a Hugging Face export needs, and the tokens trained on (6 steps x global batch x seq_len)
    assert meta["bos_id"] == meta["eod_id"] == 50256
    cfg = meta["config"]
    assert (
        meta["train_tokens"]
        == 6 * cfg["train"]["micro_batch"] * cfg["train"]["grad_accum"] * 3 * cfg["model"]["seq_len"]
    )
    # the DeepSpeed config in the run directory is the one the engine got, with the bucket sizes planned from the
    # model (the launcher's copy, written before any model existed, has none)
    zero_cfg = json.loads((killed / "deepspeed_config.json").read_text())["zero_optimization"]
    assert zero_cfg["stage"] == 1 and zero_cfg["reduce_bucket_size"] > 0, zero_cfg
    # keep_checkpoints=2 on the resumed run: of steps 2, 4, 6 only the newest two remain
    assert sorted(p.name for p in (killed / "checkpoints").glob("step_*")) == [
        "step_00000004",
        "step_00000006",
    ]


def test_a_damaged_or_dangling_latest_pointer_resumes_from_the_newest_complete_state(tmp_path, capsys):
    from launcher.state_discovery import TRAINING_FORMAT, latest_checkpoint

    ck = tmp_path / "checkpoints"
    assert latest_checkpoint(tmp_path) is None
    for step in (2, 4):
        (ck / f"step_{step:08d}").mkdir(parents=True)
        (ck / f"step_{step:08d}" / "trainer.pt").write_bytes(b"x" * 10)
        (ck / f"step_{step:08d}" / "meta.json").write_text(
            json.dumps({"format": TRAINING_FORMAT, "files": {"trainer.pt": 10}})
        )
    (ck / "step_00000006").mkdir()  # being written when the run died: no meta.json
    (ck / "latest").write_text("step_00000004\n")
    assert latest_checkpoint(tmp_path) == ck / "step_00000004"
    for bad in ("step_00000006", "step_00000008", "../../elsewhere", "/etc"):  # incomplete, deleted, escapes
        (ck / "latest").write_text(bad + "\n")
        assert latest_checkpoint(tmp_path) == ck / "step_00000004", bad
        assert "not an intact training state here" in capsys.readouterr().err
    (ck / "latest").write_text("step_00000004\n")
    # truncated: skipped, the previous intact one used
    (ck / "step_00000004" / "trainer.pt").write_bytes(b"x" * 5)
    assert latest_checkpoint(tmp_path) == ck / "step_00000002"
    assert "step_00000004 is damaged (trainer.pt has 5 bytes, 10 when written)" in capsys.readouterr().err


def test_resume_drops_the_records_the_dead_run_wrote_after_its_checkpoint(tmp_path):
    from launcher.metrics import drop_replayed_records

    path = tmp_path / "metrics.jsonl"
    recs = [{"kind": "start", "step": 0}] + [{"kind": "train", "step": s} for s in (1, 2, 3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"kind": "train", "st')  # cut by the kill
    assert drop_replayed_records(path, 2) == 2
    assert [(r["kind"], r["step"]) for r in read_metrics(path)] == [("start", 0), ("train", 1), ("train", 2)]


def test_prune_keeps_the_newest_complete_states_and_the_latest(tmp_path):
    from launcher.state_discovery import prune_checkpoints

    for step in (2, 4, 6, 8):
        (tmp_path / f"step_{step:08d}").mkdir()
        (tmp_path / f"step_{step:08d}" / "meta.json").write_text("{}")
    (tmp_path / "step_00000010").mkdir()  # incomplete (no meta.json): not counted, not touched
    (tmp_path / "latest").write_text("step_00000004\n")  # e.g. a resume pointed back
    assert prune_checkpoints(tmp_path, 0) == []
    gone = prune_checkpoints(tmp_path, 2)
    assert sorted(p.name for p in gone) == ["step_00000002"]
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [
        "step_00000004",
        "step_00000006",
        "step_00000008",
        "step_00000010",
    ]


@pytest.mark.slow
def test_consolidated_export_evaluates_on_one_process(tiny_tokens, tmp_path):
    """A 2-rank dense run (natural mix): every record has throughput fields; the export loads in one process."""
    import torch

    from launcher.checkpoint import load_consolidated

    run = tmp_path / "dense"
    _launch(["--nproc", "2", "--run-dir", str(run), *_overrides(tiny_tokens, kind="dense", steps=3, zero=0)])
    rec = [r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "train"][-1]
    for key in (
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "tflops_per_gpu_recompute",
        "tflops_per_gpu_no_recompute",
        "peak_mem_gb",
    ):
        assert key in rec, key
    per_domain = [k for k in rec if k.startswith("loss/")]  # the domains this interval's batches held
    assert per_domain and set(per_domain) <= {"loss/cooking", "loss/finance", "loss/sailing"}
    evals = [r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "eval"][-1]
    assert {"val_ppl/cooking", "val_ppl/finance", "val_ppl/sailing"} <= set(evals)
    from launcher.config import load_run_config
    from model.accounting import flops_per_update

    cfg = load_run_config(None, [a for a in _overrides(tiny_tokens, kind="dense") if a != "--set"]).model
    rep = flops_per_update(cfg, global_batch=2 * 2 * 2)
    assert rec["tflops_per_gpu_no_recompute"] / rec["tflops_per_gpu_recompute"] == pytest.approx(
        rep.no_recompute / rep.recompute
    )
    assert rec["tflops_per_gpu_recompute"] == pytest.approx(
        rep.recompute / rec["step_time_s"] / 2 / 1e12, rel=1e-6
    )
    ckpt = load_consolidated(run / "model")
    model = ckpt.build_model()
    x = torch.randint(0, 1000, (1, 8))
    assert torch.isfinite(model(x).logits).all()
    ds_cfg = json.loads((run / "deepspeed_config.json").read_text())
    assert ds_cfg["train_micro_batch_size_per_gpu"] == 2 and ds_cfg["gradient_accumulation_steps"] == 2
    # the ranks run launcher/_rank_entry.py: `python -m launcher.train` as a script
    assert "launcher/_rank_entry.py" in (run / "command.sh").read_text()


def test_precision_the_machine_lacks_fails_before_launch(tiny_tokens, tmp_path):
    """fp16 on a CPU without oneDNN fp16 kernels is refused at plan time, with what to use instead."""
    if _fp16_on_this_cpu():
        pytest.skip("this CPU has fp16 kernels: nothing to refuse")
    proc = _launch(
        [
            "--nproc",
            "1",
            "--dry-run",
            "--run-dir",
            str(tmp_path / "x"),
            *_overrides(tiny_tokens),
            "--set",
            "train.precision=fp16",
        ],
        check=False,
    )
    assert proc.returncode == 2 and "no fp16 kernels in oneDNN" in proc.stderr and "bf16" in proc.stderr


def test_unequal_domain_shares_are_announced_at_launch(tiny_tokens, tmp_path):
    """3 domains on 2 ranks: allowed, and the launcher says the lone domain reads twice as much."""
    proc = _launch(["--nproc", "2", "--dry-run", "--run-dir", str(tmp_path / "x"), *_overrides(tiny_tokens)])
    assert "domains get unequal data" in proc.stderr and "50.0%" in proc.stderr and "25.0%" in proc.stderr
    proc = _launch(["--nproc", "3", "--dry-run", "--run-dir", str(tmp_path / "y"), *_overrides(tiny_tokens)])
    assert "unequal data" not in proc.stderr


def test_bad_layout_and_missing_data_fail_before_launch(tiny_tokens, tmp_path):
    proc = _launch(
        [
            "--nproc",
            "2",
            "--dry-run",
            "--run-dir",
            str(tmp_path / "x"),
            *_overrides(tiny_tokens),
            "--set",
            "model.n_heads=3",
            "--set",
            "parallel.tensor_parallel=2",
        ],
        check=False,
    )
    assert proc.returncode == 2
    assert "n_heads=3" in proc.stderr and "tensor_parallel" in proc.stderr
    proc = _launch(
        ["--nproc", "2", "--dry-run", "--run-dir", str(tmp_path / "y"), *_overrides(tmp_path / "nowhere")],
        check=False,
    )
    assert proc.returncode == 2 and "prepare the data first" in proc.stderr
    proc = _launch(
        ["--nproc", "2", "--dry-run", "--run-dir", str(tmp_path / "z"), *_overrides(tiny_tokens)], check=True
    )
    assert (tmp_path / "z" / "deepspeed_config.json").is_file() and (tmp_path / "z" / "command.sh").is_file()


def _fp16_on_this_cpu():
    from parallel.precision import cpu_supports_fp16

    return cpu_supports_fp16()


@pytest.mark.slow
@pytest.mark.parametrize(
    "precision,zero",
    [
        ("bf16", 2),
        pytest.param(
            "fp16",
            1,
            marks=pytest.mark.skipif(
                not _fp16_on_this_cpu(),
                reason="this CPU has no fp16 kernels in oneDNN (needs avx512_fp16 or AMX-FP16): "
                "DeepSpeed refuses fp16 (tests/multirank/test_device_placement.py runs fp16 with its guard lifted)",
            ),
        ),
    ],
)
def test_mixed_precision_and_activation_checkpointing_train(tiny_tokens, tmp_path, precision, zero):
    run = tmp_path / precision
    _launch(
        [
            "--nproc",
            "2",
            "--run-dir",
            str(run),
            *_overrides(tiny_tokens, steps=3, zero=zero),
            "--set",
            f"train.precision={precision}",
            "--set",
            "train.activation_checkpointing=full",
            "--set",
            "data.domains=[cooking, sailing]",
        ]
    )
    losses = _losses(run)
    assert len(losses) == 3 and all(v == v and v < 20 for v in losses.values())  # finite
    assert losses[3] < losses[1]


@pytest.mark.slow
def test_gshard_with_tensor_parallelism_trains_and_exports(tiny_tokens, tmp_path):
    """GShard at tp=2 on 2 ranks through the launcher (ZeRO 1): one whole expert per GPU (E=2, the all-to-all
    inside the TP group), routing metrics logged, every expert in the export, which one process evaluates."""
    import torch

    from launcher.checkpoint import load_consolidated

    run = tmp_path / "gshard-tp2"
    _launch(
        [
            "--nproc",
            "2",
            "--run-dir",
            str(run),
            *_overrides(tiny_tokens, kind="gshard", steps=4),
            "--set",
            "parallel.tensor_parallel=2",
            "--set",
            "model.ffn.gshard.second_expert_policy=random",
        ]
    )
    records = [r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "train"]
    assert len(records) == 4 and all(r["loss"] == r["loss"] for r in records)
    assert records[-1]["loss"] < records[0]["loss"]
    stats = records[-1]
    assert "aux_loss" in stats and sum(stats["layer1/expert_load_E"]) == pytest.approx(1.0, abs=1e-6), stats
    assert 0.0 <= stats["layer1/dropped_fraction"] < 1.0
    ckpt = load_consolidated(run / "model")
    assert ckpt.cfg.model.ffn.num_experts == 2
    assert {k for k in ckpt.state_dict if ".experts." in k and k.endswith("fc1.weight")} == {
        "blocks.1.ffn.experts.0.fc1.weight",
        "blocks.1.ffn.experts.1.fc1.weight",
    }
    model = ckpt.build_model()
    assert model.blocks[1].ffn.experts["0"].fc1.weight.shape[0] == model.cfg.d_ffn  # whole, not a TP shard
    x = torch.randint(0, 1000, (2, 16))
    assert torch.isfinite(model(x).logits).all()


def test_consolidated_checkpoint_keeps_its_tensor_parallel_vocab_padding(tmp_path):
    """A tp=2 run pads the vocabulary further than tp=1 (300 -> 512 rows, not 384): the export builds with its own
    rows (padding logits take part in the softmax), and a run at another tp starts from it with every real row."""
    from dataclasses import replace

    import torch

    from launcher.checkpoint import load_consolidated, save_consolidated
    from launcher.config import load_run_config
    from launcher.state import load_init_weights
    from model.gpt import GPT

    cfg = load_run_config(
        None,
        ["model.preset=tiny", "model.n_layers=2", "model.vocab_size=300", "parallel.tensor_parallel=2"],
        check=False,
    )
    model = GPT(cfg.model, init_seed=0, tensor_parallel=2).eval()
    save_consolidated(tmp_path / "ckpt", model.state_dict(), cfg, ["web"])
    rebuilt = load_consolidated(tmp_path / "ckpt").build_model().eval()
    x = torch.randint(0, 300, (2, 8))
    assert rebuilt.vocab_size == 512 and torch.equal(rebuilt(x).logits, model(x).logits)
    one = replace(
        cfg,
        parallel=replace(cfg.parallel, tensor_parallel=1),
        train=replace(cfg.train, init_from=str(tmp_path / "ckpt")),
    )
    fresh = GPT(one.model, init_seed=1)
    load_init_weights(fresh, one)
    assert fresh.vocab_size == 384 and torch.equal(fresh.wte.weight[:300], model.wte.weight[:300])
    assert torch.equal(fresh.blocks[1].ln1.weight, model.blocks[1].ln1.weight)
