"""The report's figures: loss.png (training loss vs step, one line per run) and loss_domains.png (per training
domain), drawn with matplotlib's Agg backend; without matplotlib they are left out and the report says so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from launcher.report.numbers import is_number
from launcher.report.runs import Run


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _curve(run: Run, key: str) -> tuple[list[int], list[float]]:
    pts = sorted(
        (r["step"], r[key])
        for r in run.records
        if r.get("kind") == "train" and is_number(r.get("step")) and is_number(r.get(key))
    )
    return [p[0] for p in pts], [p[1] for p in pts]


def loss_figures(runs: list[Run], out: Path) -> tuple[list[str], list[str]]:
    """Write loss.png (and loss_domains.png where a run logs per-domain losses) into `out`; (files, notes)."""
    plt = _pyplot()
    if plt is None:
        return [], [
            "matplotlib is not installed: loss.png and loss_domains.png were not drawn "
            "(install matplotlib and run the report again)"
        ]
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        ax.plot(*_curve(run, "loss"), label=run.label, marker=".")
    ax.set(xlabel="step", ylabel="training loss (nats/token)", title="Training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    plt.close(fig)
    files = ["loss.png"]
    domains = list(
        dict.fromkeys(
            k[5:]
            for run in runs
            for r in run.records
            if r.get("kind") == "train"
            for k in r
            if k.startswith("loss/")
        )
    )
    if domains:
        cols = min(4, len(domains))
        rows = -(-len(domains) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False, sharex=True)
        for ax, d in zip(axes.flat, domains):
            for run in runs:
                ax.plot(*_curve(run, f"loss/{d}"), label=run.label)
            ax.set_title(d, fontsize=9)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(domains) :]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=7)
        fig.suptitle("Training loss per domain (nats/token) vs step")
        fig.tight_layout()
        fig.savefig(out / "loss_domains.png", dpi=100)
        plt.close(fig)
        files.append("loss_domains.png")
    return files, []
