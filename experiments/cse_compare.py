"""Dense vs CSE vs DEMix-on-clustered-domains vs DEMix-on-true-domains on the demo corpus, labels hidden from all
but the last, compared by per-domain test perplexity on the *true* domains, plus cluster / true-domain agreement.

    python -m experiments.cse_compare [--arms dense,cse,demix-clustered,demix-true] [--nproc 4] [--steps 60]
        [--k 8] [--max-blocks 16] [--reuse-demo] [--out runs/cse]

1. Clustered domains: `data.cluster_domains.relabel_prepared` clusters the demo's training documents (tf-idf + SVD
   + balanced k-means, labels hidden) and writes artifacts/cse/clustered/ - the demo's own token ids, tokenizer and
   document splits, regrouped by cluster (re-preparing the clustered JSONL would train another sentencepiece
   model, and perplexities under different tokenizers are not comparable).
2. Training: each arm is `python -m launcher.launch --config configs/cse/<arm>.yaml` on N local ranks. An arm that
   fails (e.g. CSE before the trainer calls parallel.cse.CSEController) is recorded as failed, the rest go on.
   `--reuse-demo` takes Dense and DEMix-true from runs/demo/{dense,demix} when they were trained for the same steps
   (the configs are identical to configs/demo/{dense,demix}.yaml).
3. Evaluation: launcher.evaluation.evaluate on artifacts/demo/tokens (the true domains' test blocks). DEMix-clustered
   sees the true domains as novel: `updating` (posterior mixture, no labels) is its fair number; `cached` estimates
   the prior on the domain's valid blocks; `naive` there is the best single cluster expert (an oracle choice).
4. Outputs under --out: report.json, report.md, and per run plots (`cse_plots`): cluster loads over training,
   inter-centre distances, domain share per cluster (CSE), cluster composition (clustered domains).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from data.argtypes import positive_int, random_seed
from data.cli import usage_error
from launcher.tables import markdown_table

ARMS = ("dense", "cse", "demix-clustered", "demix-true")
DEMO_RUN = {"dense": "dense", "demix-true": "demix"}
CLUSTERED = Path("artifacts/cse/clustered")
TRUE_DATA = Path("artifacts/demo/tokens")


# ----------------------------------------------------------------------------------------------------
# Plots and logging helpers
# ----------------------------------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def cluster_load_series(metrics: Sequence[dict]) -> dict[str, list[tuple[int, list[float]]]]:
    """Per CSE layer: (step, routed sequences per expert) from the trainer's `train` records."""
    out: dict[str, list[tuple[int, list[float]]]] = {}
    for r in metrics:
        if r.get("kind") != "train":
            continue
        for k, v in r.items():
            if k.endswith("/cluster_load_E") and isinstance(v, list):
                out.setdefault(k.split("/")[0], []).append((int(r["step"]), [float(x) for x in v]))
    return out


def cse_plots(run_dir: Path, out_dir: Path | None = None) -> dict[str, Any]:
    """From `<run_dir>/metrics.jsonl`: cluster sizes over time, inter-centre distances and domain share per
    cluster (the `cse` record written at the warm-up boundary) -> JSON + PNGs. Returns the summary."""
    import numpy as np

    from launcher.metrics import read_metrics

    run_dir = Path(run_dir)
    out_dir = Path(out_dir or run_dir / "cse")
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = list(read_metrics(run_dir / "metrics.jsonl")) if (run_dir / "metrics.jsonl").is_file() else []
    loads = cluster_load_series(metrics)
    clustering = [r for r in metrics if r.get("kind") == "cse"]
    summary = {"cluster_loads": loads, "clustering": clustering, "files": {}}
    plt = _plt()
    if loads:
        fig, axes = plt.subplots(1, len(loads), figsize=(5 * len(loads), 3.5), squeeze=False)
        for ax, (layer, series) in zip(axes[0], sorted(loads.items())):
            steps = [s for s, _ in series]
            arr = np.array([v for _, v in series])
            for e in range(arr.shape[1]):
                if arr[:, e].any():
                    ax.plot(steps, arr[:, e], label=f"expert {e}")
            ax.set(title=f"{layer}: sequences per expert", xlabel="step", ylabel="sequences / micro-batch")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / "cluster_sizes.png", dpi=100)
        plt.close(fig)
        summary["files"]["cluster_sizes"] = str(out_dir / "cluster_sizes.png")
    for rec in clustering[-1:]:
        for layer, lr in rec.get("layers", {}).items():
            fig, axes = plt.subplots(1, 2, figsize=(11, 4))
            d = np.array(lr["centre_distances"])
            im = axes[0].imshow(d, cmap="viridis")
            axes[0].set(title=f"layer {layer}: ||c_i - c_j||", xlabel="cluster", ylabel="cluster")
            fig.colorbar(im, ax=axes[0])
            share = lr.get("domain_share", {})
            doms = sorted({dm for s in share.values() for dm in s})
            bottom = np.zeros(len(share))
            for dm in doms:
                vals = np.array([share[c].get(dm, 0.0) for c in sorted(share, key=int)])
                axes[1].bar(range(len(share)), vals, bottom=bottom, label=dm)
                bottom += vals
            axes[1].set(
                title=f"layer {layer}: domain share per cluster (sizes {lr['dispatch_sizes']})",
                xlabel="cluster",
            )
            if doms:
                axes[1].legend(fontsize=7)
            fig.tight_layout()
            fig.savefig(out_dir / f"clusters_layer{layer}.png", dpi=100)
            plt.close(fig)
            summary["files"][f"clusters_layer{layer}"] = str(out_dir / f"clusters_layer{layer}.png")
    (out_dir / "cse.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def composition_plot(report: dict, path: Path) -> Path:
    """Cluster x true-domain document counts (train split) of the clustered corpus."""
    import numpy as np

    comp = report["splits"]["train"]["composition"]
    clusters = sorted(comp)
    doms = sorted({d for c in comp.values() for d in c})
    m = np.array([[comp[c].get(d, 0) for d in doms] for c in clusters], dtype=float)
    m = m / np.maximum(m.sum(1, keepdims=True), 1)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(1 + 0.7 * len(doms), 1 + 0.45 * len(clusters)))
    ax.imshow(m, cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(len(doms)), doms, rotation=45, ha="right")
    ax.set_yticks(range(len(clusters)), clusters)
    for i in range(len(clusters)):
        for j in range(len(doms)):
            if m[i, j] >= 0.05:
                ax.text(j, i, f"{m[i, j]:.2f}", ha="center", va="center", fontsize=7)
    ax.set_title("share of each cluster's documents by true domain")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------------
# Steps
# ----------------------------------------------------------------------------------------------------


def clustered_data(k: int, seed: int, force: bool = False) -> dict:
    from data.cluster_domains import relabel_prepared

    report_path = CLUSTERED / "sentencepiece" / "cluster_report.json"
    if report_path.is_file() and not force:
        report = json.loads(report_path.read_text())
        if report.get("k") == k:
            return report
    print(f"[cse] clustering the demo training documents into {k} domains (labels hidden) ...", flush=True)
    return relabel_prepared(TRUE_DATA, "sentencepiece", CLUSTERED, k=k, seed=seed)


def _finished(run_dir: Path, steps: int) -> bool:
    meta = run_dir / "model" / "meta.json"
    return meta.is_file() and int(json.loads(meta.read_text()).get("step", -1)) == steps


def train_arm(arm: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train one arm through the launcher (or reuse a finished run); never raises."""
    from launcher.launch import main as launch

    run_dir = Path(args.out) / arm
    demo = Path("runs/demo") / DEMO_RUN.get(arm, "-")
    if args.reuse_demo and arm in DEMO_RUN and _finished(demo, args.steps):
        return {"status": "reused", "run_dir": str(demo)}
    if _finished(run_dir, args.steps) and not args.fresh:
        return {"status": "reused", "run_dir": str(run_dir)}
    argv = [
        "--config",
        f"configs/cse/{arm}.yaml",
        "--nproc",
        str(args.nproc),
        "--run-dir",
        str(run_dir),
        "--resume",
        "never" if args.fresh else "auto",
        "--set",
        f"train.steps={args.steps}",
    ]
    print(f"[cse] training {arm}: python -m launcher.launch {' '.join(argv)}", flush=True)
    t0 = time.perf_counter()
    try:
        rc = launch(argv)
    except BaseException as e:  # a failing arm is a result, not the end of the comparison
        return {
            "status": "failed",
            "run_dir": str(run_dir),
            "error": "".join(traceback.format_exception_only(e)).strip(),
        }
    rec = {
        "run_dir": str(run_dir),
        "seconds": round(time.perf_counter() - t0, 1),
        "command": f"python -m launcher.launch {' '.join(argv)}",
    }
    if rc != 0 or not _finished(run_dir, args.steps):
        return {**rec, "status": "failed", "error": f"launcher exit {rc}; see {run_dir} and the output above"}
    return {**rec, "status": "trained"}


def evaluate_arm(run_dir: Path, domains: Sequence[str], max_blocks: int) -> dict[str, Any]:
    from launcher.evaluation.evaluate import evaluate_checkpoint

    res = evaluate_checkpoint(
        run_dir / "model",
        TRUE_DATA,
        tokenizer="sentencepiece",
        split="test",
        max_blocks=max_blocks,
        domains=list(domains),
        modes=("naive", "updating", "cached"),
        out_dir=run_dir / "eval_true_domains",
        progress=False,
    ).to_dict()
    return {d: e["ppl"] for d, e in res["domains"].items()}


def arm_columns(arm: str, ppl: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The numbers a table shows per arm: one column, or DEMix's modes."""
    if arm == "demix-true":
        return {"DEMix-true (own expert)": {d: p["naive"] for d, p in ppl.items()}}
    if arm == "demix-clustered":
        return {
            "DEMix-clustered updating": {d: p["updating"] for d, p in ppl.items()},
            "DEMix-clustered cached": {d: p["cached"] for d, p in ppl.items()},
            "DEMix-clustered best expert": {d: p["naive"] for d, p in ppl.items()},
        }
    return {{"dense": "Dense", "cse": "CSE"}[arm]: {d: p["ppl"] for d, p in ppl.items()}}


def markdown(report: dict) -> str:
    cols = report["columns"]
    names = list(cols)
    doms = report["domains"]
    lines = [
        f"# CSE comparison ({report['steps']} steps, {report['nproc']} CPU ranks, k = {report['k']})",
        "",
        "Test perplexity on the true training domains (lower is better). Only DEMix-true saw the labels.",
        "",
        *markdown_table(
            ["domain", *names],
            [[d, *(f"{cols[n].get(d, float('nan')):.1f}" for n in names)] for d in doms + ["average"]],
        ),
    ]
    a = report["agreement"]
    lines += [
        "",
        f"Clusters vs true domains (k-means, labels hidden): train purity {a['train']['purity']:.3f}, "
        f"NMI {a['train']['nmi']:.3f}, ARI {a['train']['ari']:.3f}; test purity {a['test']['purity']:.3f}, "
        f"NMI {a['test']['nmi']:.3f}.",
        "",
        "Arms:",
        "",
    ]
    for arm, st in report["arms"].items():
        lines.append(
            f"- {arm}: {st['status']}"
            + (f" ({st['run_dir']})" if st.get("run_dir") else "")
            + (f" - {st['error']}" if st.get("error") else "")
            + (f" - `{st['command']}`" if st.get("command") else "")
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--nproc", type=positive_int, default=4)
    p.add_argument("--steps", type=positive_int, default=60)
    p.add_argument(
        "--k",
        type=positive_int,
        default=8,
        help="clusters for DEMix-clustered (default: as many as true domains)",
    )
    p.add_argument("--seed", type=random_seed, default=0)
    p.add_argument("--max-blocks", type=positive_int, default=16, help="test blocks per domain")
    p.add_argument(
        "--reuse-demo", action="store_true", help="take Dense / DEMix-true from runs/demo when finished"
    )
    p.add_argument("--fresh", action="store_true")
    p.add_argument("--out", default="runs/cse")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from data.catalog import load_catalog
    from launcher.checkpoint import write_json_atomic

    t0 = time.perf_counter()
    domains = list(load_catalog(TRUE_DATA, "sentencepiece").train_domains)
    clusters = clustered_data(args.k, args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    composition_plot(clusters, out / "cluster_composition.png")
    arms, columns = {}, {}
    for arm in [a for a in args.arms.split(",") if a]:
        if arm not in ARMS:
            return usage_error(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")
        st = train_arm(arm, args)
        if st["status"] != "failed":
            try:
                ppl = evaluate_arm(Path(st["run_dir"]), domains, args.max_blocks)
                for name, col in arm_columns(arm, ppl).items():
                    col["average"] = sum(col.values()) / len(col)
                    columns[name] = col
                if arm == "cse":
                    summary = cse_plots(Path(st["run_dir"]), out / "cse_plots")
                    st["plots"] = summary["files"]
                    if not summary["clustering"]:  # the layers never left warm-up: this was the dense model
                        st["status"] = "unclustered"
                        st["error"] = (
                            "no `cse` record in metrics.jsonl: the trainer does not call "
                            "parallel.cse.CSEController yet, so every sequence used expert 0 (= Dense)"
                        )
            except Exception as e:  # noqa: BLE001 - recorded, the other arms still count
                st = {**st, "status": "failed", "error": f"evaluation: {e}"}
        arms[arm] = st
    report = {
        "format": "demix-cse-compare/1",
        "steps": args.steps,
        "nproc": args.nproc,
        "k": args.k,
        "domains": domains,
        "columns": columns,
        "arms": arms,
        "seconds": round(time.perf_counter() - t0, 1),
        "agreement": {
            s: {m: clusters["splits"][s][m] for m in ("purity", "nmi", "ari")} for s in ("train", "test")
        },
        "cluster_sizes": {s: clusters["splits"][s]["sizes"] for s in ("train", "valid", "test")},
    }
    write_json_atomic(out / "report.json", report)
    (out / "report.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
