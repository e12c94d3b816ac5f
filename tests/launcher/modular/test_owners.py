"""Experts from owners who share no data (launcher/modular/owners/): the anchor fingerprint, the package and its
checks, the merge and its refusals, the opt-out proof. Owners' training runs are simulated here by moving only the
expert's weights (the real runs through the launcher: tests/e2e/test_owners_workflow.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from launcher.checkpoint import CheckpointError, load_consolidated, read_meta, save_consolidated
from launcher.expert_surgery import load_without
from launcher.modular.experts import main as experts_main
from launcher.modular.lineage import inherited_meta
from launcher.modular.owners.fingerprint import (
    anchor_fingerprint,
    first_difference,
    is_shared_key,
    tensor_digest,
)
from launcher.modular.owners.merge import merge
from launcher.modular.owners.package import (
    EXPERT_FILE,
    MANIFEST,
    manifest_digest,
    package_expert,
    read_package,
)
from launcher.modular.owners.train_owner import owner_start
from launcher.modular.owners.verify import verify_opt_out

OWNERS = ["cooking", "sailing", "finance"]


def next_float(t: torch.Tensor) -> torch.Tensor:
    """`t` with its first element moved by one ulp."""
    t = t.clone()
    flat = t.view(-1)
    flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=t.dtype))
    return t


def owner_checkpoint(
    anchor: Path, domain: str, out: Path, data: Path, seed: int, shared_edit: str | None = None
):
    """An owner's trained checkpoint as train-owner's run leaves it: the anchor's start with only the expert moved
    (`shared_edit`: also move that shared tensor by one ulp, as an owner who did not freeze it would)."""
    a = load_consolidated(anchor)
    start = owner_start(a, domain, str(data), "gpt2", None)
    g = torch.Generator().manual_seed(seed)
    state = {
        k: v if is_shared_key(k) else v + 0.02 * torch.randn(v.shape, generator=g)
        for k, v in start.state_dict.items()
    }
    if shared_edit is not None:
        state[shared_edit] = next_float(state[shared_edit])
    extra = {**inherited_meta(start.meta), "train_tokens": 1000 + seed}
    return save_consolidated(out, state, start.cfg, start.domains, 5, extra=extra)


@pytest.fixture(scope="module")
def owners(random_checkpoint, tiny_tokens, tmp_path_factory):
    """A Dense anchor and one package per owner (each over the tiny corpus's own domain)."""
    root = tmp_path_factory.mktemp("owners")
    anchor = random_checkpoint(root / "anchor", "dense")
    pkgs = {}
    for i, d in enumerate(OWNERS):
        ckpt = owner_checkpoint(anchor, d, root / f"owner-{d}", tiny_tokens, seed=i)
        package_expert(
            ckpt, d, root / f"pkg-{d}", anchor=anchor, dev_blocks=2, router_blocks=2, tags={"contact": d}
        )
        pkgs[d] = root / f"pkg-{d}"
    return root, anchor, pkgs


def test_fingerprint_is_bit_exact():
    t = torch.randn(4, 3)
    assert tensor_digest(t) == tensor_digest(t.clone())
    assert tensor_digest(next_float(t)) != tensor_digest(t)
    assert tensor_digest(t.reshape(3, 4)) != tensor_digest(t)  # the shape counts
    bf = t.to(torch.bfloat16)
    assert tensor_digest(bf) != tensor_digest(bf.view(torch.float16))  # the dtype counts (same bytes)
    state = {
        "wte.weight": t,
        "blocks.0.ffn.mlp.fc.weight": torch.ones(2),
        "blocks.0.ln1.weight": torch.ones(3),
    }
    fp = anchor_fingerprint(state)
    assert set(fp["tensors"]) == {"wte.weight", "blocks.0.ln1.weight"}  # the FFN is not shared
    assert (
        first_difference(anchor_fingerprint({**state, "blocks.0.ffn.mlp.fc.weight": torch.zeros(2)}), fp)
        is None
    )
    moved = anchor_fingerprint({**state, "blocks.0.ln1.weight": next_float(torch.ones(3))})
    assert first_difference(moved, fp) == "shared tensor blocks.0.ln1.weight differs"


def test_package_manifest(owners):
    _, anchor, pkgs = owners
    p = read_package(pkgs["sailing"])
    m = p.manifest
    assert m["domain"] == "sailing" and m["tags"] == {"contact": "sailing"}
    assert m["anchor"]["sha256"] == anchor_fingerprint(load_consolidated(anchor).state_dict)["sha256"]
    assert m["tokenizer"]["sha256"] == read_meta(anchor)["tokenizer_sha256"]
    assert m["training"]["tokens"] == 1001 and m["training"]["steps"] == 5
    assert m["dev"]["perplexity"] > 1 and m["dev"]["blocks"] == 2
    assert len(m["router"]["vector"]) == 32
    assert all(k.startswith("blocks.") and ".ffn.expert." in k for k in p.tensors)


def test_package_refuses_shared_change(owners, tiny_tokens, tmp_path):
    _, anchor, _ = owners
    ckpt = owner_checkpoint(
        anchor, "cooking", tmp_path / "c", tiny_tokens, 0, shared_edit="blocks.1.attn.proj.weight"
    )
    with pytest.raises(CheckpointError, match=r"shared tensor blocks\.1\.attn\.proj\.weight differs"):
        package_expert(ckpt, "cooking", tmp_path / "pkg", anchor=anchor)
    assert not (tmp_path / "pkg").exists()


def test_edited_manifest_and_damaged_shard_refused(owners, tmp_path):
    _, _, pkgs = owners
    edited = tmp_path / "edited"
    shutil.copytree(pkgs["cooking"], edited)
    m = json.loads((edited / MANIFEST).read_text())
    m["training"]["tokens"] *= 10  # an owner claims more data
    (edited / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="was edited after packaging"):
        read_package(edited)
    damaged = tmp_path / "damaged"
    shutil.copytree(pkgs["cooking"], damaged)
    raw = bytearray((damaged / EXPERT_FILE).read_bytes())
    raw[len(raw) // 2] ^= 1
    (damaged / EXPERT_FILE).write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="does not match the sha256 its manifest recorded"):
        read_package(damaged)
    read_package(pkgs["cooking"])  # the control: the untouched package reads


def test_merge_is_bit_exact(owners, tmp_path):
    _, anchor, pkgs = owners
    rec = merge(anchor, [pkgs[d] for d in OWNERS], tmp_path / "merged")
    assert rec["domains"] == OWNERS and rec["router_vectors"]
    c = load_consolidated(tmp_path / "merged")
    a = load_consolidated(anchor)
    for k, v in c.state_dict.items():
        if is_shared_key(k):
            assert torch.equal(v, a.state_dict[k]), k
    for j, d in enumerate(OWNERS):
        want = read_package(pkgs[d]).as_expert(j)
        have = {k: v for k, v in c.state_dict.items() if f".ffn.experts.{j}." in k}
        assert want.keys() == have.keys()
        assert all(torch.equal(have[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)
    assert c.cfg.model.ffn.kind == "demix" and c.cfg.model.ffn.num_experts == 3
    assert c.meta["merge"]["anchor"]["fingerprint"]["sha256"] == anchor_fingerprint(a.state_dict)["sha256"]
    c.build_model()  # a model every tool builds


def test_merge_refuses_other_anchor(owners, random_checkpoint, tiny_tokens, tmp_path):
    """One flipped bit in one shared tensor of the anchor a package was trained from: refused, naming it."""
    _, anchor, pkgs = owners
    a = load_consolidated(anchor)
    key = "blocks.0.ln1.weight"
    other = save_consolidated(
        tmp_path / "other-anchor",
        {**a.state_dict, key: next_float(a.state_dict[key])},
        a.cfg,
        a.domains,
        a.step,
        extra=inherited_meta(a.meta),
    )
    ckpt = owner_checkpoint(other, "finance", tmp_path / "o", tiny_tokens, 9)
    package_expert(ckpt, "finance", tmp_path / "pkg-other", anchor=other, dev_blocks=1, router_blocks=1)
    with pytest.raises(CheckpointError, match=rf"trained from another anchor .*shared tensor {key} differs"):
        merge(anchor, [pkgs["cooking"], tmp_path / "pkg-other"], tmp_path / "merged")
    assert not (tmp_path / "merged").exists()
    merge(anchor, [pkgs["cooking"], pkgs["finance"]], tmp_path / "control")  # the control merges


def test_merge_refusals(owners, tmp_path, capsys):
    root, anchor, pkgs = owners
    with pytest.raises(CheckpointError, match="both for 'cooking'"):
        merge(anchor, [pkgs["cooking"], pkgs["cooking"]], tmp_path / "m")
    # another tokenizer: an honest package (its manifest sealed again) of an owner whose tokenizer differs
    shutil.copytree(pkgs["sailing"], tmp_path / "pkg-tok")
    m = json.loads((tmp_path / "pkg-tok" / MANIFEST).read_text())
    m["tokenizer"]["sha256"] = "0" * 64
    m["manifest_sha256"] = manifest_digest(m)
    (tmp_path / "pkg-tok" / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="another tokenizer"):
        merge(anchor, [tmp_path / "pkg-tok"], tmp_path / "m")
    # through the command line: one error line, status 2, nothing written
    assert (
        experts_main(
            ["merge", str(anchor), str(pkgs["sailing"]), str(pkgs["sailing"]), "--out", str(tmp_path / "m")]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "one expert per domain" in err[0]
    assert not (tmp_path / "m").exists()


def test_opt_out_proof(owners, tmp_path, capsys):
    _, anchor, pkgs = owners
    merged = tmp_path / "merged"
    merge(anchor, [pkgs[d] for d in OWNERS], merged)
    audit_path = tmp_path / "audit.json"
    assert experts_main(["verify", str(merged), "--without", "sailing", "--out", str(audit_path)]) == 0
    audit = json.loads(audit_path.read_text())
    assert audit["passed"] and audit["removed"] == ["sailing"] and audit["kept"] == ["cooking", "finance"]
    assert audit["checks"]["equal_to_merge_without"] and audit["checks"]["shared_equal_anchor"]
    assert (
        audit["removed_packages"][0]["manifest_sha256"]
        == read_package(pkgs["sailing"]).manifest["manifest_sha256"]
    )
    # the same equality by hand: the opt-out load against a merge built without the package
    merge(anchor, [pkgs["cooking"], pkgs["finance"]], tmp_path / "without")
    a, b = load_without(merged, ["sailing"]), load_consolidated(tmp_path / "without")
    assert a.domains == b.domains and a.state_dict.keys() == b.state_dict.keys()
    assert all(torch.equal(a.state_dict[k], b.state_dict[k]) for k in a.state_dict)
    assert "bit for bit" in capsys.readouterr().out


def test_opt_out_proof_fails_on_a_tampered_merge(owners, tmp_path):
    """The control: a merged checkpoint whose kept expert was changed after the merge fails the proof, naming it."""
    _, anchor, pkgs = owners
    merge(anchor, [pkgs[d] for d in OWNERS], tmp_path / "merged")
    c = load_consolidated(tmp_path / "merged")
    key = next(k for k in c.state_dict if ".ffn.experts.0." in k)
    c.state_dict[key] = next_float(c.state_dict[key])
    save_consolidated(
        tmp_path / "tampered", c.state_dict, c.cfg, c.domains, c.step, extra=inherited_meta(c.meta)
    )
    audit = verify_opt_out(tmp_path / "tampered", ["sailing"])
    assert not audit["passed"] and audit["checks"]["tensors_differing"] == [f"{key}: differs"]
    shared = next(k for k in c.state_dict if is_shared_key(k))
    c.state_dict[key] = load_consolidated(tmp_path / "merged").state_dict[key]
    c.state_dict[shared] = next_float(c.state_dict[shared])
    save_consolidated(
        tmp_path / "tampered2", c.state_dict, c.cfg, c.domains, c.step, extra=inherited_meta(c.meta)
    )
    audit = verify_opt_out(tmp_path / "tampered2", ["sailing"])
    assert not audit["passed"] and not audit["checks"]["shared_equal_anchor"]


@pytest.mark.long  # the export's logit check over a 50k vocabulary: kept out of make test's time
def test_merged_checkpoint_feeds_btx_and_hf_export(owners, tmp_path):
    """The merge is a DEMix checkpoint like any other: BTX upcycles it, the Hugging Face export writes one owner's
    expert (the remaining tools: tests/e2e/test_owners_workflow.py)."""
    pytest.importorskip(
        "transformers", reason="the Hugging Face export needs transformers (the harness extra)"
    )
    from launcher.modular.btx import upcycle
    from launcher.modular.hf_export.folder import export

    _, anchor, pkgs = owners
    merge(anchor, [pkgs[d] for d in OWNERS], tmp_path / "merged")
    upcycle(tmp_path / "merged", tmp_path / "btx", router_init="zero")
    assert load_consolidated(tmp_path / "btx").cfg.model.ffn.kind == "gshard"
    rec = export(tmp_path / "merged", tmp_path / "hf", domain="sailing")
    assert (tmp_path / "hf" / "config.json").is_file() and rec["domain"] == "sailing"
