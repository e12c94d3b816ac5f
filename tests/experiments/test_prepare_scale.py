"""experiments/prepare_scale.py: the corpus generator (deterministic, valid 8-domain JSONL, cached with a marker)
and the tiktoken baseline loop, on a tiny corpus. The prepare matrix itself is not run here."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import pytest

from experiments import prepare_scale as ps

SIZE = 400_000
POOL = 60_000  # text per source group: small, so that reading the sources stays quick


@pytest.fixture(scope="module")
def pools():
    pools = ps.load_pools(POOL)
    if not any(pools.values()):
        pytest.skip("no local text under /usr/share/doc, /usr/share/common-licenses or /usr/share/man")
    return pools


def _files(corpus: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(corpus.glob("*.jsonl"))}


def test_parse_size():
    assert ps.parse_size("200MB") == 200_000_000
    assert ps.parse_size("1.6GB") == 1_600_000_000
    assert ps.parse_size("2mb") == 2_000_000
    with pytest.raises(argparse.ArgumentTypeError):
        ps.parse_size("lots")


def test_strip_roff():
    text = ".TH LS 1\n.SH NAME\nls \\- list \\fBdirectory\\fR contents\\(em \\f[I]fast\\f[]\n.PP\nSecond one."
    assert ps.strip_roff(text).split("\n") == [
        "",
        "",
        "ls - list directory contents-- fast",
        "",
        "Second one.",
    ]


def test_generator_deterministic_valid_and_cached(tmp_path, pools):
    a = ps.generate_corpus(tmp_path / "a", SIZE, seed=3, pool_bytes=POOL, pools=pools)
    b = ps.generate_corpus(tmp_path / "b", SIZE, seed=3, pool_bytes=POOL, pools=pools)
    assert not a["reused"] and not b["reused"]
    assert ps.pools_sha256(ps.load_pools(POOL)) == a["pool_sha256"]  # the sources are read the same way again
    fa, fb = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert fa == fb and sorted(fa) == sorted(f"{d}.jsonl" for d in ps.DOMAINS) and len(ps.DOMAINS) == 8
    ps.generate_corpus(tmp_path / "c", SIZE, seed=4, pool_bytes=POOL, pools=pools)
    assert _files(tmp_path / "c") != fa  # another seed, another corpus

    total = 0
    for domain in ps.DOMAINS:
        data = fa[f"{domain}.jsonl"]
        assert data.endswith(b"\n")
        docs = [json.loads(line) for line in data.decode("utf-8").split("\n")[:-1]]  # not splitlines: U+2028
        assert docs and all(set(d) == {"id", "domain", "text"} for d in docs)
        assert [d["id"] for d in docs] == [f"{domain}-{i}" for i in range(len(docs))]
        assert {d["domain"] for d in docs} == {domain} and all(d["text"].strip() for d in docs)
        info = a["files"][domain]
        assert info == {
            "bytes": len(data),
            "documents": len(docs),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        assert len(data) >= SIZE // 8
        total += len(data)

    marker = json.loads((tmp_path / "a" / ps.MARKER).read_text())
    assert marker["size_bytes"] == SIZE and marker["seed"] == 3 and marker["total_bytes"] == total
    assert marker["files"] == a["files"]
    again = ps.generate_corpus(tmp_path / "a", SIZE, seed=3, pool_bytes=POOL, pools=pools, verify=True)
    assert again["reused"] and _files(tmp_path / "a") == fa
    # a file whose size no longer matches its marker is not reused: the corpus is written again, the same bytes
    (tmp_path / "a" / "docs.jsonl").write_bytes(b"{}\n")
    redone = ps.generate_corpus(tmp_path / "a", SIZE, seed=3, pool_bytes=POOL, pools=pools)
    assert not redone["reused"] and _files(tmp_path / "a") == fa
    assert not list((tmp_path / "a").glob(".*.tmp"))


def test_baseline_counts_the_same_tokens(tmp_path, pools):
    from data.tokenizer import load_tokenizer

    corpus = tmp_path / "corpus"
    ps.generate_corpus(corpus, SIZE, seed=1, pool_bytes=POOL, pools=pools)
    enc = load_tokenizer("gpt2")._enc
    texts = [
        json.loads(line)["text"]
        for d in ps.DOMAINS
        for line in (corpus / f"{d}.jsonl").read_bytes().split(b"\n")
        if line
    ]
    r = ps.tiktoken_loop(corpus)
    assert r["documents"] == len(texts)
    assert r["tokens"] == sum(len(enc.encode_ordinary(t)) for t in texts) > 0
