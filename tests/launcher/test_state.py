"""Training states on disk (launcher/state_discovery.py, launcher/state.py): which states a run directory holds,
which are damaged (sizes, then checksums), which one a resume picks, pruning, and the checks a resume makes
against the plan (`check_resumable`, `layout_changes`).

Every state here is a folder of real files in tmp_path laid out as `save_training_state` writes them (meta.json
with the files' sizes and sha256); no tensor is needed except the parameter files `check_resumable` looks for.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from launcher.checkpoint import CheckpointError
from launcher.state_discovery import (
    TRAINING_FORMAT,
    checksum_damage,
    complete_states,
    latest_checkpoint,
    prune_checkpoints,
    read_state_meta,
    resume_candidates,
    state_damage,
    verified_state,
)
from parallel.universal import assign_writers

FILES = {"trainer.pt": b"t" * 10, "zero/wte.weight/fp32.pt": b"w" * 40, "rng/rank00000.pt": b"r" * 20}


def _state(
    ckdir: Path,
    step: int,
    files: dict[str, bytes] = FILES,
    checksums: bool = True,
    **meta: object,
) -> Path:
    """A training state `step_<step>` in `ckdir`: `files` written, meta.json recording their sizes (and sha256)."""
    d = ckdir / f"step_{step:08d}"
    d.mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    record: dict[str, object] = {
        "format": TRAINING_FORMAT,
        "step": step,
        "layout": {},
        "params": [],
        "files": {rel: len(data) for rel, data in files.items()},
        "config": {},
    }
    if checksums:
        record["sha256"] = {rel: hashlib.sha256(data).hexdigest() for rel, data in files.items()}
    record.update(meta)
    (d / "meta.json").write_text(json.dumps(record))
    return d


def _same_size_damage(path: Path) -> None:
    """Other bytes, same length: what the size check cannot see."""
    path.write_bytes(bytes(b ^ 0xFF for b in path.read_bytes()))


# ---------------------------------------------------------------------------------------------------------------
# Which states there are, and which are damaged
# ---------------------------------------------------------------------------------------------------------------


def test_complete_states_are_the_well_formed_names_with_meta_json_oldest_first(tmp_path):
    ck = tmp_path / "checkpoints"
    four, two = _state(ck, 4), _state(ck, 2)
    (ck / "step_00000006").mkdir()  # being written when the run died: no meta.json
    (ck / ".step_00000008.tmp").mkdir()  # rank 0's staging folder
    (ck / "step_12").mkdir()  # not `step_<8 digits>`
    (ck / "step_12" / "meta.json").write_text("{}")
    (ck / "step_00000010" / "meta.json").mkdir(parents=True)  # meta.json is not a file
    assert complete_states(ck) == [two, four]
    assert complete_states(tmp_path / "nowhere") == []


def test_state_damage_is_none_for_an_intact_state_and_names_each_kind_of_damage(tmp_path):
    ck = tmp_path / "checkpoints"
    assert state_damage(_state(ck, 1)) is None
    assert state_damage(_state(ck, 2, format="demix-training/1")) is None  # another format: not damage
    missing = _state(ck, 3)
    (missing / "trainer.pt").unlink()
    assert state_damage(missing) == "trainer.pt is missing"
    cut = _state(ck, 4)
    (cut / "zero" / "wte.weight" / "fp32.pt").write_bytes(b"w" * 7)
    assert state_damage(cut) == "zero/wte.weight/fp32.pt has 7 bytes, 40 when written"
    escapes = _state(ck, 5, files={})
    meta = json.loads((escapes / "meta.json").read_text())
    (escapes / "meta.json").write_text(json.dumps({**meta, "files": {"../../etc/passwd": 1}}))
    assert state_damage(escapes) == "meta.json names a file outside the state: '../../etc/passwd'"
    assert state_damage(_state(ck, 6, files={})) == "meta.json lists no files"
    (ck / "step_00000006" / "meta.json").write_text("[1, 2]")
    assert state_damage(ck / "step_00000006") == "meta.json is not an object"
    (ck / "step_00000006" / "meta.json").write_text('{"format": ')
    assert state_damage(ck / "step_00000006").startswith("meta.json unreadable (")


def test_checksum_damage_sees_bytes_changed_in_place_and_splits_the_files_over_the_ranks(tmp_path):
    ck = tmp_path / "checkpoints"
    ckpt = _state(ck, 2)
    assert checksum_damage(ckpt) is None
    _same_size_damage(ckpt / "zero" / "wte.weight" / "fp32.pt")
    assert state_damage(ckpt) is None  # same sizes
    assert checksum_damage(ckpt) == (
        "zero/wte.weight/fp32.pt does not match its checksum: its bytes changed after it was written"
    )
    # two ranks read disjoint shares (balanced by bytes): only the rank given the damaged file reports it
    share = assign_writers({rel: len(data) for rel, data in FILES.items()}, range(2))
    found = {rank: checksum_damage(ckpt, rank, 2) for rank in range(2)}
    owner = share["zero/wte.weight/fp32.pt"]
    assert found[owner] is not None and found[1 - owner] is None
    # a state written before checksums were recorded passes; a file without its checksum does not
    assert checksum_damage(_state(ck, 4, checksums=False)) is None
    partial = _state(ck, 6, sha256={"trainer.pt": hashlib.sha256(FILES["trainer.pt"]).hexdigest()})
    assert checksum_damage(partial) in {
        "meta.json records no checksum for rng/rank00000.pt",
        "meta.json records no checksum for zero/wte.weight/fp32.pt",
    }


# ---------------------------------------------------------------------------------------------------------------
# Which state a resume uses
# ---------------------------------------------------------------------------------------------------------------


def test_resume_candidates_put_the_latest_pointer_first_then_the_others_newest_first(tmp_path):
    ck = tmp_path / "checkpoints"
    assert resume_candidates(tmp_path) == [] and latest_checkpoint(tmp_path) is None
    two, four, six = (_state(ck, s) for s in (2, 4, 6))
    assert resume_candidates(tmp_path) == [six, four, two]  # no pointer: newest first
    (ck / "latest").write_text("step_00000004\n")  # e.g. a resume that was pointed back
    assert resume_candidates(tmp_path) == [four, six, two]
    assert latest_checkpoint(tmp_path) == four


def test_a_pointer_to_nothing_intact_resumes_from_the_newest_intact_state_with_a_warning(tmp_path, capsys):
    ck = tmp_path / "checkpoints"
    two, four = _state(ck, 2), _state(ck, 4)
    (ck / "step_00000006").mkdir()  # incomplete
    for name in ("step_00000006", "step_00000008", "../../elsewhere", "garbage"):
        (ck / "latest").write_text(name + "\n")
        assert resume_candidates(tmp_path) == [four, two], name
        assert f"names {name!r}, not an intact training state here" in capsys.readouterr().err
    (ck / "latest").write_text("step_00000004\n")
    (four / "trainer.pt").write_bytes(b"t")  # truncated
    assert resume_candidates(tmp_path) == [two]
    assert (
        "step_00000004 is damaged (trainer.pt has 1 bytes, 10 when written); skipped"
        in capsys.readouterr().err
    )


def test_checksums_on_resume_selection_skip_a_state_damaged_in_place(tmp_path, capsys):
    ck = tmp_path / "checkpoints"
    two, four = _state(ck, 2), _state(ck, 4)
    _same_size_damage(four / "trainer.pt")
    assert resume_candidates(tmp_path) == [four, two]  # sizes only: not seen
    assert latest_checkpoint(tmp_path, checksums=True) == two
    assert "trainer.pt does not match its checksum" in capsys.readouterr().err


def test_when_every_state_is_damaged_resume_selection_refuses_instead_of_starting_over(tmp_path):
    ck = tmp_path / "checkpoints"
    for step in (2, 4):
        (_state(ck, step) / "trainer.pt").unlink()
    with pytest.raises(CheckpointError, match=r"no intact training state in .* \(all 2 damaged"):
        resume_candidates(tmp_path)


def _verified_states(rank: int, world_size: int, two: Path, four: Path) -> list:
    """verified_state on this rank for several candidate lists (a rank of tests/harness/multirank.py)."""
    cpu = torch.device("cpu")
    return [
        verified_state([four, two], rank, world_size, cpu),
        verified_state([two, four], rank, world_size, cpu),
        verified_state([four], rank, world_size, cpu),
        verified_state([], rank, world_size, cpu),
    ]


@pytest.mark.slow
def test_verified_state_is_the_first_candidate_whose_checksums_hold(tmp_path):
    """On 2 real gloo ranks, each checking its share of the files: whichever rank reads the damaged file, both
    agree (one all-reduce per candidate) on the first intact state."""
    from tests.harness.multirank import run_ranks

    ck = tmp_path / "checkpoints"
    two, four = _state(ck, 2), _state(ck, 4)
    _same_size_damage(four / "rng" / "rank00000.pt")
    assert run_ranks(_verified_states, 2, args=(two, four)) == [[two, two, None, None]] * 2


# ---------------------------------------------------------------------------------------------------------------
# Pruning and meta.json
# ---------------------------------------------------------------------------------------------------------------


def test_prune_deletes_the_oldest_complete_states_but_never_the_latest_or_an_incomplete_one(tmp_path):
    states = [_state(tmp_path, s) for s in (2, 4, 6, 8, 10)]
    (tmp_path / "step_00000012").mkdir()  # incomplete: neither counted nor touched
    (tmp_path / "latest").write_text("step_00000002\n")
    assert prune_checkpoints(tmp_path, 0) == []  # 0: keep all
    assert prune_checkpoints(tmp_path, 2) == states[1:3]
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [
        "step_00000002",
        "step_00000008",
        "step_00000010",
        "step_00000012",
    ]
    (tmp_path / "latest").unlink()
    assert prune_checkpoints(tmp_path, 1) == [states[0], states[3]]
    assert prune_checkpoints(tmp_path, 1) == []


def test_read_state_meta_returns_meta_json_or_says_why_it_is_not_a_state(tmp_path):
    ck = tmp_path / "checkpoints"
    assert read_state_meta(_state(ck, 2))["step"] == 2
    with pytest.raises(CheckpointError, match="is not a training state"):
        read_state_meta(tmp_path)
    with pytest.raises(CheckpointError, match="older format"):
        read_state_meta(_state(ck, 4, format="demix-training/1"))
    six = _state(ck, 6)
    (six / "meta.json").write_text(json.dumps({**read_state_meta(six), "step": "six"}))
    with pytest.raises(CheckpointError, match="step"):
        read_state_meta(six)


# ---------------------------------------------------------------------------------------------------------------
# What a resume checks against the plan (launcher/state.py)
# ---------------------------------------------------------------------------------------------------------------


def _plan(tokens: Path, world: int, **sets: str):
    from launcher.config import load_run_config
    from launcher.plan import make_plan

    base = {
        "model.preset": "tiny",
        "model.n_layers": "2",
        "model.d_model": "32",
        "model.n_heads": "2",
        "model.seq_len": "32",
        "model.ffn.kind": "dense",
        "data.path": str(tokens),
        "data.tokenizer": "gpt2",
        "data.domains": "[cooking, sailing]",
        "data.mixture": "natural",
        "logging.wandb_mode": "disabled",
        **sets,
    }
    return make_plan(load_run_config(None, [f"{k}={v}" for k, v in base.items()], check=False), world)


def _state_of(plan, ck: Path, step: int) -> Path:
    from launcher.state import layout_identity

    files = {"trainer.pt": b"t", "zero/wte.weight/fp32.pt": b"w" * 8}
    return _state(ck, step, files, layout=layout_identity(plan), params=["wte.weight"])


def test_check_resumable_returns_the_step_and_layout_changes_says_what_changed(tiny_tokens, tmp_path):
    from launcher.state import check_resumable, layout_changes

    one = _plan(tiny_tokens, 1)
    ckpt = _state_of(one, tmp_path, 6)
    assert check_resumable(ckpt, one) == 6 and layout_changes(ckpt, one) == []
    two = _plan(tiny_tokens, 2)  # twice the ranks: allowed, and announced
    assert check_resumable(ckpt, two) == 6
    changes = layout_changes(ckpt, two)
    assert changes[0].startswith(
        "resuming step_00000006 on another layout (world_size 1 -> 2, allocation [1] -> [2]): "
    )
    assert changes[1].startswith("the global batch changes from 16 to 32 sequences per step")
    bigger = _plan(tiny_tokens, 1, **{"train.micro_batch": "4", "parallel.zero_stage": "1"})
    assert check_resumable(ckpt, bigger) == 6
    assert "on another layout (zero_stage 0 -> 1, micro_batch 2 -> 4)" in layout_changes(ckpt, bigger)[0]


def test_check_resumable_refuses_another_model_a_damaged_or_an_incomplete_state(tiny_tokens, tmp_path):
    from launcher.state import check_resumable

    plan = _plan(tiny_tokens, 1)
    ckpt = _state_of(plan, tmp_path, 2)
    with pytest.raises(CheckpointError, match=r"another model or data(.|\n)*model: checkpoint"):
        check_resumable(ckpt, _plan(tiny_tokens, 1, **{"model.n_layers": "3"}))
    (ckpt / "trainer.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"is damaged \(trainer.pt has 0 bytes, 1 when written\)"):
        check_resumable(ckpt, plan)
    bare = _state(
        tmp_path, 4, {"trainer.pt": b"t"}, layout=json.loads((ckpt / "meta.json").read_text())["layout"]
    )
    with pytest.raises(CheckpointError, match="is incomplete: no parameter files"):
        check_resumable(bare, plan)
