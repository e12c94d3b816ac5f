"""Per-domain test perplexity of a consolidated checkpoint, with inference-time expert mixing (DEMix §4-5).

    python -m launcher.evaluation.evaluate CKPT_DIR [--data DIR] [--tokenizer NAME] [--split test]
        [--max-blocks N] [--modes naive,average,uniform,updating,cached,topk,router,router_posterior] [--topk 2]
        [--router-temperature 0.1] [--out DIR] [--device auto|cpu|cuda] [--precision auto|fp32|bf16|fp16]
        [--no-prior-cache] [--quiet]
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
* router   - data-free mixing with the experts' router vectors (meta.json "router_vectors", launcher/router_vectors.py;
  model/mixture.py router eqs. R1-R3): at each token, the softmax over experts of the cosine, centred on the mean
  of the present experts' vectors, between the mean first-expert-layer input of the block so far and each
  expert's vector, over `--router-temperature` τ (0.1). No dev data, no uniform start.
* router_posterior - the posterior mixture (eqs. 6-8, `--posterior`) with the router weights as the prior at
  each token (router eq. R4).

By default (no --modes) every mode runs, the router modes only when the checkpoint has a router vector for every
expert evaluated (a note says why not otherwise); a router mode asked for with --modes without them is refused,
naming the experts without a vector, before any tensor is read.

Dense / GShard / CSE checkpoints get one number per domain (mode `ppl`). +Domain-Token checkpoints
(`data.mixture = domain_token`) read blocks as the sampler does ([t_d] + x[:T-1] -> x[:T], the domain token is
never a target); training domains use their own token, novel domains the best token (DEMix §5.3).

Perplexity is exp(mean NLL over the scored tokens of a domain); averages over domains are plain means of the
per-domain perplexities, as in the paper's Tables 3 and 5. With several ranks, rank r scores blocks r, r+W, ...;
the E x N x T log-likelihoods are summed over ranks (all_reduce) so every mode sees the whole stream in order; so
are the router weights, which each rank computes from the features of its own blocks (a block's weights read
that block only).

Outputs under --out: eval.json (schema: `EVAL_SCHEMA` in launcher/evaluation/results.py), eval.md (Tables 3/4/5),
cached_priors/<domain>.json, posteriors.png (Figure 4) and specialisation.png (Figure 2).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from data.argtypes import positive_float, positive_int, unit_left_open
from data.catalog import read_token_manifest
from data.cli import check_output_dir, cli_main, exit_process
from launcher.checkpoint import CheckpointError, Consolidated, load_consolidated, read_meta
from launcher.checkpoint_data import checkpoint_data, load_blocks
from launcher.evaluation.device import (
    EVAL_DEVICES,
    EVAL_PRECISIONS,
    join_ranks,
    rank_and_world,
    resolve_eval_device,
    resolve_eval_precision,
    say,
)
from launcher.evaluation.model_evaluation import evaluate_model
from launcher.evaluation.prior_cache import PRIOR_CACHE_DIR, PriorCache
from launcher.evaluation.report import EVAL_FILES, markdown_report
from launcher.evaluation.results import DEMIX_MODES, EVAL_FORMAT, ROUTER_MODES, EvalOptions, EvalResult
from launcher.expert_surgery import load_without
from launcher.ffn_kinds import ffn_kind
from launcher.router_vectors import router_entry, router_matrix
from model import mixture as mx
from model.accounting import normalise_precision


def check_eval_request(
    checkpoint: str | Path,
    data_root: str | Path,
    tokenizer: str | None,
    split: str,
    domains: Sequence[str] | None,
    seq_len: int | None,
    allow_missing: bool = False,
    modes: Sequence[str] | None = None,
    exclude_experts: Sequence[str] = (),
) -> None:
    """Refuse (ValueError), before a tensor is read, an evaluation whose tables would be nonsense: blocks longer than
    the model's context, a domain that is not in the data, a domain with no block in `split` (unless
    `allow_missing`: it is skipped with a note, its row left out), a table with no rows at all, and a router mode
    in `modes` for a DEMix checkpoint without a router vector for every expert not in `exclude_experts`."""
    meta = read_meta(checkpoint)
    if ffn_kind(meta["config"]["model"]["ffn"]["kind"]).domain_experts:
        kept = [d for d in meta["domains"] if d not in set(exclude_experts)]
        _router_vectors(meta, kept, int(meta["config"]["model"]["d_model"]), modes, progress=False)
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


def evaluate_checkpoint(
    ckpt: str | Path | Consolidated,
    data_root: str | Path,
    exclude_experts: Sequence[str] = (),
    device: str | torch.device = "auto",
    precision: str = "auto",
    prior_cache: bool | str | Path | PriorCache | None = None,
    options: EvalOptions | None = None,
    cached_priors: dict[str, mx.CachedPrior] | None = None,
    **option_fields: Any,
) -> EvalResult:
    """Load a consolidated checkpoint (all experts, one process) and run `evaluate_model` on it, with `options`
    or the `EvalOptions` fields given as keywords (tokenizer, split, dev_split, max_blocks, modes, domains,
    batch_size, cached_blocks, decay, topk, posterior, cached_estimator, router_temperature, seq_len, out_dir,
    progress, unigram) and `cached_priors`. The result's `extra` holds "checkpoint", "step" and
    "excluded_experts" (`to_dict()`: the dict of `EVAL_SCHEMA`).

    `device` (auto|cpu|cuda or a torch.device, `resolve_eval_device`) and `precision` (auto|fp32|bf16|fp16,
    `resolve_eval_precision` against the checkpoint's train.precision): on a CPU machine the defaults are the CPU
    in fp32, the numbers this function always gave; on a GPU, the GPU in the training precision.

    `exclude_experts` (opt-out): the model is built without those DEMix experts, their weights never read; every
    mode mixes the remaining experts only and an excluded expert's domain is evaluated as a novel domain - the
    same numbers, bit for bit, as evaluating a checkpoint saved without them (`experts remove`). The router modes
    read the remaining experts' router vectors only, and centre on their mean.

    Router vectors: from the checkpoint's meta.json "router_vectors" (launcher/router_vectors.py). A router mode
    in `modes` without a vector for every remaining expert: CheckpointError naming them, before any block pass;
    by default (`modes` None) the router modes run exactly when the vectors are all there.

    `prior_cache`: True keeps the cached priors in CKPT_DIR/eval_prior_cache (launcher/evaluation/prior_cache.py,
    keyed by the checkpoint's recorded shard sums, the data and the prior's settings) and reuses them; a path, that
    directory; None/False, none (the priors are scored every time). Only for a checkpoint given by its path."""
    options = replace(options or EvalOptions(), **option_fields)
    # before loading anything
    dev = device if isinstance(device, torch.device) else resolve_eval_device(device)
    if prior_cache not in (None, False) and not isinstance(prior_cache, PriorCache):
        if isinstance(ckpt, Consolidated):
            raise ValueError(
                "prior_cache needs the checkpoint's path (an in-memory checkpoint has no recorded sums)"
            )
        prior_cache = PriorCache.beside(ckpt, exclude_experts, None if prior_cache is True else prior_cache)
    if exclude_experts:  # opt-out: the excluded experts' weights are never read (launcher/expert_surgery.py)
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
    router = None
    if ffn_kind(c.cfg).domain_experts:
        router = _router_vectors(c.meta, c.domains, c.cfg.model.d_model, options.modes, options.progress)
    prec = resolve_eval_precision(precision, c.cfg.train.precision, dev)
    if precision == "auto" and prec != normalise_precision(c.cfg.train.precision):
        say(options.progress, f"[eval] trained in {c.cfg.train.precision}, evaluated in {prec} on {dev}")
    return evaluate_model(
        c.build_model().to(dev),
        c.cfg,
        c.domains,
        data_root,
        replace(options, precision=prec),
        extra=extra,
        cached_priors=cached_priors,
        prior_cache=prior_cache or None,
        router_vectors=router,
    )


def _router_vectors(
    meta: dict[str, Any], domains: Sequence[str], d_model: int, modes: Sequence[str] | None, progress: bool
) -> torch.Tensor | None:
    """The router vectors (E x D) of the experts `domains` for an evaluation of `modes`: with a router mode asked
    for, `router_matrix` (its CheckpointError names what is missing); by default (`modes` None) the same, or None
    - with a note when the checkpoint has router vectors that cannot be used; None when no router mode runs."""
    asked = modes is not None and any(m in ROUTER_MODES for m in modes)
    if modes is not None and not asked:
        return None
    if not asked and router_entry(meta) is None:
        return None
    try:
        return router_matrix(meta, domains, d_model)
    except CheckpointError as err:
        if asked:
            raise CheckpointError(
                f"--modes {','.join(m for m in modes if m in ROUTER_MODES)}: {err}"
            ) from None
        say(progress, f"[eval] no router modes: {err}")
        return None


def parser() -> argparse.ArgumentParser:
    """The command line of `python -m launcher.evaluation.evaluate`."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _data_arguments(ap)
    _mode_arguments(ap)
    _run_arguments(ap)
    return ap


def _data_arguments(ap: argparse.ArgumentParser) -> None:
    """The checkpoint, the data, the splits."""
    ap.add_argument("checkpoint", help="consolidated checkpoint directory (meta.json + model.pt)")
    ap.add_argument("--data", help="prepared tokens root (data.prepare; default: the checkpoint's data.path)")
    ap.add_argument("--tokenizer", help="tokenizer subdirectory (default: the checkpoint's data.tokenizer)")
    ap.add_argument("--split", default="test")
    ap.add_argument("--dev-split", default="valid", help="split the cached prior is estimated on")
    ap.add_argument("--max-blocks", type=positive_int, help="at most N blocks per domain")


def _mode_arguments(ap: argparse.ArgumentParser) -> None:
    """Modes, domains and the priors (DEMix §5.1)."""
    ap.add_argument(
        "--modes",
        default=None,
        help="comma-separated subset of " + ",".join(DEMIX_MODES) + " (default: all; the router modes when "
        "the checkpoint has router vectors for every expert)",
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
        "--router-temperature",
        type=positive_float,
        default=mx.ROUTER_TEMPERATURE,
        help="τ of the router modes: softmax over experts of the centred cosines / τ (router eq. R3)",
    )
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


def _run_arguments(ap: argparse.ArgumentParser) -> None:
    """The batched pass, the output, the opt-out, device and precision, the prior cache, progress."""
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


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    """`python -m launcher.evaluation.evaluate CKPT_DIR ...`: check the request, evaluate, print the tables."""
    ap = parser()
    args = ap.parse_args(argv)
    modes = None if args.modes is None else [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes or () if m not in DEMIX_MODES]
    if bad:
        ap.error(f"unknown modes {bad}; choose from {', '.join(DEMIX_MODES)}")
    resolve_eval_device(args.device)  # e.g. --device cuda without CUDA: refused before anything is read
    data, tokenizer = checkpoint_data(args.checkpoint, args.data, args.tokenizer)  # before loading any tensor
    exclude = [e.strip() for e in args.exclude_experts.split(",") if e.strip()]
    check_eval_request(
        args.checkpoint,
        data,
        tokenizer,
        args.split,
        args.domains.split(",") if args.domains else None,
        args.seq_len,
        args.allow_missing,
        modes,
        exclude,
    )
    default_out = Path(args.checkpoint) / ("eval-without-" + "-".join(exclude) if exclude else "eval")
    # a user's eval.md is not replaced
    check_output_dir(
        Path(args.out or default_out),
        [EVAL_FORMAT],
        EVAL_FILES,
        inputs=[Path(data)],
        manifest="eval.json",
        what="--out",
    )
    device = join_ranks(args.device)
    say(
        not args.quiet,
        f"[eval] {args.checkpoint} on {data}/{tokenizer}"
        + ("" if args.data else " (the checkpoint's recorded data.path; --data DIR for another)"),
    )
    res = evaluate_checkpoint(
        args.checkpoint,
        data,
        exclude_experts=exclude,
        device=device,
        precision=args.precision,
        prior_cache=False if args.no_prior_cache else (args.prior_cache or True),
        options=_options(args, modes, tokenizer, args.out or str(default_out)),
    )
    if rank_and_world()[0] == 0:
        print(markdown_report(res.to_dict()))
        print("\n".join(f"{k}: {v}" for k, v in (res.files or {}).items()))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


def _options(args: argparse.Namespace, modes: list[str] | None, tokenizer: str, out_dir: str) -> EvalOptions:
    return EvalOptions(
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
        router_temperature=args.router_temperature,
        seq_len=args.seq_len,
        out_dir=out_dir,
        progress=not args.quiet,
    )


if __name__ == "__main__":
    exit_process(main())
