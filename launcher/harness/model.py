"""The lm-eval model `demix`: a consolidated checkpoint (a DEMix mixture, one expert, or dense) scoring lm-eval's
requests with the project's own functions (docs/harness.md: token conventions, windows, which prior per document).
Importing this module registers it with lm_eval."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval's stock models, e.g. hf, registered lazily: as its CLI has them)
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from launcher.checkpoint import load_consolidated
from launcher.checkpoint_data import check_checkpoint_data, load_blocks, load_export_tokenizer
from launcher.evaluation.generate import generate
from launcher.evaluation.scoring import _cached_prior, stream_log_likelihoods
from launcher.expert_surgery import load_without
from launcher.harness.model_args import DemixArgs, parse_model_args, say
from launcher.harness.tasks import PPL_PREFIX
from launcher.harness.windows import Windows, document_windows, pack_windows
from model import mixture as mx
from model.batched import demix_expert_ids, expert_hidden_states


def _domain_of(req: Any) -> str | None:
    """A request's domain: its document's `domain` field, else `<d>` of a task named demix_ppl_<d>, else None."""
    doc = getattr(req, "doc", None)
    if isinstance(doc, Mapping) and doc.get("domain"):
        return str(doc["domain"])
    name = getattr(req, "task_name", None) or ""
    return name[len(PPL_PREFIX) :] if name.startswith(PPL_PREFIX) else None


@register_model("demix")
class DemixLM(LM):
    """A consolidated checkpoint (DEMix mixture, one expert, or dense) as an lm-eval model (docs/harness.md)."""

    def __init__(self, checkpoint: str, max_batch_size: Any = None, **model_args: Any) -> None:
        """`model_args` as `parse_model_args` takes them (lm-eval's --model_args plus its batch_size and device);
        lm-eval's max_batch_size is accepted and unused."""
        super().__init__()
        args = parse_model_args(checkpoint, **model_args)
        self.checkpoint, self.posterior, self.cached_estimator = (
            args.checkpoint,
            args.posterior,
            args.cached_estimator,
        )
        self.cached_blocks, self.decay, self.topk = args.cached_blocks, args.decay, args.topk
        self.windows, self.dev_split, self.max_gen_toks = args.windows, args.dev_split, args.max_gen_toks
        self.batch_size = args.batch_size
        self._device = torch.device("cpu")
        self._load(args)
        self._priors: dict[str | None, mx.CachedPrior | None] = {}

    def _load(self, args: DemixArgs) -> None:
        """The checkpoint (without the excluded experts, whose shards are never read), its tokenizer, and its
        prepared data's manifest (None without prepared data: then no cached priors)."""
        if args.exclude:  # opt-out: those experts' shards are never read
            c = load_without(args.checkpoint, args.exclude)
        else:
            c = load_consolidated(args.checkpoint)
        self.consolidated = c
        self.model = c.build_model().eval()
        self.seq_len = int(c.cfg.model.seq_len)
        self.tok = load_export_tokenizer(c, args.data)
        self.data = str(args.data if args.data is not None else c.cfg.data.path)
        self.prepared_tokenizer = str(c.meta.get("tokenizer", c.cfg.data.tokenizer))
        self.experts: list[str] = list(c.domains) if demix_expert_ids(self.model) else []
        self.expert = args.expert
        self.expert_ids = [self.experts.index(self.expert)] if self.expert is not None else None
        self.mode = ("expert" if self.expert else (args.mode or "cached")) if self.experts else "dense"
        try:
            self.manifest: dict[str, Any] | None = check_checkpoint_data(
                c, self.data, self.prepared_tokenizer
            )
        except (FileNotFoundError, ValueError) as e:  # e.g. gpt2 without prepared data: no cached priors
            self.manifest = None
            if self.mode == "cached":
                say(f"no prepared data for cached priors ({e}): every document uses the updating prior")

    # ---- lm-eval's interface --------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return int(self.tok.eod_id)

    @property
    def max_length(self) -> int:
        return self.seq_len

    @property
    def tokenizer_name(self) -> str:
        return f"{self.prepared_tokenizer}-{self.tok.vocab_size}"

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """log p(every token of tok.encode(text) | bos, preceding tokens), per request (docs/harness.md)."""
        out = [0.0] * len(requests)
        for (_, domain), idxs in self._streams(requests).items():
            wins, owner = [], []
            for i in idxs:
                for w in document_windows(
                    self.tok.encode(requests[i].args[0]), self.seq_len, self.tok.bos_id, self.windows
                ):
                    wins.append(w)
                    owner.append(i)
            if not wins:
                continue
            W = pack_windows(wins, owner, self.tok.eod_id)
            ll = self._ll(W.tokens_NT, W.targets_NT)
            lp, _ = self._mixture(ll, W, domain, rolling=True)
            per_window = (lp * W.score_NT.double()).sum(dim=1)
            for i, v in zip(W.owner, per_window.tolist()):
                out[i] += v
        return out

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(sum log p(continuation tokens | bos, context), is_greedy) per request (docs/harness.md)."""
        out: list[tuple[float, bool]] = [(0.0, True)] * len(requests)
        for (_, domain), idxs in self._streams(requests).items():
            wins, conts = [], []
            for i in idxs:
                context, continuation = requests[i].args[:2]
                ctx, cont = self._encode_pair(context, continuation)
                if len(cont) > self.seq_len:
                    raise ValueError(
                        f"a continuation of {len(cont)} tokens exceeds the model's context of {self.seq_len}"
                    )
                seq = ([self.tok.bos_id] + ctx + cont)[-(self.seq_len + 1) :]
                wins.append((seq[:-1], seq[1:], len(cont)))
                conts.append(cont)
            W = pack_windows(wins, idxs, self.tok.eod_id)
            ll = self._ll(W.tokens_NT, W.targets_NT)
            lp, log_w = self._mixture(ll, W, domain, rolling=False)
            total = (lp * W.score_NT.double()).sum(dim=1).tolist()
            greedy = self._greedy(W, log_w)
            for n, i in enumerate(W.owner):
                out[i] = (total[n], greedy[n])
        return out

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation of `[bos] + enc(context)` until a stop string, eod or max_gen_toks tokens."""
        out = []
        for req in requests:
            context, gen_kwargs = req.args[0], dict(req.args[1] if len(req.args) > 1 and req.args[1] else {})
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            steps = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            domain = _domain_of(req)
            kw: dict[str, Any] = {}
            if self.mode == "expert":
                kw["expert"] = self.expert_ids[0]
            elif self.mode == "naive":
                if domain not in self.experts:
                    raise ValueError(
                        f"generation with mode=naive needs the document's own expert; domain {domain!r} "
                        f"has none (experts: {', '.join(self.experts)}): pass expert=NAME"
                    )
                kw["expert"] = self.experts.index(domain)
            elif self.mode == "average":
                raise ValueError(
                    "generation with mode=average is not supported: generate samples from the "
                    "posterior mixture (eqs. 6-8); use mode=uniform, cached or expert=NAME"
                )
            elif self.mode != "dense":
                prior = self._cached(domain) if self.mode == "cached" else None
                kw.update(mixture=True, log_prior=None if prior is None else prior.log_prior(self.experts))
            gen = generate(
                self.model,
                [self.tok.bos_id] + self.tok.encode(context),
                max_new_tokens=steps,
                temperature=0.0,
                stop_id=self.tok.eod_id,
                vocab_limit=self.tok.vocab_size,
                **kw,
            )
            ids = gen.new_ids[:-1] if gen.new_ids and gen.new_ids[-1] == self.tok.eod_id else gen.new_ids
            text = self.tok.decode(ids)
            for stop in until:
                if stop and stop in text:
                    text = text[: text.index(stop)]
            out.append(text)
        return out

    # ---- internals --------------------------------------------------------------------------------------------
    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's split: trailing spaces of the context go to the continuation; the continuation's ids are those
        of enc(context + continuation) after enc(context)'s length."""
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        ctx = self.tok.encode(context) if context else []
        whole = self.tok.encode(context + continuation)
        return ctx, whole[len(ctx) :]

    def _streams(self, requests: Sequence[Any]) -> dict[tuple[str | None, str | None], list[int]]:
        """Request indices grouped by (task, domain), each in document order: the stream an updating prior runs
        over and the set a naive oracle is chosen on."""
        groups: dict[tuple[str | None, str | None], list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault((getattr(req, "task_name", None), _domain_of(req)), []).append(i)
        for _key, idxs in groups.items():
            idxs.sort(key=lambda i: (getattr(requests[i], "doc_id", None) or 0, i))
        return groups

    def _ll(self, tokens_NT: torch.Tensor, targets_NT: torch.Tensor) -> torch.Tensor:
        """ll E x N x T of the experts this model mixes (one for expert=NAME or dense), evaluate's batched pass."""
        return stream_log_likelihoods(self.model, tokens_NT, targets_NT, self.expert_ids, self.batch_size)

    def _cached(self, domain: str | None) -> mx.CachedPrior | None:
        """The domain's cached prior, estimated once on its development blocks (evaluate's `_cached_prior`); None
        for a domain unknown to the data or without development blocks."""
        if domain not in self._priors:
            prior = None
            if domain is not None and self.manifest is not None and domain in self.manifest["domains"]:
                dev = load_blocks(
                    self.data,
                    self.prepared_tokenizer,
                    domain,
                    self.dev_split,
                    self.seq_len,
                    self.cached_blocks,
                )
                prior, _ = _cached_prior(
                    self.model,
                    dev,
                    self.experts,
                    self.cached_blocks,
                    self.decay,
                    self.batch_size,
                    self.cached_estimator,
                    self.posterior,
                )
            if prior is None and self.mode == "cached":
                say(
                    f"domain {domain!r}: no cached prior (no {self.dev_split} blocks in {self.data}); its documents "
                    "use the updating prior"
                )
            self._priors[domain] = prior
        return self._priors[domain]

    def _mixture(
        self, ll: torch.Tensor, W: Windows, domain: str | None, rolling: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log p of every target, N x T, from model/mixture.py; the log mixing weights E x N x T, None for a
        single model) under this model's mode for a stream of `domain` (docs/harness.md)."""
        E = ll.shape[0]
        if self.mode in ("dense", "expert"):
            return ll[0].double(), None
        if self.mode == "naive":
            own = self.experts.index(domain) if domain in self.experts else None
            # evaluate's naive_expert; the oracle of a loglikelihood stream is judged on its contexts only
            j = mx.naive_expert(ll, own, W.score_NT if rolling else W.evidence_NT - W.score_NT)
            log_w = torch.full(ll.shape, -math.inf, dtype=torch.float64)
            log_w[j] = 0.0
            return ll[j].double(), log_w
        if self.mode == "average":
            return mx.average_log_probs(ll), mx.uniform_log_prior(E)[:, None, None].expand(ll.shape)
        cached = self._cached(domain) if self.mode == "cached" else None
        if cached is not None:
            prior = cached.log_prior(self.experts)
        elif self.mode == "uniform" or not rolling:
            prior = mx.uniform_log_prior(E)
        else:  # updating, or cached without a prior for this domain
            prior = mx.updating_priors(ll, W.score_NT, self.decay, posterior=self.posterior).log_prior_EB
        if self.topk and cached is not None:
            top = mx.topk_mixture_log_probs(
                ll, prior, min(self.topk, E), W.evidence_NT, "prior", self.posterior
            )
            keep = top.experts
            lp_K = prior[keep]
            log_w = torch.full(ll.shape, -math.inf, dtype=torch.float64)
            log_w[keep] = mx.log_posterior(
                ll[keep], lp_K - torch.logsumexp(lp_K, 0), W.evidence_NT, self.posterior
            )
            return top.log_probs_BT, log_w
        return (
            mx.posterior_mixture_log_probs(ll, prior, W.evidence_NT, self.posterior),
            mx.log_posterior(ll, prior, W.evidence_NT, self.posterior),
        )

    @torch.no_grad()
    def _greedy(self, W: Windows, log_w: torch.Tensor | None) -> list[bool]:
        """Whether every scored target is the argmax (over the real tokens) of the next-token distribution: one
        model's, or the mixture's, logsumexp_j [log p_j(v | x_<t) + log g_j(t)] (eq. 6)."""
        out = []
        vocab = self.tok.vocab_size
        for s in range(0, W.tokens_NT.shape[0], self.batch_size):
            h_EBTD = expert_hidden_states(self.model, W.tokens_NT[s : s + self.batch_size], self.expert_ids)
            for b in range(h_EBTD.shape[1]):
                pos = W.score_NT[s + b].nonzero()[:, 0]
                if not len(pos):
                    out.append(True)
                    continue
                logp_ECV = torch.log_softmax(self.model.lm_head(h_EBTD[:, b, pos]).float(), dim=-1)
                if log_w is None:
                    mix_CV = logp_ECV[0]
                else:
                    mix_CV = mx.mixture_log_probs(logp_ECV, log_w[:, s + b, pos][..., None])
                out.append(bool((mix_CV[:, :vocab].argmax(dim=-1) == W.targets_NT[s + b, pos]).all()))
        return out
