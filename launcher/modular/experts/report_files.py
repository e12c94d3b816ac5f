"""The modularity tables (launcher/modular/experts/tables.py) as Markdown, and both written together with their
JSON into a report folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from data.atomic import staged_dir
from data.cli import check_output_dir
from launcher.checkpoint import write_json_atomic
from launcher.modular.experts.tables import pct_change
from launcher.tables import markdown_table


def adaptation_markdown(r: dict[str, Any]) -> str:
    s = r["summary"]
    dm, dn = s["demix"], s["dense"]
    new = ", ".join(r["new_domains"])
    lines = [
        f"### Adding experts (Table 6 shape): average perplexity, cached-prior mixture; new: {new}",
        "",
        *markdown_table(
            ["domains", f"{dm['experts_before']} experts", f"{dm['experts_after']} experts (DEMix-DAPT)"],
            [
                ["training", f"{dm['train_before']:.2f}", f"{dm['train_after']:.2f}"],
                ["novel (added)", f"{dm['novel_before']:.2f}", f"{dm['novel_after']:.2f}"],
            ],
        ),
        "",
        "### Forgetting (Table 13 shape): change in average perplexity after DAPT",
        "",
        "| | training (T) | novel (N) |",
        "|---|---|---|",
        f"| Dense-DAPT | {dn['train_change_pct']:+.1f}% | {dn['novel_change_pct']:+.1f}% |",
        f"| DEMix-DAPT | {dm['train_change_pct']:+.1f}% | {dm['novel_change_pct']:+.1f}% |",
        "",
        "### Per domain: perplexity before -> after",
        "",
    ]
    rows = r["per_domain"]
    table = []
    for d in r["train_domains"] + r["new_domains"]:
        role = "new" if d in r["new_domains"] else "train"
        own = (
            [f"{rows['demix_before_own_expert'][d]:.2f}", f"{rows['demix_after_own_expert'][d]:.2f}"]
            if role == "train"
            else ["-", "-"]
        )
        table.append(
            [
                d,
                role,
                *(
                    f"{rows[k][d]:.2f}"
                    for k in ("dense_before", "dense_after", "demix_before", "demix_after")
                ),
                *own,
            ]
        )
    lines += markdown_table(
        [
            "domain",
            "role",
            "Dense",
            "Dense-DAPT",
            "DEMix (mix)",
            "DEMix-DAPT (mix)",
            "own expert before",
            "own expert after",
        ],
        table,
    )
    lines += [
        "",
        f"Own-expert perplexity on training domains changed by at most {r['own_expert_max_abs_change']:.2e} "
        "(DEMix-DAPT leaves the old experts and shared weights untouched).",
        f"Test blocks per domain: {r['max_blocks']}; cached prior from {r['cached_blocks']} dev blocks.",
    ]
    return "\n".join(lines) + "\n"


def removal_markdown(r: dict[str, Any]) -> str:
    rows = [
        [d, f"{row['plus_expert']:.2f}", f"{row['minus_expert']:.2f}", f"{row['change_pct']:+.1f}%"]
        for d, row in r["per_domain"].items()
    ]
    a = r["average"]
    if a:
        rows.append(
            [
                "**average**",
                f"{a['plus_expert']:.2f}",
                f"{a['minus_expert']:.2f}",
                f"{pct_change(a['minus_expert'], a['plus_expert']):+.1f}%",
            ]
        )
    lines = [
        "### Removing experts (Table 7 shape): cached-prior mixture perplexity",
        "",
        *markdown_table(["domain", "+Expert", "-Expert", "change"], rows),
    ]
    if r.get("matrix"):
        doms = r["evaluated_domains"]
        lines += [
            "",
            "### Removing each expert: perplexity change on every domain (rows: expert removed)",
            "",
            *markdown_table(
                ["removed \\ domain", *doms],
                [[f"-{e}", *(f"{r['matrix'][e][d]:+.1f}%" for d in doms)] for e in r["experts"]],
            ),
        ]
        own, other = r.get("own_change_mean"), r.get("other_change_mean")
        lines += [
            "",
            f"Mean change on the removed expert's own domain: {own:+.1f}%; on the other domains: "
            f"{other:+.1f}%."
            if own is not None and other is not None
            else "",
        ]
    lines += [
        "",
        f"Experts: {', '.join(r['experts'])}. -Expert masks the domain's expert out of the prior and the "
        f"posterior. Test blocks per domain: {r['max_blocks']}; cached prior from {r['cached_blocks']} dev blocks.",
    ]
    return "\n".join(lines) + "\n"


def check_report_out(out: str | Path, name: str, fmt: str) -> None:
    """The output rule (data/cli.py) for `report --out`: new, or holding this report's own `<name>.json`."""
    check_output_dir(Path(out), [fmt], [f"{name}.json", f"{name}.md"], manifest=f"{name}.json", what="--out")


def write_report(report: dict[str, Any], markdown: str, out: str | Path, name: str) -> tuple[Path, Path]:
    """Write `<out>/<name>.json` and `<out>/<name>.md` together (data/atomic.py `staged_dir`, into a folder other
    reports share): a failure, a full disk included, leaves neither."""
    out = Path(out)
    with staged_dir(out, manifest=f"{name}.json", shared=True) as tmp:
        (tmp / f"{name}.md").write_text(markdown)
        write_json_atomic(tmp / f"{name}.json", report)
    return out / f"{name}.json", out / f"{name}.md"
