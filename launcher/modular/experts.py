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
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch
import yaml

from data.argtypes import positive_float, positive_int
from data.atomic import staged_dir
from data.catalog import read_token_manifest
from data.cli import check_output_dir, cli_main, exit_process
from launcher.checkpoint import (
    CheckpointError,
    Consolidated,
    check_checkpoint_out,
    load_consolidated,
    read_meta,
    save_consolidated,
    write_json_atomic,
)
from launcher.checkpoint_data import block_inputs, check_checkpoint_data, data_source, load_blocks
from launcher.config import ConfigError
from launcher.evaluation.evaluate import (
    evaluate_checkpoint,  # noqa: F401
    stream_log_likelihoods,
)
from launcher.expert_surgery import (
    EXPERT_KEY,
    CkptLike,
    _keep_indices,
    _load,
    _require_demix,
    _with_experts,  # noqa: F401
    remove_experts_state,
)
from launcher.ffn_kinds import ffn_kind
from launcher.typed import to_dict
from model import mixture as mx

REPO_ROOT = Path(__file__).resolve().parents[2]
ADAPT_REPORT_FORMAT = "demix-adapt-report/1"
REMOVAL_REPORT_FORMAT = "demix-removal-report/2"
_META_OWN = (
    "format",
    "step",
    "domains",
    "experts",
    "shards",
    "config",
)  # written by save_consolidated itself


def save(c: Consolidated, out: Union[str, Path]) -> Path:
    """Write `c` as a consolidated checkpoint, keeping the source's extra metadata (tokenizer, lineage)."""
    extra = {k: v for k, v in c.meta.items() if k not in _META_OWN}
    return save_consolidated(out, c.state_dict, c.cfg, c.domains, c.step, extra=extra)


# ----------------------------------------------------------------------------------------------------
# Per-domain log-likelihoods and masked mixtures
# ----------------------------------------------------------------------------------------------------


def domain_log_likelihoods(
    model: torch.nn.Module,
    data_root: str,
    tokenizer: str,
    domain: str,
    split: str,
    max_blocks: Optional[int],
    batch_size: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ll E x N x T of every expert on the first `max_blocks` blocks of a domain's split, and the mask N x T."""
    available = read_token_manifest(Path(data_root) / tokenizer / "manifest.json")["domains"]
    if domain not in available:
        raise CheckpointError(
            f"domain {domain!r} is not in {data_root}/{tokenizer} (domains: {', '.join(available)})"
        )
    blocks = load_blocks(data_root, tokenizer, domain, split, model.cfg.seq_len, max_blocks)
    if not len(blocks):
        raise CheckpointError(
            f"{domain}/{split} in {data_root}/{tokenizer} has no block of {model.cfg.seq_len}+1 tokens"
        )
    tokens, targets, mask = block_inputs(blocks)
    return stream_log_likelihoods(model, tokens, targets, None, batch_size), mask


def masked_mixture(
    ll_EBT: torch.Tensor,
    mask_BT: torch.Tensor,
    dev_ll_EBT: torch.Tensor,
    dev_mask_BT: torch.Tensor,
    names: Sequence[str],
    keep: Sequence[int],
    cached_blocks: int = mx.CACHED_PRIOR_BLOCKS,
    estimator: str = "mean",
) -> tuple[float, mx.CachedPrior]:
    """Perplexity of the cached-prior mixture (eqs. 6-8) restricted to the experts `keep`: the prior is estimated
    (`mx.estimate_cached_prior`, `estimator`) on the development blocks over those experts only, as a model holding
    only them would."""
    keep = list(keep)
    if not keep:
        raise ValueError("a mixture needs at least one expert")
    prior = mx.estimate_cached_prior(
        dev_ll_EBT[keep], [names[j] for j in keep], dev_mask_BT, cached_blocks, estimator=estimator
    )
    lp_BT = mx.posterior_mixture_log_probs(ll_EBT[keep], prior.log_prior(), mask_BT)
    return mx.perplexity(lp_BT, mask_BT), prior


@torch.no_grad()
def evaluate_experts(
    ckpt: CkptLike,
    data: Optional[str] = None,
    tokenizer: Optional[str] = None,
    *,
    domains: Optional[Sequence[str]] = None,
    experts: Optional[Sequence[str]] = None,
    without: Sequence[str] = (),
    split: str = "test",
    dev_split: str = "valid",
    max_blocks: Optional[int] = 16,
    cached_blocks: int = 16,
    estimator: str = "mean",
) -> dict[str, Any]:
    """Evaluation-time removal: per-domain perplexity of the cached-prior mixture over a subset of experts
    (`experts`, default all, minus `without`). Returns {"experts": [kept names], "domains": {d: {"ppl", "prior"}}}."""
    c = _load(ckpt)
    _require_demix(c, "masking experts")
    data, tokenizer = data_source(c, data, tokenizer)
    keep = _keep_indices(c.domains, experts, without)
    model = c.build_model().eval()
    out: dict[str, Any] = {"experts": [c.domains[j] for j in keep], "domains": {}}
    for dom in domains or c.domains:
        ll, mask = domain_log_likelihoods(model, data, tokenizer, dom, split, max_blocks)
        dev_ll, dev_mask = domain_log_likelihoods(model, data, tokenizer, dom, dev_split, cached_blocks)
        ppl, prior = masked_mixture(ll, mask, dev_ll, dev_mask, c.domains, keep, cached_blocks, estimator)
        out["domains"][dom] = {"ppl": ppl, "prior": dict(zip(prior.domains, prior.probs))}
    return out


# ----------------------------------------------------------------------------------------------------
# Add / remove
# ----------------------------------------------------------------------------------------------------


@torch.no_grad()
def estimate_domain_prior(
    ckpt: CkptLike,
    domain: str,
    data: Optional[str] = None,
    tokenizer: Optional[str] = None,
    split: str = "valid",
    dev_blocks: int = mx.CACHED_PRIOR_BLOCKS,
    estimator: str = "mean",
) -> mx.CachedPrior:
    """p(D = j | held-out blocks of `domain`): the cached prior (§5.1; `mx.estimate_cached_prior`) over the
    checkpoint's experts."""
    c = _load(ckpt)
    _require_demix(c, "estimating a domain posterior")
    data, tokenizer = data_source(c, data, tokenizer)
    ll, mask = domain_log_likelihoods(c.build_model().eval(), data, tokenizer, domain, split, dev_blocks)
    return mx.estimate_cached_prior(ll, c.domains, mask, dev_blocks, estimator=estimator)


def add_expert_state(c: Consolidated, domain: str, source: int) -> Consolidated:
    """Append expert E (named `domain`) to every DEMix layer as a copy of expert `source`; every other tensor is
    the same tensor object (bit-identical)."""
    _require_demix(c, "adding an expert")
    if domain in c.domains:
        raise CheckpointError(
            f"the checkpoint already has an expert for {domain!r} (experts: {', '.join(c.domains)})"
        )
    if not 0 <= source < len(c.domains):
        raise CheckpointError(f"source expert {source} out of range for {len(c.domains)} experts")
    new_id = len(c.domains)
    state = dict(c.state_dict)
    copied = 0
    for key, value in c.state_dict.items():
        m = EXPERT_KEY.match(key)
        if m and int(m.group(2)) == source:
            state[f"{m.group(1)}{new_id}{m.group(3)}"] = value.clone()
            copied += 1
    if not copied:
        raise CheckpointError(f"no tensors of expert {source} in the checkpoint")
    return _with_experts(c, state, c.domains + [domain])


def add_expert(
    ckpt: CkptLike,
    domain: str,
    out: Optional[Union[str, Path]],
    data: Optional[str] = None,
    tokenizer: Optional[str] = None,
    dev_blocks: int = mx.CACHED_PRIOR_BLOCKS,
    dev_split: str = "valid",
    source: Optional[str] = None,
) -> tuple[Consolidated, dict[str, Any]]:
    """DEMix §6, step 1-2: estimate the posterior on held-out blocks of `domain`, copy the most probable expert (or
    `source`, given by name) to a new expert id E; write the E+1-expert checkpoint to `out` (unless None). Returns
    the new checkpoint and what was done (also recorded in its meta.json under "added_experts")."""
    c = _load(ckpt)
    _require_demix(c, "adding an expert")
    if domain in c.domains:
        raise CheckpointError(f"{ckpt} already has an expert for {domain!r}")
    if source is not None and source not in c.domains:
        raise CheckpointError(
            f"--source {source!r} is not an expert of {ckpt}; experts: {', '.join(c.domains)}"
        )
    prior = estimate_domain_prior(c, domain, data, tokenizer, dev_split, dev_blocks)
    best = max(range(len(prior.probs)), key=lambda j: (prior.probs[j], -j))
    src = c.domains.index(source) if source is not None else best
    record = {
        "domain": domain,
        "expert_id": len(c.domains),
        "source": c.domains[src],
        "source_id": src,
        "posterior": dict(zip(prior.domains, prior.probs)),
        "dev_blocks": prior.blocks,
        "dev_split": dev_split,
        "data": data_source(c, data, tokenizer)[0],
        "from": None if isinstance(ckpt, Consolidated) else str(ckpt),
    }
    new = add_expert_state(c, domain, src)
    new.meta["added_experts"] = list(c.meta.get("added_experts", [])) + [record]
    if out is not None:
        save(new, out)
    return new, {**record, "out": None if out is None else str(out), "domains": new.domains}


def remove_experts(ckpt: CkptLike, names: Sequence[str], out: Union[str, Path]) -> dict[str, Any]:
    new = remove_experts_state(_load(ckpt), names)
    save(new, out)
    return {"removed": list(names), "domains": new.domains, "out": str(out)}


# ----------------------------------------------------------------------------------------------------
# DAPT runs through the launcher
# ----------------------------------------------------------------------------------------------------


def dapt_overrides(
    c: Consolidated,
    arch: str,
    init_from: str,
    domain: str,
    steps: int,
    data: Optional[str] = None,
    tokenizer: Optional[str] = None,
    lr: Optional[float] = None,
    lr_scale: float = 0.1,
) -> list[str]:
    """`--set` overrides of a DAPT run on top of the checkpoint's own run config. DEMix-DAPT (§6.1): only the
    experts of the run's domains train (here the new one), lr = lr_scale x the original lr. Dense-DAPT: all
    parameters, natural mixture; the same steps and the same (10x smaller) lr, as the paper adapts both."""
    kind = c.cfg.model.ffn.kind
    if arch != kind:
        raise CheckpointError(f"dapt --arch {arch} needs a {arch} checkpoint, got a {kind!r} one")
    if arch not in ("demix", "dense"):
        raise CheckpointError(f"dapt --arch {arch}: choose demix or dense")
    if arch == "demix" and domain not in c.domains:
        raise CheckpointError(
            f"the checkpoint has no expert for {domain!r}: run `python -m launcher.modular.experts add` first"
        )
    t = c.cfg.train
    new_lr = lr if lr is not None else t.lr * lr_scale
    data, tokenizer = data_source(c, data, tokenizer)
    sets = [
        f"train.init_from={init_from}",
        f"data.domains=[{domain}]",
        f"data.path={data}",
        f"data.tokenizer={tokenizer}",
        f"train.steps={steps}",
        f"train.lr={new_lr}",
        f"train.min_lr={min(t.min_lr, new_lr)}",
        "train.save_interval=0",
        "train.eval_interval=0",
    ]
    if arch == "demix":
        sets += ["data.mixture=by_domain", "train.trainable=experts", "model.ffn.num_experts=0"]
    else:
        sets += ["data.mixture=natural", "train.trainable=all"]
    return sets


def run_dapt(
    ckpt: Union[str, Path],
    arch: str,
    domain: str,
    steps: int,
    run_dir: Union[str, Path],
    nproc: int = 2,
    data: Optional[str] = None,
    tokenizer: Optional[str] = None,
    lr: Optional[float] = None,
    lr_scale: float = 0.1,
    extra_sets: Sequence[str] = (),
    dry_run: bool = False,
) -> Path:
    """Launch a DAPT run (`python -m launcher.launch`, N local ranks); returns `<run_dir>/model`."""
    c = load_consolidated(ckpt)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    base = run_dir / "base_config.yaml"  # the checkpoint's own run config: the recipe DAPT keeps
    base.write_text(yaml.safe_dump(to_dict(c.cfg), sort_keys=False))
    sets = dapt_overrides(c, arch, str(Path(ckpt).resolve()), domain, steps, data, tokenizer, lr, lr_scale)
    sets += [f"logging.out_dir={run_dir}", *extra_sets]
    argv = ["--config", str(base), "--nproc", str(nproc), "--run-dir", str(run_dir), "--resume", "never"] + [
        a for s in sets for a in ("--set", s)
    ]
    print(f"[experts] {arch}-DAPT: python -m launcher.launch {shlex.join(argv)}", file=sys.stderr, flush=True)
    from launcher.launch import parse_args as launch_args
    from launcher.launch import prepare_run

    _, cmd, env = prepare_run(
        launch_args(argv)
    )  # validates the whole run, writes config/DeepSpeed JSON/command
    if dry_run:
        return run_dir / "model"
    rc = subprocess.call(cmd, env=env, cwd=REPO_ROOT)
    if rc != 0:
        raise RuntimeError(f"{arch}-DAPT run failed (exit {rc}); see {run_dir}")
    return run_dir / "model"


# ----------------------------------------------------------------------------------------------------
# Reports
# ----------------------------------------------------------------------------------------------------


def _pct(after: float, before: float) -> float:
    return 100.0 * (after / before - 1.0)


def _ppl_of(res: dict[str, Any], domain: str, mode: str) -> float:
    return float(res["domains"][domain]["ppl"][mode])


def adaptation_report(
    demix_before: CkptLike,
    demix_after: CkptLike,
    dense_before: CkptLike,
    dense_after: CkptLike,
    new_domains: Sequence[str],
    data: Optional[str] = None,
    tokenizer: Optional[str] = None,
    max_blocks: Optional[int] = 16,
    cached_blocks: int = 16,
) -> dict[str, Any]:
    """Tables 6 and 13: perplexity on the training domains (T) and the new domains (N) before and after adaptation.
    DEMix: the cached-prior mixture over all experts the checkpoint holds (§6: "mix with a cached prior"), and each
    training domain's own expert (naive; unchanged by DEMix-DAPT by construction). Dense: the model itself."""
    cks = {
        k: _load(v)
        for k, v in (
            ("demix_before", demix_before),
            ("demix_after", demix_after),
            ("dense_before", dense_before),
            ("dense_after", dense_after),
        )
    }
    train = [d for d in cks["demix_before"].domains if d not in new_domains]
    data, tokenizer = data_source(cks["demix_before"], data, tokenizer)
    doms = train + list(new_domains)
    res = {}
    for name, c in cks.items():
        modes = ("naive", "cached") if ffn_kind(c.cfg).domain_experts else ("ppl",)
        res[name] = evaluate_checkpoint(
            c,
            data,
            tokenizer=tokenizer,
            split="test",
            max_blocks=max_blocks,
            modes=modes,
            domains=doms,
            cached_blocks=cached_blocks,
            progress=False,
        )
    rows: dict[str, dict[str, float]] = {}
    for name in cks:
        mode = "cached" if ffn_kind(cks[name].cfg).domain_experts else "ppl"
        rows[name] = {d: _ppl_of(res[name], d, mode) for d in doms}
        if mode == "cached":
            rows[name + "_own_expert"] = {d: _ppl_of(res[name], d, "naive") for d in train}
    summary = {}
    for arch in ("demix", "dense"):
        b, a = rows[f"{arch}_before"], rows[f"{arch}_after"]
        t_b, t_a = float(np.mean([b[d] for d in train])), float(np.mean([a[d] for d in train]))
        n_b, n_a = float(np.mean([b[d] for d in new_domains])), float(np.mean([a[d] for d in new_domains]))
        summary[arch] = {
            "experts_before": len(cks[f"{arch}_before"].domains) if arch == "demix" else None,
            "experts_after": len(cks[f"{arch}_after"].domains) if arch == "demix" else None,
            "train_before": t_b,
            "train_after": t_a,
            "train_change_pct": _pct(t_a, t_b),
            "novel_before": n_b,
            "novel_after": n_a,
            "novel_change_pct": _pct(n_a, n_b),
        }
    own_b, own_a = rows["demix_before_own_expert"], rows["demix_after_own_expert"]
    paths = dict(
        demix_before=demix_before, demix_after=demix_after, dense_before=dense_before, dense_after=dense_after
    )
    return {
        "format": ADAPT_REPORT_FORMAT,
        "train_domains": train,
        "new_domains": list(new_domains),
        "max_blocks": max_blocks,
        "cached_blocks": cached_blocks,
        "per_domain": rows,
        "summary": summary,
        "own_expert_max_abs_change": max(abs(own_a[d] - own_b[d]) for d in train),
        "checkpoints": {k: None if isinstance(v, Consolidated) else str(v) for k, v in paths.items()},
    }


def removal_report(
    ckpt: CkptLike,
    data: Optional[str] = None,
    tokenizer: Optional[str] = None,
    domains: Optional[Sequence[str]] = None,
    max_blocks: Optional[int] = 16,
    cached_blocks: int = 16,
) -> dict[str, Any]:
    """Table 7 as a full matrix: for each evaluated domain d (`domains`, default every expert's), the cached-prior
    mixture with all experts (+Expert) and with each expert r masked out, from one all-experts pass per domain.
    `per_domain[d]` is Table 7's row (r = d); `matrix[r][d]` the change on every domain when r is removed;
    `own_change_mean` / `other_change_mean` average the diagonal / the off-diagonal cells."""
    c = _load(ckpt)
    _require_demix(c, "the removal table")
    data, tokenizer = data_source(c, data, tokenizer)
    model = c.build_model().eval()
    every = list(range(len(c.domains)))
    rows, matrix, matrix_ppl = {}, {r: {} for r in c.domains}, {r: {} for r in c.domains}
    for d in domains or c.domains:
        ll, mask = domain_log_likelihoods(model, data, tokenizer, d, "test", max_blocks)
        dev_ll, dev_mask = domain_log_likelihoods(model, data, tokenizer, d, "valid", cached_blocks)
        plus, prior = masked_mixture(ll, mask, dev_ll, dev_mask, c.domains, every, cached_blocks)
        for r in c.domains:
            minus, _ = masked_mixture(
                ll, mask, dev_ll, dev_mask, c.domains, [j for j in every if c.domains[j] != r], cached_blocks
            )
            matrix[r][d], matrix_ppl[r][d] = _pct(minus, plus), minus
        if d in c.domains:
            rows[d] = {
                "plus_expert": plus,
                "minus_expert": matrix_ppl[d][d],
                "change_pct": matrix[d][d],
                "prior_on_own_expert": dict(zip(prior.domains, prior.probs)).get(d),
            }
        else:
            rows[d] = {"plus_expert": plus}
    own = [matrix[d][d] for d in rows if d in c.domains]
    other = [matrix[r][d] for r in c.domains for d in rows if d != r]
    table7 = {d: r for d, r in rows.items() if "minus_expert" in r}
    avg = (
        {k: float(np.mean([r[k] for r in table7.values()])) for k in ("plus_expert", "minus_expert")}
        if table7
        else {}
    )
    return {
        "format": REMOVAL_REPORT_FORMAT,
        "experts": c.domains,
        "max_blocks": max_blocks,
        "cached_blocks": cached_blocks,
        "per_domain": table7,
        "average": avg,
        "evaluated_domains": list(rows),
        "plus_expert": {d: r["plus_expert"] for d, r in rows.items()},
        "matrix": matrix,
        "matrix_ppl": matrix_ppl,
        "own_change_mean": float(np.mean(own)) if own else None,
        "other_change_mean": float(np.mean(other)) if other else None,
    }


def adaptation_markdown(r: dict[str, Any]) -> str:
    s = r["summary"]
    dm, dn = s["demix"], s["dense"]
    new = ", ".join(r["new_domains"])
    lines = [
        f"### Adding experts (Table 6 shape): average perplexity, cached-prior mixture; new: {new}",
        "",
        f"| domains | {dm['experts_before']} experts | {dm['experts_after']} experts (DEMix-DAPT) |",
        "|---|---|---|",
        f"| training | {dm['train_before']:.2f} | {dm['train_after']:.2f} |",
        f"| novel (added) | {dm['novel_before']:.2f} | {dm['novel_after']:.2f} |",
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
        "| domain | role | Dense | Dense-DAPT | DEMix (mix) | DEMix-DAPT (mix) | own expert before | own expert after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = r["per_domain"]
    for d in r["train_domains"] + r["new_domains"]:
        role = "new" if d in r["new_domains"] else "train"
        own = (
            f"{rows['demix_before_own_expert'][d]:.2f} | {rows['demix_after_own_expert'][d]:.2f}"
            if role == "train"
            else "- | -"
        )
        lines.append(
            f"| {d} | {role} | {rows['dense_before'][d]:.2f} | {rows['dense_after'][d]:.2f} | "
            f"{rows['demix_before'][d]:.2f} | {rows['demix_after'][d]:.2f} | {own} |"
        )
    lines += [
        "",
        f"Own-expert perplexity on training domains changed by at most {r['own_expert_max_abs_change']:.2e} "
        "(DEMix-DAPT leaves the old experts and shared weights untouched).",
        f"Test blocks per domain: {r['max_blocks']}; cached prior from {r['cached_blocks']} dev blocks.",
    ]
    return "\n".join(lines) + "\n"


def removal_markdown(r: dict[str, Any]) -> str:
    lines = [
        "### Removing experts (Table 7 shape): cached-prior mixture perplexity",
        "",
        "| domain | +Expert | -Expert | change |",
        "|---|---|---|---|",
    ]
    for d, row in r["per_domain"].items():
        lines.append(
            f"| {d} | {row['plus_expert']:.2f} | {row['minus_expert']:.2f} | {row['change_pct']:+.1f}% |"
        )
    a = r["average"]
    if a:
        lines.append(
            f"| **average** | {a['plus_expert']:.2f} | {a['minus_expert']:.2f} | "
            f"{_pct(a['minus_expert'], a['plus_expert']):+.1f}% |"
        )
    if r.get("matrix"):
        doms = r["evaluated_domains"]
        lines += [
            "",
            "### Removing each expert: perplexity change on every domain (rows: expert removed)",
            "",
            "| removed \\ domain | " + " | ".join(doms) + " |",
            "|---" * (len(doms) + 1) + "|",
        ]
        lines += [
            f"| -{e} | " + " | ".join(f"{r['matrix'][e][d]:+.1f}%" for d in doms) + " |" for e in r["experts"]
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


def check_report_out(out: Union[str, Path], name: str, fmt: str) -> None:
    """The output rule (data/cli.py) for `report --out`: new, or holding this report's own `<name>.json`."""
    check_output_dir(Path(out), [fmt], [f"{name}.json", f"{name}.md"], manifest=f"{name}.json", what="--out")


def write_report(
    report: dict[str, Any], markdown: str, out: Union[str, Path], name: str
) -> tuple[Path, Path]:
    """Write `<out>/<name>.json` and `<out>/<name>.md` together (data/atomic.py `staged_dir`, into a folder other
    reports share): a failure, a full disk included, leaves neither."""
    out = Path(out)
    with staged_dir(out, manifest=f"{name}.json", shared=True) as tmp:
        (tmp / f"{name}.md").write_text(markdown)
        write_json_atomic(tmp / f"{name}.json", report)
    return out / f"{name}.json", out / f"{name}.md"


# ----------------------------------------------------------------------------------------------------
# `make modular`
# ----------------------------------------------------------------------------------------------------


def run_demo(args: argparse.Namespace) -> int:
    """Add a novel domain to the demo DEMix model, DEMix-DAPT vs Dense-DAPT, remove an expert, print the tables."""
    demix, dense, out = Path(args.demix), Path(args.dense), Path(args.out)
    missing = [
        str(p) for p in (demix, dense) if not (p / "meta.json").is_file() or not (p / "model.pt").is_file()
    ]
    if missing:
        print(f"error: missing demo checkpoints {missing}: run `make demo` first", file=sys.stderr)
        return 2
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


def _split(s: Optional[str]) -> list[str]:
    return [x for x in (s or "").split(",") if x]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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


@cli_main
def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:
        if args.cmd in ("add", "remove"):
            check_checkpoint_out(args.out, [args.checkpoint], args.overwrite)
        if args.cmd == "add":  # the data, before any tensor is read
            check_checkpoint_data(
                args.checkpoint,
                args.data or read_meta(args.checkpoint)["config"]["data"]["path"],
                args.tokenizer,
            )
        if args.cmd == "add":
            c: CkptLike = args.checkpoint
            for i, dom in enumerate(
                args.domain
            ):  # several domains in turn: each sees the experts added before it
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
        elif args.cmd == "dapt":
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
        elif args.cmd == "remove":
            print(json.dumps(remove_experts(args.checkpoint, _split(args.experts), args.out)))
        elif args.cmd == "report" and args.which == "adapt":
            need = [
                k
                for k in ("demix_before", "demix_after", "dense_before", "dense_after", "new_domains")
                if not getattr(args, k)
            ]
            if need:
                raise CheckpointError(
                    f"report adapt needs {', '.join('--' + k.replace('_', '-') for k in need)}"
                )
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
        elif args.cmd == "report":
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
        else:
            return run_demo(args)
    except (CheckpointError, ConfigError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    exit_process(main())
