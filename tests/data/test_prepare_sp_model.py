"""`data.prepare --sp-model`: a data owner's tokens made with an anchor's sentencepiece model share its token ids
and tokenizer fingerprint (so the anchor's checkpoint accepts them); the model is part of the plan; misuse is one
error line before any work."""

import json

import pytest

from data.catalog import DataError, tokenizer_fingerprint
from data.prepare import main, prepare_corpus
from data.tokenizer import load_prepared_tokenizer
from launcher.checkpoint_data import data_manifest
from tests.conftest import write_corpus

SAMPLE = "Bond yield, equity market: the bank's cash rose 4.5% (stock price 1234).\n\tAnchor the hull."


def _prepare(corpus, out, **kw):
    return prepare_corpus(corpus, out, tokenizer="sentencepiece", workers=1, progress=False, **kw)


@pytest.fixture(scope="module")
def anchor(tmp_path_factory):
    """The anchor's tokens: sentencepiece trained on cooking and sailing."""
    root = tmp_path_factory.mktemp("anchor")
    corpus = write_corpus(root, docs_per_domain=20, domains=["cooking", "sailing"])
    _prepare(corpus, root / "tokens", sp_vocab_size=400)
    return root / "tokens"


def _manifest(tokens):
    return json.loads((tokens / "sentencepiece" / "manifest.json").read_text())


def _prepare_cli(corpus, out, *extra):
    return main(["--corpus", str(corpus), "--out", str(out), "--workers", "1", "--quiet", *extra])


def test_owner_tokens_take_the_anchors_model_and_fingerprint(anchor, tmp_path, capsys):
    model = anchor / "sentencepiece" / "tokenizer.model"
    owner = write_corpus(tmp_path / "owner", docs_per_domain=20, seed=1, domains=["finance"])
    out = tmp_path / "owner_tokens"
    assert _prepare_cli(owner, out, "--tokenizer", "sentencepiece", "--sp-model", str(model)) == 0
    a, b = _manifest(anchor), _manifest(out)
    assert b["tokenizer"] == a["tokenizer"] and tokenizer_fingerprint(
        b["tokenizer"]
    ) == tokenizer_fingerprint(a["tokenizer"])
    assert (out / "sentencepiece" / "tokenizer.model").read_bytes() == model.read_bytes()
    assert b["tokenizer_from"] == str(model.resolve()) and b["domains"] == ["finance"]
    ids = load_prepared_tokenizer(anchor, "sentencepiece").encode(SAMPLE)
    assert load_prepared_tokenizer(out, "sentencepiece").encode(SAMPLE) == ids and len(ids) > 10
    # what the anchor's checkpoint records (meta.json: tokenizer_sha256, vocab_size) accepts the owner's tokens
    fingerprint, vocab = tokenizer_fingerprint(a["tokenizer"]), a["tokenizer"]["vocab_size"]
    assert data_manifest(out, "sentencepiece", fingerprint, vocab)["domains"] == ["finance"]

    # a tokenizer trained on the owner's own data is another one: refused
    own = tmp_path / "own_tokens"
    _prepare(owner, own, sp_vocab_size=400)
    with pytest.raises(DataError, match="not the one the model"):
        data_manifest(own, "sentencepiece", fingerprint, vocab)

    # the model is part of the plan: the same one (named by its folder or tokens root) is up to date ...
    for shorthand in (anchor / "sentencepiece", anchor):
        assert _prepare(owner, out, sp_model=shorthand).skipped
    # ... another one re-prepares
    again = _prepare(owner, out, sp_model=own / "sentencepiece" / "tokenizer.model")
    assert not again.skipped and again.manifest["tokenizer"] == _manifest(own)["tokenizer"]
    # the anchor's own tokens root is never the output: the model would be replaced
    capsys.readouterr()
    assert _prepare_cli(owner, anchor, "--tokenizer", "sentencepiece", "--sp-model", str(model)) == 2
    assert "would overwrite the input" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--sp-model", "{model}"], "--sp-model goes with --tokenizer sentencepiece"),
        (["--tokenizer", "sentencepiece", "--sp-model", "{missing}"], "no such file"),
        (["--tokenizer", "sentencepiece", "--sp-model", "{text}"], "not a sentencepiece model"),
        (["--tokenizer", "sentencepiece", "--sp-model", "{folder}"], "a directory without tokenizer.model"),
        (
            ["--tokenizer", "sentencepiece", "--sp-model", "{model}", "--sp-vocab-size", "400"],
            "the given model fixes the vocabulary",
        ),
    ],
)
def test_sp_model_misuse_is_one_error_line_before_any_work(tmp_path, capsys, args, says):
    corpus = write_corpus(tmp_path, docs_per_domain=3, domains=["finance"])
    (tmp_path / "text.model").write_text("not a model\n")
    (tmp_path / "folder").mkdir()
    paths = {
        "model": tmp_path / "text.model",  # the checks before loading it do not read it
        "missing": tmp_path / "nope.model",
        "text": tmp_path / "text.model",
        "folder": tmp_path / "folder",
    }
    argv = [a.format(**{k: str(v) for k, v in paths.items()}) for a in args]
    assert _prepare_cli(corpus, tmp_path / "out", *argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], captured.err
    assert not captured.out and not (tmp_path / "out").exists()
