"""A damaged training state does not stop the run: checksums recorded while writing, verified
on resume by the ranks together, and a fall back to the newest intact state.

Damage that keeps a file's size (bytes overwritten in place) passes the size check of `state_damage`; the sha256
that `save_training_state` records per file in meta.json (computed as torch.save writes, no second read) catches
it. Real ranks over gloo write two states, one is damaged, and `--resume auto` continues from the other.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.harness.multirank import run_ranks
from tests.multirank.test_reshape import _sets, _train

pytestmark = pytest.mark.slow


def _resume(rank: int, world: int, sets: list[str], run_dir: str, resume: str) -> tuple[int, str]:
    """Set a trainer up from `run_dir` (the real resume path); return (its first step, the state it loaded)."""
    from launcher.config import load_run_config
    from launcher.plan import make_plan
    from launcher.train import Trainer

    trainer = Trainer.setup(
        make_plan(load_run_config(None, sets, check=False), world), Path(run_dir), resume=resume
    )
    return trainer.start, trainer.resumed_from.name


def _overwrite_in_place(path: Path, offset: int = 0) -> None:
    """Random bytes over part of `path`, same size: what a size check cannot see."""
    data = bytearray(path.read_bytes())
    n = min(64, len(data) - offset)
    data[offset : offset + n] = os.urandom(n)
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def two_states(tiny_tokens, tmp_path_factory) -> tuple[Path, list[str]]:
    """A DEMix run on 2 ranks (ZeRO 1) with training states at steps 2 and 4."""
    run = tmp_path_factory.mktemp("checksums") / "run"
    sets = _sets(tiny_tokens, "demix", 1, 4, "train.keep_checkpoints=0")
    run_ranks(_train, 2, args=(sets, str(run)))
    return run, sets


def _copy(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def test_every_file_of_a_state_has_the_checksum_of_its_bytes(two_states):
    from data.tokenizer import sha256_file
    from launcher.state import SUMS_DIR

    run, _ = two_states
    for ckpt in sorted((run / "checkpoints").glob("step_*")):
        meta = json.loads((ckpt / "meta.json").read_text())
        files = sorted(meta["files"])
        assert sorted(meta["sha256"]) == files and len(files) > 10
        # written by rank 1, its sum gathered by rank 0
        assert any(f.startswith("rng/rank00001") for f in files)
        for rel in files:
            assert meta["sha256"][rel] == sha256_file(ckpt / rel), rel
        assert not (ckpt / SUMS_DIR).exists()


@pytest.mark.parametrize(
    "victim", ["trainer.pt", "zero/wte.weight/fp32.pt", "zero/wte.weight/exp_avg_sq.pt", "rng/rank00001.pt"]
)
def test_auto_resume_falls_back_from_a_damaged_newest_state(two_states, tmp_path, victim, capfd):
    """The newest state's file overwritten in place, same size: every rank resumes from step 2, with a warning
    naming the file; no training state is changed or removed (metrics.jsonl rewinds to step 2, as any resume)."""
    run, sets = two_states
    run = _copy(run, tmp_path)
    newest = run / "checkpoints" / "step_00000004"
    _overwrite_in_place(newest / victim, offset=100)
    before = {p: p.read_bytes() for p in (run / "checkpoints").rglob("*") if p.is_file()}
    assert run_ranks(_resume, 2, args=(sets, str(run), "auto")) == [(2, "step_00000002")] * 2
    err = capfd.readouterr().err
    assert f"{victim} does not match its checksum" in err and "step_00000004 is damaged" in err
    assert {p: p.read_bytes() for p in (run / "checkpoints").rglob("*") if p.is_file()} == before


def test_an_intact_newest_state_is_used(two_states, tmp_path):
    run, sets = two_states
    assert run_ranks(_resume, 2, args=(sets, str(_copy(run, tmp_path)), "auto")) == [(4, "step_00000004")] * 2


def test_an_explicitly_named_damaged_state_is_an_error_not_a_fallback(two_states, tmp_path):
    run, sets = two_states
    run = _copy(run, tmp_path)
    newest = run / "checkpoints" / "step_00000004"
    _overwrite_in_place(newest / "trainer.pt", offset=100)
    with pytest.raises(AssertionError, match="step_00000004 is damaged.*--resume auto"):
        run_ranks(_resume, 2, args=(sets, str(run), str(newest)))


def test_every_state_damaged_is_an_error(two_states, tmp_path):
    run, sets = two_states
    run = _copy(run, tmp_path)
    for ckpt in (run / "checkpoints").glob("step_*"):
        _overwrite_in_place(ckpt / "trainer.pt", offset=100)
    with pytest.raises(AssertionError, match="no older intact state"):
        run_ranks(_resume, 2, args=(sets, str(run), "auto"))


def test_the_ranks_split_the_reading(two_states, tmp_path):
    """Each file is read by exactly one rank: damage in one file is reported by one rank of 2 (and of 3)."""
    from launcher.state_discovery import checksum_damage

    run, _ = two_states
    ckpt = _copy(run, tmp_path) / "checkpoints" / "step_00000004"
    assert all(checksum_damage(ckpt, r, w) is None for w in (1, 2, 3) for r in range(w))
    files = json.loads((ckpt / "meta.json").read_text())["files"]
    for victim in ("trainer.pt", "zero/wte.weight/fp32.pt", sorted(files)[-1]):
        _overwrite_in_place(ckpt / victim)
        for world in (1, 2, 3):
            hits = [r for r in range(world) if checksum_damage(ckpt, r, world)]
            assert len(hits) == 1, (victim, world, hits)
        shutil.copy(run / "checkpoints" / "step_00000004" / victim, ckpt / victim)


def test_zero_to_fp32_refuses_a_damaged_state_and_picks_an_intact_one(two_states, tmp_path):
    from launcher.checkpoint import CheckpointError
    from launcher.zero_to_fp32 import fp32_state_dict, resolve_state

    run = _copy(two_states[0], tmp_path)
    newest = run / "checkpoints" / "step_00000004"
    _overwrite_in_place(newest / "zero" / "wte.weight" / "fp32.pt", offset=100)
    with pytest.raises(CheckpointError, match="fp32.pt does not match its checksum"):
        fp32_state_dict(newest)
    assert resolve_state(run).name == "step_00000002"


def test_mutation_without_recorded_checksums_the_damage_passes(two_states, tmp_path):
    """The rule disabled (a meta.json without `sha256`, as states written before it): the same damage goes
    unnoticed by every check, so the fall-back above rests on the checksums alone."""
    from launcher.state_discovery import checksum_damage, latest_checkpoint, state_damage

    run = _copy(two_states[0], tmp_path)
    newest = run / "checkpoints" / "step_00000004"
    _overwrite_in_place(newest / "trainer.pt", offset=100)
    assert (
        checksum_damage(newest) is not None and latest_checkpoint(run, checksums=True).name == "step_00000002"
    )
    meta = json.loads((newest / "meta.json").read_text())
    del meta["sha256"]
    (newest / "meta.json").write_text(json.dumps(meta))
    assert state_damage(newest) is None and checksum_damage(newest) is None
    assert latest_checkpoint(run, checksums=True).name == "step_00000004"


def test_a_damaged_checksum_table_is_damage(two_states, tmp_path):
    from launcher.state_discovery import checksum_damage

    run = _copy(two_states[0], tmp_path)
    newest = run / "checkpoints" / "step_00000004"
    meta = json.loads((newest / "meta.json").read_text())
    for sums, why in (
        ({}, "records no checksum for"),
        ([], "not an object"),
        ({**meta["sha256"], "trainer.pt": 5}, "records no checksum for trainer.pt"),
    ):
        (newest / "meta.json").write_text(json.dumps({**meta, "sha256": sums}))
        assert why in (checksum_damage(newest) or ""), sums


def test_hashing_writer_gives_the_sha256_file(tmp_path):
    from data.tokenizer import sha256_file
    from launcher.checkpoint import save_hashed

    digest = save_hashed({"x": torch.arange(1000)}, tmp_path / "a" / "t.pt")
    assert digest == sha256_file(tmp_path / "a" / "t.pt")
    assert torch.equal(torch.load(tmp_path / "a" / "t.pt", weights_only=True)["x"], torch.arange(1000))


# ---------------------------------------------------------------- consolidated checkpoints (model/, exports)


def test_a_consolidated_export_records_the_checksum_of_every_shard(two_states):
    """The run's model/ (expert shards written by each domain group's first rank, the rest by rank 0): meta.json's
    sha256 covers every shard, as written; the per-shard sums that waited beside them are gone."""
    from data.tokenizer import sha256_file

    model = two_states[0] / "model"
    meta = json.loads((model / "meta.json").read_text())
    files = [meta["shards"]["shared"], *meta["shards"]["experts"].values()]
    assert len(files) == 3 and meta["sha256"] == {rel: sha256_file(model / rel) for rel in files}
    assert not list(model.rglob("*.sha256"))


@pytest.mark.parametrize("victim", ["model.pt", "experts/expert_0001.pt"])
def test_a_consolidated_checkpoint_changed_in_place_is_refused_by_every_reader(
    two_states, tiny_tokens, tmp_path, victim, capsys
):
    """Bytes of one shard changed in place (same size): loading names the file and the recorded checksum; a tool
    (evaluate) says so in one line with exit status 2; copying the expert into a new checkpoint refuses it too.
    The control: without the recorded sums the same damage loads without a word (or fails elsewhere)."""
    from launcher.checkpoint import CheckpointError, copy_expert_shards, load_consolidated
    from launcher.evaluation.evaluate import main as evaluate

    model = tmp_path / "model"
    shutil.copytree(two_states[0] / "model", model)
    load_consolidated(model)  # intact
    _overwrite_in_place(model / victim, offset=(model / victim).stat().st_size // 2)
    with pytest.raises(CheckpointError, match=f"{victim} does not match the sha256"):
        load_consolidated(model)
    assert (
        evaluate(
            [
                str(model),
                "--data",
                str(tiny_tokens),
                "--max-blocks",
                "1",
                "--modes",
                "naive",
                "--out",
                str(tmp_path / "eval"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "does not match the sha256" in err and "Traceback" not in err and not (tmp_path / "eval").exists()
    if victim.startswith("experts/"):
        with pytest.raises(CheckpointError, match="does not match the sha256"):
            copy_expert_shards(model, [1], tmp_path / "new")
    meta = json.loads((model / "meta.json").read_text())
    del meta["sha256"]
    (model / "meta.json").write_text(json.dumps(meta))
    try:
        load_consolidated(model)
        outcome = "loaded"
    except CheckpointError as e:
        outcome = str(e)
    assert "does not match the sha256" not in outcome
