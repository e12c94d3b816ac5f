"""Output of the cost model: the aligned or Markdown table of predictions, and the `--paper` report
(benchmarks/results/costmodel_paper.{md,json}) with its GShard notes and sensitivity table."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from benchmarks.costmodel.cluster import ROOT
from benchmarks.costmodel.gshard import GSHARD_TERM_KEYS
from launcher.tables import markdown_table

RESULTS_DIR = ROOT / "benchmarks" / "results"


_COLUMNS = (
    ("size", "size"),
    ("arch", "arch"),
    ("GPUs", "gpus"),
    ("TFLOPs/upd", "tflops_per_update"),
    ("e(h)", "efficiency"),
    ("compute s", "compute_s"),
    ("all-reduce s", "allreduce_s"),
    ("all-to-all s", "alltoall_s"),
    ("dispatch/combine s", "dispatch_combine_s"),
    ("gating s", "gating_s"),
    ("padding s", "capacity_padding_s"),
    ("expert roofline s", "expert_roofline_s"),
    ("fp32 master s", "fp32_master_s"),
    ("NIC GB/node", "internode_bytes"),
    ("mem GiB", "memory_gib"),
    ("recompute", "recompute"),
    ("step s", "step_s"),
    ("comm share", "comm_share"),
    ("pred TFLOPs/GPU", "tflops_per_gpu"),
    ("paper", "paper_tflops_per_gpu"),
    ("error", "rel_err"),
)


def _cell(key: str, value: object) -> str:
    if key in ("comm_share", "efficiency"):
        return f"{100 * float(value):.1f}%"
    if key == "rel_err":
        return f"{100 * float(value):+.1f}%"
    if key == "internode_bytes":
        return f"{float(value) / 1e9:.2f}"
    if key == "memory_gib":
        return f"{float(value):.1f}"
    if key.endswith("_s"):
        return f"{float(value):.3f}"
    if key in ("tflops_per_gpu", "tflops_per_update"):
        return f"{float(value):,.1f}"
    return str(value)


def format_table(rows: Sequence[dict], markdown: bool = False) -> str:
    """Rows as an aligned text table or a Markdown table (columns missing from a row are skipped)."""
    cols = [(n, k) for n, k in _COLUMNS if k in rows[0]]
    header = [n for n, _ in cols]
    body = [[_cell(k, r[k]) for _, k in cols] for r in rows]
    if markdown:
        return "\n".join(markdown_table(header, body))
    widths = [max(len(c) for c in col) for col in zip(header, *body)]

    def fmt(cells: Sequence[str]) -> str:  # the first two columns (size, arch) left-aligned, the rest right
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(b) for b in body])


def fitted_line(fit: dict) -> str:
    if fit["form"] == "constant":
        return f"e = {fit['e_max']:.4f} (one constant), fitted on {fit['fitted_on']}"
    return f"e(h) = {fit['e_max']:.4f} · h / (h + {fit['h_half']:.1f}), fitted on {fit['fitted_on']}"


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _gshard_table(cmp: list[dict], rc: str) -> list[str]:
    """The heading, what before/after mean, and one row per GShard size."""
    lines = [
        "## GShard: before / after the t_gshard terms",
        "",
        "Before: the all-to-all-only model (`--gshard-overheads none`). After: + dispatch/combine einsums, gating, "
        "capacity padding, expert roofline, fp32 master weights (and, with recompute none, the memory fallback). "
        f"Main table: recompute {rc}. Right: recompute none, what the reference `demix/train.sh` runs (no "
        "`--checkpoint-activations`); each refitted on Dense only.",
        "",
    ]
    header = [
        "size",
        "paper TFLOPs/GPU",
        f"before ({rc})",
        f"after ({rc})",
        "t_gshard s: dispatch/combine + gating + padding + roofline + fp32 master",
        "after step s / paper-implied step s",
        "before (none)",
        "after (none)",
        "mem GiB, recompute (none)",
    ]
    tflops = lambda r, at: f"{r[at + '_tflops_per_gpu']:.1f} ({_pct(r[at + '_rel_err'])})"  # noqa: E731
    rows = [
        [
            r["size"],
            f"{r['paper_tflops_per_gpu']:g}",
            tflops(r, "before"),
            tflops(r, "after"),
            " + ".join(f"{r['after_' + k]:.3f}" for k in GSHARD_TERM_KEYS),
            f"{r['after_step_s']:.2f} / {r['paper_step_s']:.2f}",
            tflops(r, "none_before"),
            tflops(r, "none_after"),
            f"{r['none_after_memory_gib']:.1f}, {r['none_after_recompute']}",
        ]
        for r in cmp
    ]
    return lines + markdown_table(header, rows)


def _terms_note(cmp: list[dict]) -> str:
    """How small the t_gshard terms are next to the all-to-all."""
    routing = ", ".join(f"{r['after_dispatch_combine_s'] + r['after_gating_s']:.2f}" for r in cmp)
    a2a = ", ".join(f"{r['after_alltoall_s']:.2f}" for r in cmp)
    return (
        f"- The terms are small next to the all-to-all: {routing} s per update (dispatch/combine + gating, "
        f"125M ... 1.3B) against an all-to-all of {a2a} s. "
        "Capacity padding and the expert roofline are 0 for every paper row: fairseq's C = 2·ceil(S/E) fills "
        "E·C = 2S = 4096 rows exactly (E divides S = 2048), and a 4096-row expert GEMM is compute-bound on a V100."
    )


def _recompute_notes(small: list[dict], rc: str) -> list[str]:
    """What the terms do to 125M-760M under the main table's recompute setting and under recompute none."""
    after_small = ", ".join(_pct(r["after_rel_err"]) for r in small)
    if all(r["before_rel_err"] < 0 for r in small):
        slow_line = (
            f"- With recompute {rc} (main table) the 125M-760M points were already predicted too slow; "
            f"the terms add time, so they move further below the paper ({after_small}). An under-prediction "
            "cannot be fixed by adding justified costs; what is off is an assumption shared with the all-to-all "
            "(the inter-node bandwidth) or the recompute setting (next point). No GShard constant was tuned."
        )
    else:
        slow_line = (
            f"- With recompute {rc} (main table) the terms move 125M-760M from "
            f"{', '.join(_pct(r['before_rel_err']) for r in small)} to {after_small}. "
            "No GShard constant was tuned."
        )
    none_line = (
        f"- With recompute none (the reference scripts' setting) the same terms bring 125M-760M to "
        f"{', '.join(_pct(r['none_after_rel_err']) for r in small)} (from "
        f"{', '.join(_pct(r['none_before_rel_err']) for r in small)}); Dense and DEMix fit as well under either "
        "setting (sensitivity table), so the Dense rows cannot tell the two apart."
    )
    return [slow_line, none_line]


def _memory_note(xl: dict, what: dict) -> str:
    """The 1.3B GShard's memory without recompute, and what micro-batch 1 would predict."""
    mb1, gpu = what["xl_mb1"], what["gpu_memory_gib"]
    gpu_txt = "unknown GPU memory" if gpu is None else f"{gpu:g} GiB per GPU"
    return (
        "- Memory: at micro-batch 2 without recompute the 1.3B GShard needs "
        f"≈ {what['xl_memory_gib_no_recompute']:.1f} GiB per "
        f"GPU ({gpu_txt}): 20 B/param of --fp16 model states for its "
        f"{what['xl_params_per_gpu'] / 1e9:.2f}B per-GPU parameters "
        f"plus activations, against ≈ {what['xl_dense_memory_gib_no_recompute']:.1f} GiB for the Dense 1.3B "
        f"(--memory-efficient-fp16, 12 B/param). Rows that do not fit without recompute: "
        f"{', '.join(what['not_fitting_without_recompute']) or 'none'}; so the stated 2 x 8 batch cannot run as "
        "scripted there, and with recompute none it is predicted with "
        f"--checkpoint-activations ({_pct(xl['none_before_rel_err'])} → {_pct(xl['none_after_rel_err'])}). "
        f"Micro-batch 1 x 16 would fit ({what['xl_memory_gib_mb1_no_recompute']:.1f} GiB) and predicts "
        f"{mb1['tflops_per_gpu']:.1f} TFLOPs/GPU ({_pct(mb1['rel_err'])}) with e(h) unchanged: "
        "the fit has no micro-batch "
        "information, so a smaller micro-batch's lower GEMM efficiency is not modelled."
    )


def _xl_note(xl: dict, small: list[dict], what: dict, rc: str) -> str:
    """How much of the 1.3B GShard point is left unexplained, and the candidate causes."""
    gap = xl["paper_step_s"] - xl["after_step_s"]
    gap_none = xl["paper_step_s"] - xl["none_after_step_s"]
    wall = ", ".join(f"{v:.0f}" for v in what["dense_tflops_per_gpu_from_max_updates_over_48h"].values())
    explained = abs(xl["after_rel_err"]) <= 0.2 or abs(xl["none_after_rel_err"]) <= 0.2
    return (
        f"- The 1.3B point is {'only partly' if explained else 'not'} explained. The paper's "
        f"{xl['paper_tflops_per_gpu']:g} TFLOPs/GPU implies {xl['paper_step_s']:.1f} s per update; the "
        f"model gives {xl['after_step_s']:.1f} s (recompute {rc}) or {xl['none_after_step_s']:.1f} s "
        "(none, recomputed for memory), "
        f"{gap:.1f} s / {gap_none:.1f} s short, while the same model is within "
        f"{max(abs(r['none_after_rel_err']) for r in small) * 100:.0f}% (none) "
        "of the 760M GShard on the same 128 GPUs. Its "
        "all-to-all volume is only 2048/1536 = 1.33x the 760M's; closing the gap would need its all-to-all to take "
        f"≈ {1 + gap / xl['after_alltoall_s']:.1f}x the modelled time (recompute {rc}), "
        "i.e. a slower effective network than "
        "the 760M run's (another cluster or placement), or a configuration other than Table 9's (micro-batch, "
        "optimizer offload, a slower partition), or time outside the step: Tables 2/9 may be wall-clock averages "
        "over the ~48 h budget (train.sh's --max-update x TFLOPs/update / (GPUs x 48 h) gives "
        f"{wall} TFLOPs/GPU for Dense vs 31, 37, 45, "
        "51), and the 1.3B GShard saves a 52.5B-parameter model with fp32 Adam states every 2,000 updates and "
        "validates every 500. None of these is documented for the GShard runs, so none is modelled."
    )


def _fork_note(what: dict, rc: str) -> str:
    """Why the all-to-all stays in the model although the public fork's expert group has one rank."""
    no_a2a = ", ".join(
        f"{v['tflops_per_gpu']:.1f}" for k, v in what["no_alltoall"].items() if not k.startswith("none_")
    )
    return (
        "- The public fork (kernelmachine/demix, `fairseq/modules/transformer_layer.py`) builds each MOELayer with "
        "`group=dist.new_group([ddp_rank])`, a one-rank expert group, which would make every all-to-all a local "
        "copy. Without the all-to-all the model predicts "
        f"{no_a2a} TFLOPs/GPU (125M ... 1.3B; recompute {rc}), far above the paper, so the paper's runs "
        "evidently exchanged tokens (as its text says); the all-to-all stays in the model."
    )


def _gshard_section(cmp: list[dict], what: dict, opts: dict) -> list[str]:
    """The GShard before/after table and the honest accounting of what is left."""
    rc = opts["recompute"]
    xl = next(r for r in cmp if r["size"] == "1.3B")
    small = [r for r in cmp if r["size"] != "1.3B"]
    return [
        *_gshard_table(cmp, rc),
        "",
        "What the terms do and do not explain:",
        "",
        _terms_note(cmp),
        *_recompute_notes(small, rc),
        _memory_note(xl, what),
        _xl_note(xl, small, what, rc),
        _fork_note(what, rc),
    ]


def write_paper_report(
    report: dict,
    sens: list[dict],
    command: str,
    out_dir: Path,
    gshard: tuple[list[dict], dict] | None = None,
) -> tuple[Path, Path]:
    """benchmarks/results/costmodel_paper.{md,json}; `gshard` = (gshard_comparison, gshard_what_ifs)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "costmodel_paper.json", out_dir / "costmodel_paper.md"
    extra = {} if gshard is None else {"gshard_before_after": gshard[0], "gshard_what_ifs": gshard[1]}
    json_path.write_text(
        json.dumps({"command": command, **report, "sensitivity": sens, **extra}, indent=1) + "\n"
    )
    c = report["cluster"]
    lines = [
        "# Cluster cost model vs DEMix Tables 2/9 (V100 TFLOPs/GPU)",
        "",
        f"Command: `{command}`",
        "",
        f"Cluster `{c['name']}`: {c['description']}",
        "",
        f"Fitted (Dense rows only; DEMix and GShard are predictions): {fitted_line(report['fitted'])}.",
        "",
        f"Options: {report['options']}",
        "",
        format_table(report["rows"], markdown=True),
        "",
        "Mean |error|: " + ", ".join(f"{a} {100 * v:.1f}%" for a, v in report["mean_abs_rel_err"].items()),
        "",
    ]
    if gshard is not None:
        lines += _gshard_section(gshard[0], gshard[1], report["options"]) + [""]
    lines += [
        "## Sensitivity (each variant refitted on Dense only)",
        "",
        "Mean |error| per arch (gshard: before → after the t_gshard terms), then each GShard point's error "
        "before → after.",
        "",
    ]
    sizes = ("125M", "350M", "760M", "1.3B")
    lines += markdown_table(
        [
            "cluster",
            "e(h) form",
            "overlap",
            "recompute",
            "dense",
            "demix",
            "gshard",
            "GShard 125M / 350M / 760M / 1.3B",
        ],
        [
            [
                s["cluster"],
                s["efficiency_form"],
                f"{s['overlap']:.0%}",
                s["recompute"],
                f"{100 * s['dense_mean_abs_err']:.1f}%",
                f"{100 * s['demix_mean_abs_err']:.1f}%",
                f"{100 * s['gshard_mean_abs_err_before']:.1f}% → {100 * s['gshard_mean_abs_err']:.1f}%",
                " / ".join(
                    f"{100 * s[f'{z}_gshard_err_before']:+.0f}% → {100 * s[f'{z}_gshard_err']:+.0f}%"
                    for z in sizes
                ),
            ]
            for s in sens
        ],
    )
    md_path.write_text("\n".join(lines) + "\n\n" + REPORT_NOTES + "\n")
    return md_path, json_path


REPORT_NOTES = """## Model
t_step = F/(n·P·e(h)) + (1 − overlap)·t_allreduce + t_alltoall + t_gshard, P = 125 TFLOP/s (V100 fp16).
Ring all-reduce 2(p−1)/p·S/bw + m·2(p−1)·α; hierarchical (NVLink reduce-scatter, inter-node all-reduce
of the shard, NVLink all-gather) when a group spans nodes; m = 25 MB gradient buckets.
Gradients (fp16): Dense all params over n; DEMix shared over n + each domain's experts over n/8
(inside one node when n/8 <= 8); GShard shared over n, experts not reduced (one expert per GPU).
GShard all-to-all per GPU: c·k·(2·1024)·d·2 bytes, 6 per MoE layer per micro-batch (dispatch+combine in
forward, backward and recomputed forward; 4 without recompute), pairwise-exchange cost with (E−1)/E
off-GPU and (E−8)/E off-node. NIC GB/node: bytes each node sends through its InfiniBand links per update.

t_gshard (GShard only; sources: kernelmachine/demix `demix/train.sh` and `fairseq/modules/moe/`), per MoE
layer and micro-batch, S = 2048 tokens, C = 2·ceil(S/E), N = S·E·C = 2·S², f = forward passes:
- dispatch/combine: the one-hot einsums sec,sm->ecm and sec,ecm->sm run as dense fp16 matmuls,
  2·N·d·(2f + 3) FLOPs at e_max (the fitted matmul efficiency).
- gating: fp32 routing tensors (--moe-gating-use-fp32), N·((31·g + 3)·f + 14) + S·E·(516·g·f + 110) bytes at
  900 GB/s, g = 2 gate evaluations per forward (the fork calls `self.gate` twice), + the fp16 gate GEMM.
- capacity padding: expert FLOPs on the E·C − 2S rows beyond the tokens (0 here: E divides S).
- expert roofline: expert GEMMs' memory time beyond compute time (0 here: 4096-row GEMMs are compute-bound).
- fp32 master: --fp16 (FP16Optimizer) moves ≈ 28 B/param more per optimizer step than the Dense rows'
  --memory-efficient-fp16.
mem GiB: 12 B/param (memory-efficient fp16) or 20 B/param (GShard's --fp16) of model states for the
parameters a GPU holds + activations (parallel/memory.py) + GShard's saved routing tensors; recompute: what
was predicted (recompute none falls back to recomputation when a configuration does not fit 32 GiB).
See `benchmarks/costmodel/` for the formulas and their sources. No constant was fitted on a GShard or
DEMix row: e(h) is fitted on the four Dense rows, everything else is counted from code or datasheets.

Not modelled: kernel-launch and Python overheads of the routing's many small ops, stragglers,
contention between concurrent collectives, NCCL protocol effects, and time outside the step
(checkpointing, validation)."""
