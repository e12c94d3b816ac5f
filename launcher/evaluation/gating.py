"""Per-domain gating analysis of a GShard model (DEMix §A.5: GShard's token routing is not domain-modular).

Shape legend: B batch, T tokens, G domains, E experts.

For every MoE layer l and domain d, the average gate probability over all tokens of d's sequences:

    M_l[d, e] = 1/|d| sum_{sequences b of d} 1/T sum_t p_l(e | x_bt)

Rows sum to 1. A modular router would put each row's mass on few experts (low row entropy H(M_l[d])) and
different rows on different experts; the paper finds high-entropy, domain-agnostic rows.

    python -m launcher.evaluation.gating CKPT_DIR --data TOKENS_DIR --out DIR [--batches 8] [--batch-size 4]
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from data.argtypes import positive_int
from data.atomic import staged_dir
from data.cli import cli_main, exit_process


@torch.no_grad()
def gating_matrix(model: Any, batches_by_domain: dict[str, list[dict[str, torch.Tensor]]]) -> dict:
    """{"domains": [G names], "num_experts": E, "layers": {"layer<i>": G x E nested list},
    "token_entropy": {"layer<i>": [G mean per-token router entropies, nats]}} from a plain (single-process) GPT.
    Each batch dict holds `tokens_BT` (or `tokens`)."""
    was_training = model.training
    model.eval()
    sums: dict[str, dict[str, torch.Tensor]] = {}
    ent: dict[str, dict[str, float]] = {}
    counts: dict[str, int] = {}
    try:
        for domain, batches in batches_by_domain.items():
            counts[domain] = 0
            for batch in batches:
                tokens_BT = batch["tokens_BT"] if "tokens_BT" in batch else batch["tokens"]
                stats = model(tokens_BT, return_logits=False).ffn_stats
                B = tokens_BT.shape[0]
                counts[domain] += B
                for key, v in stats.items():
                    layer, _, name = key.partition("/")
                    if name == "gate_prob_BE":
                        per = sums.setdefault(layer, {})
                        per[domain] = per.get(domain, 0.0) + v.double().sum(0)
                    elif name == "router_entropy":
                        per_e = ent.setdefault(layer, {})
                        per_e[domain] = per_e.get(domain, 0.0) + float(v) * B
    finally:
        model.train(was_training)
    if not sums:
        raise ValueError("the model has no GShard layer reporting gate_prob_BE (is model.ffn.kind gshard?)")
    domains = [d for d in batches_by_domain if counts[d] > 0]
    layers = sorted(sums, key=lambda s: int(s.removeprefix("layer")))
    return {
        "domains": domains,
        "num_experts": int(next(iter(sums[layers[0]].values())).numel()),
        "layers": {l: [(sums[l][d] / counts[d]).tolist() for d in domains] for l in layers},
        "token_entropy": {l: [ent[l][d] / counts[d] for d in domains] for l in layers if l in ent},
    }


def row_entropy(row: Sequence[float]) -> float:
    """H(M[d]) = -sum_e M[d, e] log M[d, e] (nats)."""
    return -sum(p * math.log(p) for p in row if p > 0)


def write_gating_report(matrix: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write `gating.json` (the matrix plus each row's entropy) and `gating.png` (one heatmap per layer)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    # both files staged and published together (data/atomic.py `staged_dir`): a failure leaves neither
    with staged_dir(out, manifest="gating.json", shared=True) as tmp:
        report = {
            **matrix,
            "row_entropy": {l: [row_entropy(r) for r in m] for l, m in matrix["layers"].items()},
            "uniform_entropy": math.log(matrix["num_experts"]),
        }
        (tmp / "gating.json").write_text(json.dumps(report, indent=2) + "\n")
        layers = list(matrix["layers"])
        G, E = len(matrix["domains"]), matrix["num_experts"]
        fig, axes = plt.subplots(
            1, len(layers), figsize=(1.5 + 0.45 * E * len(layers), 1.2 + 0.4 * G), squeeze=False
        )
        for ax, layer in zip(axes[0], layers):
            im = ax.imshow(matrix["layers"][layer], aspect="auto", cmap="viridis", vmin=0.0)
            ax.set_title(layer)
            ax.set_xlabel("expert")
            ax.set_xticks(range(E))
            ax.set_yticks(range(G))
            ax.set_yticklabels(matrix["domains"] if ax is axes[0][0] else [])
            fig.colorbar(im, ax=ax, fraction=0.05)
        fig.suptitle("mean gate probability per domain")
        fig.tight_layout()
        fig.savefig(tmp / "gating.png", dpi=120)
        plt.close(fig)
    return {"json": out / "gating.json", "png": out / "gating.png"}


def validation_batches(
    root: str | Path, tokenizer: str, domains: Sequence[str], seq_len: int, batches: int, batch_size: int
) -> dict[str, list[dict[str, torch.Tensor]]]:
    """The first `batches` x `batch_size` validation blocks of each domain."""
    from data.blocks import BlockDataset

    out: dict[str, list[dict[str, torch.Tensor]]] = {}
    for d in domains:
        ds = BlockDataset.from_prepared(root, tokenizer, d, split="valid", seq_len=seq_len)
        n = min(len(ds), batches * batch_size)
        blocks = [torch.from_numpy(ds[i][:-1]) for i in range(n)]
        out[d] = [{"tokens_BT": torch.stack(blocks[i : i + batch_size])} for i in range(0, n, batch_size)]
    return out


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    from launcher.checkpoint import load_consolidated, read_meta

    ap = argparse.ArgumentParser(
        prog="python -m launcher.evaluation.gating", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("checkpoint", help="consolidated checkpoint directory")
    ap.add_argument("--data", required=True, help="tokenised corpus directory (DataConfig.path)")
    ap.add_argument("--out", required=True, help="report directory")
    ap.add_argument("--tokenizer", default=None, help="default: the checkpoint's data.tokenizer")
    ap.add_argument("--batches", type=positive_int, default=8)
    ap.add_argument("--batch-size", type=positive_int, default=4)
    ap.add_argument(
        "--seq-len", type=positive_int, default=None, help="default and most: the model's context"
    )
    a = ap.parse_args(argv)
    context = read_meta(a.checkpoint)["config"]["model"]["seq_len"]  # checked before a tensor is read
    if a.seq_len is not None and a.seq_len > context:
        ap.error(f"--seq-len {a.seq_len} is beyond the model's context ({context} tokens)")
    from launcher.checkpoint_data import check_checkpoint_data

    check_checkpoint_data(a.checkpoint, a.data, a.tokenizer)
    ckpt = load_consolidated(a.checkpoint)
    model = ckpt.build_model()
    cfg = ckpt.cfg
    domains = ckpt.domains or cfg.data.domains
    if not domains:
        ap.error(f"{a.checkpoint} names no domains (meta.json 'domains' and data.domains are empty)")
    batches = validation_batches(
        a.data,
        a.tokenizer or cfg.data.tokenizer,
        domains,
        a.seq_len or cfg.model.seq_len,
        a.batches,
        a.batch_size,
    )
    paths = write_gating_report(gating_matrix(model, batches), a.out)
    print(f"wrote {paths['json']} and {paths['png']}")
    return 0


if __name__ == "__main__":
    exit_process(main())
