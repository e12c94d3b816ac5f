"""Router vectors in a consolidated checkpoint's meta.json: the format, its builder and its reader. Below both
launcher/evaluation/ (which mixes with them, modes "router" and "router_posterior") and launcher/modular/ (whose
owners/router.py computes them from an owner's data and whose merge writes them), which share it.

    meta["router_vectors"] = {
        "format": "demix-router-vectors/1",
        "representation": "first_expert_layer_input_mean",
        "vectors": {domain: [float] * d_model},   # r_j: the mean first-expert-layer FFN input on the owner's data
        "tokens": {domain: int},                  # how many tokens each mean is over
    }

Expert j of the checkpoint is its `domains[j]`; the maths is model/mixture.py's router eqs. R1-R4.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from launcher.checkpoint import CheckpointError

ROUTER_FORMAT = "demix-router-vectors/1"
ROUTER_REPRESENTATION = "first_expert_layer_input_mean"  # model/batched.py `shared_trunk_features`, averaged
ROUTER_META_KEY = "router_vectors"  # the entry of meta.json


def _vector(value: Any, what: str) -> list[float]:
    """A non-empty list of finite numbers, as floats; ValueError naming `what` otherwise."""
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{what}: expected a non-empty list of numbers, got {type(value).__name__}")
    out = []
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{what}[{i}]={v!r}: must be a finite number")
        out.append(float(v))
    return out


def router_vectors_meta(per_domain: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The meta.json entry (module docstring) from {domain: launcher/modular/owners/router.py `router_vector`'s
    dict}: every vector finite, of one length, of this representation; ValueError otherwise."""
    if not per_domain:
        raise ValueError("router vectors: no domain given")
    vectors, tokens = {}, {}
    for domain, rec in per_domain.items():
        rep = rec.get("representation", ROUTER_REPRESENTATION)
        if rep != ROUTER_REPRESENTATION:
            raise ValueError(
                f"router vector of {domain!r}: representation {rep!r}, not {ROUTER_REPRESENTATION!r}"
            )
        vectors[str(domain)] = _vector(rec.get("vector"), f"router vector of {domain!r}")
        n = rec.get("tokens")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"router vector of {domain!r}: tokens={n!r}, must be an integer >= 1")
        tokens[str(domain)] = n
    dims = {d: len(v) for d, v in vectors.items()}
    if len(set(dims.values())) > 1:
        raise ValueError(f"router vectors of different lengths: {dims}")
    return {
        "format": ROUTER_FORMAT,
        "representation": ROUTER_REPRESENTATION,
        "vectors": vectors,
        "tokens": tokens,
    }


def router_entry(meta: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The router-vector entry of a checkpoint's meta (or `meta` itself when it is the entry), None without one."""
    if "vectors" in meta and "format" in meta:
        return meta
    return meta.get(ROUTER_META_KEY)


def router_matrix(meta: Mapping[str, Any], domains: Sequence[str], dim: int | None = None) -> torch.Tensor:
    """r, E x D (float64): the router vectors of `domains` in their order (expert j = domains[j]) from a
    checkpoint's meta (Consolidated.meta, meta.json) or from its "router_vectors" entry itself. CheckpointError,
    one line, naming the experts without a vector, or a wrong format, representation, length (`dim`: the model's
    d_model when given) or value."""
    entry = router_entry(meta)
    if entry is None:
        raise CheckpointError(
            f"no router vectors: meta.json has no {ROUTER_META_KEY!r} entry, so experts {list(domains)} have "
            "none (they come with the experts' packages, launcher/modular/owners/router.py)"
        )
    if not isinstance(entry, Mapping) or entry.get("format") != ROUTER_FORMAT:
        got = entry.get("format") if isinstance(entry, Mapping) else type(entry).__name__
        raise CheckpointError(f"router vectors of format {got!r}: this code reads {ROUTER_FORMAT!r}")
    if entry.get("representation") != ROUTER_REPRESENTATION:
        raise CheckpointError(
            f"router vectors of representation {entry.get('representation')!r}: this code routes on "
            f"{ROUTER_REPRESENTATION!r} (model/batched.py shared_trunk_features)"
        )
    vectors = entry.get("vectors")
    if not isinstance(vectors, Mapping):
        raise CheckpointError(f"router vectors: 'vectors' is a {type(vectors).__name__}, not a mapping")
    missing = [d for d in domains if d not in vectors]
    if missing:
        raise CheckpointError(
            f"experts {missing} have no router vector (router vectors exist for {sorted(vectors)}); "
            "exclude them (--exclude-experts) or choose another mode"
        )
    try:
        rows = [_vector(vectors[d], f"router vector of {d!r}") for d in domains]
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    lengths = {d: len(v) for d, v in zip(domains, rows)}
    want = dim if dim is not None else (len(rows[0]) if rows else 0)
    bad = {d: n for d, n in lengths.items() if n != want}
    if bad:
        raise CheckpointError(f"router vectors of length {bad}, expected {want} (the model's d_model)")
    if not rows:
        raise CheckpointError("router vectors: no expert asked for")
    return torch.tensor(rows, dtype=torch.float64)
