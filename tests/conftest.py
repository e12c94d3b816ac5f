"""Shared fixtures: a small prepared multi-domain corpus (real tokenizer, real indexed files)."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest

# Three domains with distinct vocabularies, so a DEMix model has something domain-specific to learn.
_WORDS = {
    "cooking": "oven flour butter sugar whisk simmer garlic onion pan bake roast salt pepper dough knead stir".split(),
    "sailing": "hull mast keel tack jib wind harbour anchor bow stern rudder sail knot tide buoy starboard".split(),
    "finance": "bond yield equity market rate loan asset credit debt fund price stock share return cash bank".split(),
}


def write_corpus(
    root: Path, docs_per_domain: int = 60, seed: int = 0, domains: Sequence[str] | None = None
) -> Path:
    """Per-domain JSONL files like the demo corpus builder writes, plus its manifest (`domains`: a subset, e.g. one
    data owner's)."""
    rng = random.Random(seed)
    corpus = root / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    manifest = {
        "format": "test",
        "corpus_dir": str(corpus),
        "domains": {},
        "train_domains": list(domains or _WORDS),
        "novel_domains": [],
    }
    for d, words in _WORDS.items():
        if domains is not None and d not in domains:
            continue
        with open(corpus / f"{d}.jsonl", "w") as f:
            for i in range(docs_per_domain):
                sents = [
                    " ".join(rng.choice(words) for _ in range(rng.randint(6, 14))).capitalize() + "."
                    for _ in range(6)
                ]
                f.write(json.dumps({"id": f"{d}-{i:04d}", "domain": d, "text": " ".join(sents)}) + "\n")
        manifest["domains"][d] = {"split_role": "train"}
    (corpus / "manifest.json").write_text(json.dumps(manifest))
    return corpus


def build_tiny_tokens(root: Path, domains: Sequence[str] | None = None) -> Path:
    """The tiny corpus written and prepared (GPT-2 BPE, indexed) under `root`; returns the tokens root for data.path.
    The `tiny_tokens` fixture, and the golden curves' recorder outside pytest (tests/golden/record.py)."""
    from data.prepare import prepare_corpus

    corpus = write_corpus(root, domains=domains)
    prepare_corpus(
        corpus,
        root / "tokens",
        tokenizer="gpt2",
        workers=1,
        progress=False,
        valid_fraction=0.15,
        test_fraction=0.15,
    )
    return root / "tokens"


@pytest.fixture(scope="session")
def tiny_tokens(tmp_path_factory) -> Path:
    """A prepared (GPT-2 BPE, indexed) 3-domain corpus; returns the tokens root for data.path."""
    return build_tiny_tokens(tmp_path_factory.mktemp("tiny_corpus"))


def random_lm_batch(seed: int, micro_batch: int, seq_len: int, vocab: int) -> dict:
    """A seeded random micro-batch in the trainer's layout (tokens, next-token targets, domain 0 routed to expert 0,
    full loss mask)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=g)
    return {
        "tokens": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "domain_ids": torch.zeros(micro_batch, dtype=torch.long),
        "expert_ids": torch.zeros(micro_batch, dtype=torch.long),
        "loss_mask": torch.ones(micro_batch, seq_len),
    }


def save_random_checkpoint(out: Path, tokens_root: Path, kind: str, seed: int = 3) -> Path:
    """A randomly initialised 2-layer GPT (`kind` dense or demix, one expert per domain of `tiny_tokens`) saved as a
    consolidated checkpoint with the meta the trainer writes (tokenizer fingerprint, bos/eod ids, train_tokens)."""
    from dataclasses import replace

    from data.catalog import tokenizer_fingerprint
    from launcher.checkpoint import save_consolidated
    from launcher.config import RunConfig
    from model.config import FFNConfig, ModelConfig
    from model.gpt import GPT

    tok = json.loads((tokens_root / "gpt2" / "manifest.json").read_text())["tokenizer"]
    domains = list(_WORDS)
    cfg = RunConfig(
        model=ModelConfig(
            n_layers=2,
            d_model=32,
            n_heads=2,
            seq_len=32,
            vocab_size=50257,
            ffn=FFNConfig(kind=kind, num_experts=len(domains) if kind == "demix" else 0),
        )
    )
    cfg = replace(cfg, data=replace(cfg.data, path=str(tokens_root), tokenizer="gpt2"))
    extra = {
        "tokenizer": "gpt2",
        "vocab_size": tok["vocab_size"],
        "tokenizer_sha256": tokenizer_fingerprint(tok),
        "bos_id": tok["bos_id"],
        "eod_id": tok["eod_id"],
        "train_tokens": 12345,
    }
    return save_consolidated(
        out, GPT(cfg.model, init_seed=seed).state_dict(), cfg, domains, step=7, extra=extra
    )


@pytest.fixture(scope="session")
def random_checkpoint(tiny_tokens):
    """`random_checkpoint(out, kind, seed=3)`: `save_random_checkpoint` over the `tiny_tokens` corpus."""
    return lambda out, kind, seed=3: save_random_checkpoint(Path(out), tiny_tokens, kind, seed)


@pytest.fixture(scope="module")
def dense(random_checkpoint, tmp_path_factory) -> Path:
    """A random 2-layer dense checkpoint over `tiny_tokens` (domains cooking, sailing, finance)."""
    return random_checkpoint(tmp_path_factory.mktemp("branch") / "dense", "dense")


@pytest.fixture(scope="module")
def branched(dense, tmp_path_factory) -> Path:
    """`dense` branched into a DEMix checkpoint (launcher/modular/btx/ `branch`): every expert is the dense FFN."""
    from launcher.modular.btx import branch

    out = tmp_path_factory.mktemp("branched") / "demix"
    branch(dense, out)
    return out


def pytest_configure(config):
    """Start the forkserver that multi-rank tests fork their ranks from (tests/harness/multirank.py): it imports torch
    and DeepSpeed once, in the background, while the tests are collected."""
    from tests.harness.multirank import start_rank_server

    start_rank_server()


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA: skipped elsewhere with the reason (run them all with scripts/gpu_checks.sh). The marker
    decides, not `item.keywords`: every test under tests/gpu/ has the package name `gpu` among its keywords."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA GPU (NCCL, CUDA RNG, fp16 on the device): run scripts/gpu_checks.sh there"
    )
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
