"""The parts folder of a `data.prepare` run, `<out>/<tokenizer>.parts/`: the plan it holds work for, a record and
part files per finished chunk (so a killed run resumes after them), and the run's sentencepiece model, trained
once per plan into it (or the given one, copied into it)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from data import atomic
from data.atomic import write_bytes_atomic, write_json_atomic
from data.chunks import Chunk, sentencepiece_sample
from data.tokenizer import SP_MODEL_FILE, Tokenizer, TokenizerSpec, load_tokenizer, train_sentencepiece

PARTS_FORMAT = "demix-token-parts/1"


def _parts_dir(out_dir: Path, tokenizer: str) -> Path:
    return out_dir / f"{tokenizer}.parts"


def _open_parts(parts: Path, plan: dict, fresh: bool) -> None:
    """Make `parts` hold this plan's work: kept when its plan.json is this plan's (a resumed run, another shard),
    emptied when it is another plan's (changed inputs or settings) or `fresh`; a folder without our plan.json is
    someone else's and refused."""
    record = parts / "plan.json"
    if parts.exists():
        try:
            old = json.loads(record.read_text())
        except (OSError, ValueError):
            old = None
        if not isinstance(old, dict) or old.get("format") != PARTS_FORMAT:
            if any(parts.iterdir()):
                raise ValueError(
                    f"{parts} exists and was not written by data.prepare (no {record.name} of format "
                    f"{PARTS_FORMAT}): move it away"
                )
        elif old.get("plan_key") == plan["plan_key"] and not fresh:
            return
        shutil.rmtree(parts)
    parts.mkdir(parents=True, exist_ok=True)
    write_json_atomic(record, plan)


@contextmanager
def _parts_kept_on_progress(parts: Path, final: Path) -> Iterator[None]:
    """On a failure (Ctrl-C included), keep the parts folder when a chunk finished (the same command then resumes
    after it, and says so now); when none did, the shared rule (data/atomic.py `discard_on_failure`) removes it and
    the folders made for it. Either way a full disk is raised as the DiskFullError of `final`."""
    made = list(reversed([p for p in parts.parents if not p.exists()]))  # outermost first; `parts` is staged
    try:
        yield
    except BaseException as e:
        if not (parts.is_dir() and any(parts.glob("*/*.json"))):
            with atomic.discard_on_failure(final, parts, made=made):
                raise
        finished = len(list(parts.glob("*/*.json")))
        print(
            f"{finished} finished chunk(s) kept in {parts}: the same command resumes after them (remove that "
            "folder to start over)",
            file=sys.stderr,
            flush=True,
        )
        full = atomic.disk_full_error(e, final, [parts]) if isinstance(e, Exception) else None
        if full is not None:
            raise full from e
        raise


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (created): shards starting together train one sentencepiece model, not N."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _tokenizer(
    name: str,
    parts: Path,
    chunks: Sequence[Chunk],
    roles: dict[str, str],
    split: dict,
    policy: dict[str, bool],
    sp_vocab_size: int,
    seed: int,
    workers: int,
    say,
    sp_model: Path | None = None,
    sp_model_sha: str | None = None,
) -> Tokenizer:
    """GPT-2, or the run's sentencepiece model, kept in the parts folder for every shard: `sp_model` (an existing
    model, e.g. an anchor's, of sha256 `sp_model_sha` when planned) copied there, else one trained once per plan on
    `sentencepiece_sample` of the training domains (novel domains are held out of the tokenizer too)."""
    if name == "gpt2":
        return load_tokenizer("gpt2")
    model = parts / SP_MODEL_FILE
    with _locked(parts / "tokenizer.lock"):
        if not model.is_file() and sp_model is not None:
            data = sp_model.read_bytes()
            if hashlib.sha256(data).hexdigest() != sp_model_sha:
                raise ValueError(f"--sp-model {sp_model} changed since this run started: run it again")
            write_bytes_atomic(model, data)
        elif not model.is_file():
            import sentencepiece as spm

            train = [d for d in roles if roles[d] != "novel"] or list(roles)
            sample = sentencepiece_sample(chunks, train, split, policy)
            say(
                f"training sentencepiece BPE (vocab {sp_vocab_size}) on {sum(map(len, sample)) / 1e6:.1f} M "
                f"characters of the training split of {', '.join(train)} ..."
            )
            spm.set_random_generator_seed(seed)
            train_sentencepiece(sample, model, vocab_size=sp_vocab_size, threads=workers)
    from data import tokenizer as tokenizer_module

    tokenizer_module._CACHE.pop(TokenizerSpec("sentencepiece", str(model)), None)  # a model of this plan
    tok = load_tokenizer("sentencepiece", model)
    if sp_model is not None:
        say(
            f"sentencepiece: the given model {sp_model} (vocabulary {tok.vocab_size}), not trained on this corpus"
        )
    return tok


def _token_dtype(tok: Tokenizer, num_domains: int) -> type:
    return np.uint16 if tok.total_vocab_size(num_domains) < 65536 else np.int32


def _by_domain_records(records: Sequence[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in records:
        out.setdefault(r["chunk"]["domain"], []).append(r)
    return out
