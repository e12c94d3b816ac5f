"""Shared fixtures: a small prepared multi-domain corpus (real tokenizer, real indexed files)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

# Three domains with distinct vocabularies, so a DEMix model has something domain-specific to learn.
_WORDS = {
    "cooking": "oven flour butter sugar whisk simmer garlic onion pan bake roast salt pepper dough knead stir".split(),
    "sailing": "hull mast keel tack jib wind harbour anchor bow stern rudder sail knot tide buoy starboard".split(),
    "finance": "bond yield equity market rate loan asset credit debt fund price stock share return cash bank".split(),
}


def write_corpus(root: Path, docs_per_domain: int = 60, seed: int = 0) -> Path:
    """Per-domain JSONL files like the demo corpus builder writes, plus its manifest."""
    rng = random.Random(seed)
    corpus = root / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    manifest = {"format": "test", "corpus_dir": str(corpus), "domains": {}, "train_domains": list(_WORDS), "novel_domains": []}
    for d, words in _WORDS.items():
        with open(corpus / f"{d}.jsonl", "w") as f:
            for i in range(docs_per_domain):
                sents = [" ".join(rng.choice(words) for _ in range(rng.randint(6, 14))).capitalize() + "." for _ in range(6)]
                f.write(json.dumps({"id": f"{d}-{i:04d}", "domain": d, "text": " ".join(sents)}) + "\n")
        manifest["domains"][d] = {"split_role": "train"}
    (corpus / "manifest.json").write_text(json.dumps(manifest))
    return corpus


@pytest.fixture(scope="session")
def tiny_tokens(tmp_path_factory) -> Path:
    """A prepared (GPT-2 BPE, indexed) 3-domain corpus; returns the tokens root for data.path."""
    from data.prepare import prepare_corpus

    root = tmp_path_factory.mktemp("tiny_corpus")
    corpus = write_corpus(root)
    prepare_corpus(corpus, root / "tokens", tokenizer="gpt2", workers=1, progress=False, valid_fraction=0.15, test_fraction=0.15)
    return root / "tokens"


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA: skipped elsewhere with the reason (run them all with scripts/gpu_checks.sh)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (NCCL, CUDA RNG, fp16 on the device): run scripts/gpu_checks.sh there")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
