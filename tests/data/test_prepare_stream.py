"""data.prepare at scale, on a small corpus cut into many chunks: hash splits, shards + merge equal to one process,
a run killed mid-domain resumed to identical files, problems with file-absolute line numbers, token counts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import data.prepare as prepare_module
from data.blocks import SPLITS, open_indexed
from data.chunks import hash_split, plan_chunks
from data.ingest import CorpusError
from data.prepare import prepare_corpus, split_texts
from data.tokenizer import load_tokenizer

CHUNK = 6000  # bytes: the big domains have 10+ chunks, "small" has one (split exactly)
ROOT = Path(__file__).resolve().parents[2]


def _text(domain: str, i: int) -> str:
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
    body = " ".join(words[(i * 7 + k * 3) % len(words)] for k in range(20 + i % 37))
    return f"{domain} document {i}: {body}. Contact jane.doe@example.org or (555) 123-4567."


@pytest.fixture
def corpus(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    for domain, n in (("news", 260), ("code", 240), ("small", 12)):
        lines = [
            json.dumps({"id": f"{domain}-{i}", "domain": domain, "text": _text(domain, i)}) for i in range(n)
        ]
        if domain == "news":
            lines.insert(150, '{"id": "broken", "text": ')  # line 151, in a later chunk
            lines.insert(40, "")  # blank: counts as a line, not a problem
        if domain == "code":
            lines = [json.loads(x) for x in lines]
            # no ids: split by byte offset
            lines = [json.dumps({"domain": "code", "text": r["text"]}) for r in lines]
        (d / f"{domain}.jsonl").write_text("\n".join(lines) + "\n")
    return d


def _files(tok_dir: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(tok_dir)): p.read_bytes()
        for p in sorted(tok_dir.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }


def _prepare(corpus, out, **kw):
    kw.setdefault("workers", 1)
    return prepare_corpus(
        corpus,
        out,
        chunk_bytes=CHUNK,
        seed=5,
        valid_fraction=0.1,
        test_fraction=0.1,
        anonymise={"code": False},
        progress=False,
        **kw,
    )


def _same_manifest(a: dict, b: dict) -> None:
    for key in (
        "counts",
        "token_counts",
        "anonymise",
        "problems",
        "split",
        "inputs_sha256",
        "plan_key",
        "tokenizer",
    ):
        assert a[key] == b[key], key


def test_many_chunks_hash_split_and_absolute_problem_lines(corpus, tmp_path):
    chunks = plan_chunks({d: corpus / f"{d}.jsonl" for d in ("news", "code", "small")}, CHUNK)
    assert sum(c.domain == "news" for c in chunks) >= 10 and [
        c.exact for c in chunks if c.domain == "small"
    ] == [True]
    r = _prepare(corpus, tmp_path / "tokens")
    m = r.manifest
    assert m["problems"]["counts"] == {"invalid_json": 1}
    # blank line 41 counted
    assert m["problems"]["first"][0].startswith(f"{corpus / 'news.jsonl'}:152: invalid_json")
    tok = load_tokenizer("gpt2")
    tok_dir = tmp_path / "tokens" / "gpt2"
    files = {d: corpus / f"{d}.jsonl" for d in m["domains"]}
    for code, split in enumerate(SPLITS):
        want = split_texts(files, m["split"], code, m["anonymise"]["policy"])
        for d in m["domains"]:
            info = m["counts"][d][split]
            # kept open while its arrays live
            ds = open_indexed(tok_dir / d / split) if info["documents"] else []
            got = [tok.decode(ds[i][1:].tolist()) for i in range(len(ds))]
            assert got == want[d], (d, split)
    # the news split is the hash of (seed, domain, id): each document's own, independent of chunks
    ids = [f"news-{i}" for i in range(260)]
    codes = hash_split(ids, "news", 5, 0.1, 0.1)
    assert m["counts"]["news"]["test"]["documents"] == int((codes == 2).sum()) > 0
    assert m["counts"]["news"]["valid"]["documents"] == int((codes == 1).sum()) > 0
    assert "<EMAIL>" in want["news"][0] and "jane.doe@example.org" in want["code"][0]
    # token counts: the occurrences of every id in each split's .bin
    counts = np.load(tok_dir / m["token_counts"]["news"])
    for code, split in enumerate(SPLITS):
        tokens = np.fromfile(tok_dir / "news" / f"{split}.bin", dtype=np.uint16)
        assert (counts[code][: tok.vocab_size] == np.bincount(tokens, minlength=tok.vocab_size)).all()
    assert not (tmp_path / "tokens" / "gpt2.parts").exists()


def test_shards_then_merge_equal_one_process(corpus, tmp_path, monkeypatch):
    one = _prepare(corpus, tmp_path / "one").manifest
    for i in range(3):
        r = _prepare(corpus, tmp_path / "sharded", num_shards=3, shard_index=i)
        assert not r.merged and not (tmp_path / "sharded" / "gpt2").exists()
    merged = _prepare(corpus, tmp_path / "sharded", merge=True).manifest
    _same_manifest(one, merged)
    assert _files(tmp_path / "one" / "gpt2") == _files(tmp_path / "sharded" / "gpt2")
    monkeypatch.setattr(prepare_module, "PROCESS_MIN_BYTES", 0)
    procs = _prepare(corpus, tmp_path / "procs", workers=2)
    assert procs.stats["encoder"] == "chunk processes"
    _same_manifest(one, procs.manifest)
    assert _files(tmp_path / "one" / "gpt2") == _files(tmp_path / "procs" / "gpt2")


def test_merge_refuses_missing_chunks_and_writes_nothing(corpus, tmp_path):
    _prepare(corpus, tmp_path / "tokens", num_shards=2, shard_index=0)
    with pytest.raises(ValueError, match=r"chunk\(s\) not prepared yet \(code/00001, code/00003"):
        _prepare(corpus, tmp_path / "tokens", merge=True)
    assert not (tmp_path / "tokens" / "gpt2").exists()
    r = _prepare(corpus, tmp_path / "tokens")  # a plain run prepares what is missing and merges
    assert r.merged and (tmp_path / "tokens" / "gpt2" / "manifest.json").is_file()


KILLER = """
import os, signal, sys
import data.chunks as chunks
chunks.BATCH_CHARS = 800  # several batches per chunk: the kill lands inside one, with its parts half written
calls = [0]
encode = chunks.encode_concat
def dying(*a, **k):
    calls[0] += 1
    if calls[0] == int(sys.argv[3]):
        os.kill(os.getpid(), signal.SIGKILL)
    return encode(*a, **k)
chunks.encode_concat = dying
from data.prepare import prepare_corpus
prepare_corpus(sys.argv[1], sys.argv[2], workers=1, chunk_bytes=NNN, seed=5, valid_fraction=0.1, test_fraction=0.1,
               anonymise={"code": False}, progress=False)
""".replace("NNN", str(CHUNK))


def test_killed_mid_domain_resumes_to_identical_files(corpus, tmp_path, capsys):
    reference = _prepare(corpus, tmp_path / "reference").manifest
    out = tmp_path / "tokens"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [sys.executable, "-c", KILLER, str(corpus), str(out), "40"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == -9, p.stderr[-2000:]
    parts = out / "gpt2.parts"
    done = sorted(parts.glob("*/*.json"))
    assert 3 <= len(done) < 24 and list(parts.glob("*/*.tmp")), "killed mid-run, inside a chunk"
    assert not (out / "gpt2").exists()
    r = prepare_corpus(
        corpus,
        out,
        workers=1,
        chunk_bytes=CHUNK,
        seed=5,
        valid_fraction=0.1,
        test_fraction=0.1,
        anonymise={"code": False},
        progress=True,
    )
    assert f"resuming: {len(done)} of " in capsys.readouterr().out
    _same_manifest(reference, r.manifest)
    assert r.manifest["stats"]["chunks"] == sum(
        1 for _ in plan_chunks({d: corpus / f"{d}.jsonl" for d in r.manifest["domains"]}, CHUNK)
    ) - len(done)
    assert _files(tmp_path / "reference" / "gpt2") == _files(out / "gpt2")
    assert not parts.exists()


def test_a_chunk_with_a_damaged_part_is_redone(corpus, tmp_path):
    out = tmp_path / "tokens"
    _prepare(corpus, out, num_shards=2, shard_index=0)
    finished = len(list((out / "gpt2.parts").glob("*/*.json")))
    part = out / "gpt2.parts" / "code" / "00000.train.bin"
    part.write_bytes(part.read_bytes()[:-2])  # a record whose part no longer has its size: not finished
    r = _prepare(corpus, out)
    total = len(plan_chunks({d: corpus / f"{d}.jsonl" for d in r.manifest["domains"]}, CHUNK))
    assert r.manifest["stats"]["chunks"] == total - finished + 1
    reference = _prepare(corpus, tmp_path / "reference").manifest
    _same_manifest(reference, r.manifest)


def test_fail_mode_reports_absolute_lines_and_writes_nothing(corpus, tmp_path):
    with pytest.raises(CorpusError, match=r"news\.jsonl:152: invalid_json"):
        _prepare(corpus, tmp_path / "tokens", on_error="fail")
    assert not (tmp_path / "tokens").exists()


def test_changed_corpus_starts_over(corpus, tmp_path):
    out = tmp_path / "tokens"
    _prepare(corpus, out, num_shards=2, shard_index=0)
    with open(corpus / "small.jsonl", "a") as f:
        f.write(json.dumps({"id": "small-new", "domain": "small", "text": "one more document"}) + "\n")
    r = _prepare(corpus, out)
    assert sum(r.manifest["counts"]["small"][s]["documents"] for s in SPLITS) == 13
    reference = _prepare(corpus, tmp_path / "reference").manifest
    _same_manifest(reference, {**r.manifest, "plan_key": reference["plan_key"]})
    assert _files(tmp_path / "reference" / "gpt2") == _files(out / "gpt2")


def test_a_worker_stops_when_its_prepare_process_is_gone(corpus, tmp_path):
    """A SIGKILLed prepare leaves no worker encoding on: each checks its owner before every batch."""
    from data.chunks import ChunkJob, prepare_chunk
    from data.tokenizer import TokenizerSpec

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no longer runs
    chunk = plan_chunks({"news": corpus / "news.jsonl"}, CHUNK)[0]
    parts = tmp_path / "parts"
    job = ChunkJob(
        str(parts), TokenizerSpec("gpt2"), "uint16", 50257, 5, 0.1, 0.1, False, 20, "key", gone.pid
    )
    with pytest.raises(SystemExit, match="is gone"):
        prepare_chunk(chunk, job)
    assert (
        not list(parts.rglob("*.json")) and not list(parts.rglob("*.tmp")) and not list(parts.rglob("*.bin"))
    )
    record = prepare_chunk(chunk, ChunkJob(**{**job.__dict__, "owner_pid": os.getpid()}))  # the control
    assert record["splits"] and list(parts.rglob("*.json"))
