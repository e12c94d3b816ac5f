"""The plan of a `data.prepare` run (data/prepare.py): the corpus files checked before any work, the domains'
roles and anonymisation policy, the settings and split, and the plan key that tells whether the token files of an
earlier run are this plan's (`_up_to_date`)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from data.anonymise import AnonymisePolicy, resolve_policy
from data.ingest import MANIFEST_FORMAT as INGEST_FORMAT
from data.ingest import domain_name_problem
from data.readers import InputFileError, read_json_object
from data.tokenizer import sha256_file

FORMAT = "demix-tokens/1"


@dataclass(frozen=True)
class _Plan:
    """What a run prepares, from what and how (`prepare_corpus`'s arguments of the same names, the corpus files
    checked, the domains' roles and anonymisation policy); `key` fingerprints it: the settings, the split, the
    roles, the corpus files' sizes and times, the corpus manifest and the corpus folder. `sp_model`: an existing
    sentencepiece model to encode with instead of training one (its sha256 is a setting: another model, another
    plan); `sp_vocab_size` is then None."""

    corpus_dir: Path
    files: dict[str, Path]
    roles: dict[str, str]
    policy: dict[str, bool]
    manifest_sha: str | None
    tokenizer: str
    seed: int
    valid_fraction: float
    test_fraction: float
    sp_vocab_size: int | None
    on_error: str
    chunk_bytes: int
    sp_model: Path | None = None
    sp_model_sha: str | None = None
    key: str = ""

    @property
    def settings(self) -> dict:
        out = {
            "tokenizer": self.tokenizer,
            "seed": self.seed,
            "valid_fraction": self.valid_fraction,
            "test_fraction": self.test_fraction,
            "anonymise": self.policy,
            "sp_vocab_size": self.sp_vocab_size if self.tokenizer == "sentencepiece" else None,
            "on_error": self.on_error,
        }
        if (
            self.sp_model_sha is not None
        ):  # only then: the plan keys of trained-tokenizer runs stay as they were
            out["sp_model_sha256"] = self.sp_model_sha
        return out

    @property
    def split(self) -> dict:
        return {
            "seed": self.seed,
            "valid_fraction": self.valid_fraction,
            "test_fraction": self.test_fraction,
            "chunk_bytes": self.chunk_bytes,
        }


def _make_plan(
    corpus_dir: Path,
    domains: Sequence[str] | None,
    novel: Sequence[str] | None,
    anonymise: AnonymisePolicy,
    tokenizer: str,
    seed: int,
    valid_fraction: float,
    test_fraction: float,
    sp_vocab_size: int | None,
    on_error: str,
    chunk_bytes: int,
    sp_model: Path | None = None,
) -> _Plan:
    """Check the corpus (its files, roles and the `novel` domains) before any work, and fingerprint the plan
    (`sp_model`, a checked sentencepiece model file, by its sha256)."""
    files = _corpus_files(corpus_dir, domains)
    policy = resolve_policy(anonymise, files)
    corpus_manifest = corpus_dir / "manifest.json"
    roles = corpus_roles(corpus_manifest, files)  # before any work: a broken corpus manifest fails here
    if novel is not None:
        unknown = sorted(set(novel) - set(files))
        if unknown:
            raise ValueError(f"novel domains {unknown} are not in {corpus_dir}; domains: {', '.join(files)}")
        roles = {d: "novel" if d in set(novel) else "train" for d in files}
    manifest_sha = sha256_file(corpus_manifest) if corpus_manifest.is_file() else None
    plan = _Plan(
        corpus_dir,
        files,
        roles,
        policy,
        manifest_sha,
        tokenizer,
        seed,
        valid_fraction,
        test_fraction,
        sp_vocab_size,
        on_error,
        chunk_bytes,
        sp_model=sp_model,
        sp_model_sha=sha256_file(sp_model) if sp_model is not None else None,
    )
    stat = {f"{d}.jsonl": [p.stat().st_size, p.stat().st_mtime_ns] for d, p in files.items()}
    key = _fingerprint(
        {
            "format": FORMAT,
            "settings": plan.settings,
            "split": plan.split,
            "files": stat,
            "roles": roles,
            "manifest": manifest_sha,
            "dir": str(corpus_dir.resolve()),
        }
    )
    return replace(plan, key=key)


def _corpus_files(corpus_dir: Path, domains: Sequence[str] | None) -> dict[str, Path]:
    """`<domain>.jsonl` of the corpus by domain, checked before any work: every file a valid domain name, no two
    names equal but for case (their token folders would be one folder on macOS and Windows file systems), and, where
    the corpus has ingest's manifest, exactly the domains it lists (no file of an earlier ingest or a stray copy)."""
    found = {p.stem: p for p in sorted(corpus_dir.glob("*.jsonl"))}
    if not found:
        raw = [p.name for p in sorted(corpus_dir.iterdir())[:3]] if corpus_dir.is_dir() else []
        raise FileNotFoundError(
            f"{corpus_dir}: no <domain>.jsonl files"
            + (f" (it holds {', '.join(raw)}, ...)" if raw else "")
            + f": --corpus is what data.ingest writes; run `python -m data.ingest {corpus_dir} --out CORPUS` "
            "first (it reads JSONL with text/domain fields, or one folder of .txt files per domain)"
        )
    problems = [f"{found[d].name}: {bad}" for d in found if (bad := domain_name_problem(d)) is not None]
    folded: dict[str, list[str]] = {}
    for d in found:
        folded.setdefault(d.casefold(), []).append(d)
    problems += [
        f"{' and '.join(f'{d}.jsonl' for d in names)} name domains that differ only in case: merge them "
        "into one file (data.ingest reports such documents as domain_case_clash)"
        for names in folded.values()
        if len(names) > 1
    ]
    listed = _ingested_domains(corpus_dir / "manifest.json")
    if listed is not None:
        extra = sorted(set(found) - set(listed))
        if extra:
            problems.append(
                f"{', '.join(f'{d}.jsonl' for d in extra)} not listed in {corpus_dir / 'manifest.json'} "
                '(left by an earlier ingest, or copied in): list them in its "domains", remove them, or ingest again'
            )
        gone = sorted(set(listed) - set(found))
        if gone:
            problems.append(
                f"{corpus_dir / 'manifest.json'} lists {', '.join(gone)} but {', '.join(gone)}.jsonl "
                "is missing: ingest again"
            )
    if problems:
        raise ValueError(f"{corpus_dir}: " + "; ".join(problems))
    if domains is None:
        return found
    missing = [d for d in domains if d not in found]
    if missing:
        raise FileNotFoundError(f"{corpus_dir}: no JSONL for domains {missing}; found {sorted(found)}")
    return {d: found[d] for d in domains}


def _ingested_domains(corpus_manifest: Path) -> list[str] | None:
    """The domains data.ingest's manifest lists, or None where there is no such manifest (a corpus written by
    hand)."""
    if not corpus_manifest.is_file():
        return None
    try:
        data = json.loads(corpus_manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # corpus_roles names the broken file
    doms = data.get("domains") if isinstance(data, dict) else None
    return list(doms) if isinstance(doms, dict) and data.get("format") == INGEST_FORMAT else None


def corpus_roles(corpus_manifest: Path, domains: Iterable[str]) -> dict[str, str]:
    """Each domain's `split_role` ("train" or "novel") from the corpus manifest, copied into the token manifest
    so the roles travel with the tokens (default "train"). A corpus manifest that is not JSON is an error."""
    try:
        data = (
            read_json_object(corpus_manifest, {"domains?": dict}, "corpus manifest")
            if corpus_manifest.is_file()
            else {}
        )
    except InputFileError as e:
        raise ValueError(f"{e}: fix or remove it (it gives the domains' train/novel roles)") from None
    doms = data.get("domains", {})
    return {
        d: doms[d].get("split_role", "train") if isinstance(doms.get(d), dict) else "train" for d in domains
    }


def _fingerprint(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _up_to_date(tok_dir: Path, plan_key: str) -> dict | None:
    path = tok_dir / "manifest.json"
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("plan_key") != plan_key:
        return None
    rels = [
        info.get(k)
        for splits in manifest.get("counts", {}).values()
        for info in splits.values()
        for k in ("bin", "idx")
    ]
    sizes = [
        info.get(f"{k}_bytes")
        for splits in manifest.get("counts", {}).values()
        for info in splits.values()
        for k in ("bin", "idx")
    ]
    for rel, size in zip(rels, sizes):
        if rel and (not (tok_dir / rel).is_file() or (tok_dir / rel).stat().st_size != size):
            return None
    if any(not (tok_dir / rel).is_file() for rel in manifest.get("token_counts", {}).values()):
        return None
    model = manifest["tokenizer"].get("model_file")
    if model and manifest["tokenizer"]["files"].get(model) != (
        sha256_file(tok_dir / model) if (tok_dir / model).is_file() else None
    ):
        return None
    return manifest
