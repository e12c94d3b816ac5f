"""How DBSCAN's automatic eps (`model.ffn.cse.dbscan_auto=target`) clusters a trained model's sequence embeddings,
and what the older "least noise in range" rule would have chosen from the same scan.

    python -m experiments.cse_eps RUN/model [--data artifacts/demo/tokens] [--blocks 32] [--layers 2,3]
                                 [--min-clusters 4] [--max-clusters 8] [--out experiments/results/cse_eps.md]

Embeds `--blocks` train blocks of every training domain exactly as a CSE layer does at its warm-up boundary (the
FFN input of each layer, mean over tokens, the layer's fixed Gaussian projection; model/cse.py), runs
parallel.cse.cluster_embeddings with `target`, and reports per layer: the chosen eps, cluster sizes, and the purity
of the routed sequences against the true domains (parallel.cse.cluster_record, what the trainer logs). The
comparison row re-runs DBSCAN at the eps the old rule picks from the same recorded scan (least noise among the
candidates with min..max clusters).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.machine import machine_info
from data.argtypes import positive_int
from launcher.tables import markdown_table


def embeddings(
    model_dir: str, data: str, blocks: int, layers: Sequence[int]
) -> tuple[dict[int, torch.Tensor], np.ndarray, list[str], int]:
    """Projected sequence embeddings per layer (N x P), the true domain index of each sequence, the domains and the
    checkpoint's step."""
    from launcher.checkpoint import load_consolidated
    from launcher.checkpoint_data import block_inputs, load_blocks
    from model.cse import PROJECTION_SEED, gaussian_projection

    c = load_consolidated(model_dir)
    model = c.build_model().eval()
    caps: dict[int, list[torch.Tensor]] = {l: [] for l in layers}
    hooks = [
        model.blocks[l].ffn.register_forward_hook(lambda m, inp, out, l=l: caps[l].append(inp[0].detach()))
        for l in layers
    ]
    truth: list[int] = []
    tok_name = c.cfg.data.tokenizer
    for i, dom in enumerate(c.domains):
        b = load_blocks(data, tok_name, dom, "train", c.cfg.model.seq_len, blocks)
        if not len(b):
            continue
        with torch.no_grad():
            model(block_inputs(b)[0])
        truth += [i] * len(b)
    for h in hooks:
        h.remove()
    out = {}
    for l in layers:
        h = torch.cat(caps[l]).float().mean(dim=1)
        out[l] = h @ gaussian_projection(h.shape[1], 32, PROJECTION_SEED + l)
    return out, np.array(truth), list(c.domains), c.step


def compare(
    v: torch.Tensor, truth: np.ndarray, lo: int, hi: int, min_samples: int = 5
) -> dict[str, dict[str, Any]]:
    """The `target` rule's clustering and the old least-noise rule's, from the same eps scan."""
    from parallel.cse import cluster_embeddings, cluster_record

    res = cluster_embeddings(v, 0.0, min_samples, hi, "target", lo)
    in_range = [r for r in res.eps_scan or [] if lo <= r["clusters"] <= hi]
    rows = {"most clusters (target)": res}
    if in_range:
        old = min(in_range, key=lambda r: (r["noise"], r["eps"]))["eps"]
        rows["least noise in range (old)"] = cluster_embeddings(v, old, min_samples, hi)
    out = {}
    for name, r in rows.items():
        rec = cluster_record(r, v, truth)
        sizes = np.bincount(r.dbscan_labels_N[r.dbscan_labels_N >= 0]).tolist()
        out[name] = {
            "eps": r.eps,
            "clusters": r.num_clusters,
            "sizes": sizes,
            "noise": int((r.dbscan_labels_N < 0).sum()),
            "purity": rec["purity"],
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.cse_eps", description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--data", default="artifacts/demo/tokens")
    p.add_argument("--blocks", type=positive_int, default=32)
    p.add_argument("--layers", default="2,3")
    p.add_argument("--min-clusters", type=positive_int, default=4)
    p.add_argument("--max-clusters", type=positive_int, default=8)
    p.add_argument("--out", default=None, help="also write the markdown table here")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    layers = [int(x) for x in a.layers.split(",")]
    emb, truth, domains, step = embeddings(a.model, a.data, a.blocks, layers)
    m = machine_info()
    lines = [
        "# DBSCAN eps from the data: `target` rule vs least noise",
        "",
        f"`python -m experiments.cse_eps {' '.join(argv if argv is not None else sys.argv[1:])}`",
        "",
        f"Model `{a.model}` at step {step}; {len(truth)} train blocks ({a.blocks} per domain, {len(domains)} domains); "
        f"clusters wanted {a.min_clusters}..{a.max_clusters}; purity of the routed sequences against the true "
        f"domains (1/{len(domains)} = {1 / len(domains):.3f} is chance for balanced domains). Machine: "
        f"{m['cpu']}, 1-min load {m['loadavg_1m']}; {time.perf_counter() - t0:.0f} s.",
        "",
    ]
    lines += markdown_table(
        ["layer", "rule", "eps", "clusters", "sizes", "noise", "purity"],
        [
            [
                l,
                name,
                f"{r['eps']:.3f}",
                r["clusters"],
                "/".join(map(str, r["sizes"])),
                r["noise"],
                f"{r['purity']:.3f}",
            ]
            for l in layers
            for name, r in compare(emb[l], truth, a.min_clusters, a.max_clusters).items()
        ],
    )
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
