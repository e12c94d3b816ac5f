"""The anchor fingerprint: what "trained from the same anchor" means, bit for bit.

The shared parameters of a checkpoint are every tensor outside its FFN layers (`blocks.<l>.ffn.*`): embeddings,
attention, layer norms. A Dense anchor's FFNs and a DEMix anchor's experts are not shared: an owner's expert
replaces them. An owner trains with every shared parameter frozen, so its checkpoint's shared tensors are the
anchor's, byte for byte, and its fingerprint is the anchor's.

    digest(t)       = sha256( json({"dtype", "shape"}) || bytes of t, C order, little-endian )
    fingerprint(S)  = sha256( "<key>\\t<digest>\\n" for each shared key of S, keys sorted )

Every tool computes it with `anchor_fingerprint` (the package's manifest, the merge, the opt-out proof); the
per-tensor digests travel with it, so a mismatch names the first tensor that differs even when only a manifest is
at hand.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections.abc import Mapping
from typing import Any

import torch

FINGERPRINT_METHOD = "demix-anchor-fingerprint/1"
_FFN_KEY = re.compile(r"^blocks\.\d+\.ffn\.")


def is_shared_key(key: str) -> bool:
    """Whether state-dict key `key` is a shared parameter (outside every FFN layer): an owner never changes it."""
    return _FFN_KEY.match(key) is None


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 over a tensor's dtype, shape and bytes (C order; little-endian, as x86 and every CUDA host store it)."""
    if sys.byteorder != "little":  # pragma: no cover - no supported host is big-endian
        raise RuntimeError("anchor fingerprints are defined on little-endian bytes")
    t = t.detach().to("cpu").contiguous()
    h = hashlib.sha256(json.dumps({"dtype": str(t.dtype), "shape": list(t.shape)}).encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def anchor_fingerprint(state: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The fingerprint of `state`'s shared tensors: {"method", "sha256", "tensors": {key: digest}} (keys sorted)."""
    digests = {k: tensor_digest(state[k]) for k in sorted(state) if is_shared_key(k)}
    whole = hashlib.sha256("".join(f"{k}\t{d}\n" for k, d in digests.items()).encode()).hexdigest()
    return {"method": FINGERPRINT_METHOD, "sha256": whole, "tensors": digests}


def first_difference(have: Mapping[str, Any], want: Mapping[str, Any]) -> str | None:
    """None when fingerprints `have` and `want` are equal, else a clause naming the first shared tensor (in key
    order) that differs, is missing from `have` or is extra in it."""
    if have.get("method") != want.get("method"):
        return f"fingerprint method {have.get('method')!r}, expected {want.get('method')!r}"
    if have.get("sha256") == want.get("sha256"):
        return None
    a, b = have.get("tensors") or {}, want.get("tensors") or {}
    for key in sorted(set(a) | set(b)):
        if key not in a:
            return f"shared tensor {key} is missing"
        if key not in b:
            return f"shared tensor {key} is not in the anchor"
        if a[key] != b[key]:
            return f"shared tensor {key} differs"
    return "the fingerprints differ (their per-tensor digests are equal: one was edited)"
