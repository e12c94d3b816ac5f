"""Heatmaps of an evaluation (launcher/evaluation/evaluate.py): domain posteriors (DEMix Figure 4) and expert
specialisation (DEMix Figure 2). matplotlib with the Agg backend: no display needed.

    python -m launcher.evaluation.figures runs/eval/eval.json [--out DIR]

* posteriors.png: rows = test domains (training domains, then novel ones below a rule), columns = experts, cell =
  mean over the test blocks of the domain posterior p(D = j | block) at the end of each block, under the updating
  prior (eq. 9), the quantity the paper plots after 100 sequences.
* cached_prior_<estimator>_<posterior>.png: the same rows and columns, cell = the cached prior estimated on the
  domain's development blocks, one figure per estimator (mean | ewm | updating) x posterior mode (prefix |
  previous_token) (model/mixture.py), the quantity the paper's Figure 4 shows.
* specialisation.png: rows = training domains i, columns = experts j, cell = ppl(expert j on domain i) /
  ppl(expert i on domain i); the diagonal is 1, cells > 1 mean expert j is worse than domain i's own expert.
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from data.cli import cli_main, exit_process
from data.readers import read_json_object


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def heatmap(
    matrix: np.ndarray,
    rows: Sequence[str],
    cols: Sequence[str],
    path: Path,
    title: str,
    cbar: str,
    fmt: str = "{:.2f}",
    cmap: str = "Blues",
    rule_after: int | None = None,
) -> Path:
    """One annotated heatmap written to `path` (PNG)."""
    plt = _pyplot()
    n_r, n_c = matrix.shape
    width = max(5.5, 2.0 + 0.7 * n_c)
    fig, ax = plt.subplots(figsize=(width, 1.8 + 0.45 * n_r + 0.6), dpi=120)
    im = ax.imshow(matrix, cmap=cmap, aspect="auto")
    ax.set_xticks(range(n_c), labels=list(cols), rotation=45, ha="right")
    ax.set_yticks(range(n_r), labels=list(rows))
    ax.set_xlabel("expert")
    ax.set_ylabel("test domain")
    finite = matrix[np.isfinite(matrix)]
    mid = (finite.min() + finite.max()) / 2 if finite.size else 0.0
    for i in range(n_r):
        for j in range(n_c):
            v = matrix[i, j]
            ax.text(
                j,
                i,
                fmt.format(v) if np.isfinite(v) else "-",
                ha="center",
                va="center",
                fontsize=7,
                color="white" if np.isfinite(v) and v > mid else "black",
            )
    if rule_after is not None and 0 < rule_after < n_r:
        ax.axhline(rule_after - 0.5, color="red", linewidth=1.5)
    fig.colorbar(im, ax=ax, label=cbar)
    ax.set_title(textwrap.fill(title, int(width * 11)), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def posterior_matrix(results: dict[str, Any]) -> tuple[np.ndarray, list[str], list[str], int]:
    """(matrix, row domains, expert names, number of training-domain rows) for Figure 4."""
    experts = results["experts"]
    doms = [d for d, r in results["domains"].items() if r.get("posterior")]
    train = [d for d in doms if results["domains"][d]["role"] == "train"]
    rows = train + [d for d in doms if d not in train]
    m = np.array(
        [[results["domains"][d]["posterior"]["updating_mean_end_of_block"][e] for e in experts] for d in rows]
    )
    return m.reshape(len(rows), len(experts)), rows, experts, len(train)


def cached_prior_matrix(
    results: dict[str, Any], variant: str
) -> tuple[np.ndarray, list[str], list[str], int]:
    """(matrix, row domains, expert names, training rows) of one cached-prior variant ("<estimator>/<posterior>")."""
    experts = results["experts"]
    doms = [d for d, r in results["domains"].items() if variant in r.get("cached_prior_variants", {})]
    train = [d for d in doms if results["domains"][d]["role"] == "train"]
    rows = train + [d for d in doms if d not in train]
    m = np.array(
        [[results["domains"][d]["cached_prior_variants"][variant][e] for e in experts] for d in rows]
    )
    return m.reshape(len(rows), len(experts)), rows, experts, len(train)


def specialisation_matrix(results: dict[str, Any]) -> tuple[np.ndarray, list[str], list[str]]:
    """(ppl ratio matrix, training-domain rows, expert names) for Figure 2."""
    experts = results["experts"]
    rows = [
        d
        for d, r in results["domains"].items()
        if r["role"] == "train" and r.get("expert_ppl") and d in experts
    ]
    m = np.array(
        [
            [results["domains"][d]["expert_ppl"][e] / results["domains"][d]["expert_ppl"][d] for e in experts]
            for d in rows
        ]
    )
    return m.reshape(len(rows), len(experts)), rows, experts


def write_figures(results: dict[str, Any], out_dir: str | Path) -> dict[str, str]:
    """Write the heatmaps that `results` supports (DEMix evaluations only) and return {name: path}."""
    out_dir, written = Path(out_dir), {}
    if not results.get("experts"):
        return written
    m, rows, cols, n_train = posterior_matrix(results)
    if len(rows):
        written["posteriors"] = str(
            heatmap(
                m,
                rows,
                cols,
                out_dir / "posteriors.png",
                cbar="p(D = expert | block)",
                title=f"Domain posteriors, updating prior (λ={results['decay']}), mean at the end of "
                f"{results['split']} blocks (cf. DEMix Fig. 4); training domains above the rule",
                rule_after=n_train,
            )
        )
    names = sorted({v for r in results["domains"].values() for v in r.get("cached_prior_variants", {})})
    for name in names:
        m, rows, cols, n_train = cached_prior_matrix(results, name)
        est, post = name.split("/")
        written[f"cached_prior_{est}_{post}"] = str(
            heatmap(
                m,
                rows,
                cols,
                out_dir / f"cached_prior_{est}_{post}.png",
                cbar="cached p(D = expert)",
                title=f"Cached prior, estimator {est}, posterior {post}, from {results['cached_blocks']} "
                f"{results['dev_split']} blocks (cf. DEMix Fig. 4); training domains above the rule",
                rule_after=n_train,
            )
        )
    m, rows, cols = specialisation_matrix(results)
    if len(rows):
        written["specialisation"] = str(
            heatmap(
                m,
                rows,
                cols,
                out_dir / "specialisation.png",
                cbar="ppl(expert) / ppl(own expert)",
                cmap="Reds",
                title="Expert specialisation: ppl of expert j on domain i / ppl of domain i's expert "
                "(cf. DEMix Fig. 2)",
            )
        )
    return written


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="eval.json written by launcher.evaluation.evaluate")
    ap.add_argument("--out", help="directory for the PNGs (default: next to the JSON)")
    args = ap.parse_args(argv)
    path = Path(args.results)
    results = read_json_object(path, {"domains": dict, "experts?": list}, what="an evaluation")
    try:
        written = write_figures(results, args.out or path.parent)
    except (LookupError, TypeError, AttributeError) as e:  # an entry of another shape than evaluate writes
        raise ValueError(
            f"{path} is not an eval.json of launcher.evaluation.evaluate ({type(e).__name__}: {e})"
        ) from None
    for name, p in written.items():
        print(f"{name}: {p}")
    return 0


if __name__ == "__main__":
    exit_process(main())
