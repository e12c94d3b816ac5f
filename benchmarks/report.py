"""Render a throughput sweep's results.json as Markdown and a self-contained HTML page (plots inline).

    python -m benchmarks.report <sweep-dir> [--out DIR] [--costmodel benchmarks/results/costmodel_paper.json]

Only renders: no training. Sections: every point (tokens/s, TFLOPs/GPU in both FLOP conventions, MFU, peak
memory, scaling); Tables 2/9 layout (rows size, columns architecture: parameters, TFLOPs/update from
model/accounting.py, measured TFLOPs/GPU) per world size; scaling (tokens/s, efficiency and overhead share vs
world size) with plots; failed points with their error; the cost model's 12 paper configurations with each
point's error (from costmodel_paper.json, or computed when the file is missing); and, when the sweep names a
cluster preset, the cost model's prediction beside each measured point.

Writes into --out (default: the sweep dir): report.md, report.html, the PNGs, and results.json (a copy, when
--out is not the sweep dir), so that `python -m benchmarks.report <out>` re-renders from there too.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import shlex
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data.cli import usage_error
from launcher.tables import markdown_table

ROOT = Path(__file__).resolve().parents[1]
COSTMODEL_JSON = ROOT / "benchmarks" / "results" / "costmodel_paper.json"
ARCH_ORDER: tuple[str, ...] = ("dense", "demix", "gshard", "cse")
ARCH_LABEL: dict[str, str] = {"dense": "Dense", "demix": "DEMix", "gshard": "GShard", "cse": "CSE"}
FLOPS_NOTE = (
    "TFLOPs/GPU in two labelled conventions: *rec.* = recompute, the paper's (Narayanan et al. 2021 "
    "eq. 3: 4 forward passes of the layers, as with activation recomputation); *no-rec.* = forward + "
    "backward only (3 passes), what most trainers call model FLOPs. Both are model FLOPs of the work "
    "the point does, divided by measured step time and GPUs (ranks)."
)


# --------------------------------------------------------------------------------------------------
# Document pieces: one structure, rendered to Markdown and to HTML
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Table:
    header: list[str]
    rows: list[list[str]]
    title: str = ""
    note: str = ""


@dataclass(frozen=True)
class Figure:
    name: str  # file name of the PNG
    png: bytes
    caption: str


@dataclass(frozen=True)
class Heading:
    text: str
    level: int = 2


@dataclass(frozen=True)
class Para:
    text: str


Block = Table | Figure | Heading | Para


def num(v: Any, unit: str = "") -> str:
    """Compact numbers: thousands separators for large values, 3 significant digits for small ones."""
    if v is None:
        return "–"
    if isinstance(v, str):
        return v
    v = float(v)
    if abs(v) >= 100:
        s = f"{v:,.0f}"
    elif abs(v) >= 1:
        s = f"{v:.2f}"
    else:
        s = f"{v:.3g}"
    return s + unit


def pct(v: float | None, signed: bool = False) -> str:
    return "–" if v is None else (f"{100 * v:+.1f}%" if signed else f"{100 * v:.1f}%")


def params(v: float | None) -> str:
    if v is None:
        return "–"
    for div, suf in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if v >= div:
            return f"{v / div:.3g}{suf}"
    return str(int(v))


def to_markdown(blocks: Sequence[Block]) -> str:
    out = []
    for b in blocks:
        if isinstance(b, Heading):
            out.append("#" * b.level + " " + b.text)
        elif isinstance(b, Para):
            out.append(b.text)
        elif isinstance(b, Figure):
            out.append(f"![{b.caption}]({b.name})\n\n*{b.caption}*")
        else:
            lines = [f"**{b.title}**", ""] if b.title else []
            lines += markdown_table(
                b.header, ([c.replace("|", "\\|").replace("\n", "<br>") for c in r] for r in b.rows)
            )
            if b.note:
                lines += ["", b.note]
            out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def _inline(text: str) -> str:
    """Markdown's `code`, **bold** and *italic* in our own strings, as HTML (after escaping)."""
    import re

    t = html.escape(text)
    t = re.sub(r"`([^`]+)`", r"<code>\1</code>", t)
    t = re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", t)
    return re.sub(r"\*([^*]+)\*", r"<i>\1</i>", t)


def to_html(blocks: Sequence[Block], title: str) -> str:
    body = []
    for b in blocks:
        if isinstance(b, Heading):
            body.append(f"<h{b.level}>{_inline(b.text)}</h{b.level}>")
        elif isinstance(b, Para):
            body.append(f"<p>{_inline(b.text)}</p>")
        elif isinstance(b, Figure):
            data = base64.b64encode(b.png).decode()
            body.append(
                f'<figure><img alt="{html.escape(b.caption)}" src="data:image/png;base64,{data}">'
                f"<figcaption>{_inline(b.caption)}</figcaption></figure>"
            )
        else:
            rows = "".join(
                "<tr>" + "".join(f"<td>{_inline(c).replace(chr(10), '<br>')}</td>" for c in r) + "</tr>"
                for r in b.rows
            )
            head = "".join(f"<th>{_inline(h)}</th>" for h in b.header)
            cap = f"<caption>{_inline(b.title)}</caption>" if b.title else ""
            note = f'<p class="note">{_inline(b.note)}</p>' if b.note else ""
            body.append(f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>{note}")
    style = (
        "body{font-family:sans-serif;max-width:1200px;margin:2em auto;line-height:1.4}"
        "table{border-collapse:collapse;margin:1em 0;font-size:13px}td,th{border:1px solid #bbb;padding:3px 7px;"
        "text-align:right}th{background:#eee}caption{font-weight:bold;text-align:left;padding:4px 0}"
        "td:first-child{text-align:left}img{max-width:100%}.note{font-size:12px;color:#444}"
        "code{background:#f3f3f3;padding:0 3px}"
    )
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


# --------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------


def _archs(rows: list[dict]) -> list[str]:
    present = {r["arch"] for r in rows}
    return [a for a in ARCH_ORDER if a in present] + sorted(present - set(ARCH_ORDER))


def _sizes(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["size"] for r in rows))


def _layout(r: dict) -> str:
    extra = [
        f"ZeRO {r['zero_stage']}" if r.get("zero_stage") is not None else "",
        f"TP {r['tensor_parallel']}" if r.get("tensor_parallel") is not None else "",
    ]
    return ", ".join(e for e in extra if e)


def points_table(rows: list[dict]) -> Table:
    header = [
        "point",
        "ranks",
        "status",
        "tokens/s",
        "tokens/s/rank",
        "step s",
        "TFLOPs/GPU rec.",
        "TFLOPs/GPU no-rec.",
        "MFU",
        "HFU",
        "peak mem GB",
        "scaling eff.",
        "eff. vs cores",
        "overhead share",
        "comm share",
        "final loss",
    ]
    body = []
    for r in rows:
        ok = r["status"] == "ok"
        mfu = pct(r.get("mfu")) if r.get("mfu") is not None else ("n/a" if ok else "–")
        hfu = pct(r.get("hfu")) if r.get("hfu") is not None else ("n/a" if ok else "–")
        status = r["status"] + (f", reused from {r['reused_from']}" if r.get("reused_from") else "")
        body.append(
            [
                r["id"],
                str(r["world_size"]),
                status,
                num(r.get("tokens_per_s")),
                num(r.get("tokens_per_s_per_rank")),
                num(r.get("step_time_s")),
                num(r.get("tflops_per_gpu_recompute")),
                num(r.get("tflops_per_gpu_no_recompute")),
                mfu,
                hfu,
                num(r.get("peak_mem_gb")),
                pct(r.get("scaling_efficiency")),
                pct(r.get("core_efficiency")),
                pct(r.get("overhead_share")),
                pct(r.get("comm_share")),
                num(r.get("final_loss")),
            ]
        )
    note = (
        "Means over the logged intervals after the first (warm-up). MFU: model FLOPs (no recompute) / peak; "
        "HFU: executed FLOPs (with recompute when it is on) / peak; both n/a where the device's peak is "
        "unknown (CPU). Scaling columns compare with the same size/arch at the smallest world size N0 "
        "(weak scaling, per-rank batch fixed): scaling eff. = (tok/s/N)/(tok/s(N0)/N0); eff. vs cores divides "
        "by min(N, cores) instead of N; overhead share = 1 − step(N0)/step(N) = communication + contention. "
        "comm share = measured time inside collectives per update (rank 0) / step time."
    )
    return Table(header, body, "All points", note)


def paper_layout_tables(rows: list[dict]) -> list[Table]:
    """DEMix Tables 2/9 layout: one table per (world size, ZeRO, TP); rows size, column groups architecture."""
    ok = [r for r in rows if r["status"] == "ok" or r.get("tflops_per_update") is not None]
    archs = _archs(rows)
    keys = list(dict.fromkeys((r["world_size"], r.get("zero_stage"), r.get("tensor_parallel")) for r in ok))
    tables = []
    for world, zero, tp in keys:
        header = ["size", "layers, d"]
        for a in archs:
            lab = ARCH_LABEL.get(a, a)
            header += [
                f"{lab} experts",
                f"{lab} total params",
                f"{lab} TFLOPs/update",
                f"{lab} TFLOPs/GPU rec.",
                f"{lab} TFLOPs/GPU no-rec.",
            ]
        body = []
        for size in _sizes(ok):
            cells = {
                r["arch"]: r
                for r in ok
                if r["size"] == size
                and (r["world_size"], r.get("zero_stage"), r.get("tensor_parallel")) == (world, zero, tp)
            }
            if not cells:
                continue
            m = next(iter(cells.values())).get("model") or {}
            row = [size, f"{m.get('n_layers', '?')}, {m.get('d_model', '?')}"]
            for a in archs:
                r = cells.get(a, {})
                measured = r.get("status") == "ok"
                row += [
                    str(r.get("num_experts", "–")),
                    params(r.get("total_params")),
                    num(r.get("tflops_per_update")),
                    num(r.get("tflops_per_gpu_recompute")) if measured else "failed" if r else "–",
                    num(r.get("tflops_per_gpu_no_recompute")) if measured else "failed" if r else "–",
                ]
            body.append(row)
        lay = _layout({"zero_stage": zero, "tensor_parallel": tp})
        tables.append(
            Table(
                header,
                body,
                f"{world} rank(s){', ' + lay if lay else ''}",
                "TFLOPs/update: model/accounting.py, recompute convention, for this point's global batch.",
            )
        )
    return tables


def scaling_table(rows: list[dict]) -> Table | None:
    ok = [r for r in rows if r["status"] == "ok"]
    worlds = sorted({r["world_size"] for r in ok})
    if len(worlds) < 2:
        return None
    header = ["size", "arch", "layout"] + [f"N={w}: tok/s · eff. · overhead" for w in worlds]
    body = []
    for size in _sizes(ok):
        for a in _archs(ok):
            groups = dict.fromkeys(
                (r.get("zero_stage"), r.get("tensor_parallel"))
                for r in ok
                if r["size"] == size and r["arch"] == a
            )
            for zero, tp in groups:
                by_w = {
                    r["world_size"]: r
                    for r in ok
                    if r["size"] == size
                    and r["arch"] == a
                    and (r.get("zero_stage"), r.get("tensor_parallel")) == (zero, tp)
                }
                cells = [
                    f"{num(by_w[w]['tokens_per_s'])} · {pct(by_w[w]['scaling_efficiency'])} · "
                    f"{pct(by_w[w]['overhead_share'])}"
                    if w in by_w
                    else "–"
                    for w in worlds
                ]
                body.append(
                    [size, ARCH_LABEL.get(a, a), _layout({"zero_stage": zero, "tensor_parallel": tp}) or "–"]
                    + cells
                )
    return Table(
        header,
        body,
        "Scaling with world size",
        "Per cell: global tokens/s · scaling efficiency vs the smallest world size · overhead share "
        "(communication + core contention).",
    )


def failed_table(rows: list[dict]) -> Table | None:
    bad = [r for r in rows if r["status"] != "ok"]
    if not bad:
        return None
    return Table(
        ["point", "error (tail)"],
        [[r["id"], (r.get("error") or "").strip()[-1500:]] for r in bad],
        "Failed points",
        "Recorded, not fatal: the sweep went on. Full output: `<sweep-dir>/<point>/sweep.log`.",
    )


def load_costmodel(path: Path) -> dict:
    """The cost model's paper report: the regenerated JSON if present, else computed now (v100-dgx1)."""
    if path.is_file():
        return json.loads(path.read_text())
    from benchmarks.costmodel.cluster import load_cluster
    from benchmarks.costmodel.paper import paper_report

    return {
        "command": "benchmarks.costmodel.paper_report(load_cluster('v100-dgx1')) (computed by the report)",
        **paper_report(load_cluster("v100-dgx1")),
    }


def costmodel_table(cm: dict) -> Table:
    header = [
        "size",
        "arch",
        "GPUs",
        "TFLOPs/update",
        "pred. step s",
        "pred. comm share",
        "pred. TFLOPs/GPU rec.",
        "pred. TFLOPs/GPU no-rec.",
        "paper TFLOPs/GPU",
        "error",
    ]
    body = [
        [
            r["size"],
            ARCH_LABEL.get(r["arch"], r["arch"]),
            str(r["gpus"]),
            num(r["tflops_per_update"]),
            f"{r['step_s']:.3f}",
            pct(r["comm_share"]),
            f"{r['tflops_per_gpu']:.1f}",
            f"{r['tflops_per_gpu_no_recompute']:.1f}",
            f"{r['paper_tflops_per_gpu']:g}",
            pct(r["rel_err"], signed=True),
        ]
        for r in cm["rows"]
    ]
    mean = ", ".join(f"{ARCH_LABEL.get(a, a)} {pct(v)}" for a, v in cm.get("mean_abs_rel_err", {}).items())
    fit = cm.get("fitted", {})
    note = (
        f"Cluster `{cm['cluster']['name']}`; e(h) fitted on the four Dense rows only ({fit.get('form', '')}), so "
        f"DEMix and GShard are predictions. Mean |error|: {mean}. Source: `{cm.get('command', '')}`; details in "
        "benchmarks/results/costmodel_paper.md."
    )
    return Table(
        header, body, "Cost model vs DEMix Tables 2/9 (V100, 2×1024 tokens/GPU, 8 accumulation steps)", note
    )


def _point_options(r: dict) -> Any:
    """The cost model's options for a sweep point as it ran (its precision, micro-batch, accumulation)."""
    from benchmarks.costmodel.options import DTYPE_BYTES, CostOptions

    dtype = r.get("precision") if r.get("precision") in DTYPE_BYTES else "fp16"
    return CostOptions(
        r["micro_batch"],
        r["grad_accum"],
        dtype,
        dtype,
        "full" if r.get("activation_checkpointing") == "full" else "none",
    )


def _point_model(r: dict, padded: bool = False) -> Any:
    """A point's model config; `padded`: with the padded vocabulary the trainer builds (what its gradients
    carry), for bytes (the FLOPs convention counts the real vocabulary)."""
    from dataclasses import replace

    from launcher.typed import from_dict
    from model.config import ModelConfig

    cfg = from_dict(ModelConfig, r["model"])
    return replace(cfg, vocab_size=cfg.padded_vocab_size()) if padded else cfg


def comm_table(rows: list[dict]) -> Table | None:
    """Measured bytes per update and group (rank 0, the trainer's counters) beside the cost model's formulas."""
    from benchmarks.costmodel.layout import comm_bytes_per_update

    ok = [r for r in rows if r["status"] == "ok" and r.get("model") and r.get("comm_bytes") is not None]
    if not ok:
        return None
    body = []
    for r in ok:
        measured = r["comm_bytes"]
        why = ""
        if (r.get("zero_stage_run") or 0) > 0 or (r.get("tensor_parallel_run") or 1) > 1:
            modelled, why = (
                {},
                "not modelled (ZeRO > 0 or TP > 1: the cost model prices ZeRO-0 data parallelism)",
            )
        else:
            try:
                modelled = comm_bytes_per_update(
                    _point_model(r, padded=True), r["world_size"], _point_options(r)
                )
            except ValueError as e:
                modelled, why = {}, f"not modelled ({e})"
        for key in sorted(set(measured) | set(modelled)) or ["(none)"]:
            m, f = measured.get(key), modelled.get(key)
            verdict = why or (
                "equal" if m == f else "–" if m is None or f is None else pct((m - f) / f, signed=True)
            )
            body.append(
                [r["id"], key, num(m) if m is not None else "–", num(f) if f is not None else "–", verdict]
            )
    return Table(
        [
            "point",
            "group/collective",
            "measured bytes/update",
            "cost model bytes/update",
            "measured vs model",
        ],
        body,
        "Communication per update: measured vs cost model",
        "Measured: what rank 0 handed to each collective per optimizer update, counted by the trainer "
        "(parallel/comm_stats.py; `comm/<group>/<op>/bytes` in metrics.jsonl). Cost model: "
        "`benchmarks.costmodel.comm_bytes_per_update` (gradient all-reduce plan, GShard all-to-all volume, "
        "the 8-byte global-norm all-reduce). A group of one rank moves nothing over a network; "
        "tests/multirank/test_comm_measured.py holds the two equal at 8 and 16 ranks.",
    )


def cluster_predictions(results: dict) -> Table | None:
    """Measured vs the cost model for each point, when the sweep names a cluster preset; the cost model prices
    the bytes each point measured (`predict(measured_bytes=)`), not its byte formulas."""
    cluster_name = results.get("sweep", {}).get("cluster")
    ok = [r for r in results["points"] if r["status"] == "ok" and r.get("model")]
    if not cluster_name or not ok:
        return None
    from benchmarks.costmodel.cluster import load_cluster
    from benchmarks.costmodel.fit import cluster_efficiency
    from benchmarks.costmodel.options import CostOptions
    from benchmarks.costmodel.predict import predict

    cluster = load_cluster(cluster_name)
    body = []
    for r in ok:
        opts = _point_options(r)
        try:  # e(h) is the device's, fitted on the paper's rows with the paper's options; the point runs its own
            pred = predict(
                _point_model(r),
                r["world_size"],
                cluster,
                cluster_efficiency(cluster, CostOptions()),
                opts,
                measured_bytes=r.get("comm_bytes") or None,
            )
            p, err = (
                pred.tflops_per_gpu,
                (pred.tflops_per_gpu - r["tflops_per_gpu_recompute"]) / r["tflops_per_gpu_recompute"],
            )
            share, source = pct(pred.comm_share), pred.bytes_from
        except Exception as e:  # e.g. DEMix ranks not divisible by domains: shown, not fatal
            p, err, share, source = None, None, f"({e})", "–"
        body.append(
            [r["id"], num(r["tflops_per_gpu_recompute"]), num(p), pct(err, signed=True), share, source]
        )
    return Table(
        [
            "point",
            "measured TFLOPs/GPU rec.",
            "cost model TFLOPs/GPU rec.",
            "model error",
            "pred. comm share",
            "bytes from",
        ],
        body,
        f"Measured vs the cost model on `{cluster_name}`",
    )


# --------------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------------


def _png(fig: Any) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _series(rows: list[dict], size: str, arch: str, key: str) -> tuple[list[int], list[float]]:
    """(world sizes, values) of one size/arch; with several ZeRO/TP layouts, the first one's (as in the caption)."""
    layout = (rows[0].get("zero_stage"), rows[0].get("tensor_parallel"))
    pts = sorted(
        (r["world_size"], r[key])
        for r in rows
        if r["size"] == size
        and r["arch"] == arch
        and r.get(key) is not None
        and (r.get("zero_stage"), r.get("tensor_parallel")) == layout
    )
    return [p[0] for p in pts], [p[1] for p in pts]


SERIES_LABEL: dict[str, str] = {
    "tflops_per_gpu_recompute": "rec.",
    "tflops_per_gpu_no_recompute": "no-rec.",
    "scaling_efficiency": "per rank",
    "core_efficiency": "per core",
}


def scaling_figures(rows: list[dict]) -> list[Figure]:
    """tokens/s, TFLOPs/GPU (both conventions) and scaling efficiency vs world size; one panel per size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return []
    sizes, archs = _sizes(ok), _archs(ok)
    colours = {a: f"C{i}" for i, a in enumerate(archs)}
    specs = [
        (
            "scaling_tokens.png",
            "tokens/s (global)",
            [("tokens_per_s", "-")],
            True,
            "Global tokens/s vs world size per architecture; dotted: linear scaling from the smallest world size.",
        ),
        (
            "tflops_per_gpu.png",
            "TFLOPs/GPU",
            [("tflops_per_gpu_recompute", "-"), ("tflops_per_gpu_no_recompute", "--")],
            False,
            "TFLOPs/GPU vs world size: solid = recompute convention (paper's), dashed = no-recompute.",
        ),
        (
            "scaling_efficiency.png",
            "efficiency",
            [("scaling_efficiency", "-"), ("core_efficiency", "--")],
            False,
            "Scaling efficiency vs world size: solid = per rank, dashed = per usable core (min(N, cores)).",
        ),
    ]
    figs = []
    for name, ylabel, keys, ideal, caption in specs:
        fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 3.6), squeeze=False)
        for ax, size in zip(axes[0], sizes):
            for a in archs:
                for key, style in keys:
                    xs, ys = _series(ok, size, a, key)
                    if xs:
                        lab = ARCH_LABEL.get(a, a) + (
                            f" ({SERIES_LABEL[key]})" if key in SERIES_LABEL else ""
                        )
                        ax.plot(xs, ys, style, marker="o", color=colours[a], label=lab)
                        if ideal and xs:
                            ax.plot(xs, [ys[0] * x / xs[0] for x in xs], ":", color=colours[a], alpha=0.6)
            ax.set_title(f"size {size}")
            ax.set_xlabel("world size (ranks)")
            ax.set_ylabel(ylabel)
            ax.set_xscale("log", base=2)
            ax.set_xticks(
                sorted({r["world_size"] for r in ok}), [str(w) for w in sorted({r["world_size"] for r in ok})]
            )
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        lay = _layout(ok[0])
        figs.append(Figure(name, _png(fig), caption + (f" Layout: {lay}." if lay else "")))
    return figs


def costmodel_figure(cm: dict) -> Figure:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = cm["rows"]
    labels = [f"{r['size']}\n{ARCH_LABEL.get(r['arch'], r['arch'])}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(11, 3.6))
    ax.bar(
        [i - 0.2 for i in x], [r["paper_tflops_per_gpu"] for r in rows], 0.4, label="paper (V100, measured)"
    )
    ax.bar([i + 0.2 for i in x], [r["tflops_per_gpu"] for r in rows], 0.4, label="cost model")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("TFLOPs/GPU (recompute)")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    return Figure(
        "costmodel_paper.png", _png(fig), "DEMix Tables 2/9 TFLOPs/GPU: the paper vs the cost model."
    )


# --------------------------------------------------------------------------------------------------
# The document
# --------------------------------------------------------------------------------------------------


def _machine_line(m: dict) -> str:
    return (
        f"Machine: {m.get('cores')} usable cores (os.cpu_count() = {m.get('cpu_count')}), "
        f"{m.get('cpu') or 'unknown CPU'}, "
        f"GPU {m.get('gpu') or 'none'}, {m.get('platform')}, Python {m.get('python')}, torch {m.get('torch')}, "
        f"DeepSpeed {m.get('deepspeed')}, OMP_NUM_THREADS={m.get('omp_num_threads')}; 1-minute load average "
        f"{m.get('loadavg_1m')} at the start and {m.get('loadavg_1m_end', '?')} at the end."
    )


def external_load_note(m: dict) -> str:
    """A warning when the machine was busy with other work when the sweep started (1-minute load average of at
    least one core's worth). The load at the end is not used: it includes the sweep's own ranks."""
    cores = m.get("cores") or 0
    start, end = m.get("loadavg_1m"), m.get("loadavg_1m_end")
    if not cores or start is None or start < 1.0:
        return ""
    return (
        f"**Warning: the machine was shared with other jobs during this sweep** (1-minute load average {start} at "
        f"the start and {end} at the end, on {cores} usable cores). Outside processes competed with the ranks for "
        "cores, so tokens/s, scaling efficiency and overhead share here mostly measure that contention, not the "
        "trainer's communication. Rerun on an idle machine before drawing conclusions about scaling."
    )


def reused_note(rows: list[dict]) -> str:
    """The points a `--reuse` sweep took from earlier runs, each with when it ran and its own load; "" if none."""
    reused = [r for r in rows if r.get("reused_from")]
    if not reused:
        return ""

    def one(r: dict) -> str:
        load = r.get("load") or {}
        return (
            f"{r['id']} (reused from {r['reused_from']}; 1-minute load average {load.get('loadavg_1m_start', '?')} "
            f"to {load.get('loadavg_1m_end', '?')}, other processes {load.get('others_cores', '?')} cores during it)"
        )

    return (
        f"**{len(reused)} of {len(rows)} points were reused from earlier runs (`--reuse`), not timed by this "
        "sweep**: their numbers, timings and load are their own runs': "
        + "; ".join(one(r) for r in reused)
        + ". The sweep's wall time and the machine's load above are those of the points timed now."
    )


def build_blocks(results: dict, cm: dict | None, render_command: str) -> tuple[list[Block], list[Figure]]:
    rows = results["points"]
    s = results.get("sweep", {})
    n_ok = sum(r["status"] == "ok" for r in rows)
    blocks: list[Block] = [
        Heading(f"Throughput sweep `{s.get('name', '?')}`", 1),
        Para(
            f"Sweep: `{results.get('command', '')}` (config `{results.get('config_path', '')}`, base run config "
            f"`{s.get('base_config', '?')}`, {s.get('steps')} steps per point, log interval {s.get('log_interval')}); "
            f"{n_ok}/{len(rows)} points ok; sweep wall time {results.get('wall_s', 0):.0f} s, started "
            f"{results.get('started', '?')}. Report: `{render_command}`."
        ),
        Para(_machine_line(results.get("machine", {}))),
        Para(FLOPS_NOTE),
    ]
    cores = results.get("machine", {}).get("cores") or 0
    if cores and any(r["world_size"] > cores for r in rows) and not results.get("machine", {}).get("gpu"):
        blocks.append(
            Para(
                f"Caution: points with more ranks than the {cores} usable cores time-share cores, so their "
                "overhead share is mostly contention, not communication; *eff. vs cores* accounts for that. "
                "The machine is shared, so absolute numbers are noisy."
            )
        )
    load_note = external_load_note(results.get("machine", {}))
    if load_note:
        blocks.append(Para(load_note))
    if reused_note(rows):
        blocks.append(Para(reused_note(rows)))
    blocks.append(points_table(rows))
    blocks.append(Heading("Tables 2/9 layout (rows size, columns architecture)"))
    blocks += paper_layout_tables(rows)
    figs = scaling_figures(rows)
    sc = scaling_table(rows)
    if sc is not None or figs:
        blocks.append(Heading("Scaling"))
        blocks += ([sc] if sc is not None else []) + figs
    pred = cluster_predictions(results)
    if pred is not None:
        blocks += [Heading("Measured vs cost model"), pred]
    fail = failed_table(rows)
    if fail is not None:
        blocks.append(fail)
    blocks.append(
        Para(
            "Communication share: measured by the trainer (time inside every collective per update, "
            "rank 0, `comm/<group>/<op>/seconds` in metrics.jsonl; `comm_share` and the bytes per group "
            "`comm_bytes` in results.json). The overhead share above is communication + contention from "
            "weak scaling; the cost model below gives the predicted communication share on the paper's "
            "cluster, and its byte formulas equal the measured bytes exactly "
            "(tests/multirank/test_comm_measured.py; the table below for these points)."
        )
    )
    comm = comm_table(rows)
    if comm is not None:
        blocks.append(comm)
    if cm is not None:
        f = costmodel_figure(cm)
        blocks += [Heading("Cost model: the paper's 12 configurations"), costmodel_table(cm), f]
        figs.append(f)
    return blocks, figs


def render(
    sweep_dir: Path, out: Path | None = None, costmodel: Path | None = COSTMODEL_JSON, command: str = ""
) -> dict[str, Path]:
    """Write report.md, report.html and the PNGs for `<sweep_dir>/results.json` into `out` (default sweep_dir)."""
    out = out or sweep_dir
    out.mkdir(parents=True, exist_ok=True)
    src = sweep_dir / "results.json"
    results = json.loads(src.read_text())
    if (out / "results.json").resolve() != src.resolve():
        shutil.copyfile(src, out / "results.json")
    cm = load_costmodel(costmodel) if costmodel is not None else None
    command = command or f"python -m benchmarks.report {sweep_dir}"
    blocks, figs = build_blocks(results, cm, command)
    for f in figs:
        (out / f.name).write_bytes(f.png)
    paths = {"md": out / "report.md", "html": out / "report.html"}
    paths["md"].write_text(to_markdown(blocks))
    paths["html"].write_text(to_html(blocks, f"Throughput sweep {results.get('sweep', {}).get('name', '')}"))
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0])
    p.add_argument("sweep_dir", help="a directory with results.json (written by benchmarks.sweep)")
    p.add_argument("--out", help="output directory (default: the sweep dir)")
    p.add_argument(
        "--costmodel", default=str(COSTMODEL_JSON), help="the cost model's paper JSON ('' to leave it out)"
    )
    args = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    sweep_dir = Path(args.sweep_dir)
    if not (sweep_dir / "results.json").is_file():
        return usage_error(
            f"{sweep_dir / 'results.json'} not found; run `python -m benchmarks.sweep CONFIG` first"
        )
    paths = render(
        sweep_dir,
        Path(args.out) if args.out else None,
        Path(args.costmodel) if args.costmodel else None,
        "python -m benchmarks.report " + shlex.join(argv),
    )
    print(f"report: {paths['md']} and {paths['html']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
