"""Typed data configuration: where the tokenised per-domain corpus lives and how batches mix domains."""

from __future__ import annotations

from pydantic import ConfigDict, StrictInt
from pydantic.dataclasses import dataclass

CONFIG = ConfigDict(extra="forbid")  # as model.config.CONFIG (data/ imports no other project folder)

MIXTURES: tuple[str, ...] = ("by_domain", "natural", "balanced", "domain_token")
TOKENIZERS: tuple[str, ...] = ("gpt2", "sentencepiece")


@dataclass(frozen=True, config=CONFIG)
class DataConfig:
    """mixture: "by_domain" (DEMix: a rank reads only its domains), "natural" (Dense: documents in their
    natural proportions), "balanced" (Dense-balanced: equal tokens per domain), "domain_token"
    (+Domain-Token: natural mix with a domain token prepended to every block)."""

    path: str = "artifacts/demo/tokens"  # directory of per-domain, per-split indexed datasets
    domains: list[str] | None = None  # None = every training domain found in the manifest
    mixture: str = "by_domain"
    tokenizer: str = "gpt2"
    seed: StrictInt = 1234

    def problems(self, prefix: str = "data") -> list[str]:
        out = []
        if self.mixture not in MIXTURES:
            out.append(f"{prefix}.mixture={self.mixture!r}: choose one of {', '.join(MIXTURES)}")
        if self.tokenizer not in TOKENIZERS:
            out.append(f"{prefix}.tokenizer={self.tokenizer!r}: choose one of {', '.join(TOKENIZERS)}")
        if self.domains is not None and len(set(self.domains)) != len(self.domains):
            out.append(f"{prefix}.domains: duplicate names in {self.domains}")
        return out
