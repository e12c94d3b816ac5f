"""Anonymisation of user-identifiable strings (DEMix Appendix A.2, Table 8): e-mail addresses, DART ids, Facebook
user ids, phone numbers, credit-card numbers, social security numbers and user handles become dummy tokens
(`<EMAIL>`, ...). The patterns, the look-alikes they keep and why are in docs/anonymise.md.

This module is the front door: `anonymise`, `find_spans` (the input ranges replaced), the per-domain policy
(`resolve_policy`) and the command line that scores the anonymiser on a labelled set:

    python -m data.anonymise --evaluate tests/fixtures/anonymise_labelled.jsonl [--errors] [--baseline OTHER.py]

Behind it: data/anonymise_patterns.py (patterns and the checks on their matches), data/anonymise_prescreen.py
(cheap tests that skip the steps that cannot match), data/anonymise_pass.py (replacing matches, tracking
offsets), data/anonymise_pipeline.py (the steps in order) and data/anonymise_eval.py (precision and recall).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping, Sequence

from data.anonymise_eval import (
    _load_anonymiser,
    evaluate_spans,
    format_table,
    load_labelled,
    spans_from_output,
)
from data.anonymise_pass import Span
from data.anonymise_patterns import CATEGORIES, CODE_AT_WORDS, TOKENS
from data.anonymise_pipeline import Anonymised, anonymise, find_spans
from data.cli import cli_main, exit_process

__all__ = [
    "CATEGORIES",
    "CODE_AT_WORDS",
    "TOKENS",
    "Anonymised",
    "AnonymisePolicy",
    "Span",
    "add_counts",
    "anonymise",
    "anonymise_many",
    "find_spans",
    "main",
    "parse_policy_args",
    "resolve_policy",
]


def add_counts(total: dict[str, int], counts: Mapping[str, int]) -> dict[str, int]:
    """Accumulate per-category counts into `total` (in place) and return it."""
    for k, v in counts.items():
        total[k] = total.get(k, 0) + v
    return total


AnonymisePolicy = bool | Mapping[str, bool]


def resolve_policy(policy: AnonymisePolicy, domains: Iterable[str], default: bool = True) -> dict[str, bool]:
    """Per-domain on/off from `True`/`False` or a mapping such as `{"code": False}` (unlisted domains: `default`).

    Unknown domain names in the mapping are an error, so a typo cannot silently leave a domain un-anonymised."""
    domains = list(domains)
    if isinstance(policy, bool):
        return {d: policy for d in domains}
    unknown = sorted(set(policy) - set(domains))
    if unknown:
        raise ValueError(f"anonymise: unknown domains {unknown}; known: {domains}")
    bad = {k: v for k, v in policy.items() if not isinstance(v, bool)}
    if bad:
        raise ValueError(f"anonymise: values must be true/false, got {bad}")
    return {d: bool(policy.get(d, default)) for d in domains}


def anonymise_many(texts: Iterable[str], enabled: bool = True) -> tuple[list[str], dict[str, int]]:
    """Anonymise a list of documents (identity when not `enabled`); return texts and summed counts."""
    if not enabled:
        return list(texts), {}
    out, total = [], {}
    for t in texts:
        r = anonymise(t)
        out.append(r.text)
        add_counts(total, r.counts)
    return out, total


def parse_policy_args(on: bool | None, off_domains: Iterable[str]) -> AnonymisePolicy:
    """CLI helper: `--no-anonymise` -> False; `--anonymise-off code` (repeatable) -> {"code": False}."""
    off = list(off_domains)
    if on is False:
        return False
    return {d: False for d in off} if off else True


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    """`python -m data.anonymise --evaluate FILE`: a precision/recall table (0), or one error line (2)."""
    p = argparse.ArgumentParser(
        prog="python -m data.anonymise", description=evaluate_spans.__doc__.split("\n")[0]
    )
    p.add_argument("--evaluate", required=True, metavar="FILE", help="labelled JSONL (see load_labelled)")
    p.add_argument(
        "--baseline",
        metavar="MODULE.py",
        help="evaluate the anonymise() of another copy of this module instead of this one",
    )
    p.add_argument("--errors", action="store_true", help="also list every missed and spurious span")
    a = p.parse_args(argv)
    records = load_labelled(a.evaluate)
    find = find_spans
    if a.baseline:
        other = _load_anonymiser(a.baseline)
        find = lambda text: spans_from_output(text, other(text))  # noqa: E731
    errors: list[tuple[str, str, str]] = []
    result = evaluate_spans(records, find, errors if a.errors else None)
    print(f"{a.evaluate}: {len(records)} lines, anonymiser {a.baseline or 'data/anonymise.py'}")
    print(format_table(result))
    for kind, cat, text in errors:
        print(f"{kind}\t{cat}\t{text}")
    return 0


if __name__ == "__main__":
    exit_process(main())
