"""Training states that move between layouts: another number of ranks, domain allocation, ZeRO stage, precision.

A training state keeps each parameter's fp32 master and Adam moments whole, by its plain-model name
(launcher/state.py, parallel/universal.py). The strongest check: a state written by one layout, loaded by
another and written again is the same, file for file and bit for bit (so nothing was lost or reordered on the
way in or out). Then, end to end through the launcher: a 4-rank run resumed on 2 ranks (and 2 on 4) continues
the loss of an uninterrupted run, and `launcher.zero_to_fp32` gives the model the consolidated export holds.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from launcher.metrics import read_metrics
from tests.e2e.test_train import _launch, _overrides, _train_ranks, reference_run
from tests.harness.multirank import run_ranks

pytestmark = pytest.mark.slow


def _sets(tokens: Path, kind: str = "demix", zero: int = 1, steps: int = 2, *extra: str) -> list[str]:
    sets = [a for a in _overrides(tokens, kind=kind, steps=steps, zero=zero) if a != "--set"]
    return sets + ["data.domains=[cooking,finance]", "train.eval_batches=1", *extra]


def _lift_fp16_guard() -> None:
    """DeepSpeed's CPU accelerator refuses fp16 where oneDNN lacks it; torch computes it in software on any x86 CPU,
    so lifting the guard runs DeepSpeed's real fp16 optimizer and loss scaler (as
    tests/multirank/test_device_placement.py)."""
    from deepspeed.accelerator import get_accelerator

    type(get_accelerator()).is_fp16_supported = lambda self: True


def _train(rank: int, world: int, sets: list[str], run_dir: str) -> None:
    if "train.precision=fp16" in sets:
        _lift_fp16_guard()
    _train_ranks(rank, world, sets, run_dir)


def _load_and_save_again(rank: int, world: int, sets: list[str], run_dir: str, out_dir: str) -> int:
    """Set a trainer up from `run_dir`'s latest state (the real resume path), then write its state into `out_dir`."""
    from launcher.config import load_run_config
    from launcher.plan import make_plan
    from launcher.state import save_training_state
    from launcher.train import Trainer

    if "train.precision=fp16" in sets:
        _lift_fp16_guard()
    plan = make_plan(load_run_config(None, sets, check=False), world)
    trainer = Trainer.setup(plan, Path(run_dir), resume="auto")
    save_training_state(Path(out_dir), trainer.start, trainer.bundle, trainer.plan, rank)
    return trainer.start


def _state_files(ckpt: Path) -> dict[str, object]:
    out = {}
    for path in sorted((ckpt / "zero").glob("*/*.pt")):  # per parameter (not the optimizer_state.pt index)
        obj = torch.load(path, weights_only=True)
        out[str(path.relative_to(ckpt))] = obj
    return out


def _assert_same_state(a: Path, b: Path) -> None:
    fa, fb = _state_files(a), _state_files(b)
    assert sorted(fa) == sorted(fb), sorted(set(fa) ^ set(fb))
    for name, va in fa.items():
        vb = fb[name]
        if isinstance(va, dict):
            assert va["cat_dim"] == vb["cat_dim"], name
            assert torch.equal(va["param"], vb["param"]), name  # bit for bit
        else:
            assert torch.equal(va, vb), name
    ta, tb = (torch.load(p / "trainer.pt", weights_only=True) for p in (a, b))
    assert (
        ta["scheduler"] == tb["scheduler"] and ta["adam_step"] == tb["adam_step"] and ta["step"] == tb["step"]
    )


def _roundtrip(tmp_path: Path, first: tuple[int, list[str]], then: list[tuple[int, list[str]]]) -> Path:
    """Train `first` (world, sets) to its end, then load its state in each of `then` and save it again."""
    run = tmp_path / "run"
    run_ranks(_train, first[0], args=(first[1], str(run)), device_strict=True)
    ckpt = run / "checkpoints" / "step_00000002"
    assert json.loads((ckpt / "meta.json").read_text())["layout"]["world_size"] == first[0]
    for i, (world, sets) in enumerate(then):
        out = tmp_path / f"again{i}"
        starts = run_ranks(_load_and_save_again, world, args=(sets, str(run), str(out)), device_strict=True)
        assert starts == [2] * world
        _assert_same_state(ckpt, out / "checkpoints" / "step_00000002")
    return ckpt


def test_demix_state_moves_from_4_ranks_to_2_and_1_rank_bit_for_bit(tiny_tokens, tmp_path):
    """DEMix, 2 domains. Written at 4 ranks (2 per domain, ZeRO 1: each expert partitioned over its 2 ranks).
    Loaded at 2 ranks (one per domain) with ZeRO 2 in bf16 (fp32 masters behind bf16 parameters), and at 1 rank
    (both experts on it) with ZeRO 0: each writes back the same fp32 weights, moments and step."""
    a = _sets(tiny_tokens, zero=1)
    ckpt = _roundtrip(
        tmp_path,
        (4, a),
        [
            (2, _sets(tiny_tokens, "demix", 2, 2, "train.precision=bf16", "train.grad_accum=4")),
            (1, _sets(tiny_tokens, "demix", 0, 2, "train.grad_accum=8")),
        ],
    )
    names = json.loads((ckpt / "meta.json").read_text())["params"]
    assert "blocks.0.ffn.experts.0.fc1.weight" in names and "blocks.0.ffn.experts.1.fc1.weight" in names
    assert (ckpt / "zero" / "wte.weight" / "exp_avg_sq.pt").is_file()


def test_fp16_zero0_state_moves_to_fp32_zero2_and_back(tiny_tokens, tmp_path):
    """fp16 at ZeRO 0 keeps its fp32 masters in DeepSpeed's FP16_UnfusedOptimizer (one fp32 copy per parameter):
    written there on 2 ranks, loaded by an fp32 ZeRO 2 run and by the fp16 ZeRO 0 layout itself, bit for bit;
    the same-layout load also gets the dynamic loss scale back. (DeepSpeed's fp16 optimizer takes one Adam step on
    zero gradients at start-up to create its state, so its Adam step count is one ahead of the training step.)"""
    fp16 = _sets(tiny_tokens, "demix", 0, 2, "train.precision=fp16")
    ckpt = _roundtrip(tmp_path, (2, fp16), [(2, _sets(tiny_tokens, "demix", 2, 2)), (2, fp16)])
    saved = torch.load(ckpt / "trainer.pt", weights_only=True)["loss_scaler"]
    again = torch.load(
        tmp_path / "again1" / "checkpoints" / "step_00000002" / "trainer.pt", weights_only=True
    )
    assert saved["cur_scale"] > 1 and again["loss_scaler"] == saved
    assert torch.load(ckpt / "trainer.pt", weights_only=True)["adam_step"] == 3


def test_gshard_state_moves_from_4_ranks_to_2_with_two_experts_each(tiny_tokens, tmp_path):
    """GShard with 4 experts: one per rank at 4 ranks (ZeRO 1), two per rank at 2 (ZeRO 0). DeepSpeed names an
    expert by its local index; the state uses the plain model's global ids, so rank 1 of the 2-rank run finds
    experts 2 and 3 where ranks 2 and 3 wrote them."""

    def sets(zero: int, *extra: str) -> list[str]:
        return _sets(tiny_tokens, "gshard", zero, 2, "model.ffn.num_experts=4", *extra)

    ckpt = _roundtrip(
        tmp_path, (4, sets(1)), [(2, sets(0, "train.grad_accum=4", "model.ffn.gshard.experts_per_rank=2"))]
    )
    assert (ckpt / "zero" / "blocks.1.ffn.experts.3.fc1.weight" / "exp_avg.pt").is_file()


def test_tensor_parallel_state_is_written_whole_and_resharded(tiny_tokens, tmp_path):
    """tp=2: shards are gathered into whole tensors (cat_dim records the split) and sliced again on load, here by
    a layout with half the data-parallel ranks and another ZeRO stage."""
    ckpt = _roundtrip(
        tmp_path,
        (4, _sets(tiny_tokens, "dense", 1, 2, "parallel.tensor_parallel=2", "data.mixture=natural")),
        [
            (
                2,
                _sets(
                    tiny_tokens,
                    "dense",
                    2,
                    2,
                    "parallel.tensor_parallel=2",
                    "data.mixture=natural",
                    "train.grad_accum=4",
                ),
            )
        ],
    )
    qkv = torch.load(ckpt / "zero" / "blocks.0.attn.qkv.weight" / "fp32.pt", weights_only=True)
    assert qkv["param"].shape == (3 * 64, 64) and qkv["cat_dim"] == 0


def _deepspeed_loads_it(rank: int, world: int, sets: list[str], ckdir: str, scratch: str) -> tuple:
    """A fresh engine, then DeepSpeed's own universal-checkpoint loader on our state; returns what disagrees with
    the state's files, and the step and schedule position DeepSpeed restored."""

    from launcher.config import load_run_config
    from launcher.plan import make_plan
    from launcher.train import Trainer
    from parallel.universal import ParamStates

    trainer = Trainer.setup(
        make_plan(load_run_config(None, sets, check=False), world), Path(scratch), resume="never"
    )
    engine = trainer.bundle.engine
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = (
        "1"  # DeepSpeed's loaders pass weights_only=False: refuse code
    )
    path, _ = engine.load_checkpoint(ckdir, tag="step_00000002", load_module_strict=False)
    states, bad = ParamStates(engine), []
    for name, p in engine.module.named_parameters():
        got = states.get(p)
        if sorted(got) != ["exp_avg", "exp_avg_sq", "fp32"]:
            bad.append((name, sorted(got)))
        for key, value in got.items():
            want = torch.load(Path(ckdir) / "step_00000002" / "zero" / name / f"{key}.pt", weights_only=True)[
                "param"
            ]
            if not torch.equal(value.cpu(), want):
                bad.append((name, key))
        if not torch.equal(p.detach().float().cpu(), states.get(p)["fp32"].cpu()):
            bad.append((name, "parameter"))
    return bad, engine.global_steps, trainer.bundle.scheduler.last_epoch, path is not None


def test_deepspeeds_own_universal_loader_reads_the_state(tiny_tokens, tmp_path):
    """The state is a DeepSpeed universal checkpoint: `engine.load_checkpoint` with `checkpoint.load_universal`
    (DeepSpeed's code, not ours) restores a 4-rank DEMix ZeRO 1 state into a 2-rank ZeRO 2 engine, fp32 masters,
    Adam moments, parameters, step and schedule, reading every file weights-only."""
    run = tmp_path / "run"
    run_ranks(_train, 4, args=(_sets(tiny_tokens, zero=1), str(run)))
    sets = _sets(
        tiny_tokens, "demix", 2, 2, "train.grad_accum=4", "extra_deepspeed.checkpoint.load_universal=true"
    )
    results = run_ranks(
        _deepspeed_loads_it, 2, args=(sets, str(run / "checkpoints"), str(tmp_path / "scratch"))
    )
    for bad, global_steps, last_epoch, loaded in results:
        assert loaded and bad == [] and global_steps == 2 and last_epoch == 2


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "train"}


def _launch_args(tokens: Path, run: Path, ranks: int, steps: int, zero: int) -> list[str]:
    global_batch = 16  # micro_batch 2: grad_accum = 16 / (2 x ranks), the same recipe at every size
    args = _overrides(tokens, steps=steps, zero=zero)
    extra = [
        "data.domains=[cooking,finance]",
        f"train.grad_accum={global_batch // (2 * ranks)}",
        "train.schedule=constant",
        "train.warmup_fraction=0",
        "train.save_interval=3",
    ]
    return ["--nproc", str(ranks), "--run-dir", str(run), *args, *[a for s in extra for a in ("--set", s)]]


@pytest.fixture(scope="module")
def moved(tiny_tokens, tmp_path_factory) -> dict[str, Path]:
    """DEMix, 2 domains, the same global batch (16) and a constant learning rate on every layout, three launches:
    `a` trains steps 1-6 on 2 ranks (ZeRO 1; the trainer on forked ranks); `b` resumes a's step-3 state on 4 ranks
    (ZeRO 2) for steps 4-9; `c` resumes b's step-6 state on 2 ranks (ZeRO 2) for steps 7-9. Each move is checked
    against the run that did not move (b against a for steps 4-6, c against b for 7-9), and c is the fp32 ZeRO-2 run
    zero_to_fp32 reads."""
    root = tmp_path_factory.mktemp("moved")
    runs = {name: root / name for name in "abc"}
    # forked ranks, no launcher
    reference_run(_launch_args(tiny_tokens, runs["a"], 2, 6, zero=1)[4:], 2, runs["a"])
    for name, ranks, source in (
        ("b", 4, runs["a"] / "checkpoints" / "step_00000003"),
        ("c", 2, runs["b"] / "checkpoints" / "step_00000006"),
    ):
        proc = _launch(_launch_args(tiny_tokens, runs[name], ranks, 9, zero=2) + ["--resume", str(source)])
        (runs[name] / "launch.stderr").write_text(proc.stderr)
    return runs


@pytest.mark.long
@pytest.mark.parametrize("before,after", [(2, 4), (4, 2)])
def test_a_run_resumed_on_another_number_of_ranks_continues_its_loss(moved, before, after):
    """A state written on `before` ranks continues on `after` ranks (and another ZeRO stage for 2 -> 4) on the
    trajectory of the run that did not move. The data order differs after the move (other shards), so the losses
    match within a tolerance, not exactly."""
    stay, move, source, steps = ("a", "b", 3, (4, 5, 6)) if before == 2 else ("b", "c", 6, (7, 8, 9))
    stderr = (moved[move] / "launch.stderr").read_text()
    assert f"world_size {before} -> {after}" in stderr and "carry over exactly" in stderr
    a, b = _losses(moved[stay]), _losses(moved[move])
    assert sorted(b) == list(range(source + 1, 10))
    for step in steps:
        assert b[step] == pytest.approx(a[step], rel=1e-2), (step, a, b)
    assert b[9] < b[source + 1]  # still learning after the move
    start = [r for r in read_metrics(moved[move] / "metrics.jsonl") if r.get("kind") == "start"][-1]
    assert start["world_size"] == after and start["resumed_from"].endswith(f"step_{source:08d}")


@pytest.mark.long
def test_zero_to_fp32_gives_the_model_the_export_holds(tiny_tokens, moved, tmp_path, capsys):
    """`python -m launcher.zero_to_fp32 RUN` converts the latest training state of an fp32 ZeRO-2 run into a
    consolidated checkpoint equal to the run's own export, tensor for tensor, so both evaluate to the same
    perplexity."""
    import subprocess
    import sys

    run = moved["c"]
    out = tmp_path / "fp32"
    conv = subprocess.run(
        [sys.executable, "-m", "launcher.zero_to_fp32", str(run), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert conv.returncode == 0, conv.stderr
    assert json.loads(conv.stdout)["from"].endswith("step_00000009")

    from launcher.checkpoint import load_consolidated
    from launcher.evaluation.evaluate import main as evaluate
    from launcher.zero_to_fp32 import main as zero_to_fp32

    assert zero_to_fp32([str(run), "--out", str(out)]) == 2  # never over an existing output
    err = capsys.readouterr().err
    assert "exists" in err and "Traceback" not in err

    mine, export = load_consolidated(out), load_consolidated(run / "model")
    assert sorted(mine.state_dict) == sorted(export.state_dict) and mine.domains == export.domains
    for k, v in export.state_dict.items():
        assert torch.equal(mine.state_dict[k], v), k
    ppl = {}
    for name, ckpt in (("fp32", out), ("export", run / "model")):
        report = tmp_path / f"eval-{name}"
        args = [
            str(ckpt),
            "--data",
            str(tiny_tokens),
            "--max-blocks",
            "4",
            "--modes",
            "naive",
            "--out",
            str(report),
        ]
        assert evaluate(args) == 0, capsys.readouterr().err
        res = json.loads((report / "eval.json").read_text())
        ppl[name] = {d: r["ppl"] for d, r in res["domains"].items()}
    assert ppl["fp32"] == ppl["export"] and ppl["fp32"]["cooking"]["naive"] > 1


@pytest.mark.long
def test_what_cannot_change_on_resume_is_named_before_anything_starts(tiny_tokens, moved, tmp_path, capsys):
    """Another head count, tensor-parallel size or domain set cannot load a state: the launcher names each
    difference (before any rank starts: these are dry runs of `launcher.launch`); an old-format state says how to
    continue from it."""
    from launcher.launch import main

    run = tmp_path / "run"
    shutil.copytree(moved["c"], run)  # a dry run writes its run files: the shared run stays as it was

    def dry_run(*sets: str) -> tuple[int, str]:
        more = [a for s in sets for a in ("--set", s)]
        status = main(_launch_args(tiny_tokens, run, 2, 12, zero=2) + more + ["--dry-run"])
        return status, capsys.readouterr().err

    for bad, word in (
        ("model.n_heads=4", "model"),
        ("parallel.tensor_parallel=2", "tensor_parallel"),
        ("data.domains=[cooking,sailing]", "domains"),
    ):
        status, err = dry_run(bad)
        assert status == 2 and word in err and "Traceback" not in err, (bad, err)
    status, err = dry_run()
    assert status == 0, err  # the same launch with nothing changed is accepted
    old = run / "checkpoints" / "step_00000009"
    meta = json.loads((old / "meta.json").read_text())
    (old / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "format"}))
    status, err = dry_run()
    assert status == 2 and "older format" in err and "train.init_from" in err
    shutil.rmtree(old / "zero" / "wte.weight")
    (old / "meta.json").write_text(json.dumps(meta))
    status, err = dry_run()
    assert status == 2 and "no intact training state" in err and "zero/wte.weight/" in err
