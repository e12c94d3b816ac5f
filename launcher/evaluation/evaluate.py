"""Per-domain test perplexity of a consolidated checkpoint, with inference-time expert mixing (DEMix §4-5).

    python -m launcher.evaluation.evaluate CKPT_DIR [--data DIR] [--tokenizer NAME] [--split test]
        [--max-blocks N] [--modes naive,average,uniform,updating,cached,topk] [--topk 2] [--out DIR]
        [--device auto|cpu|cuda] [--precision auto|fp32|bf16|fp16] [--no-prior-cache] [--quiet]
    torchrun --nproc-per-node 2 -m launcher.evaluation.evaluate CKPT_DIR ...     # blocks sharded over ranks

Data: --data/--tokenizer default to the data.path and data.tokenizer the checkpoint's run config recorded
(`checkpoint_data`, the rule of `experts` and `hf_export`); when that data is missing the error names it.

Time: the work is block passes - one all-experts pass per test block (every mode mixes the same log-likelihoods)
plus, for the cached/topk modes, the cached prior's `--cached-blocks` (100) dev blocks per domain, usually most of
a small evaluation. Before any work a plan line gives the counts and an estimated time; then block counts with an
ETA (stderr; --quiet silences them). The prior is cached per checkpoint, data and settings in
CKPT_DIR/eval_prior_cache/ (launcher/evaluation/prior_cache.py) and reused. Bounds: --max-blocks, --modes; faster:
a GPU (--device cuda) or several ranks (torchrun); docs/evaluation.md.

Device and precision: by default (`auto`) the training device - `cuda:LOCAL_RANK` where CUDA is available (an
NCCL group across ranks, launcher/distributed.py), the CPU otherwise (gloo) - in the checkpoint's `train.precision`
where that device has it (parallel/precision.py), as torch autocast over the fp32 weights (`forward_precision`, the
trainer's own rule): matmuls in bf16/fp16, log-likelihoods and every sum in fp32. On the CPU `auto` is fp32 (the
numbers evaluations always gave there); `--precision bf16` asks for bf16 autocast there too. Both are recorded in
eval.json (`device`, `precision`).

Domains: the checkpoint's training domains (`role: train`) and every other domain of the data manifest
(`role: novel`). One process holds all experts; the E experts' token log-likelihoods ll[j, b, t] of each block
come from one batched pass (model/batched.py), the mixtures from model/mixture.py:

* naive    - expert of the known domain (training domains); the best single expert on that test set (novel).
* average  - uniform average of the experts' probabilities at every token.
* uniform / updating / cached - the posterior mixture (eqs. 6-8) with that prior (eq. 9 for updating, λ = 0.3,
  over the test blocks in order; cached = estimated on `cached_blocks` blocks of the `dev_split`: by default the
  mean of their posteriors, the paper's text; `--cached-estimator ewm|updating` for the reference implementation's
  exponentially weighted mean or eq. 9). `--posterior previous_token` conditions every posterior on the previous
  token only (the reference implementation) instead of the whole prefix (eqs. 7-8, default). Both choices are
  recorded in eval.json (`posterior`, `cached_estimator`) and in each cached prior file.
* topk     - the posterior mixture restricted to the k experts with the highest cached prior (k of E experts run).

Dense / GShard / CSE checkpoints get one number per domain (mode `ppl`). +Domain-Token checkpoints
(`data.mixture = domain_token`) read blocks as the sampler does ([t_d] + x[:T-1] -> x[:T], the domain token is
never a target); training domains use their own token, novel domains the best token (DEMix §5.3).

Perplexity is exp(mean NLL over the scored tokens of a domain); averages over domains are plain means of the
per-domain perplexities, as in the paper's Tables 3 and 5. With several ranks, rank r scores blocks r, r+W, ...;
the E x N x T log-likelihoods are summed over ranks (all_reduce) so every mode sees the whole stream in order.

Outputs under --out: eval.json (schema: `EVAL_SCHEMA`), eval.md (Tables 3/4/5), cached_priors/<domain>.json,
posteriors.png (Figure 4) and specialisation.png (Figure 2).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch

from data.argtypes import positive_int, unit_left_open
from data.atomic import staged_dir
from data.catalog import read_token_manifest
from data.cli import check_output_dir, cli_main, exit_process
from launcher.checkpoint import Consolidated, load_consolidated, read_meta, write_json_atomic
from launcher.checkpoint_data import block_inputs, checkpoint_data, count_blocks, data_manifest, load_blocks
from launcher.distributed import ensure_env, start_distributed, training_device
from launcher.evaluation.prior_cache import PRIOR_CACHE_DIR, PriorCache, PriorEntries, data_fingerprint
from launcher.evaluation.progress import Progress, plan_line
from launcher.evaluation.stats import block_sums, bootstrap_mean_ppl, bootstrap_ppl
from launcher.evaluation.unigram import domain_unigram
from model import mixture as mx
from model.accounting import normalise_precision
from model.batched import demix_expert_ids, expert_log_likelihoods
from parallel.precision import forward_precision, local_precision_problems

DEMIX_MODES: tuple[str, ...] = ("naive", "average", "uniform", "updating", "cached", "topk")
EVAL_FORMAT = "demix-eval/1"
# What `write_outputs` writes into --out (figures by launcher/evaluation/figures.py).
EVAL_FILES = ("eval.json", "eval.md", "posteriors.png", "specialisation.png")
EVAL_DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
EVAL_PRECISIONS: tuple[str, ...] = ("auto", "fp32", "bf16", "fp16")
EVAL_SCHEMA = """What `evaluate_model` returns (and eval.json holds):

    {"format": "demix-eval/1", "kind": "demix"|"dense"|..., "data_mixture": str, "experts": [names] ([] unless
         DEMix), "train_domains": [...], "split": str, "dev_split": str, "seq_len": T, "max_blocks": N|None,
         "modes": [...], "decay": λ, "cached_blocks": n, "topk": k, "posterior": "prefix"|"previous_token",
         "cached_estimator": "mean"|"ewm"|"updating", "device": "cpu"|"cuda:i", "precision": "fp32"|"bf16"|"fp16",
         "seconds": s, **extra (evaluate_checkpoint: "checkpoint": path|None, "step": int),
         "domains": {name: {"role": "train"|"novel", "blocks": int, "tokens": int, "ppl": {mode: float},
                            DEMix/domain-token only: "expert_ppl": {expert: float}, "naive_expert": name,
                            DEMix only: "posterior": {"updating_mean_end_of_block": {expert: p},
                                                      "updating_final_prior": {expert: p}},
                                        "cached_prior": {"probs": {expert: p}, "blocks": n, "estimator",
                                                         "posterior"},
                                        "cached_prior_variants": {"<estimator>/<posterior>": {expert: p}},
                                        "topk": {"k", "experts", "experts_evaluated", "of"}}},
         every domain also: "block_nll": {mode: [NLL sum per block, nats]}, "block_tokens": [scored tokens per block],
         and with `unigram`: "unigram": {"ppl", "k", "train_tokens", "block_nll"} (launcher/evaluation/unigram.py: the
         domain's own add-k unigram on the same test targets),
         "tables": {"in_domain_average": {mode: ppl}, "novel_average": {mode: ppl},
                    "per_domain": {domain: {mode: ppl}}, "in_domain_average_ci" / "novel_average_ci": {mode: [lo, hi]},
                    "per_domain_ci": {domain: {mode: [lo, hi]}}}  (95 % bootstrap over blocks, stats.py),
         "prior_cache": {"file": path|None, "from_cache": [domains], "scored": [domains]}  (DEMix with cached/topk),
         "files": {"json", "markdown", "posteriors", "specialisation"}  (when out_dir is given)}
"""


def _dist() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _say(progress: bool, *a: Any) -> None:
    if progress and _dist()[0] == 0:
        print(*a, file=sys.stderr, flush=True)


def resolve_eval_device(choice: str = "auto") -> torch.device:
    """The device to evaluate on: `cpu`; `cuda`, this rank's GPU (the training device: `torch.cuda.current_device()`,
    which `start_distributed` binds to LOCAL_RANK), refused (ValueError) where CUDA is not available; `auto`, the GPU
    where CUDA is available unless this process already joined a gloo group (its collectives run on the host),
    else the CPU."""
    if choice not in EVAL_DEVICES:
        raise ValueError(f"device {choice!r}: choose from {', '.join(EVAL_DEVICES)}")
    if choice == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if choice == "cuda":
            raise ValueError(
                f"--device cuda: CUDA is not available on this machine (torch {torch.__version__}, "
                f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use --device cpu"
            )
        return torch.device("cpu")
    if (
        choice == "auto"
        and torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_backend() == "gloo"
    ):
        return torch.device("cpu")
    return training_device()


def resolve_eval_precision(choice: str, trained: str, device: torch.device) -> str:
    """fp32, bf16 or fp16 for `choice` (`auto` or one of them) on `device`, for a checkpoint trained in `trained`.

    `auto`: on a GPU the training precision where the GPU has it (`local_precision_problems`; e.g. a V100 has no
    bf16: fp32 then), on the CPU fp32 (the numbers CPU evaluations always gave; CPU autocast is real bf16
    arithmetic, slower than fp32 without AMX). An explicit precision the GPU lacks is refused (ValueError)."""
    if choice == "auto":
        p = normalise_precision(trained)
        return p if device.type != "cpu" and not local_precision_problems(p) else "fp32"
    p = normalise_precision(choice)
    problems = local_precision_problems(p) if device.type == "cuda" else []
    if problems:
        raise ValueError(f"--precision {p} on {device}: " + "; ".join(problems))
    return p


def check_eval_request(
    checkpoint: Union[str, Path],
    data_root: Union[str, Path],
    tokenizer: Optional[str],
    split: str,
    domains: Optional[Sequence[str]],
    seq_len: Optional[int],
    allow_missing: bool = False,
) -> None:
    """Refuse (ValueError), before a tensor is read, an evaluation whose tables would be nonsense: blocks longer than
    the model's context, a domain that is not in the data, a domain with no block in `split` (unless
    `allow_missing`: it is skipped with a note, its row left out), and a table with no rows at all."""
    meta = read_meta(checkpoint)
    context = int(meta["config"]["model"]["seq_len"])
    if seq_len is not None and seq_len > context:
        raise ValueError(
            f"--seq-len {seq_len} is beyond the model's context ({context} tokens, model.seq_len of "
            f"{checkpoint}): it has no position embedding past it; use at most {context}"
        )
    tokenizer = tokenizer or meta["config"]["data"]["tokenizer"]
    path = Path(data_root) / tokenizer / "manifest.json"
    have = list(read_token_manifest(path)["domains"])
    names = list(domains) if domains else have
    unknown = [d for d in names if d not in have]
    if unknown:
        raise ValueError(f"--domains {unknown} are not in {path}; its domains: {', '.join(have)}")
    T = seq_len or context
    empty = [d for d in names if not len(load_blocks(data_root, tokenizer, d, split, T, 1))]
    if len(empty) == len(names):
        raise ValueError(
            f"no domain has a {split} block of {T}+1 tokens in {path.parent}: every table would have no "
            "rows; evaluate another --split, or a shorter --seq-len"
        )
    if empty and not allow_missing:
        raise ValueError(
            f"{empty} have no {split} block of {T}+1 tokens in {path.parent}: their rows would be missing "
            "from the tables; pass --allow-missing to evaluate the other domains, or a shorter --seq-len"
        )


@torch.no_grad()
def stream_log_likelihoods(
    model: torch.nn.Module,
    tokens_NT: torch.Tensor,
    targets_NT: torch.Tensor,
    expert_ids: Optional[Sequence[int]] = None,
    batch_size: int = 4,
    precision: str = "fp32",
    on_blocks: Optional[Callable[[int], None]] = None,
) -> torch.Tensor:
    """ll E x N x T (fp32, on the host) over a stream of N blocks, scored on the model's device in `precision`
    (`forward_precision`); blocks are sharded over ranks and summed back (all_reduce). `on_blocks(k)` after each
    batch: about k of the N blocks are done over all ranks (progress)."""
    rank, world = _dist()
    N, T = tokens_NT.shape
    mine = list(range(rank, N, world))
    device = next(
        model.parameters()
    ).device  # the blocks are scored and summed over ranks there (NCCL: no CPU)
    parts = {}
    for s in range(0, len(mine), batch_size):
        idx = mine[s : s + batch_size]
        with forward_precision(model, precision, device.type):
            parts[tuple(idx)] = expert_log_likelihoods(
                model, tokens_NT[idx].to(device), targets_NT[idx].to(device), expert_ids
            )
        if on_blocks is not None:
            on_blocks(min(N, (s + len(idx)) * world))
    E = next(iter(parts.values())).shape[0] if parts else max(1, len(expert_ids or demix_expert_ids(model)))
    full = torch.zeros(E, N, T, dtype=torch.float32, device=device)
    for idx, ll in parts.items():
        full[:, list(idx)] = ll.float()
    if world > 1:
        torch.distributed.all_reduce(full)
    return full.cpu()


def _domain_token_ll(
    model,
    blocks,
    base: int,
    num_domains: int,
    batch_size: int,
    precision: str = "fp32",
    on_blocks: Optional[Callable[[int], None]] = None,
) -> torch.Tensor:
    """+Domain-Token: ll under each domain token d (the token plays the expert's part), G x N x T."""
    out = []
    for d in range(num_domains):
        tokens, targets, _ = block_inputs(blocks, base + d)
        tick = None if on_blocks is None else (lambda k, d=d: on_blocks(d * len(blocks) + k))
        out.append(stream_log_likelihoods(model, tokens, targets, None, batch_size, precision, tick)[0])
    return torch.stack(out)


def _cached_prior(
    model,
    dev_blocks,
    experts,
    cached_blocks,
    decay,
    batch_size,
    estimator: str = "mean",
    posterior: str = "prefix",
    precision: str = "fp32",
    on_blocks: Optional[Callable[[int], None]] = None,
) -> tuple[Optional[mx.CachedPrior], dict[str, dict[str, float]]]:
    """The cached prior of one domain from its development blocks (None without any), and every estimator x
    posterior variant of it on the same log-likelihoods ({"<estimator>/<posterior>": {expert: p}}, Figure 4 for
    each choice)."""
    if not len(dev_blocks):
        return None, {}
    tokens, targets, mask = block_inputs(dev_blocks)
    ll = stream_log_likelihoods(model, tokens, targets, None, batch_size, precision, on_blocks)
    variants = {}
    for est in mx.CACHED_ESTIMATORS:
        for post in mx.POSTERIORS:
            v = mx.estimate_cached_prior(
                ll, experts, mask, cached_blocks, decay if est == "updating" else None, est, post
            )
            variants[f"{est}/{post}"] = dict(zip(v.domains, v.probs))
    prior = mx.estimate_cached_prior(
        ll, experts, mask, cached_blocks, decay if estimator == "updating" else None, estimator, posterior
    )
    return prior, variants


def _domain_token_entry(
    model,
    blocks,
    base: int,
    train_domains: list[str],
    own: Optional[int],
    batch_size: int,
    precision: str = "fp32",
    on_blocks: Optional[Callable[[int], None]] = None,
) -> dict[str, Any]:
    """+Domain-Token: own token in-domain, the best token on a novel domain (DEMix §5.3)."""
    ll = _domain_token_ll(model, blocks, base, len(train_domains), batch_size, precision, on_blocks)
    mask = torch.ones(ll.shape[1:])
    exp_ppl = mx.expert_perplexities(ll, mask)
    best = mx.naive_expert(ll, own, mask)
    nll, tokens = block_sums(ll[best], mask)
    return {
        "expert_ppl": dict(zip(train_domains, exp_ppl)),
        "naive_expert": train_domains[best],
        "ppl": {"ppl": exp_ppl[best]},
        "block_nll": {"ppl": nll},
        "block_tokens": tokens,
    }


def _mean(values: list[float]) -> Optional[float]:
    return float(np.mean(values)) if values else None


def _demix_domain(
    ll_EBT, mask_BT, own, experts, modes, cached_prior, topk, decay, posterior: str = "prefix"
) -> dict[str, Any]:
    """Every mode's perplexity and the posterior statistics of one test domain."""
    E = ll_EBT.shape[0]
    uniform = mx.uniform_log_prior(E)
    exp_ppl = mx.expert_perplexities(ll_EBT, mask_BT)
    naive = mx.naive_expert(ll_EBT, own, mask_BT)
    upd = mx.updating_priors(ll_EBT, mask_BT, decay, posterior=posterior)
    res: dict[str, Any] = {
        "expert_ppl": dict(zip(experts, exp_ppl)),
        "naive_expert": experts[naive],
        "ppl": {},
        "posterior": {
            "updating_mean_end_of_block": dict(zip(experts, upd.log_posterior_EB.exp().mean(dim=1).tolist())),
            "updating_final_prior": dict(zip(experts, upd.final_log_prior_E.exp().tolist())),
        },
    }
    for mode in modes:
        if mode == "naive":
            lp = ll_EBT[naive]
        elif mode == "average":
            lp = mx.average_log_probs(ll_EBT)
        elif mode == "uniform":
            lp = mx.posterior_mixture_log_probs(ll_EBT, uniform, mask_BT, posterior)
        elif mode == "updating":
            lp = mx.posterior_mixture_log_probs(ll_EBT, upd.log_prior_EB, mask_BT, posterior)
        elif mode in ("cached", "topk"):
            if cached_prior is None:
                continue
            lp_E = cached_prior.log_prior(experts)
            if mode == "cached":
                lp = mx.posterior_mixture_log_probs(ll_EBT, lp_E, mask_BT, posterior)
            else:
                top = mx.topk_mixture_log_probs(ll_EBT, lp_E, min(topk, E), mask_BT, posterior=posterior)
                lp = top.log_probs_BT
                res["topk"] = {
                    "k": min(topk, E),
                    "experts": [experts[j] for j in top.experts],
                    "experts_evaluated": top.experts_evaluated,
                    "of": E,
                }
        else:
            raise ValueError(f"mode {mode!r}: choose from {', '.join(DEMIX_MODES)}")
        res["ppl"][mode] = mx.perplexity(lp, mask_BT)
        res.setdefault("block_nll", {})[mode], res["block_tokens"] = block_sums(lp, mask_BT)
    if cached_prior is not None:
        res["cached_prior"] = {
            "probs": dict(zip(cached_prior.domains, cached_prior.probs)),
            "blocks": cached_prior.blocks,
            "estimator": cached_prior.estimator,
            "posterior": cached_prior.posterior,
        }
    return res


@dataclass
class _Eval:
    """What every stage of one evaluation (`evaluate_model`) shares."""

    model: torch.nn.Module
    data_root: Union[str, Path]
    tokenizer: str
    manifest: dict[str, Any]
    train_domains: list[str]
    experts: list[str]
    modes: list[str]
    split: str
    dev_split: str
    seq_len: int
    max_blocks: Optional[int]
    batch_size: int
    precision: str
    cached_blocks: int
    decay: float
    topk: int
    posterior: str
    cached_estimator: str
    unigram: bool
    domain_token: bool

    @property
    def passes_per_block(self) -> int:
        """Forward passes per block: one (all experts batched, or a dense model), G for +Domain-Token."""
        return len(self.train_domains) if self.domain_token and not self.experts else 1

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def _time_block_pass(e: _Eval, dom: str) -> tuple[float, int]:
    """Seconds per block pass from one timed batch of `dom`'s first test blocks (the plan line's estimate), and
    how many blocks it timed. On a GPU one block is passed first (CUDA start-up is not timed)."""
    n = e.batch_size if e.max_blocks is None else min(e.batch_size, e.max_blocks)
    tokens, targets, _ = block_inputs(load_blocks(e.data_root, e.tokenizer, dom, e.split, e.seq_len, n))
    tokens, targets = tokens.to(e.device), targets.to(e.device)
    with torch.no_grad(), forward_precision(e.model, e.precision, e.device.type):
        if e.device.type == "cuda":
            expert_log_likelihoods(e.model, tokens[:1], targets[:1])
            torch.cuda.synchronize(e.device)
        t = time.perf_counter()
        expert_log_likelihoods(e.model, tokens, targets)
        if e.device.type == "cuda":
            torch.cuda.synchronize(e.device)
    return (time.perf_counter() - t) / len(tokens), len(tokens)


def _agree_over_ranks(hits: list[str], need: list[str], device: torch.device) -> list[str]:
    """The cache hits every rank has (all ranks must score the same priors: the passes are collective)."""
    if _dist()[1] == 1 or not need:
        return hits
    flags = torch.tensor([1.0 if d in hits else 0.0 for d in need], device=device)
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN)
    return [d for d, f in zip(need, flags.tolist()) if f > 0]


def _prior_plan(
    e: _Eval,
    domains: list[str],
    given: Optional[dict[str, mx.CachedPrior]],
    cache: Optional[PriorCache],
    say: Callable[[str], None],
) -> tuple[PriorEntries, dict[str, int], str, Optional[dict[str, Any]]]:
    """The priors given or cached, the development blocks to score for the other domains, the plan line's
    "prior: ..." clause, and the cache key (None without a cache)."""
    entries: PriorEntries = {d: {"prior": given[d], "given": True} for d in domains if given and d in given}
    need = [d for d in domains if d not in entries]
    key, cached = None, {}
    if cache is not None and need:
        key = cache.fingerprint(
            data_fingerprint(e.data_root, e.tokenizer, e.dev_split),
            {
                "dev_split": e.dev_split,
                "cached_blocks": e.cached_blocks,
                "seq_len": e.seq_len,
                "decay": e.decay,
                "estimator": e.cached_estimator,
                "posterior": e.posterior,
                "precision": e.precision,
                "device": e.device.type,
                "experts": e.experts,
            },
        )
        cached, why = cache.read(key)
        if why:
            say(f"[eval] prior cache not used: {why}")
    hits = _agree_over_ranks([d for d in need if d in cached], need, e.device)
    entries.update({d: cached[d] for d in hits})
    to_score = {
        d: count_blocks(e.data_root, e.tokenizer, d, e.dev_split, e.seq_len, e.cached_blocks)
        for d in need
        if d not in hits
    }
    parts = []
    if hits:
        parts.append(
            f"prior: cached from {cache.file(key)}"
            + (f" for {', '.join(hits)}" if to_score else "")
            + f" (its {e.cached_blocks} {e.dev_split} blocks per domain are not scored again)"
        )
    if to_score:
        n = sorted(set(to_score.values()))
        where = (
            f"once per checkpoint: cached in {cache.file(key)}"
            if cache is not None
            else "not cached: evaluate_checkpoint(prior_cache=True) or the command caches it"
        )
        parts.append(
            f"prior: scoring {n[0] if len(n) == 1 else f'{n[0]}-{n[-1]}'} {e.dev_split} blocks per domain"
            + (f" for {', '.join(to_score)}" if hits else f" ({len(to_score)} domains)")
            + f", {where}"
        )
    if len(entries) > len(hits):
        parts.append("prior: given for " + ", ".join(d for d in entries if entries[d].get("given")))
    return entries, to_score, "; ".join(parts), key


def _score_priors(e: _Eval, to_score: dict[str, int], prog: Progress) -> PriorEntries:
    """The cached prior (and its variants) of each domain of `to_score`, from its development blocks."""
    out: PriorEntries = {}
    for dom in to_score:
        prog.start(f"prior {dom} ({e.dev_split})")
        dev = load_blocks(e.data_root, e.tokenizer, dom, e.dev_split, e.seq_len, e.cached_blocks)
        prior, variants = _cached_prior(
            e.model,
            dev,
            e.experts,
            e.cached_blocks,
            e.decay,
            e.batch_size,
            e.cached_estimator,
            e.posterior,
            e.precision,
            prog.at,
        )
        out[dom] = {"prior": prior, "variants": variants}
        prog.stage_done(len(dev))
    return out


def _save_priors(
    cache: Optional[PriorCache],
    key: Optional[dict[str, Any]],
    scored: PriorEntries,
    seconds: float,
    say: Callable[[str], None],
) -> None:
    """Write the priors scored here into the checkpoint's cache (rank 0; a read-only place is only noted)."""
    if cache is None or key is None or not scored or _dist()[0] != 0:
        return
    try:
        say(f"[eval] prior: cached in {cache.write(key, scored, seconds)} for the next evaluation")
    except OSError as err:
        say(f"[eval] prior: not cached ({err})")


def _evaluate_domain(
    e: _Eval, dom: str, prior: Optional[dict[str, Any]], prog: Progress, say: Callable[[str], None]
) -> dict[str, Any]:
    """One domain's entry of eval.json: every mode from the same log-likelihoods of its test blocks."""
    role = "train" if dom in e.train_domains else "novel"
    own = e.train_domains.index(dom) if role == "train" else None
    prog.start(f"{dom} ({role}, {e.split})")
    blocks = load_blocks(e.data_root, e.tokenizer, dom, e.split, e.seq_len, e.max_blocks)
    tokens, targets, mask = block_inputs(blocks)
    entry: dict[str, Any] = {"role": role, "blocks": int(len(blocks)), "tokens": int(mask.sum())}
    if e.unigram:
        try:
            entry["unigram"] = domain_unigram(
                e.data_root,
                e.tokenizer,
                dom,
                e.seq_len,
                int(e.manifest["tokenizer"]["vocab_size"]),
                targets,
                mask,
                e.dev_split,
            )
        except ValueError as err:
            say(f"[eval] {dom}: no unigram baseline ({err})")
    if e.experts:
        ll = stream_log_likelihoods(e.model, tokens, targets, None, e.batch_size, e.precision, prog.at)
        if prior and prior.get("variants"):
            entry["cached_prior_variants"] = prior["variants"]
        entry.update(
            _demix_domain(
                ll,
                mask,
                own,
                e.experts,
                e.modes,
                prior["prior"] if prior else None,
                e.topk,
                e.decay,
                e.posterior,
            )
        )
    elif e.domain_token:
        base = int(e.manifest["tokenizer"]["vocab_size"])
        entry.update(
            _domain_token_entry(
                e.model, blocks, base, e.train_domains, own, e.batch_size, e.precision, prog.at
            )
        )
    else:
        ll = stream_log_likelihoods(e.model, tokens, targets, None, e.batch_size, e.precision, prog.at)
        entry["ppl"] = {"ppl": mx.perplexity(ll[0], mask)}
        nll, entry["block_tokens"] = block_sums(ll[0], mask)
        entry["block_nll"] = {"ppl": nll}
    prog.stage_done(
        len(blocks) * e.passes_per_block,
        "done: " + ", ".join(f"{m} {_fmt(v)}" for m, v in entry["ppl"].items()),
    )
    return entry


def evaluate_model(
    model: torch.nn.Module,
    cfg: Any,
    train_domains: Sequence[str],
    data_root: Union[str, Path],
    *,
    tokenizer: Optional[str] = None,
    split: str = "test",
    dev_split: str = "valid",
    max_blocks: Optional[int] = None,
    modes: Sequence[str] = DEMIX_MODES,
    domains: Optional[Sequence[str]] = None,
    batch_size: int = 4,
    cached_blocks: int = mx.CACHED_PRIOR_BLOCKS,
    decay: float = mx.UPDATING_DECAY,
    topk: int = 2,
    seq_len: Optional[int] = None,
    out_dir: Optional[Union[str, Path]] = None,
    progress: bool = True,
    extra: Optional[dict[str, Any]] = None,
    cached_priors: Optional[dict[str, mx.CachedPrior]] = None,
    posterior: str = "prefix",
    cached_estimator: str = "mean",
    unigram: bool = True,
    precision: str = "fp32",
    prior_cache: Optional[PriorCache] = None,
) -> dict[str, Any]:
    """Evaluate an in-memory model (all experts held) on every domain of the prepared data, on the model's device in
    `precision` (fp32, or bf16/fp16 autocast over fp32 weights: `forward_precision`). `cached_priors` maps a
    domain to a prior to use instead of estimating one on `dev_split`; `prior_cache` (launcher/evaluation/
    prior_cache.py) keeps the estimated ones for the next evaluation of the same checkpoint, data and settings.
    With `progress`, a plan line (work, estimated time, the prior's cost) and then block counts with an ETA go to
    stderr (launcher/evaluation/progress.py). Returns the dict documented in `EVAL_SCHEMA`."""
    if posterior not in mx.POSTERIORS or cached_estimator not in mx.CACHED_ESTIMATORS:
        raise ValueError(
            f"posterior={posterior!r} / cached_estimator={cached_estimator!r}: choose from "
            f"{', '.join(mx.POSTERIORS)} / {', '.join(mx.CACHED_ESTIMATORS)}"
        )
    t0 = time.perf_counter()
    say = functools.partial(_say, progress)
    tokenizer, seq_len = tokenizer or cfg.data.tokenizer, seq_len or cfg.model.seq_len
    if seq_len > cfg.model.seq_len:
        raise ValueError(f"seq_len={seq_len} is beyond the model's context ({cfg.model.seq_len} tokens)")
    manifest = data_manifest(
        data_root, tokenizer, (extra or {}).get("tokenizer_sha256"), (extra or {}).get("vocab_size")
    )
    all_domains = list(domains) if domains is not None else list(manifest["domains"])
    is_demix = bool(demix_expert_ids(model))
    experts = list(train_domains) if is_demix else []
    if is_demix and len(experts) != len(demix_expert_ids(model)):
        raise ValueError(f"{len(experts)} domain names for {len(demix_expert_ids(model))} experts")
    e = _Eval(
        model.eval(),
        data_root,
        tokenizer,
        manifest,
        list(train_domains),
        experts,
        [m for m in modes if m in DEMIX_MODES] if is_demix else ["ppl"],
        split,
        dev_split,
        seq_len,
        max_blocks,
        batch_size,
        normalise_precision(precision),
        cached_blocks,
        decay,
        topk,
        posterior,
        cached_estimator,
        unigram,
        cfg.data.mixture == "domain_token",
    )
    results: dict[str, Any] = {
        "format": EVAL_FORMAT,
        "kind": cfg.model.ffn.kind,
        "data_mixture": cfg.data.mixture,
        "experts": experts,
        "train_domains": list(train_domains),
        "split": split,
        "dev_split": dev_split,
        "seq_len": seq_len,
        "max_blocks": max_blocks,
        "modes": e.modes,
        "decay": decay,
        "cached_blocks": cached_blocks,
        "topk": topk,
        "posterior": posterior,
        "cached_estimator": cached_estimator,
        "device": str(e.device),
        "precision": e.precision,
        **(extra or {}),
        "domains": {},
    }
    plan = {d: count_blocks(data_root, tokenizer, d, split, seq_len, max_blocks) for d in all_domains}
    for dom in [d for d, n in plan.items() if not n]:
        say(f"[eval] {dom}/{split}: no blocks of {seq_len}+1 tokens, skipped")
    plan = {d: n for d, n in plan.items() if n}
    if not plan:
        raise ValueError(
            f"no domain of {all_domains} has a {split} block of {seq_len}+1 tokens in {data_root}/"
            f"{tokenizer}: the evaluation has no rows"
        )
    priors, to_score, prior_note, key = ({}, {}, "", None)
    if is_demix and any(m in e.modes for m in ("cached", "topk")):
        priors, to_score, prior_note, key = _prior_plan(e, list(plan), cached_priors, prior_cache, say)
        results["prior_cache"] = {
            "file": str(prior_cache.file(key)) if key else None,
            "from_cache": [d for d in priors if not priors[d].get("given")],
            "scored": list(to_score),
        }
    elif is_demix:
        priors = {d: {"prior": p, "given": True} for d, p in (cached_priors or {}).items() if d in plan}
        prior_note = "prior: none (no cached/topk mode)"
    sec, timed = _time_block_pass(e, next(iter(plan))) if progress and _dist()[0] == 0 else (None, 0)
    say(
        plan_line(
            plan,
            split,
            seq_len,
            len(experts),
            e.modes,
            e.passes_per_block,
            to_score,
            dev_split,
            prior_note,
            sec,
            timed,
            _dist()[1],
        )
    )
    prog = Progress(sum(plan.values()) * e.passes_per_block + sum(to_score.values()), say)
    t_prior = time.perf_counter()
    scored = _score_priors(e, to_score, prog)
    prior_seconds = time.perf_counter() - t_prior
    priors.update(scored)
    estimated = {d: p["prior"] for d, p in priors.items() if p["prior"] is not None and not p.get("given")}
    for dom in plan:
        results["domains"][dom] = _evaluate_domain(e, dom, priors.get(dom), prog, say)
    results["tables"] = summary_tables(results)
    results["seconds"] = round(time.perf_counter() - t0, 3)
    if (
        out_dir is not None and _dist()[0] == 0
    ):  # the estimated priors are written with the report, not midway
        results["files"] = write_outputs(results, out_dir, estimated)
    # cached only once the evaluation has succeeded (its outputs published): a failed one leaves nothing behind
    _save_priors(prior_cache, key, scored, prior_seconds, say)
    return results


def evaluate_checkpoint(
    ckpt: Union[str, Path, Consolidated],
    data_root: Union[str, Path],
    exclude_experts: Sequence[str] = (),
    device: Union[str, torch.device] = "auto",
    precision: str = "auto",
    prior_cache: Union[bool, str, Path, PriorCache, None] = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Load a consolidated checkpoint (all experts, one process) and run `evaluate_model` on it (same keyword
    arguments: tokenizer, split, dev_split, max_blocks, modes, domains, batch_size, cached_blocks, decay, topk,
    posterior, cached_estimator, seq_len, out_dir, progress, cached_priors). Returns the result dict of
    `EVAL_SCHEMA`, with "checkpoint", "step" and "excluded_experts".

    `device` (auto|cpu|cuda or a torch.device, `resolve_eval_device`) and `precision` (auto|fp32|bf16|fp16,
    `resolve_eval_precision` against the checkpoint's train.precision): on a CPU machine the defaults are the CPU
    in fp32, the numbers this function always gave; on a GPU, the GPU in the training precision.

    `exclude_experts` (opt-out): the model is built without those DEMix experts, their weights never read; every
    mode mixes the remaining experts only and an excluded expert's domain is evaluated as a novel domain - the
    same numbers, bit for bit, as evaluating a checkpoint saved without them (`experts remove`).

    `prior_cache`: True keeps the cached priors in CKPT_DIR/eval_prior_cache (launcher/evaluation/prior_cache.py,
    keyed by the checkpoint's recorded shard sums, the data and the prior's settings) and reuses them; a path, that
    directory; None/False, none (the priors are scored every time). Only for a checkpoint given by its path."""
    dev = (
        device if isinstance(device, torch.device) else resolve_eval_device(device)
    )  # before loading anything
    if prior_cache not in (None, False) and not isinstance(prior_cache, PriorCache):
        if isinstance(ckpt, Consolidated):
            raise ValueError(
                "prior_cache needs the checkpoint's path (an in-memory checkpoint has no recorded sums)"
            )
        prior_cache = PriorCache.beside(ckpt, exclude_experts, None if prior_cache is True else prior_cache)
    if exclude_experts:  # opt-out: the excluded experts' weights are never read (launcher/expert_surgery.py)
        from launcher.expert_surgery import load_without

        c = load_without(ckpt, exclude_experts)
    else:
        c = ckpt if isinstance(ckpt, Consolidated) else load_consolidated(ckpt)
    extra = {
        "checkpoint": None if isinstance(ckpt, Consolidated) else str(ckpt),
        "step": c.step,
        "tokenizer_sha256": c.meta.get("tokenizer_sha256"),
        "vocab_size": c.meta.get("vocab_size"),
        "excluded_experts": list(exclude_experts),
    }
    prec = resolve_eval_precision(precision, c.cfg.train.precision, dev)
    if precision == "auto" and prec != normalise_precision(c.cfg.train.precision):
        _say(
            kwargs.get("progress", True),
            f"[eval] trained in {c.cfg.train.precision}, evaluated in {prec} on {dev}",
        )
    return evaluate_model(
        c.build_model().to(dev),
        c.cfg,
        c.domains,
        data_root,
        extra=extra,
        precision=prec,
        prior_cache=prior_cache or None,
        **kwargs,
    )


def summary_tables(results: dict[str, Any]) -> dict[str, Any]:
    """Table 3 (mean over training domains), Table 4 (per domain), Table 5 (mean over novel domains), each with
    95 % bootstrap intervals over blocks (launcher/evaluation/stats.py) where the per-block NLLs were recorded."""
    doms = results["domains"]
    per_domain = {d: r["ppl"] for d, r in doms.items()}
    avg, avg_ci = {}, {}
    for role in ("train", "novel"):
        avg[role] = {
            m: _mean([r["ppl"][m] for r in doms.values() if r["role"] == role and m in r["ppl"]])
            for m in results["modes"]
        }
        avg_ci[role] = {}
        for m in results["modes"]:
            blocks = [
                (r["block_nll"][m], r["block_tokens"])
                for r in doms.values()
                if r["role"] == role and m in r.get("block_nll", {})
            ]
            if blocks:
                avg_ci[role][m] = list(bootstrap_mean_ppl(blocks)[1:])
    per_domain_ci = {
        d: {m: list(bootstrap_ppl(nll, r["block_tokens"])[1:]) for m, nll in r.get("block_nll", {}).items()}
        for d, r in doms.items()
    }
    unigram = {
        role: _mean([r["unigram"]["ppl"] for r in doms.values() if r["role"] == role and "unigram" in r])
        for role in ("train", "novel")
    }
    return {
        "in_domain_average": avg["train"],
        "novel_average": avg["novel"],
        "per_domain": per_domain,
        "unigram_in_domain_average": unigram["train"],
        "unigram_novel_average": unigram["novel"],
        "in_domain_average_ci": avg_ci["train"],
        "novel_average_ci": avg_ci["novel"],
        "per_domain_ci": per_domain_ci,
    }


def _fmt(v: Optional[float]) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:.2f}"


def markdown_report(results: dict[str, Any]) -> str:
    """The paper's tables as markdown (modes as rows)."""
    modes, doms, t = results["modes"], results["domains"], results["tables"]
    label = (
        (lambda m: f"DEMix ({m})")
        if results["experts"]
        else (
            lambda m: (
                results["kind"] + (" +Domain-Token" if results["data_mixture"] == "domain_token" else "")
            )
        )
    )
    lines = [
        f"# Evaluation ({results['split']} split, {results['seq_len']}-token blocks"
        + (f", at most {results['max_blocks']} blocks per domain" if results["max_blocks"] else "")
        + ")",
        "",
    ]
    if results.get("checkpoint"):
        lines += [f"checkpoint: `{results['checkpoint']}` (step {results.get('step')})", ""]
    if results.get("precision", "fp32") != "fp32" or results.get("device", "cpu") != "cpu":
        lines += [
            f"device: {results.get('device', 'cpu')}; precision: {results.get('precision', 'fp32')}"
            + (
                " (autocast: matmuls in half precision, log-likelihoods and sums in fp32)"
                if results.get("precision", "fp32") != "fp32"
                else ""
            ),
            "",
        ]
    if results["experts"]:
        lines += [
            f"posterior: {results.get('posterior', 'prefix')} (evidence of every posterior); cached prior: "
            f"{results.get('cached_estimator', 'updating')} over {results['cached_blocks']} "
            f"{results['dev_split']} blocks; updating prior λ = {results['decay']}",
            "",
        ]
    lines += [
        "## In-domain average perplexity (cf. Table 3)",
        "",
        "| model | avg ppl | 95% interval (blocks) |",
        "|---|---|---|",
    ]
    ci = t.get("in_domain_average_ci", {})
    lines += [
        f"| {label(m)} | {_fmt(t['in_domain_average'][m])} | "
        + (f"{_fmt(ci[m][0])} – {_fmt(ci[m][1])}" if m in ci else "–")
        + " |"
        for m in modes
    ]
    for role, title in (("train", "Training domains (cf. Table 4)"), ("novel", "Novel domains")):
        names = [d for d, r in doms.items() if r["role"] == role]
        if not names:
            continue
        lines += [
            "",
            f"## {title}",
            "",
            "| model | " + " | ".join(names) + " | avg |",
            "|---" * (len(names) + 2) + "|",
        ]
        for m in modes:
            cells = [_fmt(doms[d]["ppl"].get(m)) for d in names]
            avg = t["in_domain_average" if role == "train" else "novel_average"][m]
            lines.append(f"| {label(m)} | " + " | ".join(cells) + f" | {_fmt(avg)} |")
        if any("unigram" in doms[d] for d in names):
            uni = t.get("unigram_in_domain_average" if role == "train" else "unigram_novel_average")
            lines.append(
                "| unigram (own train split) | "
                + " | ".join(_fmt(doms[d]["unigram"]["ppl"]) if "unigram" in doms[d] else "–" for d in names)
                + f" | {_fmt(uni)} |"
            )
    lines += ["", "## Novel-domain average perplexity (cf. Table 5)", "", "| model | avg ppl |", "|---|---|"]
    lines += [f"| {label(m)} | {_fmt(t['novel_average'][m])} |" for m in modes]
    naive = {d: r["naive_expert"] for d, r in doms.items() if "naive_expert" in r}
    if naive:
        lines += [
            "",
            "naive expert per domain (own expert in-domain, best single expert on novel domains): "
            + ", ".join(f"{d} -> {e}" for d, e in naive.items()),
        ]
    tk = {d: r["topk"] for d, r in doms.items() if "topk" in r}
    if tk:
        k = next(iter(tk.values()))
        lines += [
            f"top-k: k = {k['k']} of {k['of']} experts evaluated per token (chosen by the cached prior): "
            + ", ".join(f"{d} -> {'+'.join(v['experts'])}" for d, v in tk.items())
        ]
    return "\n".join(lines) + "\n"


def write_outputs(
    results: dict[str, Any], out_dir: Union[str, Path], cached_priors: Optional[dict[str, Any]] = None
) -> dict[str, str]:
    """Write the report into `out_dir` (eval.json, eval.md, the figures, `cached_priors/<domain>.json` for each
    estimated prior); returns {name: path}. Staged and published together (data/atomic.py `staged_dir`): a failure
    (a full disk included) leaves no report without its eval.json."""
    from launcher.evaluation.figures import write_figures

    out_dir = Path(out_dir)
    with staged_dir(out_dir, manifest="eval.json") as tmp:
        for dom, prior in (cached_priors or {}).items():
            prior.save(tmp / "cached_priors" / f"{dom}.json")
        files = {"json": str(out_dir / "eval.json"), "markdown": str(out_dir / "eval.md")}
        files.update(
            {k: str(out_dir / Path(v).relative_to(tmp)) for k, v in write_figures(results, tmp).items()}
        )
        results["files"] = files
        (tmp / "eval.md").write_text(markdown_report(results))
        write_json_atomic(tmp / "eval.json", results)
    return files


def _join_ranks(device_choice: str) -> torch.device:
    """Under a launcher of several ranks (torchrun, deepspeed, MPI, srun), join them - on GPUs through the trainer's
    `start_distributed` (each rank binds its own GPU, NCCL), on the CPU a gloo group - and return this rank's
    evaluation device. A single process joins nothing."""
    world = ensure_env()  # MPI/SLURM ranks: torch's variables, from the launcher's own (the trainer's rule)
    if world > 1 and not torch.distributed.is_initialized():
        if resolve_eval_device(device_choice).type == "cuda":
            start_distributed()
        else:  # a gloo group, as before: no DeepSpeed (its CPU start-up JIT-compiles a shared-memory op)
            torch.distributed.init_process_group("gloo")
    return resolve_eval_device(device_choice)


@cli_main
def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="consolidated checkpoint directory (meta.json + model.pt)")
    ap.add_argument("--data", help="prepared tokens root (data.prepare; default: the checkpoint's data.path)")
    ap.add_argument("--tokenizer", help="tokenizer subdirectory (default: the checkpoint's data.tokenizer)")
    ap.add_argument("--split", default="test")
    ap.add_argument("--dev-split", default="valid", help="split the cached prior is estimated on")
    ap.add_argument("--max-blocks", type=positive_int, help="at most N blocks per domain")
    ap.add_argument(
        "--modes", default=",".join(DEMIX_MODES), help="comma-separated subset of " + ",".join(DEMIX_MODES)
    )
    ap.add_argument("--domains", help="comma-separated domains (default: all in the data manifest)")
    ap.add_argument("--cached-blocks", type=positive_int, default=mx.CACHED_PRIOR_BLOCKS)
    ap.add_argument(
        "--decay",
        type=unit_left_open,
        default=mx.UPDATING_DECAY,
        help="λ of the updating prior (eq. 9), in (0, 1]",
    )
    ap.add_argument("--topk", type=positive_int, default=2)
    ap.add_argument(
        "--posterior",
        choices=mx.POSTERIORS,
        default="prefix",
        help="evidence of every posterior: the whole prefix (eqs. 7-8) or the previous token (reference code)",
    )
    ap.add_argument(
        "--cached-estimator",
        choices=mx.CACHED_ESTIMATORS,
        default="mean",
        help="cached prior: mean of the dev posteriors (paper), ewm (reference code, α=0.3) or eq. 9",
    )
    ap.add_argument(
        "--batch-size", type=positive_int, default=4, help="blocks per batched pass (x E sequences)"
    )
    ap.add_argument(
        "--seq-len", type=positive_int, help="block length (default and most: the model's context)"
    )
    ap.add_argument(
        "--allow-missing",
        action="store_true",
        help="skip (with a note) domains with no block in --split instead of refusing the evaluation",
    )
    ap.add_argument(
        "--out",
        default=None,
        help="output directory (default: CKPT_DIR/eval, with --exclude-experts "
        "CKPT_DIR/eval-without-<names>)",
    )
    ap.add_argument(
        "--exclude-experts",
        default="",
        help="comma-separated DEMix experts to opt out: never read, no part in any output",
    )
    ap.add_argument(
        "--device",
        choices=EVAL_DEVICES,
        default="auto",
        help="auto: this rank's GPU (cuda:LOCAL_RANK) where CUDA is available, else the CPU",
    )
    ap.add_argument(
        "--precision",
        choices=EVAL_PRECISIONS,
        default="auto",
        help="auto: the checkpoint's train.precision on a GPU that has it (bf16/fp16 as autocast), fp32 "
        "on the CPU",
    )
    ap.add_argument(
        "--prior-cache",
        metavar="DIR",
        help="where the cached priors are kept and reused (default: "
        f"CKPT_DIR/{PRIOR_CACHE_DIR}, keyed by the checkpoint's sums, the data and the prior's settings)",
    )
    ap.add_argument(
        "--no-prior-cache",
        action="store_true",
        help="score the cached prior's dev blocks again, keep nothing",
    )
    ap.add_argument("--quiet", action="store_true", help="no plan line, progress or ETA on stderr")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in DEMIX_MODES]
    if bad:
        ap.error(f"unknown modes {bad}; choose from {', '.join(DEMIX_MODES)}")
    resolve_eval_device(args.device)  # e.g. --device cuda without CUDA: refused before anything is read
    data, tokenizer = checkpoint_data(args.checkpoint, args.data, args.tokenizer)  # before loading any tensor
    check_eval_request(
        args.checkpoint,
        data,
        tokenizer,
        args.split,
        args.domains.split(",") if args.domains else None,
        args.seq_len,
        args.allow_missing,
    )
    exclude = [e.strip() for e in args.exclude_experts.split(",") if e.strip()]
    default_out = Path(args.checkpoint) / ("eval-without-" + "-".join(exclude) if exclude else "eval")
    check_output_dir(
        Path(args.out or default_out),
        [EVAL_FORMAT],
        EVAL_FILES,
        inputs=[Path(data)],
        manifest="eval.json",
        what="--out",
    )  # a user's eval.md is not replaced
    device = _join_ranks(args.device)
    _say(
        not args.quiet,
        f"[eval] {args.checkpoint} on {data}/{tokenizer}"
        + ("" if args.data else " (the checkpoint's recorded data.path; --data DIR for another)"),
    )
    res = evaluate_checkpoint(
        args.checkpoint,
        data,
        tokenizer=tokenizer,
        split=args.split,
        dev_split=args.dev_split,
        max_blocks=args.max_blocks,
        modes=modes,
        domains=args.domains.split(",") if args.domains else None,
        batch_size=args.batch_size,
        cached_blocks=args.cached_blocks,
        decay=args.decay,
        topk=args.topk,
        posterior=args.posterior,
        cached_estimator=args.cached_estimator,
        seq_len=args.seq_len,
        out_dir=args.out or str(default_out),
        exclude_experts=exclude,
        device=device,
        precision=args.precision,
        progress=not args.quiet,
        prior_cache=False if args.no_prior_cache else (args.prior_cache or True),
    )
    if _dist()[0] == 0:
        print(markdown_report(res))
        print("\n".join(f"{k}: {v}" for k, v in res.get("files", {}).items()))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_process(main())
