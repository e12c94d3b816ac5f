"""An owner's router vector (launcher/modular/owners/router.py) and the meta.json entry that holds the vectors
(launcher/router_vectors.py): the mean of the shared trunk's features over the owner's blocks, the same from any
model holding the same shared weights, deterministic; the entry's format and its reader's one-line errors."""

from __future__ import annotations

import pytest
import torch

from launcher.checkpoint import CheckpointError, load_consolidated
from launcher.checkpoint_data import block_inputs, load_blocks
from launcher.modular.owners.router import (
    ROUTER_FORMAT,
    ROUTER_REPRESENTATION,
    router_matrix,
    router_vector,
    router_vectors_meta,
)
from model.batched import shared_trunk_features


@pytest.fixture(scope="module")
def ckpt(random_checkpoint, tmp_path_factory):
    return load_consolidated(random_checkpoint(tmp_path_factory.mktemp("owners") / "demix", "demix"))


def test_router_vector_is_the_mean_first_expert_layer_input(ckpt, tiny_tokens):
    model = ckpt.build_model().eval()
    rec = router_vector(model, tiny_tokens, "gpt2", "cooking", max_blocks=3)
    assert set(rec) == {"vector", "tokens", "representation", "split", "blocks"}
    assert (rec["representation"], rec["split"], rec["blocks"]) == (ROUTER_REPRESENTATION, "train", 3)
    assert rec["tokens"] == 3 * 32 and len(rec["vector"]) == 32
    tokens, _, _ = block_inputs(load_blocks(tiny_tokens, "gpt2", "cooking", "train", 32, 3))
    with torch.no_grad():
        ref = shared_trunk_features(model, tokens).double().mean(dim=(0, 1))
    assert torch.allclose(torch.tensor(rec["vector"], dtype=torch.float64), ref, atol=1e-6)
    # deterministic; the same from an owner's model holding one expert with the same shared weights, and
    # from a model left in training mode (restored afterwards)
    assert router_vector(model, tiny_tokens, "gpt2", "cooking", max_blocks=3) == rec
    owner = ckpt.build_model(expert_ids=[2]).train()
    assert router_vector(owner, tiny_tokens, "gpt2", "cooking", max_blocks=3) == rec and owner.training
    other = router_vector(model, tiny_tokens, "gpt2", "sailing", max_blocks=3)["vector"]
    assert other != rec["vector"]


def test_router_vector_refuses_what_it_cannot_average(ckpt, tiny_tokens):
    model = ckpt.build_model().eval()
    with pytest.raises(ValueError, match="'nosuchdomain' is not in"):
        router_vector(model, tiny_tokens, "gpt2", "nosuchdomain")
    with pytest.raises(ValueError, match="no block of 32"):
        router_vector(model, tiny_tokens, "gpt2", "cooking", split="nosplit")
    with pytest.raises(ValueError, match="beyond the model's context"):
        router_vector(model, tiny_tokens, "gpt2", "cooking", seq_len=64)


def test_meta_entry_round_trip_and_errors():
    recs = {
        d: {"vector": [float(i), 1.0, -2.0], "tokens": 10 * (i + 1), "representation": ROUTER_REPRESENTATION}
        for i, d in enumerate(["a", "b", "c"])
    }
    entry = router_vectors_meta(recs)
    assert entry == {
        "format": ROUTER_FORMAT,
        "representation": ROUTER_REPRESENTATION,
        "vectors": {d: r["vector"] for d, r in recs.items()},
        "tokens": {"a": 10, "b": 20, "c": 30},
    }
    r = router_matrix({"router_vectors": entry, "domains": ["a", "b", "c"]}, ["c", "a"])
    assert r.dtype == torch.float64 and r.tolist() == [[2.0, 1.0, -2.0], [0.0, 1.0, -2.0]]
    assert torch.equal(router_matrix(entry, ["c", "a"], dim=3), r)  # the entry itself is read too
    with pytest.raises(CheckpointError, match=r"experts \['d'\] have no router vector"):
        router_matrix({"router_vectors": entry}, ["a", "d"])
    with pytest.raises(CheckpointError, match="no router vectors"):
        router_matrix({"domains": ["a"]}, ["a"])
    with pytest.raises(CheckpointError, match="format 'demix-router-vectors/9'"):
        router_matrix({"router_vectors": {**entry, "format": "demix-router-vectors/9"}}, ["a"])
    with pytest.raises(CheckpointError, match="representation 'final_hidden_mean'"):
        router_matrix({"router_vectors": {**entry, "representation": "final_hidden_mean"}}, ["a"])
    with pytest.raises(CheckpointError, match="expected 4"):
        router_matrix({"router_vectors": entry}, ["a"], dim=4)
    bad = {**entry, "vectors": {**entry["vectors"], "b": [1.0, float("nan"), 0.0]}}
    with pytest.raises(CheckpointError, match="finite"):
        router_matrix({"router_vectors": bad}, ["a", "b"])
    with pytest.raises(ValueError, match="different lengths"):
        router_vectors_meta({**recs, "d": {"vector": [1.0], "tokens": 1}})
    with pytest.raises(ValueError, match="tokens=0"):
        router_vectors_meta({"a": {"vector": [1.0], "tokens": 0}})
