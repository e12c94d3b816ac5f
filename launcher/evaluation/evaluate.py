"""Per-domain test perplexity of a consolidated checkpoint, with inference-time expert mixing (DEMix §4-5).

    python -m launcher.evaluation.evaluate CKPT_DIR --data artifacts/demo/tokens [--tokenizer gpt2] [--split test]
        [--max-blocks N] [--modes naive,average,uniform,updating,cached,topk] [--topk 2] [--out DIR]
        [--device auto|cpu|cuda] [--precision auto|fp32|bf16|fp16]
    torchrun --nproc-per-node 2 -m launcher.evaluation.evaluate CKPT_DIR ...     # blocks sharded over ranks

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

Outputs under --out: eval.json (schema in `evaluate_model`), eval.md (Tables 3/4/5), cached_priors/<domain>.json,
posteriors.png (Figure 4) and specialisation.png (Figure 2).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from data.blocks import BlockDataset
from data.catalog import check_tokenizer, read_token_manifest
from launcher.checkpoint import Consolidated, load_consolidated, read_meta, write_json_atomic
from launcher.distributed import ensure_env, start_distributed, training_device
from launcher.evaluation.stats import block_sums, bootstrap_mean_ppl, bootstrap_ppl
from launcher.evaluation.unigram import domain_unigram
from model import mixture as mx
from model.accounting import normalise_precision
from model.batched import demix_expert_ids, expert_log_likelihoods
from data.argtypes import positive_int, unit_left_open
from data.atomic import staged_dir
from data.cli import check_output_dir, cli_main, exit_process
from parallel.precision import forward_precision, local_precision_problems

DEMIX_MODES: tuple[str, ...] = ("naive", "average", "uniform", "updating", "cached", "topk")
EVAL_FORMAT = "demix-eval/1"
# What `write_outputs` writes into --out (figures by launcher/evaluation/figures.py).
EVAL_FILES = ("eval.json", "eval.md", "posteriors.png", "specialisation.png")
EVAL_DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
EVAL_PRECISIONS: tuple[str, ...] = ("auto", "fp32", "bf16", "fp16")


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
            raise ValueError(f"--device cuda: CUDA is not available on this machine (torch {torch.__version__}, "
                             f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use --device cpu")
        return torch.device("cpu")
    if choice == "auto" and torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_backend() == "gloo":
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


def data_manifest(data_root: Union[str, Path], tokenizer: str, model_tokenizer_sha256: Optional[str] = None,
                  model_vocab: Optional[int] = None) -> dict[str, Any]:
    """The token manifest of `data_root/tokenizer`, refusing (DataError) tokens of another tokenizer than the
    model's (its consolidated checkpoint records the fingerprint): perplexities on them would be meaningless."""
    path = Path(data_root) / tokenizer / "manifest.json"
    manifest = read_token_manifest(path)
    check_tokenizer(manifest, model_tokenizer_sha256, model_vocab, str(path))
    return manifest


def check_checkpoint_data(c: Union[Consolidated, str, Path], data_root: Union[str, Path],
                          tokenizer: Optional[str] = None) -> dict[str, Any]:
    """`data_manifest` for checkpoint `c` (its tokenizer fingerprint and vocabulary size); a path reads only its
    meta.json, so a CLI checks the data before loading any tensor. `tokenizer` defaults to the checkpoint's."""
    meta = c.meta if isinstance(c, Consolidated) else read_meta(c)
    tokenizer = tokenizer or meta["config"].get("data", {}).get("tokenizer", "gpt2")
    return data_manifest(data_root, tokenizer, meta.get("tokenizer_sha256"), meta.get("vocab_size"))


def load_blocks(data_root: Union[str, Path], tokenizer: str, domain: str, split: str, seq_len: int,
                max_blocks: Optional[int]) -> np.ndarray:
    """The first `max_blocks` blocks (N x (T+1) tokens, in stream order) of a domain's split; N may be 0."""
    try:
        ds = BlockDataset.from_prepared(data_root, tokenizer, domain, split, seq_len)
    except (ValueError, FileNotFoundError):
        return np.zeros((0, seq_len + 1), dtype=np.int64)
    n = len(ds) if max_blocks is None else min(len(ds), max_blocks)
    return np.stack([ds[i] for i in range(n)]) if n else np.zeros((0, seq_len + 1), dtype=np.int64)


def check_eval_request(checkpoint: Union[str, Path], data_root: Union[str, Path], tokenizer: Optional[str],
                       split: str, domains: Optional[Sequence[str]], seq_len: Optional[int],
                       allow_missing: bool = False) -> None:
    """Refuse (ValueError), before a tensor is read, an evaluation whose tables would be nonsense: blocks longer than
    the model's context, a domain that is not in the data, a domain with no block in `split` (unless
    `allow_missing`: it is skipped with a note, its row left out), and a table with no rows at all."""
    meta = read_meta(checkpoint)
    context = int(meta["config"]["model"]["seq_len"])
    if seq_len is not None and seq_len > context:
        raise ValueError(f"--seq-len {seq_len} is beyond the model's context ({context} tokens, model.seq_len of "
                         f"{checkpoint}): it has no position embedding past it; use at most {context}")
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
        raise ValueError(f"no domain has a {split} block of {T}+1 tokens in {path.parent}: every table would have no "
                         "rows; evaluate another --split, or a shorter --seq-len")
    if empty and not allow_missing:
        raise ValueError(f"{empty} have no {split} block of {T}+1 tokens in {path.parent}: their rows would be missing "
                         "from the tables; pass --allow-missing to evaluate the other domains, or a shorter --seq-len")


def block_inputs(blocks_NT1: np.ndarray, domain_token: Optional[int] = None) -> tuple[torch.Tensor, ...]:
    """(tokens_NT, targets_NT, mask_NT) as the sampler builds them (data/sampler.py)."""
    x = torch.from_numpy(blocks_NT1.astype(np.int64))
    if domain_token is None:
        tokens, targets = x[:, :-1], x[:, 1:]
    else:
        T = x.shape[1] - 1
        tokens = torch.cat([torch.full((x.shape[0], 1), domain_token, dtype=torch.long), x[:, :T - 1]], dim=1)
        targets = x[:, :T]
    return tokens.contiguous(), targets.contiguous(), torch.ones(targets.shape, dtype=torch.float32)


@torch.no_grad()
def stream_log_likelihoods(
    model: torch.nn.Module, tokens_NT: torch.Tensor, targets_NT: torch.Tensor,
    expert_ids: Optional[Sequence[int]] = None, batch_size: int = 4, precision: str = "fp32",
) -> torch.Tensor:
    """ll E x N x T (fp32, on the host) over a stream of N blocks, scored on the model's device in `precision`
    (`forward_precision`); blocks are sharded over ranks and summed back (all_reduce)."""
    rank, world = _dist()
    N, T = tokens_NT.shape
    mine = list(range(rank, N, world))
    device = next(model.parameters()).device  # the blocks are scored and summed over ranks there (NCCL: no CPU)
    parts = {}
    for s in range(0, len(mine), batch_size):
        idx = mine[s:s + batch_size]
        with forward_precision(model, precision, device.type):
            parts[tuple(idx)] = expert_log_likelihoods(model, tokens_NT[idx].to(device), targets_NT[idx].to(device),
                                                       expert_ids)
    E = next(iter(parts.values())).shape[0] if parts else max(1, len(expert_ids or demix_expert_ids(model)))
    full = torch.zeros(E, N, T, dtype=torch.float32, device=device)
    for idx, ll in parts.items():
        full[:, list(idx)] = ll.float()
    if world > 1:
        torch.distributed.all_reduce(full)
    return full.cpu()


def _domain_token_ll(model, blocks, base: int, num_domains: int, batch_size: int, precision: str = "fp32"
                     ) -> torch.Tensor:
    """+Domain-Token: ll under each domain token d (the token plays the expert's part), G x N x T."""
    out = []
    for d in range(num_domains):
        tokens, targets, _ = block_inputs(blocks, base + d)
        out.append(stream_log_likelihoods(model, tokens, targets, None, batch_size, precision)[0])
    return torch.stack(out)


def _cached_prior(model, dev_blocks, experts, cached_blocks, decay, batch_size, estimator: str = "mean",
                  posterior: str = "prefix", precision: str = "fp32",
                  ) -> tuple[Optional[mx.CachedPrior], dict[str, dict[str, float]]]:
    """The cached prior of one domain from its development blocks (None without any), and every estimator x
    posterior variant of it on the same log-likelihoods ({"<estimator>/<posterior>": {expert: p}}, Figure 4 for
    each choice)."""
    if not len(dev_blocks):
        return None, {}
    tokens, targets, mask = block_inputs(dev_blocks)
    ll = stream_log_likelihoods(model, tokens, targets, None, batch_size, precision)
    variants = {}
    for est in mx.CACHED_ESTIMATORS:
        for post in mx.POSTERIORS:
            v = mx.estimate_cached_prior(ll, experts, mask, cached_blocks, decay if est == "updating" else None, est, post)
            variants[f"{est}/{post}"] = dict(zip(v.domains, v.probs))
    prior = mx.estimate_cached_prior(ll, experts, mask, cached_blocks, decay if estimator == "updating" else None,
                                     estimator, posterior)
    return prior, variants


def _domain_token_entry(model, blocks, base: int, train_domains: list[str], own: Optional[int],
                        batch_size: int, precision: str = "fp32") -> dict[str, Any]:
    """+Domain-Token: own token in-domain, the best token on a novel domain (DEMix §5.3)."""
    ll = _domain_token_ll(model, blocks, base, len(train_domains), batch_size, precision)
    mask = torch.ones(ll.shape[1:])
    exp_ppl = mx.expert_perplexities(ll, mask)
    best = mx.naive_expert(ll, own, mask)
    nll, tokens = block_sums(ll[best], mask)
    return {"expert_ppl": dict(zip(train_domains, exp_ppl)), "naive_expert": train_domains[best],
            "ppl": {"ppl": exp_ppl[best]}, "block_nll": {"ppl": nll}, "block_tokens": tokens}


def _mean(values: list[float]) -> Optional[float]:
    return float(np.mean(values)) if values else None


def _demix_domain(ll_EBT, mask_BT, own, experts, modes, cached_prior, topk, decay,
                  posterior: str = "prefix") -> dict[str, Any]:
    """Every mode's perplexity and the posterior statistics of one test domain."""
    E = ll_EBT.shape[0]
    uniform = mx.uniform_log_prior(E)
    exp_ppl = mx.expert_perplexities(ll_EBT, mask_BT)
    naive = mx.naive_expert(ll_EBT, own, mask_BT)
    upd = mx.updating_priors(ll_EBT, mask_BT, decay, posterior=posterior)
    res: dict[str, Any] = {
        "expert_ppl": dict(zip(experts, exp_ppl)), "naive_expert": experts[naive], "ppl": {},
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
                res["topk"] = {"k": min(topk, E), "experts": [experts[j] for j in top.experts],
                               "experts_evaluated": top.experts_evaluated, "of": E}
        else:
            raise ValueError(f"mode {mode!r}: choose from {', '.join(DEMIX_MODES)}")
        res["ppl"][mode] = mx.perplexity(lp, mask_BT)
        res.setdefault("block_nll", {})[mode], res["block_tokens"] = block_sums(lp, mask_BT)
    if cached_prior is not None:
        res["cached_prior"] = {"probs": dict(zip(cached_prior.domains, cached_prior.probs)),
                               "blocks": cached_prior.blocks, "estimator": cached_prior.estimator,
                               "posterior": cached_prior.posterior}
    return res


def evaluate_model(
    model: torch.nn.Module, cfg: Any, train_domains: Sequence[str], data_root: Union[str, Path], *,
    tokenizer: Optional[str] = None, split: str = "test", dev_split: str = "valid", max_blocks: Optional[int] = None,
    modes: Sequence[str] = DEMIX_MODES, domains: Optional[Sequence[str]] = None, batch_size: int = 4,
    cached_blocks: int = mx.CACHED_PRIOR_BLOCKS, decay: float = mx.UPDATING_DECAY, topk: int = 2,
    seq_len: Optional[int] = None, out_dir: Optional[Union[str, Path]] = None, progress: bool = True,
    extra: Optional[dict[str, Any]] = None, cached_priors: Optional[dict[str, mx.CachedPrior]] = None,
    posterior: str = "prefix", cached_estimator: str = "mean", unigram: bool = True, precision: str = "fp32",
) -> dict[str, Any]:
    """Evaluate an in-memory model (all experts held) on every domain of the prepared data, on the model's device in
    `precision` (fp32, or bf16/fp16 autocast over fp32 weights: `forward_precision`). `cached_priors` maps a
    domain to a prior to use instead of estimating one on `dev_split`. Returns

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
         "files": {"json", "markdown", "posteriors", "specialisation"}  (when out_dir is given)}
    """
    if posterior not in mx.POSTERIORS or cached_estimator not in mx.CACHED_ESTIMATORS:
        raise ValueError(f"posterior={posterior!r} / cached_estimator={cached_estimator!r}: choose from "
                         f"{', '.join(mx.POSTERIORS)} / {', '.join(mx.CACHED_ESTIMATORS)}")
    precision = normalise_precision(precision)
    t0 = time.perf_counter()
    tokenizer = tokenizer or cfg.data.tokenizer
    seq_len = seq_len or cfg.model.seq_len
    if seq_len > cfg.model.seq_len:
        raise ValueError(f"seq_len={seq_len} is beyond the model's context ({cfg.model.seq_len} tokens)")
    manifest = data_manifest(data_root, tokenizer, extra.get("tokenizer_sha256") if extra else None,
                             (extra or {}).get("vocab_size"))
    all_domains = list(domains) if domains is not None else list(manifest["domains"])
    is_demix = bool(demix_expert_ids(model))
    domain_token = cfg.data.mixture == "domain_token"
    experts = list(train_domains) if is_demix else []
    if is_demix and len(experts) != len(demix_expert_ids(model)):
        raise ValueError(f"{len(experts)} domain names for {len(demix_expert_ids(model))} experts")
    modes = [m for m in modes if m in DEMIX_MODES] if is_demix else ["ppl"]
    model.eval()
    estimated: dict[str, Any] = {}  # domain -> the cached prior estimated here, saved with the report
    results: dict[str, Any] = {
        "format": EVAL_FORMAT, "kind": cfg.model.ffn.kind, "data_mixture": cfg.data.mixture, "experts": experts,
        "train_domains": list(train_domains), "split": split, "dev_split": dev_split, "seq_len": seq_len,
        "max_blocks": max_blocks, "modes": modes, "decay": decay, "cached_blocks": cached_blocks, "topk": topk,
        "posterior": posterior, "cached_estimator": cached_estimator,
        "device": str(next(model.parameters()).device), "precision": precision,
        **(extra or {}), "domains": {},
    }
    for dom in all_domains:
        role = "train" if dom in train_domains else "novel"
        own = list(train_domains).index(dom) if role == "train" else None
        blocks = load_blocks(data_root, tokenizer, dom, split, seq_len, max_blocks)
        if not len(blocks):
            _say(progress, f"[eval] {dom}/{split}: no blocks of {seq_len}+1 tokens, skipped")
            continue
        _say(progress, f"[eval] {dom} ({role}): {len(blocks)} blocks")
        tokens, targets, mask = block_inputs(blocks)
        entry: dict[str, Any] = {"role": role, "blocks": int(len(blocks)), "tokens": int(mask.sum())}
        if unigram:
            try:
                entry["unigram"] = domain_unigram(data_root, tokenizer, dom, seq_len,
                                                  int(manifest["tokenizer"]["vocab_size"]), targets, mask, dev_split)
            except ValueError as e:
                _say(progress, f"[eval] {dom}: no unigram baseline ({e})")
        if is_demix:
            ll = stream_log_likelihoods(model, tokens, targets, None, batch_size, precision)
            cached = None
            if cached_priors and dom in cached_priors:  # given (e.g. loaded with CachedPrior.load): not re-estimated
                cached = cached_priors[dom]
            elif any(m in modes for m in ("cached", "topk")):
                dev = load_blocks(data_root, tokenizer, dom, dev_split, seq_len, cached_blocks)
                cached, variants = _cached_prior(model, dev, experts, cached_blocks, decay, batch_size,
                                                 cached_estimator, posterior, precision)
                if variants:
                    entry["cached_prior_variants"] = variants
                if cached is not None and out_dir is not None and _dist()[0] == 0:
                    estimated[dom] = cached  # written with the report (write_outputs), not into --out midway
            entry.update(_demix_domain(ll, mask, own, experts, modes, cached, topk, decay, posterior))
        elif domain_token:
            base = int(manifest["tokenizer"]["vocab_size"])
            entry.update(_domain_token_entry(model, blocks, base, list(train_domains), own, batch_size, precision))
        else:
            ll = stream_log_likelihoods(model, tokens, targets, None, batch_size, precision)
            entry["ppl"] = {"ppl": mx.perplexity(ll[0], mask)}
            nll, entry["block_tokens"] = block_sums(ll[0], mask)
            entry["block_nll"] = {"ppl": nll}
        results["domains"][dom] = entry
    if not results["domains"]:
        raise ValueError(f"no domain of {all_domains} has a {split} block of {seq_len}+1 tokens in {data_root}/"
                         f"{tokenizer}: the evaluation has no rows")
    results["tables"] = summary_tables(results)
    results["seconds"] = round(time.perf_counter() - t0, 3)
    if out_dir is not None and _dist()[0] == 0:
        results["files"] = write_outputs(results, out_dir, estimated)
    return results


def evaluate_checkpoint(
    ckpt: Union[str, Path, Consolidated], data_root: Union[str, Path], exclude_experts: Sequence[str] = (),
    device: Union[str, torch.device] = "auto", precision: str = "auto", **kwargs: Any,
) -> dict[str, Any]:
    """Load a consolidated checkpoint (all experts, one process) and run `evaluate_model` on it (same keyword
    arguments: tokenizer, split, dev_split, max_blocks, modes, domains, batch_size, cached_blocks, decay, topk,
    posterior, cached_estimator, seq_len, out_dir, progress, cached_priors). Returns the result dict documented
    there, plus "checkpoint", "step" and "excluded_experts".

    `device` (auto|cpu|cuda or a torch.device, `resolve_eval_device`) and `precision` (auto|fp32|bf16|fp16,
    `resolve_eval_precision` against the checkpoint's train.precision): on a CPU machine the defaults are the CPU
    in fp32, the numbers this function always gave; on a GPU, the GPU in the training precision.

    `exclude_experts` (opt-out): the model is built without those DEMix experts, their weights never read; every
    mode mixes the remaining experts only and an excluded expert's domain is evaluated as a novel domain - the
    same numbers, bit for bit, as evaluating a checkpoint saved without them (`experts remove`)."""
    dev = device if isinstance(device, torch.device) else resolve_eval_device(device)  # before loading anything
    if exclude_experts:  # opt-out: the excluded experts' weights are never read (launcher/modular/surgery.py)
        from launcher.modular.surgery import load_without

        c = load_without(ckpt, exclude_experts)
    else:
        c = ckpt if isinstance(ckpt, Consolidated) else load_consolidated(ckpt)
    extra = {"checkpoint": None if isinstance(ckpt, Consolidated) else str(ckpt), "step": c.step,
             "tokenizer_sha256": c.meta.get("tokenizer_sha256"), "vocab_size": c.meta.get("vocab_size"),
             "excluded_experts": list(exclude_experts)}
    prec = resolve_eval_precision(precision, c.cfg.train.precision, dev)
    if precision == "auto" and prec != normalise_precision(c.cfg.train.precision):
        _say(kwargs.get("progress", True), f"[eval] trained in {c.cfg.train.precision}, evaluated in {prec} on {dev}")
    return evaluate_model(c.build_model().to(dev), c.cfg, c.domains, data_root, extra=extra, precision=prec, **kwargs)


def summary_tables(results: dict[str, Any]) -> dict[str, Any]:
    """Table 3 (mean over training domains), Table 4 (per domain), Table 5 (mean over novel domains), each with
    95 % bootstrap intervals over blocks (launcher/evaluation/stats.py) where the per-block NLLs were recorded."""
    doms = results["domains"]
    per_domain = {d: r["ppl"] for d, r in doms.items()}
    avg, avg_ci = {}, {}
    for role in ("train", "novel"):
        avg[role] = {m: _mean([r["ppl"][m] for r in doms.values() if r["role"] == role and m in r["ppl"]])
                     for m in results["modes"]}
        avg_ci[role] = {}
        for m in results["modes"]:
            blocks = [(r["block_nll"][m], r["block_tokens"]) for r in doms.values()
                      if r["role"] == role and m in r.get("block_nll", {})]
            if blocks:
                avg_ci[role][m] = list(bootstrap_mean_ppl(blocks)[1:])
    per_domain_ci = {d: {m: list(bootstrap_ppl(nll, r["block_tokens"])[1:]) for m, nll in r.get("block_nll", {}).items()}
                     for d, r in doms.items()}
    unigram = {role: _mean([r["unigram"]["ppl"] for r in doms.values() if r["role"] == role and "unigram" in r])
               for role in ("train", "novel")}
    return {"in_domain_average": avg["train"], "novel_average": avg["novel"], "per_domain": per_domain,
            "unigram_in_domain_average": unigram["train"], "unigram_novel_average": unigram["novel"],
            "in_domain_average_ci": avg_ci["train"], "novel_average_ci": avg_ci["novel"],
            "per_domain_ci": per_domain_ci}


def _fmt(v: Optional[float]) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:.2f}"


def markdown_report(results: dict[str, Any]) -> str:
    """The paper's tables as markdown (modes as rows)."""
    modes, doms, t = results["modes"], results["domains"], results["tables"]
    label = (lambda m: f"DEMix ({m})") if results["experts"] else (lambda m: results["kind"] + (
        " +Domain-Token" if results["data_mixture"] == "domain_token" else ""))
    lines = [f"# Evaluation ({results['split']} split, {results['seq_len']}-token blocks"
             + (f", at most {results['max_blocks']} blocks per domain" if results["max_blocks"] else "") + ")", ""]
    if results.get("checkpoint"):
        lines += [f"checkpoint: `{results['checkpoint']}` (step {results.get('step')})", ""]
    if results.get("precision", "fp32") != "fp32" or results.get("device", "cpu") != "cpu":
        lines += [f"device: {results.get('device', 'cpu')}; precision: {results.get('precision', 'fp32')}"
                  + (" (autocast: matmuls in half precision, log-likelihoods and sums in fp32)"
                     if results.get("precision", "fp32") != "fp32" else ""), ""]
    if results["experts"]:
        lines += [f"posterior: {results.get('posterior', 'prefix')} (evidence of every posterior); cached prior: "
                  f"{results.get('cached_estimator', 'updating')} over {results['cached_blocks']} "
                  f"{results['dev_split']} blocks; updating prior λ = {results['decay']}", ""]
    lines += ["## In-domain average perplexity (cf. Table 3)", "", "| model | avg ppl | 95% interval (blocks) |",
              "|---|---|---|"]
    ci = t.get("in_domain_average_ci", {})
    lines += [f"| {label(m)} | {_fmt(t['in_domain_average'][m])} | "
              + (f"{_fmt(ci[m][0])} – {_fmt(ci[m][1])}" if m in ci else "–") + " |" for m in modes]
    for role, title in (("train", "Training domains (cf. Table 4)"), ("novel", "Novel domains")):
        names = [d for d, r in doms.items() if r["role"] == role]
        if not names:
            continue
        lines += ["", f"## {title}", "", "| model | " + " | ".join(names) + " | avg |", "|---" * (len(names) + 2) + "|"]
        for m in modes:
            cells = [_fmt(doms[d]["ppl"].get(m)) for d in names]
            avg = t["in_domain_average" if role == "train" else "novel_average"][m]
            lines.append(f"| {label(m)} | " + " | ".join(cells) + f" | {_fmt(avg)} |")
        if any("unigram" in doms[d] for d in names):
            uni = t.get("unigram_in_domain_average" if role == "train" else "unigram_novel_average")
            lines.append("| unigram (own train split) | " + " | ".join(
                _fmt(doms[d]["unigram"]["ppl"]) if "unigram" in doms[d] else "–" for d in names) + f" | {_fmt(uni)} |")
    lines += ["", "## Novel-domain average perplexity (cf. Table 5)", "", "| model | avg ppl |", "|---|---|"]
    lines += [f"| {label(m)} | {_fmt(t['novel_average'][m])} |" for m in modes]
    naive = {d: r["naive_expert"] for d, r in doms.items() if "naive_expert" in r}
    if naive:
        lines += ["", "naive expert per domain (own expert in-domain, best single expert on novel domains): "
                  + ", ".join(f"{d} -> {e}" for d, e in naive.items())]
    tk = {d: r["topk"] for d, r in doms.items() if "topk" in r}
    if tk:
        k = next(iter(tk.values()))
        lines += [f"top-k: k = {k['k']} of {k['of']} experts evaluated per token (chosen by the cached prior): "
                  + ", ".join(f"{d} -> {'+'.join(v['experts'])}" for d, v in tk.items())]
    return "\n".join(lines) + "\n"


def write_outputs(results: dict[str, Any], out_dir: Union[str, Path],
                  cached_priors: Optional[dict[str, Any]] = None) -> dict[str, str]:
    """Write the report into `out_dir` (eval.json, eval.md, the figures, `cached_priors/<domain>.json` for each
    estimated prior); returns {name: path}. Staged and published together (data/atomic.py `staged_dir`): a failure
    (a full disk included) leaves no report without its eval.json."""
    from launcher.evaluation.figures import write_figures

    out_dir = Path(out_dir)
    with staged_dir(out_dir, manifest="eval.json") as tmp:
        for dom, prior in (cached_priors or {}).items():
            prior.save(tmp / "cached_priors" / f"{dom}.json")
        files = {"json": str(out_dir / "eval.json"), "markdown": str(out_dir / "eval.md")}
        files.update({k: str(out_dir / Path(v).relative_to(tmp)) for k, v in write_figures(results, tmp).items()})
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
    ap.add_argument("--data", default="artifacts/demo/tokens", help="prepared tokens root (data.prepare)")
    ap.add_argument("--tokenizer", help="tokenizer subdirectory (default: the checkpoint's data.tokenizer)")
    ap.add_argument("--split", default="test")
    ap.add_argument("--dev-split", default="valid", help="split the cached prior is estimated on")
    ap.add_argument("--max-blocks", type=positive_int, help="at most N blocks per domain")
    ap.add_argument("--modes", default=",".join(DEMIX_MODES), help="comma-separated subset of " + ",".join(DEMIX_MODES))
    ap.add_argument("--domains", help="comma-separated domains (default: all in the data manifest)")
    ap.add_argument("--cached-blocks", type=positive_int, default=mx.CACHED_PRIOR_BLOCKS)
    ap.add_argument("--decay", type=unit_left_open, default=mx.UPDATING_DECAY,
                    help="λ of the updating prior (eq. 9), in (0, 1]")
    ap.add_argument("--topk", type=positive_int, default=2)
    ap.add_argument("--posterior", choices=mx.POSTERIORS, default="prefix",
                    help="evidence of every posterior: the whole prefix (eqs. 7-8) or the previous token (reference code)")
    ap.add_argument("--cached-estimator", choices=mx.CACHED_ESTIMATORS, default="mean",
                    help="cached prior: mean of the dev posteriors (paper), ewm (reference code, α=0.3) or eq. 9")
    ap.add_argument("--batch-size", type=positive_int, default=4, help="blocks per batched pass (x E sequences)")
    ap.add_argument("--seq-len", type=positive_int, help="block length (default and most: the model's context)")
    ap.add_argument("--allow-missing", action="store_true",
                    help="skip (with a note) domains with no block in --split instead of refusing the evaluation")
    ap.add_argument("--out", default=None, help="output directory (default: CKPT_DIR/eval, with --exclude-experts "
                    "CKPT_DIR/eval-without-<names>)")
    ap.add_argument("--exclude-experts", default="",
                    help="comma-separated DEMix experts to opt out: never read, no part in any output")
    ap.add_argument("--device", choices=EVAL_DEVICES, default="auto",
                    help="auto: this rank's GPU (cuda:LOCAL_RANK) where CUDA is available, else the CPU")
    ap.add_argument("--precision", choices=EVAL_PRECISIONS, default="auto",
                    help="auto: the checkpoint's train.precision on a GPU that has it (bf16/fp16 as autocast), fp32 "
                         "on the CPU")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in DEMIX_MODES]
    if bad:
        ap.error(f"unknown modes {bad}; choose from {', '.join(DEMIX_MODES)}")
    resolve_eval_device(args.device)  # e.g. --device cuda without CUDA: refused before anything is read
    check_checkpoint_data(args.checkpoint, args.data, args.tokenizer)  # before loading any tensor
    check_eval_request(args.checkpoint, args.data, args.tokenizer, args.split,
                       args.domains.split(",") if args.domains else None, args.seq_len, args.allow_missing)
    exclude = [e.strip() for e in args.exclude_experts.split(",") if e.strip()]
    default_out = Path(args.checkpoint) / ("eval-without-" + "-".join(exclude) if exclude else "eval")
    check_output_dir(Path(args.out or default_out), [EVAL_FORMAT], EVAL_FILES, inputs=[Path(args.data)],
                     manifest="eval.json", what="--out")  # a user's eval.md is not replaced
    device = _join_ranks(args.device)
    res = evaluate_checkpoint(
        args.checkpoint, args.data, tokenizer=args.tokenizer, split=args.split, dev_split=args.dev_split,
        max_blocks=args.max_blocks, modes=modes, domains=args.domains.split(",") if args.domains else None,
        batch_size=args.batch_size, cached_blocks=args.cached_blocks, decay=args.decay, topk=args.topk,
        posterior=args.posterior, cached_estimator=args.cached_estimator,
        seq_len=args.seq_len, out_dir=args.out or str(default_out), exclude_experts=exclude,
        device=device, precision=args.precision,
    )
    if _dist()[0] == 0:
        print(markdown_report(res))
        print("\n".join(f"{k}: {v}" for k, v in res.get("files", {}).items()))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_process(main())
