"""`python -m benchmarks.costmodel`: the paper's 12 configurations (`--paper`, writes the report) or one
configuration (`--preset`). docs/costmodel.md."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from benchmarks.costmodel.cluster import ClusterSpec, cluster_presets, load_cluster
from benchmarks.costmodel.fit import cluster_efficiency
from benchmarks.costmodel.options import (
    ARCHS,
    DTYPE_BYTES,
    EFFICIENCY_FORMS,
    GSHARD_OVERHEADS,
    ON_OOM,
    OPTIMIZERS,
    RECOMPUTE,
    CostOptions,
)
from benchmarks.costmodel.paper import gshard_comparison, gshard_what_ifs, paper_report, sensitivity
from benchmarks.costmodel.predict import predict
from benchmarks.costmodel.report import RESULTS_DIR, fitted_line, format_table, write_paper_report
from data.argtypes import nonneg_int, positive_float, positive_int, unit_closed
from data.cli import usage_error
from launcher.typed import ConfigError
from model import accounting as acc
from model.config import ModelConfig

DESCRIPTION = (
    "A cluster cost model for Dense, DEMix and GShard training, checked against DEMix Tables 2 and 9."
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.costmodel", description=DESCRIPTION)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--paper", action="store_true", help="the 12 configurations of DEMix Tables 2/9; writes results"
    )
    mode.add_argument("--preset", help="a model preset (gpt3-small ... gpt3-xl) for one configuration")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--cluster", default="v100-dgx1", help="cluster preset: " + ", ".join(cluster_presets())
    )
    where.add_argument("--cluster-file", help="a cluster YAML (keys of ClusterSpec)")
    p.add_argument("--arch", choices=ARCHS, default="dense", help="with --preset")
    p.add_argument("--gpus", type=positive_int, default=8, help="with --preset")
    p.add_argument(
        "--experts",
        type=nonneg_int,
        default=0,
        help="with --preset: DEMix domains (8) / GShard experts (= GPUs)",
    )
    p.add_argument("--micro-batch", type=positive_int, default=acc.PAPER_MICRO_BATCH)
    p.add_argument("--grad-accum", type=positive_int, default=acc.PAPER_GRAD_ACCUM)
    p.add_argument("--grad-dtype", choices=sorted(DTYPE_BYTES), default="fp16")
    p.add_argument("--recompute", choices=RECOMPUTE, default="full")
    p.add_argument(
        "--overlap", type=unit_closed, default=0.0, help="fraction of the all-reduce hidden by backward"
    )
    p.add_argument("--bucket-mb", type=positive_float, default=25.0)
    p.add_argument(
        "--gshard-overheads",
        choices=GSHARD_OVERHEADS,
        default="fairseq",
        help="t_gshard terms of fairseq's MoE layer; none = the all-to-all-only model",
    )
    p.add_argument(
        "--gate-calls",
        type=positive_int,
        default=2,
        help="GShard gate evaluations per MoE-layer forward (fork: 2)",
    )
    p.add_argument(
        "--gshard-optimizer",
        choices=OPTIMIZERS,
        default="fp16",
        help="GShard's fairseq optimizer wrapper (the reference ran --fp16: fp32 master weights)",
    )
    p.add_argument(
        "--on-oom",
        choices=ON_OOM,
        default="recompute",
        help="with --recompute none, a configuration that does not fit the GPU is recomputed or not",
    )
    p.add_argument("--efficiency-form", choices=EFFICIENCY_FORMS, default="saturating")
    p.add_argument("--out-dir", default=str(RESULTS_DIR), help="with --paper: where the .md/.json go")
    p.add_argument("--no-write", action="store_true", help="with --paper: print only")
    p.add_argument("--json", action="store_true", help="print JSON")
    return p


def _model(preset: str, arch: str, gpus: int, experts: int) -> ModelConfig:
    from launcher.config import load_run_config

    n = experts or {"dense": 0, "demix": acc.PAPER_DEMIX_EXPERTS, "gshard": gpus}[arch]
    return load_run_config(
        None, [f"model.preset={preset}", f"model.ffn.kind={arch}", f"model.ffn.num_experts={n}"]
    ).model


def _options(args: argparse.Namespace) -> CostOptions:
    """CostOptions from the command line; every problem (and a bad --gpus) in one ConfigError."""
    opts = CostOptions(
        micro_batch=args.micro_batch,
        grad_accum=args.grad_accum,
        grad_dtype=args.grad_dtype,
        act_dtype="fp16",
        recompute=args.recompute,
        overlap=args.overlap,
        bucket_mb=args.bucket_mb,
        gshard_overheads=args.gshard_overheads,
        gate_calls=args.gate_calls,
        gshard_optimizer=args.gshard_optimizer,
        on_oom=args.on_oom,
    )
    if opts.problems() or args.gpus < 1:
        raise ConfigError(
            opts.problems() + ([f"--gpus={args.gpus}: must be >= 1"] if args.gpus < 1 else []), "options"
        )
    return opts


def _paper(args: argparse.Namespace, argv: list[str], cluster: ClusterSpec, opts: CostOptions) -> None:
    """--paper: print the 12 configurations and, unless --no-write, write the report."""
    report = paper_report(cluster, opts, args.efficiency_form)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(format_table(report["rows"]))
        print(f"\nfitted on Dense only: {fitted_line(report['fitted'])}")
    if not args.no_write:
        command = "python -m benchmarks.costmodel " + shlex.join(argv)
        gshard = (
            gshard_comparison(cluster, opts, args.efficiency_form),
            gshard_what_ifs(cluster, opts, args.efficiency_form),
        )
        paths = write_paper_report(report, sensitivity(opts), command, Path(args.out_dir), gshard)
        print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)


def _one(args: argparse.Namespace, cluster: ClusterSpec, opts: CostOptions) -> None:
    """--preset: print one configuration's prediction."""
    cfg = _model(args.preset, args.arch, args.gpus, args.experts)
    eff = cluster_efficiency(cluster, opts, args.efficiency_form)
    row = {"size": args.preset, **asdict(predict(cfg, args.gpus, cluster, eff, opts))}
    if args.json:
        print(json.dumps({"cluster": cluster.name, "efficiency_fit": asdict(eff), **row}, indent=1))
    else:
        print(format_table([row]))
        print(f"\ncluster {cluster.name}; {fitted_line(asdict(eff))}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; 0 on success, 2 on a configuration error (printed, no traceback)."""
    args = build_parser().parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        cluster = load_cluster(args.cluster_file or args.cluster)
        opts = _options(args)
        if args.paper:
            _paper(args, argv, cluster, opts)
        else:
            _one(args, cluster, opts)
        return 0
    except (ConfigError, ValueError) as e:
        return usage_error(e)
