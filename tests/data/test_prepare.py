"""prepare_corpus on a small real-looking multi-domain corpus: layout, manifest, exact decode, idempotence."""

import json
import os

import numpy as np
import pytest

from data.anonymise import anonymise
from data.blocks import SPLITS, BlockDataset, open_indexed
from data.ingest import CorpusError
from data.prepare import main, prepare_corpus, split_documents
from data.tokenizer import load_prepared_tokenizer

NEWS = [
    "The city council voted 7-2 on Tuesday to approve a $1.2 million budget for road repairs, officials said.",
    "Shares of the carmaker fell 4.5% after the company warned that supply shortages would hit 2021 deliveries.",
    "Readers can reach the newsroom at tips@examplenews.com or call (555) 123-4567 with information.",
    "Heavy rain is expected across the region through Friday, with flood warnings issued for low-lying areas.",
    "The minister said the new rules, effective 2022-01-01, would cut paperwork for small businesses.",
]
CODE = [
    'def mean(xs):\n\t"""Average of a list."""\n\treturn sum(xs) / len(xs)\n',
    "class Stack:\n    def __init__(self):\n        self._items = []\n\n"
    "    def push(self, x):\n        self._items.append(x)\n",
    "@property\ndef name(self):\n    # contact: dev@example.org\n    return self._name  \n",
    "for i in range(10):\n    if i % 2:\n        print(i, end=' ')\n",
]
LEGAL = [
    "Permission is hereby granted, free of charge, to any person obtaining a copy of this software.",
    'THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED.',
    "Redistributions of source code must retain the above copyright notice, this list of conditions.",
]


def _docs(base, n):
    return [
        f"{base[i % len(base)]}\n\nParagraph {i}: " + " ".join(base[(i + k) % len(base)] for k in range(1, 4))
        for i in range(n)
    ]


@pytest.fixture
def corpus(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    docs = {"news": _docs(NEWS, 14), "code": _docs(CODE, 12), "legal": _docs(LEGAL, 9)}
    for name, texts in docs.items():
        lines = [json.dumps({"id": f"{name}-{i}", "domain": name, "text": t}) for i, t in enumerate(texts)]
        if name == "news":
            lines.insert(3, '{"id": "broken", "domain": "news", "text": ')  # a bad line, reported and skipped
        (d / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    (d / "manifest.json").write_text(json.dumps({"sources": {"news": "synthetic"}}))
    return d, docs


def _decoded_split(tok_dir, tok, domain, split):
    ds = open_indexed(tok_dir / domain / split)
    out = []
    for i in range(len(ds)):
        ids = ds[i]
        assert ids[0] == tok.bos_id and ids.dtype == np.uint16
        out.append(tok.decode(ids[1:].tolist()))
    return out


def test_prepare_gpt2_layout_exact_decode_and_idempotence(corpus, tmp_path, capsys):
    corpus_dir, docs = corpus
    out = tmp_path / "tokens"
    policy = {"code": False}
    r = prepare_corpus(
        corpus_dir,
        out,
        tokenizer="gpt2",
        workers=2,
        seed=3,
        valid_fraction=0.1,
        test_fraction=0.1,
        anonymise=policy,
    )
    assert not r.skipped
    printed = capsys.readouterr().out
    assert "tokens/s" in printed and "MB/s" in printed and "news" in printed
    tok_dir = out / "gpt2"
    m = json.loads((tok_dir / "manifest.json").read_text())
    assert (
        m["tokenizer"]["name"] == "gpt2" and m["tokenizer"]["vocab_size"] == 50257 and m["dtype"] == "uint16"
    )
    assert m["domains"] == ["code", "legal", "news"] and m["split"]["seed"] == 3
    assert m["corpus"]["manifest_sha256"] and set(m["corpus"]["files"]) == {
        "code.jsonl",
        "legal.jsonl",
        "news.jsonl",
    }
    assert (
        m["problems"]["counts"] == {"invalid_json": 1}
        and "news.jsonl:4: invalid_json" in m["problems"]["first"][0]
    )
    assert m["anonymise"]["policy"] == {"code": False, "legal": True, "news": True}
    assert m["anonymise"]["counts"]["news"]["EMAIL"] > 0 and "code" not in m["anonymise"]["counts"]
    tok = load_prepared_tokenizer(out, "gpt2")
    for domain, texts in docs.items():
        expected = [anonymise(t).text if policy.get(domain, True) else t for t in texts]
        split = split_documents(len(texts), domain, 3, 0.1, 0.1)
        assert sum(m["counts"][domain][s]["documents"] for s in SPLITS) == len(texts)  # nothing valid lost
        for code, s in enumerate(SPLITS):
            want = [t for t, c in zip(expected, split) if c == code]
            assert len(want) >= 1
            assert _decoded_split(tok_dir, tok, domain, s) == want
            assert m["counts"][domain][s]["tokens"] == sum(len(tok.encode(t)) + 1 for t in want)
    # code left as is
    assert any(
        "@" in t
        for t in _decoded_split(tok_dir, tok, "code", "train")
        + _decoded_split(tok_dir, tok, "code", "valid")
        + _decoded_split(tok_dir, tok, "code", "test")
    )
    blocks = BlockDataset.from_prepared(out, "gpt2", "news", "train", seq_len=32)
    raw = open_indexed(tok_dir / "news" / "train")  # keep it alive: its arrays are views into its mmap
    stream = np.concatenate([raw[i] for i in range(blocks.num_documents)])
    assert len(blocks) == (len(stream) - 1) // 32 and blocks[1].tolist() == stream[32:65].tolist()

    mtime = os.stat(tok_dir / "news" / "train.bin").st_mtime_ns
    again = prepare_corpus(
        corpus_dir,
        out,
        tokenizer="gpt2",
        workers=2,
        seed=3,
        valid_fraction=0.1,
        test_fraction=0.1,
        anonymise=policy,
    )
    assert again.skipped and os.stat(tok_dir / "news" / "train.bin").st_mtime_ns == mtime
    assert (
        main(
            [
                "--corpus",
                str(corpus_dir),
                "--out",
                str(out),
                "--seed",
                "3",
                "--valid-fraction",
                "0.1",
                "--test-fraction",
                "0.1",
                "--anonymise",
                "--anonymise-off",
                "code",
                "--quiet",
            ]
        )
        == 0
    )
    # the CLI saw the same inputs: skipped
    assert os.stat(tok_dir / "news" / "train.bin").st_mtime_ns == mtime
    with open(corpus_dir / "legal.jsonl", "a") as f:
        f.write(json.dumps({"id": "new", "domain": "legal", "text": "A new licence clause."}) + "\n")
    changed = prepare_corpus(
        corpus_dir,
        out,
        tokenizer="gpt2",
        workers=1,
        seed=3,
        valid_fraction=0.1,
        test_fraction=0.1,
        anonymise=policy,
        progress=False,
    )
    assert (
        not changed.skipped and sum(changed.manifest["counts"]["legal"][s]["documents"] for s in SPLITS) == 10
    )


def test_prepare_sentencepiece_keeps_code_exact(corpus, tmp_path):
    corpus_dir, docs = corpus
    out = tmp_path / "tokens"
    r = prepare_corpus(
        corpus_dir,
        out,
        tokenizer="sentencepiece",
        workers=1,
        seed=5,
        valid_fraction=0.0,
        test_fraction=0.0,
        anonymise=False,
        sp_vocab_size=600,
        domains=["code", "legal"],
        progress=False,
    )
    m = r.manifest
    assert (out / "sentencepiece" / "tokenizer.model").is_file() and m["tokenizer"][
        "model_file"
    ] == "tokenizer.model"
    assert m["counts"]["code"]["valid"] == {"documents": 0, "tokens": 0, "bin": None, "idx": None}
    tok = load_prepared_tokenizer(out, "sentencepiece")
    assert m["tokenizer"]["vocab_size"] == tok.vocab_size <= 600
    assert _decoded_split(out / "sentencepiece", tok, "code", "train") == docs["code"]
    assert prepare_corpus(
        corpus_dir,
        out,
        tokenizer="sentencepiece",
        workers=1,
        seed=5,
        valid_fraction=0.0,
        test_fraction=0.0,
        anonymise=False,
        sp_vocab_size=600,
        domains=["code", "legal"],
        progress=False,
    ).skipped


def test_fail_mode_raises_before_any_work(corpus, tmp_path):
    corpus_dir, _ = corpus
    with pytest.raises(CorpusError, match=r"news\.jsonl:4: invalid_json"):
        prepare_corpus(corpus_dir, tmp_path / "tokens", on_error="fail", workers=2, progress=False)
    assert not (tmp_path / "tokens").exists()


def test_split_is_deterministic_and_document_level():
    a = split_documents(100, "news", 1, 0.1, 0.05)
    assert (a == split_documents(100, "news", 1, 0.1, 0.05)).all()
    assert (a != split_documents(100, "news", 2, 0.1, 0.05)).any()
    assert np.bincount(a, minlength=3).tolist() == [85, 10, 5]
    assert np.bincount(split_documents(3, "x", 0, 0.05, 0.05), minlength=3).tolist() == [1, 1, 1]


def _reference_prepare(corpus_dir, seed, valid_fraction, test_fraction, policy, out):
    """The straightforward single-process pipeline: read, anonymise, split, encode each document with
    `encode_ordinary`, one `add_item` + `end_document` per document."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from data.tokenizer import load_tokenizer

    tok = load_tokenizer("gpt2")
    for path in sorted(corpus_dir.glob("*.jsonl")):
        d = path.stem
        texts = []
        for line in path.read_text().splitlines():
            try:
                texts.append(json.loads(line)["text"])
            except ValueError:
                continue
        if policy.get(d, True):
            texts = [anonymise(t).text for t in texts]
        split = split_documents(len(texts), d, seed, valid_fraction, test_fraction)
        for code, s in enumerate(SPLITS):
            chosen = [t for t, c in zip(texts, split) if c == code]
            if not chosen:
                continue
            (out / d).mkdir(parents=True, exist_ok=True)
            b = IndexedDatasetBuilder(str(out / d / s) + ".bin", dtype=np.uint16)
            for t in chosen:
                b.add_item(torch.tensor([tok.bos_id] + tok.encode(t), dtype=torch.int64))
                b.end_document()
            b.finalize(str(out / d / s) + ".idx")


@pytest.mark.parametrize("workers", [1, 2])
def test_fast_path_writes_the_reference_bytes(corpus, tmp_path, monkeypatch, workers):
    """Batch-at-a-time encoding in chunk workers (in this process with tiny batches, or in worker processes), with
    the .idx streamed from the parts (data/indexed.py), gives the same .bin/.idx bytes and manifest counts as the
    one-document-at-a-time single-process reference with megatron-core's builder, both for the domain that is not
    anonymised (code) and for those that are."""
    import hashlib

    import data.prepare as prepare_module

    corpus_dir, _ = corpus
    with open(corpus_dir / "code.jsonl", "a") as f:  # special-token text stays ordinary text
        f.write(
            json.dumps({"id": "x", "domain": "code", "text": "s = '<|endoftext|>' + '<|fim_prefix|>'"}) + "\n"
        )
        f.write("{not json\n")  # skipped while streaming: the split still counts only the good documents
        f.write(json.dumps({"id": "y", "domain": "code", "text": "caf\u00e9 = 'na\u00efve'"}) + "\n")
    import data.chunks

    monkeypatch.setattr(data.chunks, "BATCH_CHARS", 300)  # many batches per chunk (in this process)
    monkeypatch.setattr(prepare_module, "PROCESS_MIN_BYTES", 0)  # worker processes even for a tiny corpus
    policy = {"code": False}
    r = prepare_corpus(
        corpus_dir,
        tmp_path / "tokens",
        workers=workers,
        seed=7,
        valid_fraction=0.2,
        test_fraction=0.2,
        anonymise=policy,
        progress=False,
    )
    assert r.stats["encoder"] == ("chunk processes" if workers > 1 else "in-process")
    ref = tmp_path / "ref"
    _reference_prepare(corpus_dir, 7, 0.2, 0.2, policy, ref)
    tok_dir = tmp_path / "tokens" / "gpt2"
    for d, splits in r.manifest["counts"].items():
        for s in SPLITS:
            info = splits[s]
            assert info["documents"] > 0
            for ext in ("bin", "idx"):
                assert (tok_dir / d / f"{s}.{ext}").read_bytes() == (ref / d / f"{s}.{ext}").read_bytes(), (
                    d,
                    s,
                    ext,
                )
            data = (ref / d / f"{s}.bin").read_bytes()
            assert info["bin_sha256"] == hashlib.sha256(data).hexdigest() and info["bin_bytes"] == len(data)
            assert info["tokens"] == len(data) // 2 and info["documents"] == len(open_indexed(ref / d / s))


def test_index_header_is_megatrons():
    """data/indexed.py writes megatron-core's .idx header without importing it (no torch in data preparation)."""
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

    from data.indexed import DTYPE_CODES, INDEX_HEADER

    assert INDEX_HEADER == _INDEX_HEADER
    for dtype, code in DTYPE_CODES.items():
        assert DType.code_from_dtype(dtype.type) == code and DType.dtype_from_code(code) == dtype.type


def test_anonymisation_is_off_unless_asked_and_announced(corpus, tmp_path, capsys):
    """Rewriting text is never silent: off by default (said so), and when asked, what it replaced per domain."""
    corpus_dir, docs = corpus
    assert main(["--corpus", str(corpus_dir), "--out", str(tmp_path / "plain"), "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "anonymisation: off (--anonymise replaces" in out and "anonymised" not in out
    m = json.loads((tmp_path / "plain" / "gpt2" / "manifest.json").read_text())
    assert (
        m["anonymise"]["policy"] == {"code": False, "legal": False, "news": False}
        and m["anonymise"]["counts"] == {}
    )
    tok = load_prepared_tokenizer(tmp_path / "plain", "gpt2")
    kept = [
        t
        for s in SPLITS
        if m["counts"]["news"][s]["documents"]
        for t in _decoded_split(tmp_path / "plain" / "gpt2", tok, "news", s)
    ]
    # every document exactly as written, the e-mail address included
    assert sorted(kept) == sorted(docs["news"])

    assert (
        main(
            [
                "--corpus",
                str(corpus_dir),
                "--out",
                str(tmp_path / "anon"),
                "--workers",
                "1",
                "--anonymise",
                "--anonymise-off",
                "code",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "anonymisation: ON for legal, news; off for code: their text is rewritten" in out
    m = json.loads((tmp_path / "anon" / "gpt2" / "manifest.json").read_text())
    n = m["anonymise"]["counts"]["news"]
    assert n["EMAIL"] > 0 and "anonymised news: " in out and f"{n['EMAIL']:,} EMAIL" in out
    assert m["anonymise"]["documents"]["news"] == sum("@" in t for t in docs["news"])
    with pytest.raises(SystemExit):
        main(["--corpus", str(corpus_dir), "--out", str(tmp_path / "x"), "--anonymise-off", "code"])
    assert "goes with --anonymise" in capsys.readouterr().err


def test_novel_domains_from_ingest_or_prepare_and_kept_out_of_the_tokenizer(corpus, tmp_path):
    from data.ingest import ingest

    corpus_dir, docs = corpus
    src = tmp_path / "src.jsonl"
    greek = ["ζήτα ψυχή ξένος " * 20 + str(i) for i in range(6)]  # letters no other domain has
    records = [{"id": f"{d}-{i}", "domain": d, "text": t} for d, ts in docs.items() for i, t in enumerate(ts)]
    records += [{"id": f"greek-{i}", "domain": "greek", "text": t} for i, t in enumerate(greek)]
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    ingest(src, tmp_path / "ingested", novel=["greek"])
    roles = {
        d: v["split_role"]
        for d, v in json.loads((tmp_path / "ingested" / "manifest.json").read_text())["domains"].items()
    }
    assert roles == {"code": "train", "greek": "novel", "legal": "train", "news": "train"}
    with pytest.raises(ValueError, match=r"novel domains \['gone'\] have no documents"):
        ingest(src, tmp_path / "ingested2", novel=["gone"])
    assert not (tmp_path / "ingested2").exists()

    def sp(out, **kw):
        r = prepare_corpus(
            tmp_path / "ingested",
            out,
            tokenizer="sentencepiece",
            workers=1,
            sp_vocab_size=400,
            progress=False,
            **kw,
        )
        return r.manifest, load_prepared_tokenizer(out, "sentencepiece")

    m, tok = sp(tmp_path / "held_out")
    assert m["roles"]["greek"] == "novel"
    assert tok._sp.piece_to_id("ζ") == tok._sp.unk_id()  # never in the tokenizer's sample: byte fallback only
    m, tok = sp(tmp_path / "all_trained", novel=[])  # prepare --novel overrides the corpus roles
    assert set(m["roles"].values()) == {"train"} and tok._sp.piece_to_id("ζ") != tok._sp.unk_id()
    m, _ = sp(tmp_path / "legal_novel", novel=["legal"])
    assert m["roles"] == {"code": "train", "greek": "train", "legal": "novel", "news": "train"}
    with pytest.raises(ValueError, match=r"novel domains \['nope'\] are not in"):
        sp(tmp_path / "bad", novel=["nope"])


def test_a_raw_folder_is_told_to_run_ingest_first(tmp_path):
    raw = tmp_path / "raw"
    (raw / "news").mkdir(parents=True)
    (raw / "news" / "a.txt").write_text("text")
    with pytest.raises(
        FileNotFoundError,
        match=r"no <domain>\.jsonl files \(it holds news, \.\.\.\).*run "
        r"`python -m data\.ingest",
    ):
        prepare_corpus(raw, tmp_path / "tokens", progress=False)
