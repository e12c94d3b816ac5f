"""Text generation from a consolidated checkpoint, with one chosen expert or the expert mixture (DEMix §5).

    python -m launcher.evaluation.generate CKPT_DIR --prompt "The patient" --expert biomed [--max-new-tokens 50]
    python -m launcher.evaluation.generate CKPT_DIR --prompt "The patient" --mixture [--prior uniform|PATH.json]
        [--temperature 1.0] [--top-k 0] [--top-p 1.0] [--seed 0] [--data DIR] [--tokenizer NAME]

The tokenizer is the checkpoint's own: from the data.path and data.tokenizer its run config recorded (evaluate's
`checkpoint_data`), unless --data/--tokenizer say otherwise; GPT-2 needs no data.

Shape legend: E experts, V vocabulary.

--expert NAME routes every DEMix layer to that domain's expert (eq. 5); on a +Domain-Token checkpoint it prepends
that domain's token instead. --mixture samples from eq. 6 with the posterior (eqs. 7-8) updated as tokens are
generated:

    log g_j(t)   = log p(D = j) + sum_{s < t} log p(x_s | x_<s, D = j)  - normaliser      (prompt included)
    log p(x | .) = logsumexp_j [ log p(x | x_<t, D = j) + log g_j(t) ]

with a uniform prior by default or a cached prior file (model/mixture.py CachedPrior). All experts' next-token
distributions come from one batched pass (model/batched.py); there is no KV cache (the whole window is recomputed
each step: fine for the small models this is for). When the text outgrows the context the model sees the last
seq_len tokens; the posterior scores the prompt's last seq_len + 1 tokens and then every generated token.
Sampling: temperature (0 = greedy), then top-k, then top-p (nucleus) on the mixture distribution; a seeded
torch.Generator makes the output a function of the seed.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from data.argtypes import nonneg_float, nonneg_int, positive_int, random_seed, unit_left_open
from data.cli import cli_main, exit_process
from launcher.checkpoint import load_consolidated, read_meta
from launcher.checkpoint_data import checkpoint_data
from model import mixture as mx
from model.batched import demix_expert_ids, expert_log_likelihoods, next_token_log_probs


@dataclass
class Generation:
    prompt_ids: list[int]
    new_ids: list[int]
    posteriors: list[list[float]] = field(default_factory=list)  # mixture only: g(t) before each new token, E


def sample_token(
    logp_V: torch.Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator
) -> int:
    """One token from log-probabilities: greedy at temperature 0, else tempered, top-k and nucleus filtered."""
    if temperature <= 0:
        return int(torch.argmax(logp_V))
    logits = logp_V.double() / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        probs_sorted, order = torch.sort(torch.softmax(logits, -1), descending=True)
        # keep the smallest prefix reaching top_p
        drop = torch.cumsum(probs_sorted, -1) - probs_sorted >= top_p
        logits[order[drop]] = float("-inf")
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt_ids: Sequence[int],
    *,
    expert: int | None = None,
    mixture: bool = False,
    log_prior: torch.Tensor | None = None,
    max_new_tokens: int = 50,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_id: int | None = None,
    prefix_ids: Sequence[int] = (),
    vocab_limit: int | None = None,
) -> Generation:
    """Sample `max_new_tokens` after `prompt_ids`. DEMix: `expert` (global id) or `mixture=True`; dense: neither.
    `prefix_ids` (e.g. a domain token) precede the prompt in the model's input but are not part of the output.
    Only ids below `vocab_limit` (default the config's vocab_size: never a padding id) are sampled."""
    experts = demix_expert_ids(model)
    if experts and (expert is None) == (not mixture):
        raise ValueError("a DEMix model needs exactly one of expert=ID or mixture=True")
    if not experts and (expert is not None or mixture):
        raise ValueError("this model has no experts: generate without expert or mixture")
    if not prompt_ids and not prefix_ids:
        raise ValueError("empty prompt: give at least one token (e.g. the beginning-of-document token)")
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    ids = list(prefix_ids) + list(prompt_ids)
    chosen = [expert] if expert is not None else (experts or None)
    out = Generation(list(prompt_ids), [])
    log_joint_E = None
    if mixture:
        E = len(experts)
        log_joint_E = (mx.uniform_log_prior(E) if log_prior is None else log_prior.double()).clone()
        if len(ids) > 1:
            x = torch.tensor([ids[-model.cfg.seq_len - 1 :]])
            log_joint_E += expert_log_likelihoods(model, x[:, :-1], x[:, 1:]).double().sum(dim=(1, 2))
    for _ in range(max_new_tokens):
        logp_EV = next_token_log_probs(model, torch.tensor([ids[-model.cfg.seq_len :]]), chosen)[:, 0]
        if mixture:
            log_g_E = torch.log_softmax(log_joint_E, 0)
            out.posteriors.append(log_g_E.exp().tolist())
            logp_V = torch.logsumexp(logp_EV.double() + log_g_E[:, None], dim=0)
        else:
            logp_V = logp_EV[0]
        tok = sample_token(logp_V[: vocab_limit or model.cfg.vocab_size], temperature, top_k, top_p, gen)
        if mixture:
            log_joint_E += logp_EV[:, tok].double()
        ids.append(tok)
        out.new_ids.append(tok)
        if stop_id is not None and tok == stop_id:
            break
    return out


def checkpoint_tokenizer(
    checkpoint: str | Path, data: str | None = None, tokenizer: str | None = None
) -> Any:
    """The tokenizer to generate with: from the data given, else from the data and tokenizer the checkpoint's run
    config recorded (evaluate's `checkpoint_data`, the rule every tool follows), checked against its fingerprint;
    DataError naming the recorded path and --data when that data is missing. GPT-2 needs no data (offline files):
    without its prepared manifest it is loaded as is."""
    from data.tokenizer import load_prepared_tokenizer, load_tokenizer

    recorded = read_meta(checkpoint)["config"]["data"]
    name, root = tokenizer or recorded["tokenizer"], data if data is not None else recorded["path"]
    if name == "gpt2" and not (Path(root) / name / "manifest.json").is_file():
        return load_tokenizer("gpt2")
    root, name = checkpoint_data(checkpoint, data, tokenizer)
    return load_prepared_tokenizer(root, name)


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="consolidated checkpoint directory")
    ap.add_argument(
        "--prompt", default="", help="text to continue (a beginning-of-document token is prepended)"
    )
    who = ap.add_mutually_exclusive_group()
    who.add_argument("--expert", help="domain name of the expert (or domain token) to generate with")
    who.add_argument(
        "--mixture", action="store_true", help="mix all experts with the running domain posterior"
    )
    ap.add_argument("--prior", default="uniform", help="mixture prior: uniform or a cached prior JSON file")
    ap.add_argument("--max-new-tokens", type=positive_int, default=50)
    ap.add_argument("--temperature", type=nonneg_float, default=1.0, help="0: greedy")
    ap.add_argument("--top-k", type=nonneg_int, default=0, help="0: no top-k filter")
    ap.add_argument("--top-p", type=unit_left_open, default=1.0, help="nucleus mass in (0, 1]; 1: no filter")
    ap.add_argument("--seed", type=random_seed, default=0)
    ap.add_argument("--stop-at-eod", action="store_true", help="stop at the end-of-document token")
    ap.add_argument(
        "--data",
        help="prepared tokens root holding the tokenizer (default: the checkpoint's recorded "
        "data.path; GPT-2 needs none)",
    )
    ap.add_argument("--tokenizer", help="tokenizer subdirectory (default: the checkpoint's data.tokenizer)")
    ap.add_argument("--json", action="store_true", help="print a JSON record (ids, text, posteriors)")
    args = ap.parse_args(argv)
    # before the model
    prior = mx.CachedPrior.load(args.prior) if args.mixture and args.prior != "uniform" else None
    tok = checkpoint_tokenizer(args.checkpoint, args.data, args.tokenizer)  # before any tensor is read
    ckpt = load_consolidated(args.checkpoint)
    model = ckpt.build_model()
    is_demix = bool(demix_expert_ids(model))
    domain_token = ckpt.cfg.data.mixture == "domain_token"
    if args.expert is not None and args.expert not in ckpt.domains:
        ap.error(f"--expert {args.expert!r}: the checkpoint's domains are {ckpt.domains}")
    if is_demix and args.expert is None and not args.mixture:
        ap.error(f"a DEMix checkpoint needs --expert NAME (one of {ckpt.domains}) or --mixture")
    if args.mixture and not is_demix:
        ap.error("--mixture needs a DEMix checkpoint")
    log_prior = None
    if prior is not None:
        log_prior = prior.log_prior(ckpt.domains)
    expert = ckpt.domains.index(args.expert) if args.expert is not None else None
    prefix = [tok.domain_token_id(expert)] if domain_token and expert is not None else []
    res = generate(
        model,
        [tok.bos_id] + tok.encode(args.prompt),
        expert=expert if is_demix else None,
        mixture=args.mixture,
        log_prior=log_prior,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_id=tok.eod_id if args.stop_at_eod else None,
        prefix_ids=prefix,
        vocab_limit=tok.vocab_size,
    )
    text = tok.decode(res.new_ids)
    if args.json:
        print(
            json.dumps(
                {
                    "prompt": args.prompt,
                    "new_ids": res.new_ids,
                    "text": text,
                    "experts": ckpt.domains,
                    "posteriors": res.posteriors,
                },
                ensure_ascii=False,
            )
        )
    else:
        print(args.prompt + text)
        if res.posteriors:
            final = dict(zip(ckpt.domains, (round(p, 3) for p in res.posteriors[-1])))
            print(f"\n[posterior before the last token] {final}")
    return 0


if __name__ == "__main__":
    exit_process(main())
