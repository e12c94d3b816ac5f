"""Modular experts (DEMix §6-7): add an expert for a new domain, adapt it (DEMix-DAPT, and the Dense-DAPT
baseline), remove experts, and report both in the paper's shape (Tables 6, 7, 13).

    python -m launcher.modular.experts add CKPT --domain speeches --out NEW [--data DIR --tokenizer TOK --dev-blocks 100]
    python -m launcher.modular.experts dapt --arch demix NEW --domain speeches --steps 40 --nproc 2 --run-dir RUN
    python -m launcher.modular.experts dapt --arch dense DENSE --domain speeches --steps 40 --nproc 2 --run-dir RUN
    python -m launcher.modular.experts remove CKPT --experts legal[,news] --out SMALLER
    python -m launcher.modular.experts report adapt --demix-before CKPT --demix-after RUN/model \\
        --dense-before DENSE --dense-after RUN/model --new-domains speeches --out DIR
    python -m launcher.modular.experts report remove CKPT --out DIR
    python -m launcher.modular.experts demo            # `make modular`: all of the above on the demo corpus

Experts from owners who share no data (launcher/modular/owners/, docs/modular.md):

    python -m launcher.modular.experts train-owner ANCHOR --domain D --data OWNER_TOKENS --steps N --out PKG \\
        [--nproc 2 | --hostfile H] [--source EXPERT] [--tag licence=cc-by]
    python -m launcher.modular.experts package CKPT --domain D --out PKG [--anchor ANCHOR] [--data DIR]
    python -m launcher.modular.experts merge ANCHOR PKG [PKG ...] --out MERGED
    python -m launcher.modular.experts verify MERGED --without D [--packages PKG ...] [--anchor A] [--out AUDIT.json]

Expert ids are positions in the checkpoint's domain list (`meta.json` "domains"). Adding appends id E (domain list
+ [new]); removing renumbers the kept experts in their old order. Every other tensor is copied unchanged.

Adding (§6): the domain posterior on a held-out sample of the new domain is the cached prior of §5 (the updating
prior of eq. 9 after n development blocks, model/mixture.py); the new expert starts, in every DEMix layer, as a copy
of its most probable expert  j* = argmax_j p(D = j | dev blocks).

DEMix-DAPT trains only the new expert (`train.trainable=experts` with `data.domains=[new]`: the run's ranks hold
that one expert) with the original run's recipe and a 10x smaller learning rate; Dense-DAPT continues training all
parameters of the dense model on the new domain for the same budget.

Removal at evaluation time masks experts out of the mixture: the cached prior and the posterior (eqs. 6-8) are
computed over the kept experts only, which is what a checkpoint without them computes (`remove`), but from one
all-experts pass per domain.
"""  # noqa: E501 (the usage lines, as --help shows them)

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from data.argtypes import positive_float, positive_int
from data.cli import cli_main, usage_error
from launcher.checkpoint import CheckpointError, check_checkpoint_out, read_meta
from launcher.checkpoint_data import check_checkpoint_data
from launcher.config import ConfigError
from launcher.expert_surgery import CkptLike
from launcher.modular.experts.dapt import run_dapt
from launcher.modular.experts.editing import add_expert, remove_experts
from launcher.modular.experts.report_files import (
    adaptation_markdown,
    check_report_out,
    removal_markdown,
    write_report,
)
from launcher.modular.experts.tables import (
    ADAPT_REPORT_FORMAT,
    REMOVAL_REPORT_FORMAT,
    adaptation_report,
    removal_report,
)
from model import mixture as mx


def run_demo(args: argparse.Namespace) -> int:
    """Add a novel domain to the demo DEMix model, DEMix-DAPT vs Dense-DAPT, remove an expert, print the tables."""
    demix, dense, out = Path(args.demix), Path(args.dense), Path(args.out)
    missing = [
        str(p) for p in (demix, dense) if not (p / "meta.json").is_file() or not (p / "model.pt").is_file()
    ]
    if missing:
        return usage_error(f"missing demo checkpoints {missing}: run `make demo` first")
    t0 = time.perf_counter()
    _, added = add_expert(demix, args.domain, out / "demix-added", dev_blocks=args.dev_blocks)
    print(
        f"[modular] added {args.domain!r} as expert {added['expert_id']}, initialised from {added['source']!r} "
        f"(posterior {added['posterior'][added['source']]:.3f})",
        flush=True,
    )
    demix_after = run_dapt(
        out / "demix-added", "demix", args.domain, args.steps, out / "demix-dapt", args.nproc
    )
    dense_after = run_dapt(dense, "dense", args.domain, args.steps, out / "dense-dapt", args.nproc)
    adapt = adaptation_report(
        demix,
        demix_after,
        dense,
        dense_after,
        [args.domain],
        max_blocks=args.max_blocks,
        cached_blocks=args.dev_blocks,
    )
    adapt["added"] = added
    removed = remove_experts(demix, [args.remove], out / f"demix-minus-{args.remove}")
    removal = removal_report(demix, max_blocks=args.max_blocks, cached_blocks=args.dev_blocks)
    removal["removed_checkpoint"] = removed
    post = added["posterior"][added["source"]]
    md_a = (
        f"New expert {args.domain!r} (id {added['expert_id']}) initialised from {added['source']!r}, its most "
        f"probable expert (posterior {post:.3f} on {added['dev_blocks']} dev blocks); DAPT: {args.steps} steps on "
        f"{args.nproc} ranks, lr 10x smaller than the original run.\n\n" + adaptation_markdown(adapt)
    )
    md_r = removal_markdown(removal)
    write_report(adapt, md_a, out, "adapt")
    write_report(removal, md_r, out, "remove")
    (out / "report.md").write_text(f"# Modular experts on the demo corpus\n\n{md_a}\n{md_r}")
    print(f"\n{md_a}\n{md_r}\nwritten: {out / 'report.md'} ({time.perf_counter() - t0:.0f} s)")
    return 0


def _split(s: str | None) -> list[str]:
    return [x for x in (s or "").split(",") if x]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="experts.py",  # what it was as a module: usage lines and errors unchanged
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    def data_args(q: argparse.ArgumentParser) -> None:
        q.add_argument("--data", help="prepared tokens root (default: the checkpoint's data.path)")
        q.add_argument("--tokenizer", help="tokenizer directory name (default: the checkpoint's)")

    a = sub.add_parser("add", help="append an expert for a new domain, copied from its most probable expert")
    a.add_argument("checkpoint")
    a.add_argument(
        "--domain", required=True, action="append", help="new domain (repeat to add several in turn)"
    )
    a.add_argument("--out", required=True)
    a.add_argument(
        "--dev-blocks",
        type=positive_int,
        default=mx.CACHED_PRIOR_BLOCKS,
        help="held-out blocks for the posterior",
    )
    a.add_argument("--source", help="initialise from this expert instead of the most probable one")
    a.add_argument(
        "--overwrite", action="store_true", help="replace an existing checkpoint at --out (even the input)"
    )
    data_args(a)
    d = sub.add_parser("dapt", help="DEMix-DAPT (train the new expert only) or Dense-DAPT (all parameters)")
    d.add_argument("checkpoint")
    d.add_argument("--arch", choices=("demix", "dense"), required=True)
    d.add_argument("--domain", required=True)
    d.add_argument("--steps", type=positive_int, required=True)
    d.add_argument("--run-dir", required=True)
    d.add_argument("--nproc", type=positive_int, default=2)
    d.add_argument(
        "--lr", type=positive_float, help="learning rate (default: lr-scale x the checkpoint's run lr)"
    )
    d.add_argument("--lr-scale", type=positive_float, default=0.1)
    d.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    d.add_argument("--dry-run", action="store_true")
    data_args(d)
    r = sub.add_parser("remove", help="drop experts (ids renumbered, names kept consistent)")
    r.add_argument("checkpoint")
    r.add_argument("--experts", required=True, help="comma-separated domain names")
    r.add_argument("--out", required=True)
    r.add_argument(
        "--overwrite", action="store_true", help="replace an existing checkpoint at --out (even the input)"
    )
    rep = sub.add_parser("report", help="Tables 6/13 (adapt) or Table 7 (remove), markdown + JSON")
    rep.add_argument("which", choices=("adapt", "remove"))
    rep.add_argument("checkpoint", nargs="?", help="remove: the DEMix checkpoint")
    for k in ("demix-before", "demix-after", "dense-before", "dense-after"):
        rep.add_argument(f"--{k}")
    rep.add_argument("--new-domains", help="adapt: comma-separated added domains")
    rep.add_argument("--domains", help="remove: domains to report (default: every expert's)")
    rep.add_argument("--max-blocks", type=positive_int, default=16)
    rep.add_argument("--cached-blocks", type=positive_int, default=16)
    rep.add_argument("--out", required=True)
    data_args(rep)
    _owner_parsers(sub, data_args)
    m = sub.add_parser("demo", help="`make modular`: add, DEMix-DAPT vs Dense-DAPT, remove, tables")
    m.add_argument("--demix", default="runs/demo/demix/model")
    m.add_argument("--dense", default="runs/demo/dense/model")
    m.add_argument("--domain", default="speeches")
    m.add_argument("--remove", default="legal")
    m.add_argument("--steps", type=positive_int, default=20)
    m.add_argument("--nproc", type=positive_int, default=2)
    m.add_argument("--dev-blocks", type=positive_int, default=8)
    m.add_argument("--max-blocks", type=positive_int, default=8)
    m.add_argument("--out", default="runs/modular")
    return p.parse_args(argv)


def _tags(pairs: Sequence[str]) -> dict[str, str]:
    """`--tag key=value` pairs as a dict (a key given twice keeps the last value)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise CheckpointError(f"--tag {pair!r}: expected KEY=VALUE, e.g. --tag licence=cc-by-4.0")
        out[key.strip()] = value
    return out


def _owner_parsers(sub: Any, data_args: Any) -> None:
    """The subcommands of owners who share no data: train-owner, package, merge, verify."""
    t = sub.add_parser(
        "train-owner",
        help="train a new expert from ANCHOR on the owner's data alone (shared parameters frozen), then package it",
    )
    t.add_argument("anchor", help="the public anchor checkpoint (Dense or DEMix)")
    t.add_argument("--domain", required=True, help="the owner's domain: the new expert's name")
    t.add_argument("--data", required=True, help="the owner's prepared tokens root (python -m data.prepare)")
    t.add_argument("--tokenizer", help="tokenizer directory name (default: the anchor's)")
    t.add_argument("--steps", type=positive_int, required=True)
    t.add_argument("--out", required=True, help="the package directory to write")
    t.add_argument("--run-dir", help="the training run's directory (default: OUT.run)")
    t.add_argument("--nproc", type=positive_int, default=2, help="local ranks (without --hostfile)")
    t.add_argument("--hostfile", help="a DeepSpeed hostfile: train on those hosts (docs/cluster.md)")
    t.add_argument(
        "--launcher", help="with --hostfile: pdsh (default), openmpi, slurm, ... (launch --launcher)"
    )
    t.add_argument("--master-addr", help="with --hostfile: the first host's address")
    t.add_argument("--source", help="a DEMix anchor's expert to start from (default: the most probable one)")
    t.add_argument("--lr", type=positive_float, help="learning rate (default: lr-scale x the anchor's)")
    t.add_argument("--lr-scale", type=positive_float, default=1.0)
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    t.add_argument(
        "--tag", action="append", default=[], metavar="KEY=VALUE", help="e.g. licence=..., contact=..."
    )
    t.add_argument("--dev-blocks", type=positive_int, default=32, help="valid blocks for the dev perplexity")
    t.add_argument(
        "--router-blocks", type=positive_int, default=64, help="train blocks for the router vector"
    )
    t.add_argument("--overwrite", action="store_true", help="replace an existing package at --out")
    t.add_argument("--dry-run", action="store_true", help="write the start and the run's plan; train nothing")
    k = sub.add_parser("package", help="write one expert of a DEMix checkpoint as an expert package")
    k.add_argument("checkpoint")
    k.add_argument("--domain", required=True)
    k.add_argument("--out", required=True)
    k.add_argument(
        "--anchor", help="check that the checkpoint's shared parameters are this anchor's, bit for bit"
    )
    k.add_argument("--tag", action="append", default=[], metavar="KEY=VALUE")
    k.add_argument("--dev-blocks", type=positive_int, default=32)
    k.add_argument("--router-blocks", type=positive_int, default=64)
    k.add_argument("--overwrite", action="store_true")
    data_args(k)
    g = sub.add_parser("merge", help="merge expert packages into the anchor: one DEMix checkpoint")
    g.add_argument("anchor")
    g.add_argument("packages", nargs="+")
    g.add_argument("--out", required=True)
    g.add_argument("--overwrite", action="store_true")
    g.add_argument(
        "--anchor-data", help="a DEMix anchor's own data: router vectors for its experts (router mode)"
    )
    g.add_argument("--anchor-tokenizer", help="tokenizer directory of --anchor-data (default: the anchor's)")
    v = sub.add_parser("verify", help="prove an opt-out: MERGED without D equals a merge without D's package")
    v.add_argument("merged")
    v.add_argument("--without", required=True, help="comma-separated domains to opt out")
    v.add_argument("--packages", nargs="+", help="the packages (default: those the merge recorded)")
    v.add_argument("--anchor", help="the anchor (default: the one the merge recorded)")
    v.add_argument("--out", help="write the audit record (JSON) here")


def _train_owner(args: argparse.Namespace) -> None:
    """`train-owner`: the owner's run and its package; prints the manifest's summary."""
    from launcher.modular.owners.train_owner import train_owner

    launch: list[str] = []
    for flag, value in (
        ("--hostfile", args.hostfile),
        ("--launcher", args.launcher),
        ("--master-addr", args.master_addr),
    ):
        if value:
            launch += [flag, value]
    m = train_owner(
        args.anchor,
        args.domain,
        args.data,
        args.out,
        steps=args.steps,
        nproc=args.nproc,
        tokenizer=args.tokenizer,
        source=args.source,
        lr=args.lr,
        lr_scale=args.lr_scale,
        run_dir=args.run_dir,
        launch_args=launch,
        overrides=args.overrides,
        tags=_tags(args.tag),
        dev_blocks=args.dev_blocks,
        router_blocks=args.router_blocks,
        overwrite=args.overwrite,
        dry_run=args.dry_run,
    )
    print(json.dumps(_summary(m, args.out)))


def _summary(m: dict[str, Any], out: str) -> dict[str, Any]:
    if "manifest_sha256" not in m:
        return m
    return {
        "package": out,
        "domain": m["domain"],
        "anchor_fingerprint": m["anchor"]["sha256"],
        "dev_perplexity": (m.get("dev") or {}).get("perplexity"),
        "training_tokens": m["training"]["tokens"],
        "manifest_sha256": m["manifest_sha256"],
    }


def _package(args: argparse.Namespace) -> None:
    """`package`: one expert of a checkpoint as a package."""
    from launcher.modular.owners.package import package_expert

    m = package_expert(
        args.checkpoint,
        args.domain,
        args.out,
        anchor=args.anchor,
        data=args.data,
        tokenizer=args.tokenizer,
        tags=_tags(args.tag),
        dev_blocks=args.dev_blocks,
        router_blocks=args.router_blocks,
        overwrite=args.overwrite,
    )
    print(json.dumps(_summary(m, args.out)))


def _merge(args: argparse.Namespace) -> None:
    """`merge`: the anchor and the packages as one DEMix checkpoint."""
    from launcher.modular.owners.merge import merge

    rec = merge(
        args.anchor,
        args.packages,
        args.out,
        overwrite=args.overwrite,
        anchor_data=args.anchor_data,
        anchor_tokenizer=args.anchor_tokenizer,
    )
    print(json.dumps(rec))


def _verify(args: argparse.Namespace) -> int:
    """`verify`: the opt-out proof; 0 when it holds, 1 (with the failed checks) when it does not."""
    from launcher.modular.owners.verify import verify_opt_out

    audit = verify_opt_out(args.merged, _split(args.without), args.packages, args.anchor, args.out)
    c = audit["checks"]
    print(
        f"verify: {args.merged} without {', '.join(audit['removed'])}: "
        f"{'equal' if c['equal_to_merge_without'] else 'NOT equal'} to the merge without them "
        f"({c['tensors_compared']} tensors, bit for bit); shared parameters "
        f"{'are' if c['shared_equal_anchor'] else 'are NOT'} the anchor's ({audit['anchor']['fingerprint'][:16]}); "
        f"router vectors {'equal' if c['router_vectors_equal'] else 'differ'}"
        + (f"; audit: {args.out}" if args.out else "")
    )
    for d in c["tensors_differing"]:
        print(f"  {d}")
    return 0 if audit["passed"] else 1


def _add(args: argparse.Namespace) -> None:
    """`add`: the output and the data checked before any tensor is read, then each domain in turn (each sees the
    experts added before it); the last one's checkpoint is written."""
    check_checkpoint_out(args.out, [args.checkpoint], args.overwrite)
    check_checkpoint_data(
        args.checkpoint,
        args.data or read_meta(args.checkpoint)["config"]["data"]["path"],
        args.tokenizer,
    )
    c: CkptLike = args.checkpoint
    for i, dom in enumerate(args.domain):
        last = i == len(args.domain) - 1
        c, rec = add_expert(
            c,
            dom,
            args.out if last else None,
            args.data,
            args.tokenizer,
            args.dev_blocks,
            source=args.source,
        )
        print(json.dumps(rec))


def _dapt(args: argparse.Namespace) -> None:
    """`dapt`: launch the run; prints its model folder."""
    print(
        run_dapt(
            args.checkpoint,
            args.arch,
            args.domain,
            args.steps,
            args.run_dir,
            args.nproc,
            args.data,
            args.tokenizer,
            args.lr,
            args.lr_scale,
            args.overrides,
            args.dry_run,
        )
    )


def _remove(args: argparse.Namespace) -> None:
    """`remove`: the smaller checkpoint, its output checked first."""
    check_checkpoint_out(args.out, [args.checkpoint], args.overwrite)
    print(json.dumps(remove_experts(args.checkpoint, _split(args.experts), args.out)))


def _report_adapt(args: argparse.Namespace) -> None:
    """`report adapt`: Tables 6 and 13 from the four checkpoints."""
    need = [
        k
        for k in ("demix_before", "demix_after", "dense_before", "dense_after", "new_domains")
        if not getattr(args, k)
    ]
    if need:
        raise CheckpointError(f"report adapt needs {', '.join('--' + k.replace('_', '-') for k in need)}")
    check_report_out(args.out, "adapt", ADAPT_REPORT_FORMAT)
    r = adaptation_report(
        args.demix_before,
        args.demix_after,
        args.dense_before,
        args.dense_after,
        _split(args.new_domains),
        args.data,
        args.tokenizer,
        args.max_blocks,
        args.cached_blocks,
    )
    write_report(r, md := adaptation_markdown(r), args.out, "adapt")
    print(md)


def _report_remove(args: argparse.Namespace) -> None:
    """`report remove`: Table 7 of the DEMix checkpoint."""
    if not args.checkpoint:
        raise CheckpointError("report remove needs the DEMix checkpoint")
    check_report_out(args.out, "remove", REMOVAL_REPORT_FORMAT)
    r = removal_report(
        args.checkpoint,
        args.data,
        args.tokenizer,
        _split(args.domains) or None,
        args.max_blocks,
        args.cached_blocks,
    )
    write_report(r, md := removal_markdown(r), args.out, "remove")
    print(md)


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    """The command line: status 0, or 2 with one `error:` line for a bad input or a failed run."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:
        if args.cmd == "demo":
            return run_demo(args)
        if args.cmd == "report":
            if args.which == "adapt":
                _report_adapt(args)
            else:
                _report_remove(args)
        elif args.cmd == "verify":
            return _verify(args)
        else:
            commands = {"add": _add, "dapt": _dapt, "remove": _remove, "train-owner": _train_owner}
            {**commands, "package": _package, "merge": _merge}[args.cmd](args)
    except (CheckpointError, ConfigError, RuntimeError) as e:
        return usage_error(e)
    return 0
