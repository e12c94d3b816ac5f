"""The cost model against DEMix Tables 2/9: all 12 configurations predicted from the Dense fit, GShard before and
after the t_gshard terms, the what-ifs behind the report's GShard notes, and the sensitivity to the assumptions."""

from __future__ import annotations

from dataclasses import asdict, replace

from benchmarks.costmodel.cluster import ClusterSpec, load_cluster
from benchmarks.costmodel.fit import fit_efficiency, paper_points
from benchmarks.costmodel.gshard import GSHARD_TERM_KEYS
from benchmarks.costmodel.layout import params_per_gpu
from benchmarks.costmodel.memory import memory_bytes
from benchmarks.costmodel.options import ARCHS, EFFICIENCY_FORMS, CostOptions
from benchmarks.costmodel.predict import predict
from model import accounting as acc


def paper_report(cluster: ClusterSpec, opts: CostOptions = CostOptions(), form: str = "saturating") -> dict:
    """Fit on Dense, predict all 12 configurations, and compare with the paper (JSON-ready)."""
    points = paper_points()
    eff = fit_efficiency(points, cluster, opts, form)
    rows = []
    for pt in points:
        pred = predict(pt.cfg, pt.gpus, cluster, eff, opts)
        err = (pred.tflops_per_gpu - pt.measured_tflops_per_gpu) / pt.measured_tflops_per_gpu
        rows.append(
            {
                "size": pt.size,
                **asdict(pred),
                "paper_tflops_per_gpu": pt.measured_tflops_per_gpu,
                "rel_err": err,
            }
        )
    mean_abs = {a: sum(abs(r["rel_err"]) for r in rows if r["arch"] == a) / 4 for a in ARCHS}
    return {
        "cluster": asdict(cluster),
        "options": asdict(opts),
        "fitted": {**asdict(eff), "fitted_on_archs": ["dense"]},
        "rows": rows,
        "mean_abs_rel_err": mean_abs,
    }


def before_options(opts: CostOptions) -> CostOptions:
    """The earlier, all-to-all-only model: no t_gshard terms and no memory fallback."""
    return replace(opts, gshard_overheads="none", on_oom="ignore")


def gshard_comparison(
    cluster: ClusterSpec, opts: CostOptions = CostOptions(), form: str = "saturating"
) -> list[dict]:
    """Each GShard point before (all-to-all only) and after the t_gshard terms, for `opts` and for
    recompute='none' (what the reference train.sh runs: no --checkpoint-activations), each refitted on Dense
    only; with the step time the paper's TFLOPs/GPU implies and what-ifs for the notes."""
    variants = {"": opts, "none_": replace(opts, recompute="none")}
    reports = {}
    for prefix, o in variants.items():
        reports[prefix + "before"] = paper_report(cluster, before_options(o), form)
        reports[prefix + "after"] = paper_report(cluster, o, form)
    out = []
    for i, r in enumerate(reports["after"]["rows"]):
        if r["arch"] != "gshard":
            continue
        row = {
            "size": r["size"],
            "gpus": r["gpus"],
            "paper_tflops_per_gpu": r["paper_tflops_per_gpu"],
            "paper_step_s": r["tflops_per_update"] / (r["gpus"] * r["paper_tflops_per_gpu"]),
        }
        for name, rep_ in reports.items():
            x = rep_["rows"][i]
            row.update(
                {
                    f"{name}_tflops_per_gpu": x["tflops_per_gpu"],
                    f"{name}_rel_err": x["rel_err"],
                    f"{name}_step_s": x["step_s"],
                    f"{name}_alltoall_s": x["alltoall_s"],
                }
            )
            if name.endswith("after"):
                row.update({f"{name}_{k}": x[k] for k in GSHARD_TERM_KEYS})
                row.update({f"{name}_memory_gib": x["memory_gib"], f"{name}_recompute": x["recompute"]})
        out.append(row)
    return out


def sensitivity(opts: CostOptions) -> list[dict]:
    """Mean |error| per arch under alternative assumptions (each refitted on Dense only), and each DEMix and
    GShard point's error; GShard also before the t_gshard terms (`before_options`)."""
    out = []
    variants = [
        (c, f, o, r)
        for c in ("v100-dgx1", "v100-dgx1-4ib")
        for f in EFFICIENCY_FORMS
        for o in (0.0, 1.0)
        for r in ("full",)
    ]
    variants += [(c, "saturating", 0.0, "none") for c in ("v100-dgx1", "v100-dgx1-4ib")]
    for cluster_name, form, overlap, recompute in variants:
        o = CostOptions(**{**asdict(opts), "overlap": overlap, "recompute": recompute})
        rep = paper_report(load_cluster(cluster_name), o, form)
        before = paper_report(load_cluster(cluster_name), before_options(o), form)
        out.append(
            {
                "cluster": cluster_name,
                "efficiency_form": form,
                "overlap": overlap,
                "recompute": recompute,
                **{f"{a}_mean_abs_err": rep["mean_abs_rel_err"][a] for a in ARCHS},
                **{f"{r['size']}_{r['arch']}_err": r["rel_err"] for r in rep["rows"] if r["arch"] != "dense"},
                **{
                    f"{r['size']}_gshard_err_before": r["rel_err"]
                    for r in before["rows"]
                    if r["arch"] == "gshard"
                },
                "gshard_mean_abs_err_before": before["mean_abs_rel_err"]["gshard"],
            }
        )
    return out


# --max-update per size in the reference demix/train.sh (gpt3_small/medium/large/xl), "about 48 hours" each.
REFERENCE_MAX_UPDATES: dict[str, int] = {"125M": 300_000, "350M": 120_000, "760M": 65_000, "1.3B": 50_000}
REFERENCE_HOURS = 48.0


def gshard_what_ifs(
    cluster: ClusterSpec, opts: CostOptions = CostOptions(), form: str = "saturating"
) -> dict:
    """Numbers for the report's GShard notes (none of them is fitted to a GShard row):
    the 1.3B GShard's memory at micro-batch 2 without recompute, its prediction at micro-batch 1 x 16
    accumulation (recompute none, e(h) unchanged: the fit has no micro-batch information), and every GShard
    point without its all-to-all (the public fork builds each MOELayer with `group=dist.new_group([rank])`,
    a one-rank expert group, which would make the all-to-all a local copy)."""
    none = replace(opts, recompute="none")
    eff_none = fit_efficiency(paper_points(), cluster, none, form)
    xl = next(pt for pt in paper_points() if pt.size == "1.3B" and pt.arch == "gshard")
    mb1 = replace(none, micro_batch=1, grad_accum=opts.grad_accum * opts.micro_batch)  # same global batch
    pred_mb1 = predict(xl.cfg, xl.gpus, cluster, eff_none, mb1)
    no_a2a = {}
    for label, o in (("", opts), ("none_", none)):
        rep = paper_report(cluster, o, form)
        for r in rep["rows"]:
            if r["arch"] == "gshard":
                tpg = r["tflops_per_update"] / (r["gpus"] * (r["step_s"] - r["alltoall_s"]))
                no_a2a[f"{label}{r['size']}"] = {
                    "tflops_per_gpu": tpg,
                    "rel_err": tpg / r["paper_tflops_per_gpu"] - 1,
                }
    limit = cluster.gpu_memory_bytes
    too_big = [
        f"{pt.size} {pt.arch}"
        for pt in paper_points()
        if limit is not None and memory_bytes(pt.cfg, pt.gpus, none, False) > limit
    ]
    xl_dense = next(pt for pt in paper_points() if pt.size == "1.3B" and pt.arch == "dense")
    wall = {
        pt.size: acc.flops_per_update(pt.cfg, pt.gpus * opts.micro_batch * opts.grad_accum).recompute
        * REFERENCE_MAX_UPDATES[pt.size]
        / (pt.gpus * REFERENCE_HOURS * 3600)
        / 1e12
        for pt in paper_points()
        if pt.arch == "dense"
    }
    return {
        "dense_tflops_per_gpu_from_max_updates_over_48h": wall,
        "not_fitting_without_recompute": too_big,
        "xl_params_per_gpu": params_per_gpu(xl.cfg, xl.gpus),
        "xl_dense_memory_gib_no_recompute": memory_bytes(xl_dense.cfg, xl_dense.gpus, none, False) / 2**30,
        "xl_memory_gib_no_recompute": memory_bytes(xl.cfg, xl.gpus, none, False) / 2**30,
        "xl_memory_gib_recompute": memory_bytes(xl.cfg, xl.gpus, opts, True) / 2**30,
        "xl_memory_gib_mb1_no_recompute": memory_bytes(xl.cfg, xl.gpus, mb1, False) / 2**30,
        "gpu_memory_gib": None if limit is None else limit / 2**30,
        "xl_mb1": {
            "micro_batch": mb1.micro_batch,
            "grad_accum": mb1.grad_accum,
            "recompute": pred_mb1.recompute,
            "step_s": pred_mb1.step_s,
            "tflops_per_gpu": pred_mb1.tflops_per_gpu,
            "rel_err": pred_mb1.tflops_per_gpu / xl.measured_tflops_per_gpu - 1,
        },
        "no_alltoall": no_a2a,
    }
