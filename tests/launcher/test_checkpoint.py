"""launcher/checkpoint.py: the consolidated checkpoint layout on real tensors. A round trip keeps every tensor, the
config, the domains and the step; each shard's sha256 is recorded while writing and equals a fresh hash of the file;
a shard changed afterwards is refused by every read of it (and only by reads of it); the older one-file format
still loads; bad inputs and outputs are refused with the reason."""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from launcher.checkpoint import (
    CONSOLIDATED_FORMAT,
    SHARED_FILE,
    CheckpointError,
    check_checkpoint_out,
    copy_expert_shards,
    expert_shard_name,
    finish_consolidated,
    load_consolidated,
    load_weights_only,
    read_meta,
    save_consolidated,
    save_hashed,
    sharded_experts,
    write_expert_shard,
    write_shared_shard,
)
from launcher.config import RunConfig
from launcher.typed import to_dict
from model.config import FFNConfig, ModelConfig
from model.gpt import GPT, expert_of_key

DOMAINS = ["cooking", "sailing", "finance"]


def _cfg(kind: str = "demix", num_experts: int = 3) -> RunConfig:
    """A 2-layer GPT small enough to save in milliseconds (256-token vocabulary)."""
    model = ModelConfig(
        n_layers=2,
        d_model=16,
        n_heads=2,
        seq_len=8,
        vocab_size=256,
        ffn=FFNConfig(kind=kind, num_experts=num_experts),
    )
    return RunConfig(model=model)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture()
def demix(tmp_path) -> tuple[Path, RunConfig, dict[str, torch.Tensor]]:
    cfg = _cfg()
    state = GPT(cfg.model, init_seed=1).state_dict()
    path = save_consolidated(tmp_path / "ckpt", state, cfg, DOMAINS, step=7, extra={"train_tokens": 123})
    return path, cfg, state


def test_round_trip_keeps_tensors_config_domains_and_step(demix):
    path, cfg, state = demix
    got = load_consolidated(path)
    assert _same(got.state_dict, state)
    assert got.cfg == cfg and got.domains == DOMAINS and got.step == 7 and got.meta["train_tokens"] == 123
    model = got.build_model()
    assert _same(model.state_dict(), state)


def test_layout_one_shard_per_expert_and_the_shared_tensors_in_model_pt(demix):
    path, cfg, state = demix
    # the sha256 side files are gone once meta.json holds the sums
    assert sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()) == [
        "experts/expert_0000.pt",
        "experts/expert_0001.pt",
        "experts/expert_0002.pt",
        "meta.json",
        SHARED_FILE,
    ]
    shared = load_weights_only(path / SHARED_FILE)
    assert shared.keys() == {k for k in state if expert_of_key(k) is None}
    for e in range(3):
        shard = load_weights_only(path / expert_shard_name(e))
        assert shard.keys() == {k for k in state if expert_of_key(k) == e} and shard
    meta = json.loads((path / "meta.json").read_text())
    assert meta["format"] == CONSOLIDATED_FORMAT and meta["step"] == 7 and meta["domains"] == DOMAINS
    assert meta["experts"] == {"0": "cooking", "1": "sailing", "2": "finance"}
    assert meta["shards"] == {
        "shared": SHARED_FILE,
        "experts": {str(e): expert_shard_name(e) for e in range(3)},
    }
    assert meta["config"] == to_dict(cfg)
    assert read_meta(path)["domains"] == DOMAINS


def test_the_recorded_sha256_of_every_shard_is_the_hash_of_its_bytes(demix):
    path, _, _ = demix
    sums = json.loads((path / "meta.json").read_text())["sha256"]
    assert sorted(sums) == [*(expert_shard_name(e) for e in range(3)), SHARED_FILE]
    assert all(sums[rel] == _sha256(path / rel) for rel in sums)


def test_save_hashed_returns_the_sha256_of_what_it_wrote(tmp_path):
    digest = save_hashed({"w": torch.arange(10.0)}, tmp_path / "sub" / "w.pt")
    assert digest == _sha256(tmp_path / "sub" / "w.pt")
    assert torch.equal(load_weights_only(tmp_path / "sub" / "w.pt")["w"], torch.arange(10.0))


def test_a_shard_changed_in_place_is_refused_and_the_others_still_load(demix):
    path, _, state = demix
    shard = path / expert_shard_name(1)
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF  # same size: only the checksum can tell
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match the sha256"):
        load_consolidated(path)
    with pytest.raises(CheckpointError, match="expert_0001.pt"):
        load_consolidated(path, experts=[1])
    partial = load_consolidated(path, experts=[0, 2])  # expert 1's shard is never read
    assert partial.state_dict.keys() == {k for k in state if expert_of_key(k) in (None, 0, 2)}
    assert all(torch.equal(v, state[k]) for k, v in partial.state_dict.items())


def test_loading_some_experts_reads_only_theirs(demix):
    path, cfg, state = demix
    (path / expert_shard_name(2)).write_bytes(b"not a torch file")  # would fail any read
    got = load_consolidated(path, experts=[1])
    assert got.state_dict.keys() == {k for k in state if expert_of_key(k) in (None, 1)}
    model = got.build_model(expert_ids=[1])
    assert _same(model.state_dict(), {k: state[k] for k in model.state_dict()})


def test_dense_and_cse_keep_everything_in_model_pt_gshard_shards_its_experts(tmp_path):
    assert sharded_experts(_cfg("dense", 0)) == 0 and sharded_experts(_cfg("cse", 4)) == 0
    assert sharded_experts(_cfg("demix", 3)) == 3 and sharded_experts(_cfg("gshard", 4)) == 4
    cfg = _cfg("dense", 0)
    state = GPT(cfg.model, init_seed=2).state_dict()
    path = save_consolidated(tmp_path / "dense", state, cfg, DOMAINS)
    assert not (path / "experts").exists()
    meta = json.loads((path / "meta.json").read_text())
    assert meta["shards"]["experts"] == {} and meta["experts"] == {} and list(meta["sha256"]) == [SHARED_FILE]
    assert _same(load_consolidated(path).state_dict, state)


def test_the_one_file_format_still_loads(demix, tmp_path):
    """Format 1: everything in model.pt, no shard index; `experts` filters the experts' tensors out of it."""
    _, cfg, state = demix
    old = tmp_path / "old"
    old.mkdir()
    torch.save(state, old / SHARED_FILE)
    meta = {"format": "demix-consolidated/1", "domains": DOMAINS, "step": 3, "config": to_dict(cfg)}
    (old / "meta.json").write_text(json.dumps(meta))
    got = load_consolidated(old)
    assert _same(got.state_dict, state) and got.step == 3 and got.domains == DOMAINS
    only = load_consolidated(old, experts=[0])
    assert only.state_dict.keys() == {k for k in state if expert_of_key(k) in (None, 0)}


def test_built_shard_by_shard_then_finished(demix, tmp_path):
    """The distributed export's path: each shard written on its own (with its sum beside it), then meta.json;
    a missing shard is named and nothing is published."""
    _, cfg, state = demix
    shared = {k: v for k, v in state.items() if expert_of_key(k) is None}
    tmp = tmp_path / "building"
    write_shared_shard(tmp, shared)
    for e in (0, 1):
        write_expert_shard(tmp, e, {k: v for k, v in state.items() if expert_of_key(k) == e})
    assert (tmp / (SHARED_FILE + ".sha256")).read_text().strip() == _sha256(tmp / SHARED_FILE)
    with pytest.raises(CheckpointError, match=r"missing shards \['experts/expert_0002.pt'\]"):
        finish_consolidated(tmp, tmp_path / "final", cfg, DOMAINS)
    assert not (tmp_path / "final").exists()
    write_expert_shard(tmp, 2, {k: v for k, v in state.items() if expert_of_key(k) == 2})
    final = finish_consolidated(tmp, tmp_path / "final", cfg, DOMAINS, step=5)
    assert not tmp.exists() and not list(final.rglob("*.sha256"))
    got = load_consolidated(final)
    assert _same(got.state_dict, state) and got.step == 5
    sums = json.loads((final / "meta.json").read_text())["sha256"]
    assert all(sums[rel] == _sha256(final / rel) for rel in sums)


def test_copied_expert_shards_are_the_same_bytes(demix, tmp_path):
    path, _, _ = demix
    copy_expert_shards(path, [2, 0], tmp_path / "new")
    for e in (0, 2):
        assert (tmp_path / "new" / expert_shard_name(e)).read_bytes() == (
            path / expert_shard_name(e)
        ).read_bytes()
    assert not (tmp_path / "new" / expert_shard_name(1)).exists()


def test_domain_names_must_match_the_experts_and_nothing_is_written(tmp_path):
    cfg = _cfg()
    state = GPT(cfg.model, init_seed=1).state_dict()
    with pytest.raises(CheckpointError, match="2 domain names for 3 experts"):
        save_consolidated(tmp_path / "x", state, cfg, DOMAINS[:2])
    assert list(tmp_path.iterdir()) == []


def test_build_model_names_the_missing_tensors(demix):
    path, cfg, _ = demix
    got = load_consolidated(path, experts=[0])
    with pytest.raises(CheckpointError, match="lacks .* tensors the model needs"):
        got.build_model()  # all experts asked, one loaded


def test_unreadable_checkpoints_are_refused_with_the_reason(demix, tmp_path):
    path, cfg, _ = demix
    with pytest.raises(CheckpointError, match="is not a consolidated checkpoint"):
        read_meta(tmp_path / "nowhere")
    other = tmp_path / "other"
    shutil.copytree(path, other)
    meta = json.loads((other / "meta.json").read_text())
    (other / "meta.json").write_text(json.dumps({**meta, "format": "demix-consolidated/9"}))
    with pytest.raises(CheckpointError, match="format 'demix-consolidated/9', expected one of"):
        load_consolidated(other)
    (other / "meta.json").write_text(json.dumps({**meta, "domains": ["cooking", 3, "finance"]}))
    with pytest.raises(CheckpointError, match="are not all names"):
        read_meta(other)
    (other / "meta.json").write_text(json.dumps(meta))
    (other / expert_shard_name(1)).unlink()
    with pytest.raises(
        CheckpointError, match="expert shard experts/expert_0001.pt listed in meta.json is missing"
    ):
        load_consolidated(other)


class _OpensAFile:
    """Unpickled without restriction, this calls open(path, "w"): the file appearing would mean code ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class _PlainObject:
    pass


def test_load_weights_only_refuses_what_is_not_weights(tmp_path):
    with pytest.raises(CheckpointError, match="is missing"):
        load_weights_only(tmp_path / "none.pt")
    # A pickle that would create `marker` if unpickled unrestricted (an object whose __reduce__ calls open), and a
    # plain object of this module: neither is weights. (argparse.Namespace is not a good probe: DeepSpeed's import
    # adds it to torch's weights-only allowlist.)
    marker = tmp_path / "executed"
    torch.save({"w": torch.ones(2), "payload": _OpensAFile(str(marker))}, tmp_path / "code.pt")
    torch.save({"args": _PlainObject()}, tmp_path / "object.pt")
    for name in ("code.pt", "object.pt"):
        with pytest.raises(CheckpointError, match="cannot be read as weights .*nothing in it was executed"):
            load_weights_only(tmp_path / name)
    assert not marker.exists()
    (tmp_path / "short.pt").write_bytes(b"PK\x03\x04")
    with pytest.raises(CheckpointError, match="cannot be read as weights"):
        load_weights_only(tmp_path / "short.pt")


def test_check_checkpoint_out(demix, tmp_path):
    path, _, _ = demix
    check_checkpoint_out(tmp_path / "new")  # nothing there: fine, and nothing made
    assert not (tmp_path / "new").exists()
    with pytest.raises(CheckpointError, match="holds a consolidated checkpoint; .* pass --overwrite"):
        check_checkpoint_out(path)
    with pytest.raises(CheckpointError, match="is the input checkpoint"):
        check_checkpoint_out(path, inputs=[path])
    check_checkpoint_out(path, overwrite=True)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match="exists and is not a consolidated checkpoint"):
        check_checkpoint_out(tmp_path / "mine", overwrite=True)


def test_a_changed_config_is_what_loads_back(tmp_path):
    """The config is stored whole (not only the model): a run's data and training settings come back."""
    cfg = _cfg()
    cfg = replace(cfg, data=replace(cfg.data, path="tokens/here", tokenizer="sentencepiece"))
    cfg = replace(cfg, train=replace(cfg.train, steps=11, lr=1e-3))
    path = save_consolidated(tmp_path / "c", GPT(cfg.model, init_seed=0).state_dict(), cfg, DOMAINS)
    got = load_consolidated(path).cfg
    assert got == cfg and (got.data.path, got.train.steps, got.train.lr) == ("tokens/here", 11, 1e-3)
