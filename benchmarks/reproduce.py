"""`make reproduce`: train every architecture on the demo corpus with the same token budget, evaluate with
intervals, and give each of the paper's claims a verdict.

    python -m benchmarks.reproduce [--budget configs/reproduce/full.yaml] [--out runs/reproduce] [--arms dense,demix]
                                   [--data artifacts/demo/tokens] [--record benchmarks/results/reproduce]

Stages, each resumable (kill it and rerun: finished work is reused, an interrupted training run resumes from its
last checkpoint through the launcher's `--resume auto`):

1. arms: Dense, Dense-balanced, +Domain-Token, DEMix, GShard and CSE (`ARMS`), each with the budget's seeds
   (`train.seed` and `data.seed`), the same steps, ranks and batch, so the same tokens; run dirs
   `<out>/arms/<arm>-s<seed>`;
2. evaluation of every arm (launcher/evaluation/evaluate.py) on `eval_blocks` test blocks per domain with
   per-block NLLs, bootstrap intervals, the unigram floor and cached priors from `cached_blocks` dev blocks
   (100, the paper's number): `<run>/eval/eval.json`, reused when its settings match;
3. modularity on DEMix seed 1 and Dense seed 1: the removal matrix (every expert masked, Table 7), and DAPT on the
   budget's novel domain (DEMix: add an expert copied from the most probable one, train it alone; Dense: train
   everything; the paper's recipe: lr 10x smaller, same steps for both; Table 13);
4. GShard's gating per domain (launcher/evaluation/gating.py; Figure 6);
5. the report: `<out>/report.md` and `report.json` (claims with verdicts, numbers and intervals), copied to
   `--record` when given.

Verdict rules (95 % intervals: paired bootstrap over the same test blocks, launcher/evaluation/stats.py):
* precondition - every arm's in-domain average perplexity is at most half the unigram one;
* Tables 3/4 - DEMix (naive, its own expert) beats Dense in-domain: for every seed pair the pooled
  DEMix/Dense perplexity ratio's upper bound is below 1;
* Table 5 - on novel domains cached <= updating <= uniform < average: no "<=" ratio has its lower bound above 1,
  and uniform/average has its upper bound below 1; and DEMix's cached mixture beats Dense there: for every seed
  pair the pooled ratio's upper bound is below 1;
* Figure 4 - the cached prior (mean of dev posteriors, the paper's text) puts its largest mass on the domain's own
  expert for every training domain;
* Table 7 - removing an expert hurts its own domain (every diagonal change > 0) far more than the others (mean
  diagonal change > 3x the mean absolute off-diagonal change);
* Table 13 - DEMix-DAPT leaves the training domains' perplexity unchanged (|change| < 1 %) while Dense-DAPT raises
  it (pooled ratio lower bound above 1);
* Figure 6 - GShard's per-domain gate distributions are nearly uniform: mean row entropy >= 0.8 log E;
* clusters - CSE forms >= 4 clusters in some layer and one of those layers has purity >= 0.6 against the true
  domains (one cluster of everything scores the largest domain's share);
* CSE vs Dense - the pooled CSE/Dense ratio's upper bound is below 1.
A claim whose arms were not run (see --arms) is reported as "not evaluated", with what is missing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from data.readers import read_yaml
from launcher.checkpoint import write_json_atomic
from launcher.evaluation.stats import bootstrap_mean_ppl, paired_ratio, seed_spread
from launcher.tables import markdown_table

ROOT = Path(__file__).resolve().parents[1]
ARMS: dict[str, tuple[str, tuple[str, ...]]] = {  # name: (base run config, overrides)
    "dense": ("configs/demo/dense.yaml", ()),
    "dense-balanced": ("configs/demo/dense-balanced.yaml", ()),
    "domain-token": ("configs/demo/domain-token.yaml", ()),
    "demix": ("configs/demo/demix.yaml", ()),
    # 8 experts (4 per rank) as DEMix has: the paper's one expert per GPU would give 2 on 2 ranks, too few for
    # Figure 6's question (does the gate follow the 8 domains?)
    "gshard": ("configs/demo/gshard.yaml", ("model.ffn.gshard.experts_per_rank=4",)),
    "cse": (
        "configs/cse/cse.yaml",
        ("model.ffn.cse.dbscan_eps=0.0", "model.ffn.cse.dbscan_auto=target", "model.ffn.cse.min_clusters=4"),
    ),
}
DEMIX_MODES = ("naive", "average", "uniform", "updating", "cached", "topk")


@dataclass
class Budget:
    """What `make reproduce` spends (configs/reproduce/*.yaml)."""

    steps: int
    nproc: int = 2
    seeds: dict[str, list[int]] = field(default_factory=lambda: {a: [1] for a in ARMS})
    sets: list[str] = field(default_factory=list)  # overrides for every arm (model size, lr, batch, ...)
    eval_blocks: int = 64
    cached_blocks: int = 100
    save_interval: int = 50
    dapt_domain: str | None = "speeches"
    dapt_steps: int = 0  # 0: no DAPT

    @classmethod
    def load(cls, path: Path) -> Budget:
        raw = read_yaml(path) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a mapping at the top level")
        unknown = sorted(set(raw) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"{path}: unknown keys {unknown}; known: {sorted(cls.__dataclass_fields__)}")
        b = cls(**raw)
        bad = sorted(set(b.seeds) - set(ARMS))
        if bad:
            raise ValueError(f"{path}: seeds for unknown arms {bad}; arms: {', '.join(ARMS)}")
        return b


# --------------------------------------------------------------------------------------------------
# Stages
# --------------------------------------------------------------------------------------------------


def _finished(run_dir: Path, steps: int) -> bool:
    meta = run_dir / "model" / "meta.json"
    return meta.is_file() and int(json.loads(meta.read_text()).get("step", -1)) == steps


def train_arm(arm: str, seed: int, budget: Budget, out: Path) -> Path:
    """Train one arm (reused when finished, resumed when interrupted); returns its run directory."""
    from launcher.launch import main as launch

    run_dir = out / "arms" / f"{arm}-s{seed}"
    config, arm_sets = ARMS[arm]
    sets = [
        f"train.steps={budget.steps}",
        f"train.seed={seed}",
        f"data.seed={seed}",
        "logging.wandb_mode=disabled",
        f"train.save_interval={budget.save_interval}",
        "train.keep_checkpoints=1",
        *budget.sets,
        *arm_sets,
    ]
    settings = {"config": config, "sets": sets}
    recorded = run_dir / "reproduce_arm.json"
    if recorded.is_file() and json.loads(recorded.read_text()) != settings:
        raise SystemExit(
            f"[reproduce] {run_dir} was trained with other settings than this budget asks for "
            f"({recorded}); delete it to retrain, or pass another --out"
        )
    if _finished(run_dir, budget.steps) and recorded.is_file():
        print(f"[reproduce] {arm} seed {seed}: finished earlier, reused", flush=True)
        return run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(recorded, settings)
    argv = [
        "--config",
        str(ROOT / config),
        "--nproc",
        str(budget.nproc),
        "--run-dir",
        str(run_dir),
        "--resume",
        "auto",
    ]
    print(f"[reproduce] training {arm} seed {seed}: {budget.steps} steps on {budget.nproc} ranks", flush=True)
    if launch(argv + [a for s in sets for a in ("--set", s)]) != 0:
        raise SystemExit(f"[reproduce] training {arm} seed {seed} failed; rerun to resume ({run_dir})")
    return run_dir


def _eval_settings(budget: Budget) -> dict[str, Any]:
    return {"max_blocks": budget.eval_blocks, "cached_blocks": budget.cached_blocks, "split": "test"}


def evaluate_arm(run_dir: Path, budget: Budget, data: str) -> dict[str, Any]:
    """eval.json of a finished arm (reused when step and settings match)."""
    from launcher.evaluation.evaluate import evaluate_checkpoint

    path = run_dir / "eval" / "eval.json"
    want = _eval_settings(budget)
    if path.is_file():
        res = json.loads(path.read_text())
        if res.get("step") == budget.steps and all(res.get(k) == v for k, v in want.items()):
            return res
    print(f"[reproduce] evaluating {run_dir.name}", flush=True)
    return evaluate_checkpoint(
        run_dir / "model", data, modes=DEMIX_MODES, out_dir=run_dir / "eval", progress=False, **want
    ).to_dict()


def _cached_json(path: Path, make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    if path.is_file():
        return json.loads(path.read_text())
    res = make()
    write_json_atomic(path, res)
    return res


def modularity(runs: dict[str, dict[int, Path]], budget: Budget, data: str, out: Path) -> dict[str, Any]:
    """Removal matrix on DEMix seed 1; DEMix-DAPT and Dense-DAPT on the budget's novel domain."""
    from launcher.modular import experts

    res: dict[str, Any] = {}
    demix = runs.get("demix", {}).get(1)
    if demix is not None:
        res["removal"] = _cached_json(
            out / "modular" / "removal.json",
            lambda: experts.removal_report(
                demix / "model", data, max_blocks=budget.eval_blocks, cached_blocks=budget.cached_blocks
            ),
        )
    dense = runs.get("dense", {}).get(1)
    if demix is None or dense is None or not budget.dapt_steps or not budget.dapt_domain:
        return res
    dom, mod = budget.dapt_domain, out / "modular"
    if not (mod / "demix-added" / "meta.json").is_file():
        experts.add_expert(demix / "model", dom, mod / "demix-added", data, dev_blocks=budget.cached_blocks)
    after = {}
    for arch, start in (("demix", mod / "demix-added"), ("dense", dense / "model")):
        run = mod / f"{arch}-dapt"
        after[arch] = (
            run / "model"
            if _finished(run, budget.dapt_steps)
            else experts.run_dapt(start, arch, dom, budget.dapt_steps, run, budget.nproc, data)
        )
    settings = {**_eval_settings(budget), "modes": ["naive", "cached"]}
    from launcher.evaluation.evaluate import evaluate_checkpoint

    for arch in ("demix", "dense"):
        res[f"{arch}_dapt_eval"] = _cached_json(
            mod / f"{arch}-dapt-eval.json",
            lambda a=arch: evaluate_checkpoint(after[a], data, progress=False, **settings).to_dict(),
        )
    res["dapt_domain"], res["dapt_steps"] = dom, budget.dapt_steps
    return res


def gating(runs: dict[str, dict[int, Path]], data: str) -> dict[str, Any] | None:
    """GShard seed 1's per-domain gate distributions (gating.json)."""
    from launcher.evaluation.gating import main as gating_main

    run = runs.get("gshard", {}).get(1)
    if run is None:
        return None
    path = run / "gating" / "gating.json"
    if not path.is_file():
        gating_main([str(run / "model"), "--data", data, "--out", str(run / "gating"), "--batches", "8"])
    return json.loads(path.read_text())


def cse_record(runs: dict[str, dict[int, Path]]) -> dict[str, Any] | None:
    """The CSE arm's clustering record from its metrics.jsonl (the trainer logs it at the warm-up boundary)."""
    from launcher.metrics import read_metrics

    run = runs.get("cse", {}).get(1)
    if run is None:
        return None
    recs = [r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "cse" and "layers" in r]
    return recs[-1] if recs else {}


# --------------------------------------------------------------------------------------------------
# Claims
# --------------------------------------------------------------------------------------------------


def _domains(res: dict[str, Any], role: str) -> list[str]:
    return sorted(d for d, r in res["domains"].items() if r["role"] == role)


def _pooled(res: dict[str, Any], mode: str, domains: Sequence[str]) -> tuple[list[float], list[int]]:
    """Per-block NLLs and token counts of `domains`, concatenated in that order (the same blocks in every
    evaluation of the same data and settings, so two models' lists pair up)."""
    nll, tok = [], []
    for d in domains:
        nll += res["domains"][d]["block_nll"][mode]
        tok += res["domains"][d]["block_tokens"]
    return nll, tok


def _avg(res: dict[str, Any], mode: str, role: str = "train") -> tuple[float, float, float] | None:
    blocks = [
        (r["block_nll"][mode], r["block_tokens"])
        for r in res["domains"].values()
        if r["role"] == role and mode in r.get("block_nll", {})
    ]
    return bootstrap_mean_ppl(blocks) if blocks else None


def _seed_pairs(evals: dict[str, dict[int, dict]], mode: str, role: str):
    """(seed, DEMix eval, Dense eval, paired DEMix `mode` / Dense ratio pooled over the `role` domains) for every
    seed both arms ran."""
    for seed in sorted(set(evals["demix"]) & set(evals["dense"])):
        dm, dn = evals["demix"][seed], evals["dense"][seed]
        a, tok = _pooled(dm, mode, _domains(dm, role))
        b, _ = _pooled(dn, "ppl", _domains(dm, role))
        yield seed, dm, dn, paired_ratio(a, b, tok)


def _ppl(res: dict[str, Any], mode: str, domain: str) -> float | None:
    """One domain's test perplexity under `mode` from its per-block NLL sums (None when not evaluated)."""
    r = res["domains"].get(domain, {})
    nll = r.get("block_nll", {}).get(mode)
    return float(np.exp(sum(nll) / sum(r["block_tokens"]))) if nll else None


def _mode(res: dict[str, Any]) -> str:
    return "naive" if res.get("experts") else "ppl"


def _claim(
    name: str, paper: str, verdict: bool | None, numbers: dict[str, Any], why: str = ""
) -> dict[str, Any]:
    v = "not evaluated" if verdict is None else ("reproduced" if verdict else "not reproduced")
    return {"claim": name, "paper": paper, "verdict": v, "numbers": numbers, "reason": why}


def _missing(name: str, paper: str, what: str) -> dict[str, Any]:
    return _claim(name, paper, None, {}, f"not run: {what}")


Evals = dict[str, dict[int, dict]]


def _demix_first_seed(evals: Evals) -> dict[str, Any] | None:
    """DEMix's evaluation at its lowest seed (what Table 5 and Figure 4 read), None without the demix arm."""
    return evals["demix"][min(evals["demix"])] if evals.get("demix") else None


def _precondition(evals: Evals, mod: dict[str, Any], gate: dict | None, cse: dict | None) -> list[dict]:
    """Every arm well below the unigram floor."""
    rows = {}
    for arm, by_seed in evals.items():
        for seed, res in by_seed.items():
            uni = res["tables"].get("unigram_in_domain_average")
            rows[f"{arm}-s{seed}"] = {"ppl": res["tables"]["in_domain_average"][_mode(res)], "unigram": uni}
    ok = all(r["unigram"] and r["ppl"] <= 0.5 * r["unigram"] for r in rows.values()) if rows else None
    return [
        _claim(
            "every model at most half the unigram perplexity (in-domain average)",
            "precondition",
            ok,
            rows,
            "" if ok else "undertrained: more steps or a better learning rate",
        )
    ]


def _demix_beats_dense(evals: Evals, mod: dict[str, Any], gate: dict | None, cse: dict | None) -> list[dict]:
    """Tables 3/4: DEMix (naive) beats Dense in-domain for every seed pair."""
    if not (evals.get("demix") and evals.get("dense")):
        return [_missing("DEMix beats Dense in-domain", "Tables 3/4", "needs the dense and demix arms")]
    nums, ok = {}, True
    for seed, dm, dn, r in _seed_pairs(evals, "naive", "train"):
        nums[f"seed {seed}"] = {
            "demix_naive": _avg(dm, "naive"),
            "demix_cached": _avg(dm, "cached"),
            "dense": _avg(dn, "ppl"),
            "ratio_demix_over_dense": r,
        }
        ok &= r[2] < 1
    seeds = [v["demix_naive"][0] for v in nums.values()], [v["dense"][0] for v in nums.values()]
    nums["seed_spread"] = {"demix_naive": seed_spread(seeds[0]), "dense": seed_spread(seeds[1])}
    return [
        _claim(
            "DEMix beats Dense in-domain",
            "Tables 3/4",
            ok,
            nums,
            ""
            if ok
            else "the DEMix/Dense ratio interval reaches 1 for some seed: the difference is "
            "within block-to-block noise at this training length",
        )
    ]


def _novel_ordering(evals: Evals, mod: dict[str, Any], gate: dict | None, cse: dict | None) -> list[dict]:
    """Table 5: on novel domains cached <= updating <= uniform < average."""
    name = "novel domains: cached <= updating <= uniform < average"
    res = _demix_first_seed(evals)
    if res is None:
        return [_missing(name, "Table 5", "needs the demix arm")]
    novel = _domains(res, "novel")
    if not novel:
        return [_missing(name, "Table 5", "the data has no novel domain")]
    pairs = [("cached", "updating"), ("updating", "uniform"), ("uniform", "average")]
    nums = {m: _avg(res, m, "novel") for m in ("cached", "updating", "uniform", "average")}
    ok = True
    for a, b in pairs:
        na, tok = _pooled(res, a, novel)
        nb, _ = _pooled(res, b, novel)
        r = paired_ratio(na, nb, tok)
        nums[f"{a}/{b}"] = r
        ok &= (r[2] < 1) if (a, b) == ("uniform", "average") else (r[1] <= 1)
    return [_claim(name, "Table 5", ok, nums, "" if ok else "an ordering is reversed beyond its interval")]


def _novel_vs_dense(evals: Evals, mod: dict[str, Any], gate: dict | None, cse: dict | None) -> list[dict]:
    """Table 5 vs Dense: DEMix's cached mixture beats Dense on novel domains for every seed pair."""
    name = "DEMix (cached mixture) beats Dense on novel domains"
    res = _demix_first_seed(evals)
    if not (evals.get("demix") and evals.get("dense") and res is not None and _domains(res, "novel")):
        return [_missing(name, "Table 5", "needs the dense and demix arms and a novel domain")]
    nums, ok = {}, True
    for seed, dm, dn, r in _seed_pairs(evals, "cached", "novel"):
        nums[f"seed {seed}"] = {
            "demix_cached": _avg(dm, "cached", "novel"),
            "dense": _avg(dn, "ppl", "novel"),
            "ratio_demix_over_dense": r,
        }
        ok &= r[2] < 1
    return [
        _claim(
            name,
            "Table 5",
            ok,
            nums,
            ""
            if ok
            else "each expert saw 1/8 of the tokens: at this scale one dense model trained on "
            "every domain generalises better to unseen text than a mixture of small experts",
        )
    ]


def _cached_prior(evals: Evals, mod: dict[str, Any], gate: dict | None, cse: dict | None) -> list[dict]:
    """Figure 4: the cached prior puts its largest mass on the domain's own expert."""
    name = "the cached prior picks the domain's own expert"
    res = _demix_first_seed(evals)
    if res is None:
        return [_missing(name, "Figure 4", "needs the demix arm")]
    own = {}
    for d, r in res["domains"].items():
        if r["role"] == "train" and "cached_prior_variants" in r:
            own[d] = {
                v: {"own": p.get(d), "top": max(p, key=p.get)} for v, p in r["cached_prior_variants"].items()
            }
    ok = bool(own) and all(v["mean/prefix"]["top"] == d for d, v in own.items())
    why = "" if ok else "some training domain's cached prior favours another expert"
    return [_claim(name, "Figure 4", ok if own else None, own, why)]


def _removal(evals: Evals, mod: dict[str, Any], gate: dict | None, cse: dict | None) -> list[dict]:
    """Table 7: removing an expert hurts its own domain far more than the others."""
    name = "removing an expert hurts its domain, barely the others"
    rem = mod.get("removal")
    if not rem:
        return [_missing(name, "Table 7", "needs the demix arm")]
    diag = [rem["matrix"][d][d] for d in rem["experts"] if d in rem["matrix"][d]]
    own, other = rem["own_change_mean"], rem["other_change_mean"]
    off = [abs(rem["matrix"][r][d]) for r in rem["experts"] for d in rem["evaluated_domains"] if d != r]
    ok = all(x > 0 for x in diag) and own > 3 * float(np.mean(off))
    nums = {
        "own_change_mean_pct": own,
        "other_change_mean_pct": other,
        "other_abs_change_mean_pct": float(np.mean(off)),
        "matrix_pct": rem["matrix"],
    }
    return [
        _claim(
            name,
            "Table 7",
            ok,
            nums,
            "" if ok else "experts are not specialised enough for removal to be local",
        )
    ]


def _dapt(evals: Evals, mod: dict[str, Any], gate: dict | None, cse: dict | None) -> list[dict]:
    """Table 13: DEMix-DAPT leaves the training domains unchanged while Dense-DAPT forgets them."""
    name = "DEMix-DAPT does not forget, Dense-DAPT does"
    if not ("demix_dapt_eval" in mod and evals.get("dense") and evals.get("demix")):
        return [_missing(name, "Table 13", "needs the dense and demix arms and dapt_steps > 0")]
    dm_b, dm_a = evals["demix"][1], mod["demix_dapt_eval"]
    dn_b, dn_a = evals["dense"][1], mod["dense_dapt_eval"]
    old = _domains(dm_b, "train")  # the original training domains, whatever the adapted models call them
    a, tok = _pooled(dm_a, "cached", old)
    b, _ = _pooled(dm_b, "cached", old)
    rd = paired_ratio(a, b, tok)
    a, tok = _pooled(dn_a, "ppl", old)
    b, _ = _pooled(dn_b, "ppl", old)
    rn = paired_ratio(a, b, tok)
    ok = abs(rd[0] - 1) < 0.01 and rn[1] > 1
    dom = mod["dapt_domain"]
    novel = {
        "demix_before": _ppl(dm_b, "cached", dom),
        "demix_after": _ppl(dm_a, "cached", dom),
        "dense_before": _ppl(dn_b, "ppl", dom),
        "dense_after": _ppl(dn_a, "ppl", dom),
    }
    nums = {
        "demix_after_over_before": rd,
        "dense_after_over_before": rn,
        "domain": dom,
        "steps": mod["dapt_steps"],
        f"{dom}_ppl": novel,
    }
    return [
        _claim(
            name,
            "Table 13",
            ok,
            nums,
            "" if ok else "Dense-DAPT too short or too gentle to forget measurably",
        )
    ]


def _gating(evals: Evals, mod: dict[str, Any], gate: dict | None, cse: dict | None) -> list[dict]:
    """Figure 6: GShard's per-domain gate distributions are nearly uniform."""
    name = "GShard's gating is nearly domain-agnostic"
    if not gate:
        return [_missing(name, "Figure 6", "needs the gshard arm")]
    ents = [e for rows_ in gate["row_entropy"].values() for e in rows_]
    frac = float(np.mean(ents)) / gate["uniform_entropy"]
    return [
        _claim(
            name,
            "Figure 6",
            frac >= 0.8,
            {"mean_row_entropy_over_log_E": frac, "num_experts": gate["num_experts"]},
            "" if frac >= 0.8 else "the router specialises by domain on this corpus",
        )
    ]


def _cse(evals: Evals, mod: dict[str, Any], gate: dict | None, cse: dict | None) -> list[dict]:
    """CSE: its clusters recover the true domains, and it beats Dense."""
    clusters, beats = "clustered domains recover the true ones", "CSE beats Dense"
    if not (cse is not None and evals.get("cse") and evals.get("dense")):
        return [
            _missing(clusters, "CSE / DEMix §8", "needs the cse and dense arms"),
            _missing(beats, "CSE paper", "needs the cse and dense arms"),
        ]
    layers = cse.get("layers", {})
    nums = {
        l: {"clusters": r["num_clusters"], "purity": r.get("purity"), "eps": r.get("eps")}
        for l, r in layers.items()
    }
    ok = any(r["clusters"] >= 4 and (r["purity"] or 0) >= 0.6 for r in nums.values())
    why = "" if ok else "fewer than 4 clusters or clusters that mix domains"
    train = _domains(evals["dense"][1], "train")
    a, tok = _pooled(evals["cse"][1], "ppl", train)
    b, _ = _pooled(evals["dense"][1], "ppl", train)
    r = paired_ratio(a, b, tok)
    return [
        _claim(clusters, "CSE / DEMix §8", ok, nums, why),
        _claim(
            beats,
            "CSE paper",
            r[2] < 1,
            {"ratio_cse_over_dense": r},
            "" if r[2] < 1 else "within noise or worse at this scale",
        ),
    ]


# The claims in report order, each (evals, modularity, gating, cse clustering) -> its claim records.
CLAIMS: tuple[Callable[[Evals, dict[str, Any], dict | None, dict | None], list[dict]], ...] = (
    _precondition,
    _demix_beats_dense,
    _novel_ordering,
    _novel_vs_dense,
    _cached_prior,
    _removal,
    _dapt,
    _gating,
    _cse,
)


def claims(evals: Evals, mod: dict[str, Any], gate: dict | None, cse: dict | None) -> list[dict[str, Any]]:
    """Every claim of the module docstring with its verdict, numbers (intervals as [lo, hi]) and a reason."""
    return [record for claim in CLAIMS for record in claim(evals, mod, gate, cse)]


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    if isinstance(v, (list, tuple)) and len(v) == 3 and all(isinstance(x, (int, float)) for x in v):
        return f"{v[0]:.3f} [{v[1]:.3f}, {v[2]:.3f}]"
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, dict):
        return "; ".join(f"{k}: {_fmt(x)}" for k, x in v.items())
    return str(v)


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Reproducing DEMix on the demo corpus",
        "",
        f"Budget `{report['budget_file']}`: {report['budget']['steps']} steps x {report['budget']['nproc']} ranks "
        f"per arm; seeds {report['budget']['seeds']}; {report['budget']['eval_blocks']} test blocks per domain; "
        f"cached priors from {report['budget']['cached_blocks']} dev blocks. This invocation took "
        f"{report['seconds']:.0f} s (stages finished by an earlier one are reused, not re-timed). "
        "Intervals: 95 % bootstrap over test blocks (paired where two models are compared).",
        "",
    ]
    lines += markdown_table(
        ["claim", "paper", "verdict", "numbers", "most likely reason if not"],
        [
            [
                c["claim"],
                c["paper"],
                f"**{c['verdict']}**",
                "<br>".join(f"{k}: {_fmt(v)}" for k, v in c["numbers"].items() if k != "matrix_pct"),
                c["reason"],
            ]
            for c in report["claims"]
        ],
    )
    lines += ["", "## In-domain and novel averages per arm", ""]
    lines += markdown_table(
        ["arm", "in-domain ppl [95 %]", "novel ppl [95 %]", "unigram in / novel"],
        [
            [
                name,
                _fmt(r["in_domain"]),
                _fmt(r["novel"]),
                f"{_fmt(r['unigram_in'])} / {_fmt(r['unigram_novel'])}",
            ]
            for name, r in report["arms"].items()
        ],
    )
    return "\n".join(lines) + "\n"


def build_report(
    evals: dict[str, dict[int, dict]],
    mod: dict,
    gate: dict | None,
    cse: dict | None,
    budget: Budget,
    budget_file: str,
    seconds: float,
) -> dict[str, Any]:
    arms = {}
    for arm, by_seed in evals.items():
        for seed, res in by_seed.items():
            m = _mode(res) if arm != "demix" else "cached"
            arms[f"{arm}-s{seed}"] = {
                "mode": m,
                "in_domain": _avg(res, m),
                "novel": _avg(res, m, "novel"),
                "unigram_in": res["tables"].get("unigram_in_domain_average"),
                "unigram_novel": res["tables"].get("unigram_novel_average"),
            }
    return {
        "format": "demix-reproduce/1",
        "budget_file": budget_file,
        "budget": budget.__dict__,
        "seconds": seconds,
        "claims": claims(evals, mod, gate, cse),
        "arms": arms,
        "posterior": "prefix",
        "cached_estimator": "mean",
    }


def run(budget_file: str, out: Path, arms: Sequence[str], data: str, record: Path | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    budget = Budget.load(ROOT / budget_file if not Path(budget_file).is_absolute() else Path(budget_file))
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"error: unknown arms {unknown}; arms: {', '.join(ARMS)}")
    if Path(data).resolve() == (ROOT / "artifacts" / "demo" / "tokens").resolve():
        from data.build_demo import main as build_data  # cached after the first build (~1 min from scratch)

        if build_data(["--out", str(ROOT / "artifacts" / "demo"), "--tokenizers", "sentencepiece"]) != 0:
            raise SystemExit("[reproduce] building the demo corpus failed (see above)")
    elif not Path(data).is_dir():
        raise SystemExit(
            f"error: --data {data} is not a directory; prepare it with `python -m data.prepare` "
            "or leave --data out to use the demo corpus"
        )
    runs: dict[str, dict[int, Path]] = {}
    for arm in arms:
        for seed in budget.seeds.get(arm, []):
            runs.setdefault(arm, {})[seed] = train_arm(arm, seed, budget, out)
    evals = {
        arm: {s: evaluate_arm(p, budget, data) for s, p in by_seed.items()} for arm, by_seed in runs.items()
    }
    mod = modularity(runs, budget, data, out)
    gate, cse = gating(runs, data), cse_record(runs)
    report = build_report(evals, mod, gate, cse, budget, budget_file, time.perf_counter() - t0)
    write_json_atomic(out / "report.json", report)
    (out / "report.md").write_text(markdown(report))
    if record is not None:
        record.mkdir(parents=True, exist_ok=True)
        for name in ("report.json", "report.md"):
            shutil.copy2(out / name, record / name)
    print(markdown(report))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.reproduce", description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", default="configs/reproduce/full.yaml")
    p.add_argument("--out", default=str(ROOT / "runs" / "reproduce"))
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ",".join(ARMS))
    p.add_argument("--data", default=str(ROOT / "artifacts" / "demo" / "tokens"))
    p.add_argument(
        "--record", default=None, help="also copy report.{md,json} here (e.g. benchmarks/results/reproduce)"
    )
    a = p.parse_args(argv)
    run(
        a.budget,
        Path(a.out),
        [x for x in a.arms.split(",") if x],
        a.data,
        Path(a.record) if a.record else None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
