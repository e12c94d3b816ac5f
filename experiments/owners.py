"""Experts from owners who share no data, on the demo corpus: does a merge of separately trained experts match joint
training? (launcher/modular/owners/, docs/modular.md.)

    python -m experiments.owners [--anchor-steps 150] [--owner-steps 100] [--nproc 2] [--max-blocks 32]
        [--out runs/owners] [--record experiments/results/owners.md]

Domains: the anchor's (news, legal, code, literature), the owners' (biomed, techdocs, reviews, email: one owner
each) and the novel ones (speeches, scripture, drama, tweets: nobody trains on them).

Arms, all on `nproc` CPU ranks through the launcher, evaluated by launcher.evaluation.evaluate on the test split:

  anchor     DEMix trained on the anchor's domains for `anchor-steps` steps: the public model.
  merged     the anchor + four packages: each owner runs `experts train-owner` (its own expert, initialised from the
             anchor's most probable expert on its data, trained `owner-steps` steps on a data root that holds its
             domain only, every shared parameter frozen), then `experts merge`. Router vectors of the anchor's own
             experts are computed on the anchor's data (`merge --anchor-data`).
  joint      DEMix trained from scratch on all eight domains with the same total tokens (anchor-steps + 4 x
             owner-steps steps of the same batch).
  dense-dapt a Dense model trained on the anchor's domains for anchor-steps, then continued on the four owners' data
             (natural mixture) for 4 x owner-steps steps: the same tokens again.
  opt-out    the merged model with `--exclude-experts` email (the `experts verify` proof is run and recorded).

Reported: the mean perplexity over each group of domains (anchor's, owners', novel) with 95 % bootstrap intervals
over blocks (launcher/evaluation/stats.py `bootstrap_mean_ppl`), per mixing mode, and per domain. Finished stages
under --out are reused.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.machine import uptime
from data.argtypes import positive_int
from experiments.btx_compare import launch_run
from launcher.tables import markdown_table

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "artifacts" / "demo" / "tokens"
TOKENIZER = "sentencepiece"
ANCHOR_DOMAINS = ["news", "legal", "code", "literature"]
OWNER_DOMAINS = ["biomed", "techdocs", "reviews", "email"]
NOVEL_DOMAINS = ["speeches", "scripture", "drama", "tweets"]
OPT_OUT = "email"
GROUPS = {"anchor's": ANCHOR_DOMAINS, "owners'": OWNER_DOMAINS, "novel": NOVEL_DOMAINS}


def owner_data(domain: str, out: Path) -> Path:
    """A tokens root holding only `domain` (links to the demo's files, the manifest cut to that domain): the only
    data the owner's run can open."""
    import os

    src = DATA / TOKENIZER
    root = out / f"data-{domain}"
    tok = root / TOKENIZER
    tok.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((src / "manifest.json").read_text())
    names = set(manifest["domains"])

    def only(v: Any) -> Any:  # every per-domain list or dict of the manifest, cut to `domain`
        if isinstance(v, dict):
            return (
                {domain: v[domain]} if set(v) <= names and domain in v else {k: only(x) for k, x in v.items()}
            )
        if isinstance(v, list) and v and all(isinstance(x, str) for x in v) and set(v) <= names:
            return [x for x in v if x == domain]
        return v

    manifest = {k: v if k == "tokenizer" else only(v) for k, v in manifest.items()}
    (tok / "manifest.json").write_text(json.dumps(manifest))
    for name in (domain, manifest["tokenizer"]["model_file"]):
        if not (tok / name).exists():
            os.symlink((src / name).resolve(), tok / name)
    return root


def sets_for(domains: Sequence[str], steps: int, kind: str) -> list[str]:
    return [f"data.domains={json.dumps(list(domains))}", f"train.steps={steps}", f"model.ffn.kind={kind}"]


def train_owner(anchor: Path, domain: str, out: Path, steps: int, nproc: int) -> Path:
    from launcher.modular.experts import main as experts

    pkg = out / f"pkg-{domain}"
    if (pkg / "manifest.json").is_file():
        print(f"[owners] {domain}: package there, reused", flush=True)
        return pkg
    data = owner_data(domain, out)
    argv = ["train-owner", str(anchor), "--domain", domain, "--data", str(data), "--steps", str(steps)]
    argv += ["--out", str(pkg), "--nproc", str(nproc), "--tag", f"owner={domain}-owner", "--overwrite"]
    t0 = time.perf_counter()
    if experts(argv) != 0:
        raise SystemExit(f"[owners] train-owner {domain} failed")
    print(f"[owners] {domain}: packaged in {time.perf_counter() - t0:.0f} s", flush=True)
    return pkg


def evaluate(ckpt: Path, out: Path, max_blocks: int, exclude: Sequence[str] = ()) -> dict[str, Any]:
    from launcher.evaluation.evaluate import evaluate_checkpoint

    path = out / "eval.json"
    if path.is_file():
        return json.loads(path.read_text())
    res = evaluate_checkpoint(
        ckpt,
        DATA,
        exclude_experts=list(exclude),
        tokenizer=TOKENIZER,
        max_blocks=max_blocks,
        cached_blocks=max_blocks,
        domains=ANCHOR_DOMAINS + OWNER_DOMAINS + NOVEL_DOMAINS,
        progress=False,
    ).to_dict()
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res))
    return res


def group_ppl(res: dict[str, Any], mode: str, domains: Sequence[str]) -> tuple[float, float, float]:
    """Mean perplexity over `domains` in `mode` (`ppl` for dense) with its 95 % bootstrap interval."""
    from launcher.evaluation.stats import bootstrap_mean_ppl

    rows = [(res["domains"][d]["block_nll"][mode], res["domains"][d]["block_tokens"]) for d in domains]
    return bootstrap_mean_ppl(rows)


def arm_rows(name: str, res: dict[str, Any], modes: Sequence[str]) -> list[dict[str, Any]]:
    rows = []
    for mode in modes:
        if not all(mode in res["domains"][d]["block_nll"] for d in res["domains"]):
            continue
        row: dict[str, Any] = {"arm": name, "mode": mode}
        for g, ds in GROUPS.items():
            row[g] = group_ppl(res, mode, ds)
        row["per_domain"] = {d: res["domains"][d]["ppl"][mode] for d in res["domains"]}
        rows.append(row)
    return rows


def _fmt(v: tuple[float, float, float]) -> str:
    return f"{v[0]:.1f} [{v[1]:.1f}, {v[2]:.1f}]" if math.isfinite(v[0]) else "n/a"


def markdown(rep: dict[str, Any]) -> str:
    rows = rep["rows"]
    table = markdown_table(
        ["arm", "mode", *(f"{g} domains" for g in GROUPS)],
        [[r["arm"], r["mode"], *(_fmt(r[g]) for g in GROUPS)] for r in rows],
    )
    domains = ANCHOR_DOMAINS + OWNER_DOMAINS + NOVEL_DOMAINS
    per = markdown_table(
        ["arm", "mode", *domains],
        [[r["arm"], r["mode"], *(f"{r['per_domain'][d]:.1f}" for d in domains)] for r in rows],
    )
    a = rep["settings"]
    lines = [
        "# Experts from owners who share no data (demo corpus)",
        "",
        f"Command: `{rep['command']}`; machine load before this (last) invocation: {rep['load_before']}. Stages "
        "finished by an earlier invocation of the same settings are reused.",
        "",
        f"Anchor: DEMix on {', '.join(ANCHOR_DOMAINS)}, {a['anchor_steps']} steps on {a['nproc']} ranks. Owners "
        f"({', '.join(OWNER_DOMAINS)}): each `experts train-owner` from the anchor, {a['owner_steps']} steps on "
        f"{a['nproc']} ranks, on a data root holding its domain only. Joint DEMix and Dense-DAPT: the same total "
        f"tokens ({a['anchor_steps'] + 4 * a['owner_steps']} steps of the same batch). Test split, at most "
        f"{a['max_blocks']} blocks per domain; mean perplexity of each group of domains, 95 % bootstrap interval "
        "over blocks.",
        "",
        *table,
        "",
        "Per domain:",
        "",
        *per,
        "",
        "Opt-out: " + rep["opt_out"],
        "",
        "Modes: naive (the domain's own expert; a novel domain's best single expert), average, uniform/updating/cached "
        "(the DEMix posterior with that prior), topk (k = 2 by the cached prior), router (router vectors, τ = "
        f"{rep['router_temperature']}), router_posterior (the posterior with the router weights as its prior).",
    ]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    from launcher.modular.experts import main as experts

    t0, load = time.perf_counter(), uptime()
    out = Path(args.out)
    n, sa, so = args.nproc, args.anchor_steps, args.owner_steps
    demix_cfg, dense_cfg = ROOT / "configs/demo/demix.yaml", ROOT / "configs/demo/dense.yaml"
    settings = {"anchor_steps": sa, "owner_steps": so, "nproc": n, "max_blocks": args.max_blocks}
    anchor = launch_run(demix_cfg, sets_for(ANCHOR_DOMAINS, sa, "demix"), out / "anchor", sa, n, settings)
    joint = launch_run(
        demix_cfg,
        sets_for(ANCHOR_DOMAINS + OWNER_DOMAINS, sa + 4 * so, "demix"),
        out / "joint",
        sa + 4 * so,
        n,
        settings,
    )
    dense = launch_run(dense_cfg, sets_for(ANCHOR_DOMAINS, sa, "dense"), out / "dense", sa, n, settings)
    dapt_sets = sets_for(OWNER_DOMAINS, 4 * so, "dense") + [f"train.init_from={dense}"]
    dapt = launch_run(dense_cfg, dapt_sets, out / "dense-dapt", 4 * so, n, settings)
    pkgs = [train_owner(anchor, d, out, so, n) for d in OWNER_DOMAINS]
    merged = out / "merged"
    if not (merged / "meta.json").is_file():
        argv_m = ["merge", str(anchor), *map(str, pkgs), "--out", str(merged)]
        if experts([*argv_m, "--anchor-data", str(DATA), "--anchor-tokenizer", TOKENIZER]) != 0:
            raise SystemExit("[owners] merge failed")
    audit = out / "opt-out-audit.json"
    if experts(["verify", str(merged), "--without", OPT_OUT, "--out", str(audit)]) != 0:
        raise SystemExit("[owners] the opt-out proof failed")
    mb = args.max_blocks
    evals = {
        "anchor": evaluate(anchor, out / "eval-anchor", mb),
        "merged": evaluate(merged, out / "eval-merged", mb),
        f"merged without {OPT_OUT}": evaluate(merged, out / "eval-opt-out", mb, [OPT_OUT]),
        "joint": evaluate(joint, out / "eval-joint", mb),
        "dense-dapt": evaluate(dapt, out / "eval-dense-dapt", mb),
    }
    demix_modes = ["naive", "average", "uniform", "updating", "cached", "topk", "router", "router_posterior"]
    rows = []
    for name, res in evals.items():
        rows += arm_rows(name, res, ["ppl"] if res["kind"] == "dense" else demix_modes)
    a = json.loads(audit.read_text())
    full = {r["mode"]: r for r in rows if r["arm"] == "merged"}
    opt = {r["mode"]: r for r in rows if r["arm"] == f"merged without {OPT_OUT}"}
    changed = sorted(
        d
        for m in ("naive",)
        for d in full[m]["per_domain"]
        if m in opt and opt[m]["per_domain"][d] != full[m]["per_domain"][d]
    )
    opt_line = (
        f"`experts verify {merged} --without {OPT_OUT}`: passed={a['passed']} ({a['checks']['tensors_compared']} "
        f"tensors equal, bit for bit, to the merge without its package; shared parameters are the anchor's: "
        f"{a['checks']['shared_equal_anchor']}). Domains whose naive (own-expert) perplexity changed when {OPT_OUT} "
        f"opted out: {', '.join(changed) or 'none'}."
    )
    rep = {
        "command": "python -m experiments.owners " + " ".join(argv),
        "settings": settings,
        "load_before": load,
        "rows": rows,
        "opt_out": opt_line,
        "router_temperature": evals["merged"].get("router_temperature"),
        "audit": a,
        "seconds": time.perf_counter() - t0,
    }
    (out / "owners.json").write_text(json.dumps(rep, indent=1))
    md = markdown(rep)
    (out / "owners.md").write_text(md)
    if args.record:
        Path(args.record).write_text(md)
    print(md)
    return rep


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--anchor-steps", type=positive_int, default=150)
    p.add_argument("--owner-steps", type=positive_int, default=100)
    p.add_argument("--nproc", type=positive_int, default=2)
    p.add_argument("--max-blocks", type=positive_int, default=32)
    p.add_argument("--out", default="runs/owners")
    p.add_argument("--record", help="also write the Markdown report here (experiments/results/owners.md)")
    run(p.parse_args(argv), argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
