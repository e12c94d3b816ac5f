"""The task folder `python -m launcher.harness tasks` writes (docs/harness.md): one perplexity task per
domain (loglikelihood_rolling, token_perplexity among its metrics), their group, and a multiple-choice
continuation task, as local YAML + JSONL from the raw text of a prepared split."""

from __future__ import annotations

import inspect
import json
import random
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from data.atomic import staged_dir, write_json_atomic
from data.cli import check_output_dir
from launcher.checkpoint_data import split_documents_text
from launcher.harness.task_folder import OLD_TASKS_FORMATS, TASKS_FORMAT, file_hashes

PPL_GROUP = "demix_ppl"


PPL_PREFIX = "demix_ppl_"


MC_TASK = "demix_continuation"


CONTEXT_TOKENS, CONTINUATION_TOKENS, DISTRACTORS = 48, 16, 3


def _say(*a: Any) -> None:
    print("[demix-harness]", *a, file=sys.stderr, flush=True)


def process_ppl_results(doc, results):
    """lm-eval process_results of a demix_ppl task: the harness's rolling metrics plus token_perplexity, each
    (loglikelihood, weight) for weighted_perplexity / bits_per_byte aggregation."""
    (loglikelihood,) = results
    text = doc["text"]
    n_words = len(re.split(r"\s+", text))
    n_bytes = len(text.encode("utf-8"))
    return {
        "word_perplexity": (loglikelihood, n_words),
        "byte_perplexity": (loglikelihood, n_bytes),
        "bits_per_byte": (loglikelihood, n_bytes),
        "token_perplexity": (loglikelihood, int(doc["n_tokens"])),
    }


def utils_source() -> str:
    """utils.py written beside the task YAMLs: self-contained (the tasks load without this project)."""
    return (
        '"""process_results of the demix_ppl tasks (written by launcher.harness tasks)."""\n\n'
        "import re\n\n\n" + inspect.getsource(process_ppl_results)
    )


def _metric(name: str, aggregation: str, higher_is_better: bool) -> dict[str, Any]:
    return {"metric": name, "aggregation": aggregation, "higher_is_better": higher_is_better}


def ppl_task_yaml(domain: str, data_file: Path, split: str) -> str:
    """YAML of the perplexity task of one domain (loglikelihood_rolling over its documents' text)."""
    cfg = {
        "task": PPL_PREFIX + domain,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_file)}},
        "output_type": "loglikelihood_rolling",
        "test_split": "test",
        "doc_to_text": "",
        "doc_to_target": "text",
        "metric_list": [
            _metric("word_perplexity", "weighted_perplexity", False),
            _metric("byte_perplexity", "weighted_perplexity", False),
            _metric("bits_per_byte", "bits_per_byte", False),
            _metric("token_perplexity", "weighted_perplexity", False),
        ],
        "metadata": {"version": 1.0, "domain": domain, "split": split},
    }
    return yaml.safe_dump(cfg, sort_keys=False) + "process_results: !function utils.process_ppl_results\n"


def group_yaml(tasks: Sequence[str]) -> str:
    cfg = {
        "group": PPL_GROUP,
        "task": list(tasks),
        "aggregate_metric_list": [
            {"metric": "token_perplexity", "aggregation": "mean", "weight_by_size": False}
        ],
        "metadata": {"version": 1.0},
    }
    return yaml.safe_dump(cfg, sort_keys=False)


def mc_task_yaml(data_file: Path) -> str:
    cfg = {
        "task": MC_TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_file)}},
        "output_type": "multiple_choice",
        "test_split": "test",
        "doc_to_text": "context",
        "doc_to_choice": "choices",
        "doc_to_target": "gold",
        "target_delimiter": "",
        "metric_list": [_metric("acc", "mean", True), _metric("acc_norm", "mean", True)],
        "metadata": {"version": 1.0},
    }
    return yaml.safe_dump(cfg, sort_keys=False)


def _span(tok: Any, ids: Sequence[int], text: str, start: int, stop: int) -> tuple[str, str] | None:
    """(text of ids[:start], text of ids[start:stop]) as a prefix and the next piece of `text`; None when the
    decoded tokens are not a prefix of the text (a cut inside a character) or the piece is blank."""
    head, full = tok.decode(list(ids[:start])), tok.decode(list(ids[:stop]))
    if not text.startswith(full) or not full.startswith(head) or not full[len(head) :].strip():
        return None
    return head, full[len(head) :]


def continuation_docs(
    tok: Any,
    texts: Mapping[str, Sequence[str]],
    seed: int = 0,
    context_tokens: int = CONTEXT_TOKENS,
    continuation_tokens: int = CONTINUATION_TOKENS,
) -> list[dict[str, Any]]:
    """The multiple-choice documents: per document with enough tokens, its first `context_tokens` tokens' text,
    and as choices its true next `continuation_tokens` tokens and DISTRACTORS spans at the same offset of documents
    of other domains (random.Random(seed)); {"domain", "doc_index", "context", "choices", "gold"}."""
    rng = random.Random(seed)
    spans: dict[str, list[tuple[int, str, str]]] = {}
    for d, docs in texts.items():
        for i, text in enumerate(docs):
            ids = tok.encode(text)
            if len(ids) >= context_tokens + continuation_tokens:
                s = _span(tok, ids, text, context_tokens, context_tokens + continuation_tokens)
                if s is not None:
                    spans.setdefault(d, []).append((i, *s))
    out = []
    for d in texts:
        others = [o for o in spans if o != d]
        if not others:
            continue
        for i, context, cont in spans.get(d, []):
            pick = (
                rng.sample(others, DISTRACTORS)
                if len(others) >= DISTRACTORS
                else rng.choices(others, k=DISTRACTORS)
            )
            choices = [cont] + [rng.choice(spans[o])[2] for o in pick]
            order = list(range(len(choices)))
            rng.shuffle(order)
            out.append(
                {
                    "domain": d,
                    "doc_index": i,
                    "context": context,
                    "choices": [choices[k] for k in order],
                    "gold": order.index(0),
                    "distractor_domains": pick,
                }
            )
    return out


def write_tasks(
    data_root: str | Path,
    tokenizer: str,
    out: str | Path,
    split: str = "test",
    max_docs: int | None = None,
    domains: Sequence[str] | None = None,
    seed: int = 0,
    docs_from: str | None = None,
) -> dict[str, Any]:
    """Write the task folder `out` (docs/harness.md): <task>.yaml, utils.py, data/*.jsonl and demix_tasks.json
    (the record, returned). Documents: the first `max_docs` of each domain's `split`, with their token count under
    the prepared `tokenizer`."""
    from data.tokenizer import load_prepared_tokenizer

    out = Path(out).resolve()
    docs_from = docs_from or tokenizer
    manifest = Path(data_root) / docs_from / "manifest.json"
    if not manifest.is_file():
        raise FileNotFoundError(
            f"{manifest} not found: --data is a prepared tokens root (data.prepare) and "
            f"--tokenizer one of its tokenizers"
        )
    names = ["demix_tasks.json", "utils.py", "data", f"{PPL_GROUP}.yaml", f"{MC_TASK}.yaml"]
    check_output_dir(
        out, [TASKS_FORMAT, *OLD_TASKS_FORMATS], names, inputs=[Path(data_root)], manifest="demix_tasks.json"
    )
    tok = load_prepared_tokenizer(data_root, tokenizer)
    texts, notes = _task_texts(data_root, docs_from, split, max_docs, domains, manifest)
    with staged_dir(out, manifest="demix_tasks.json") as tmp:  # a failed write leaves no half task folder
        (tmp / "data").mkdir()
        record: dict[str, Any] = {
            "format": TASKS_FORMAT,
            "data": str(Path(data_root).resolve()),
            "tokenizer": tokenizer,
            "docs_from": docs_from,
            "split": split,
            "max_docs": max_docs,
            "seed": seed,
            "group": PPL_GROUP,
            "domains": {},
            "changed_corpus_files": notes["changed_corpus_files"],
        }
        tasks = _write_ppl_tasks(tmp, out, tok, texts, split, record)
        mc = _write_continuation_task(tmp, out, tok, texts, seed)
        record["tasks"] = tasks + ([MC_TASK] if mc else [])
        record["continuation"] = {
            "task": MC_TASK if mc else None,
            "documents": len(mc),
            "context_tokens": CONTEXT_TOKENS,
            "continuation_tokens": CONTINUATION_TOKENS,
            "distractors": DISTRACTORS,
        }
        (tmp / "utils.py").write_text(utils_source(), encoding="utf-8")
        # what `check` verifies before lm-eval imports anything from the folder
        record["files"] = file_hashes(tmp)
        write_json_atomic(tmp / "demix_tasks.json", record)
    return record


def _task_texts(
    data_root: str | Path,
    docs_from: str,
    split: str,
    max_docs: int | None,
    domains: Sequence[str] | None,
    manifest: Path,
) -> tuple[dict[str, list[str]], dict[str, Any]]:
    """{domain: texts} of the split (the asked domains, those with documents) and `split_documents_text`'s notes;
    a corpus file changed since the data was prepared is warned about."""
    texts, notes = split_documents_text(data_root, docs_from, split, max_docs)
    if notes["changed_corpus_files"]:
        _say(
            f"warning: {', '.join(notes['changed_corpus_files'])} changed since {data_root}/{docs_from} was "
            "prepared: these are not exactly the tokenised documents"
        )
    if domains:
        unknown = [d for d in domains if d not in texts]
        if unknown:
            raise ValueError(f"domains {unknown} are not in {manifest}; domains: {', '.join(texts)}")
        texts = {d: texts[d] for d in domains}
    texts = {d: ts for d, ts in texts.items() if ts}
    if not texts:
        raise ValueError(f"no {split} documents in {data_root}/{docs_from}")
    return texts, notes


def _write_ppl_tasks(
    tmp: Path, out: Path, tok: Any, texts: Mapping[str, Sequence[str]], split: str, record: dict[str, Any]
) -> list[str]:
    """One perplexity task per domain (data/ppl_<domain>.jsonl and its YAML, pointing at `out`) and their group;
    each domain's documents and tokens go into `record`. Returns the task names."""
    tasks = []
    for d, docs in texts.items():
        rows = [
            {"domain": d, "doc_index": i, "text": t, "n_tokens": len(tok.encode(t))}
            for i, t in enumerate(docs)
        ]
        name = f"ppl_{d}.jsonl"
        (tmp / "data" / name).write_text(
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8"
        )
        (tmp / f"{PPL_PREFIX}{d}.yaml").write_text(
            ppl_task_yaml(d, out / "data" / name, split), encoding="utf-8"
        )
        tasks.append(PPL_PREFIX + d)
        record["domains"][d] = {
            "task": PPL_PREFIX + d,
            "documents": len(rows),
            "tokens": sum(r["n_tokens"] for r in rows),
        }
    (tmp / f"{PPL_GROUP}.yaml").write_text(group_yaml(tasks), encoding="utf-8")
    return tasks


def _write_continuation_task(
    tmp: Path, out: Path, tok: Any, texts: Mapping[str, Sequence[str]], seed: int
) -> list[dict[str, Any]]:
    """data/continuation.jsonl (`continuation_docs`) and, when it has documents, the multiple-choice task's YAML.
    Returns the documents."""
    mc = continuation_docs(tok, texts, seed)
    (tmp / "data" / "continuation.jsonl").write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in mc), encoding="utf-8"
    )
    if mc:
        (tmp / f"{MC_TASK}.yaml").write_text(
            mc_task_yaml(out / "data" / "continuation.jsonl"), encoding="utf-8"
        )
    return mc
