"""The DEMix mixture inside EleutherAI's lm-evaluation-harness (lm_eval 0.4), offline.

    python -m launcher.evaluation.harness tasks --data artifacts/demo/tokens --tokenizer sentencepiece --out DIR \\
        [--split test] [--max-docs N] [--domains legal,code] [--seed 0]
    python -m launcher.evaluation.harness run --model demix --include_path DIR --tasks demix_ppl \\
        --model_args checkpoint=CKPT,data=artifacts/demo/tokens,mode=cached [--device cpu --batch_size 8]
    python -m launcher.evaluation.harness check CKPT --tasks-dir DIR --data artifacts/demo/tokens \\
        --domains legal,code [--modes cached,naive] [--hf-domain legal]   # harness == evaluate, hf == expert

    import launcher.evaluation.harness            # registers model "demix" with lm_eval
    lm_eval.simple_evaluate(model="demix", model_args="checkpoint=CKPT,mode=cached", tasks=["demix_ppl"],
                            task_manager=lm_eval.tasks.TaskManager(include_path=DIR))

`tasks` writes local task YAMLs and JSONL data (no network, no Hugging Face hub) from the raw text of a prepared
split (`launcher.checkpoint_data.split_documents_text`: exactly the documents `data.prepare` tokenised):

* `demix_ppl_<domain>` (loglikelihood_rolling) per domain, with the harness's word_perplexity / byte_perplexity /
  bits_per_byte and `token_perplexity` = exp(- sum log p / sum n_tokens), n_tokens = len(tok.encode(text)) stored
  per document (meaningful for models with the project's tokenizer); the group `demix_ppl` averages the domains'
  token perplexities (a plain mean, as the paper's Tables 3 and 5);
* `demix_continuation` (multiple_choice, acc / acc_norm): the first ~48 tokens of a test document, and as choices
  its true next ~16 tokens and three 16-token spans of documents of other domains (seeded).

Model `demix` (model_args, comma-separated key=value):

    checkpoint=DIR (consolidated)  data=TOKENS_ROOT (default: the checkpoint's data.path)
    mode=cached|updating|uniform|naive|average (default cached)  posterior=prefix|previous_token
    cached_estimator=mean|ewm|updating  cached_blocks=100  decay=0.3 (λ, eq. 9)  topk=0 (k > 0: cached top-k)
    expert=NAME (one expert alone, no mixture)  exclude_experts=a;b (opt-out: never read)
    windows=blocks|lm_eval  batch_size=4 (windows per batched pass, x E)

Dense (and GShard / CSE) checkpoints have no experts: one model, no mode. The model runs on the CPU (evaluate's
functions build their inputs there; lm-eval's --device is ignored). Token conventions are the project's: a document
is d = [bos] + tok.encode(text); `loglikelihood_rolling` scores every token of ids = tok.encode(text) once, in
disjoint windows of T = seq_len predicted tokens: window w reads d[wT : wT+T] and predicts ids[wT : wT+T]
(evaluate's blocks when one document is one stream; the last window is shorter, padded and masked).
`windows=lm_eval` gives the last window the full T tokens of context instead, as lm-eval's own
`get_rolling_token_windows` does for the stock `hf` model (a window's posterior conditions on every document token it
reads; the updating prior's end-of-window evidence is its scored tokens, so each counts once).
`loglikelihood(context, continuation)` scores `[bos] + enc(context + continuation)` (trailing spaces of the context
moved to the continuation, as lm-eval does), cut to the last seq_len + 1 tokens.

The stock `hf` model (pip install lm_eval[hf]) on a `launcher.modular.hf_export` folder: pass add_bos_token=False,
since lm-eval's rolling windows already start with the prefix (bos) token and the exported tokenizer would add a
second one. It then equals `expert=<domain>,windows=lm_eval` up to the probability our model gives the padding rows
of its embedding, which the export's trimmed vocabulary leaves out (`padding_log_mass`; `check` reports both).

Which prior, per document (model/mixture.py docstring; DEMix §5.1, eqs. 6-9). The domain of a document is its
`domain` field (tasks written here carry one), else the `<domain>` of a task named `demix_ppl_<domain>`:

* cached:   the domain's cached prior, estimated once on its first `cached_blocks` development blocks with
            evaluate's own `_cached_prior` (what `launcher.evaluation.evaluate` does); a document with no known
            domain (none, or one without development blocks in `data`) uses the updating prior instead;
* updating: eq. 9 over the windows of a task's documents of one domain, in document order (evaluate's stream);
* uniform:  1/E;   average: fixed 1/E weights, no posterior;
* naive:    the domain's own expert; a domain without one takes the best single expert on that task's documents
            (evaluate's oracle; for loglikelihood requests, judged on their contexts).
* topk=k:   mode cached with only the k experts of highest cached prior (documents without a cached prior: the
            full mixture under the updating prior).

A loglikelihood request is one window: its updating prior is the uniform prior (eq. 9, block 0). `is_greedy`
compares each continuation token with the argmax of the mixture's next-token distribution (eq. 6 with the same
weights), over the tokenizer's real tokens. `generate_until` is greedy through `launcher.evaluation.generate`
(the mixture with the document's cached prior, else uniform; the own expert for naive); stop strings truncate the
decoded text.

`evaluate_documents` feeds the same per-document windows through evaluate's own functions (`stream_log_likelihoods`,
`_cached_prior`, `_demix_domain`, the dense path): the harness's token perplexity must equal it (`check`: 1e-4
relative).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
import os
import random
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import lm_eval.models  # noqa: F401  (lm-eval's stock models, e.g. hf, registered lazily: as its CLI has them)
import torch
import yaml
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from data.argtypes import nonneg_float, positive_int, random_seed, unit_left_open
from data.atomic import staged_dir, write_json_atomic
from data.cli import check_output_dir, cli_main, exit_process
from data.readers import check_shape, read_json_object
from launcher.checkpoint import Consolidated, load_consolidated, read_meta
from launcher.checkpoint_data import (
    check_checkpoint_data,
    load_blocks,
    load_export_tokenizer,
    split_documents_text,
)
from launcher.evaluation.evaluate import (
    DEMIX_MODES,
    _cached_prior,
    _demix_domain,
    stream_log_likelihoods,
)
from launcher.evaluation.generate import generate
from model import mixture as mx
from model.batched import demix_expert_ids, expert_hidden_states

MODES: tuple[str, ...] = ("cached", "updating", "uniform", "naive", "average")
WINDOWS: tuple[str, ...] = ("blocks", "lm_eval")
TASKS_FORMAT = (
    "demix-harness-tasks/2"  # /2: the record holds the sha256 of every file written (`verify_tasks_dir`)
)
_OLD_TASKS_FORMATS = ("demix-harness-tasks/1",)  # replaced by `tasks`, refused by `check`
PPL_GROUP = "demix_ppl"
PPL_PREFIX = "demix_ppl_"
MC_TASK = "demix_continuation"
CONTEXT_TOKENS, CONTINUATION_TOKENS, DISTRACTORS = 48, 16, 3


# ---------------------------------------------------------------- windows ----------------------------------------


@dataclass
class Windows:
    """Model inputs of N windows, right-padded to T: `score_NT` marks the predicted (scored) targets, `evidence_NT`
    every real target (what a posterior may condition on; equal to `score_NT` for blocks), `owner` the request
    index of each window."""

    tokens_NT: torch.Tensor
    targets_NT: torch.Tensor
    score_NT: torch.Tensor
    evidence_NT: torch.Tensor
    owner: list[int]


def document_windows(
    ids: Sequence[int], seq_len: int, bos: int, windows: str = "blocks"
) -> list[tuple[list[int], list[int], int]]:
    """(input, targets, n_scored) per window of the document `[bos] + ids`, scoring every token of `ids` once; the
    scored targets are the last n_scored. blocks: window w reads d[wT : wT+T] and predicts d[wT+1 : wT+T+1] of
    d = [bos] + ids (evaluate's blocks over a one-document stream, the last one shorter). lm_eval: the harness's
    `get_rolling_token_windows` + `make_disjoint_window` with prefix bos, context_len 1 (the last window reads the
    full seq_len tokens before its targets)."""
    if windows not in WINDOWS:
        raise ValueError(f"windows={windows!r}: choose one of {', '.join(WINDOWS)}")
    ids = list(ids)
    if windows == "blocks":
        d = [bos] + ids
        out = []
        for s in range(0, len(ids), seq_len):
            tgt = d[s + 1 : s + 1 + seq_len]
            out.append((d[s : s + len(tgt)], tgt, len(tgt)))
        return out
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    out = []
    for ctx, pred in map(make_disjoint_window, get_rolling_token_windows(ids, bos, seq_len, 1)):
        seq = (list(ctx) + list(pred))[-(seq_len + 1) :]
        out.append((seq[:-1], seq[1:], len(pred)))
    return out


def pack_windows(
    windows: Sequence[tuple[list[int], list[int], int]], owner: Sequence[int], pad: int
) -> Windows:
    """Right-pad windows to the longest (padding is never scored nor evidence; a causal model's real positions do
    not see it)."""
    N, T = len(windows), max((len(w[0]) for w in windows), default=1)
    tokens = torch.full((N, T), pad, dtype=torch.long)
    targets = torch.full((N, T), pad, dtype=torch.long)
    score = torch.zeros(N, T, dtype=torch.float32)
    evidence = torch.zeros(N, T, dtype=torch.float32)
    for i, (inp, tgt, n) in enumerate(windows):
        L = len(inp)
        tokens[i, :L], targets[i, :L] = torch.tensor(inp), torch.tensor(tgt)
        evidence[i, :L] = 1
        score[i, L - n : L] = 1
    return Windows(tokens, targets, score, evidence, list(owner))


# ---------------------------------------------------------------- model_args -------------------------------------


def _names(value: Any) -> list[str]:
    """`a;b` (model_args cannot hold commas), a list, or None -> names."""
    if value is None or value == "":
        return []
    if isinstance(value, (list, tuple)):
        return [str(v).strip() for v in value if str(v).strip()]
    return [v.strip() for v in str(value).split(";") if v.strip()]


def _batch_size(value: Any) -> int:
    """lm-eval passes an int, a numeric string, or 'auto' / 'auto:N' (taken as the default 4)."""
    if value is None or (isinstance(value, str) and value.startswith("auto")):
        return 4
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"demix model_args: batch_size={value!r} is not a number") from None
    if n < 1:
        raise ValueError(f"demix model_args: batch_size={n}: must be >= 1")
    return n


def _domain_of(req: Any) -> Optional[str]:
    """A request's domain: its document's `domain` field, else `<d>` of a task named demix_ppl_<d>, else None."""
    doc = getattr(req, "doc", None)
    if isinstance(doc, Mapping) and doc.get("domain"):
        return str(doc["domain"])
    name = getattr(req, "task_name", None) or ""
    return name[len(PPL_PREFIX) :] if name.startswith(PPL_PREFIX) else None


def _say(*a: Any) -> None:
    print("[demix-harness]", *a, file=sys.stderr, flush=True)


def _registered(cls: type) -> type:
    """Register with lm_eval as "demix". Not when this file runs as __main__: `main` imports the module proper,
    which registers it (a second class under the same name is refused by lm_eval's registry)."""
    return cls if __name__ == "__main__" else register_model("demix")(cls)


# ---------------------------------------------------------------- the model --------------------------------------


@_registered
class DemixLM(LM):
    """A consolidated checkpoint (DEMix mixture, one expert, or dense) as an lm-eval model (module docstring)."""

    def __init__(
        self,
        checkpoint: str,
        data: Optional[str] = None,
        mode: Optional[str] = None,
        posterior: str = "prefix",
        cached_estimator: str = "mean",
        cached_blocks: int = mx.CACHED_PRIOR_BLOCKS,
        decay: float = mx.UPDATING_DECAY,
        expert: Optional[str] = None,
        topk: int = 0,
        exclude_experts: Any = None,
        batch_size: Any = 4,
        windows: str = "blocks",
        dev_split: str = "valid",
        max_gen_toks: int = 256,
        device: Optional[str] = None,
        max_batch_size: Any = None,
        **unknown: Any,
    ) -> None:
        super().__init__()
        if unknown:
            raise ValueError(
                f"demix model_args: unknown {', '.join(sorted(unknown))}; known: checkpoint, data, mode, "
                "posterior, cached_estimator, cached_blocks, decay, expert, topk, exclude_experts, "
                "batch_size, windows, dev_split, max_gen_toks"
            )
        if not checkpoint:
            raise ValueError("demix model_args: checkpoint=DIR (a consolidated checkpoint) is required")
        meta = read_meta(checkpoint)  # everything below is checked before a tensor is read
        kind = meta["config"]["model"]["ffn"]["kind"]
        domains = list(meta["domains"])
        is_demix = kind == "demix"
        if meta["config"].get("data", {}).get("mixture") == "domain_token":
            raise ValueError(
                f"{checkpoint}: a +Domain-Token model reads a domain token before every document; "
                "the harness model does not support it"
            )
        exclude = _names(exclude_experts)
        if exclude and not is_demix:
            raise ValueError(
                f"demix model_args: exclude_experts={';'.join(exclude)}: {checkpoint} is a {kind} "
                "checkpoint, it has no experts"
            )
        unknown_ex = [e for e in exclude if e not in domains]
        if unknown_ex:
            raise ValueError(
                f"demix model_args: exclude_experts {unknown_ex} are not experts of {checkpoint}; "
                f"experts: {', '.join(domains)}"
            )
        kept = [d for d in domains if d not in exclude]
        if is_demix and not kept:
            raise ValueError(f"demix model_args: excluding {exclude} leaves no expert")
        if mode is not None and mode not in MODES:
            raise ValueError(f"demix model_args: mode={mode!r}: choose one of {', '.join(MODES)}")
        if posterior not in mx.POSTERIORS:
            raise ValueError(
                f"demix model_args: posterior={posterior!r}: choose one of {', '.join(mx.POSTERIORS)}"
            )
        if cached_estimator not in mx.CACHED_ESTIMATORS:
            raise ValueError(
                f"demix model_args: cached_estimator={cached_estimator!r}: choose one of "
                f"{', '.join(mx.CACHED_ESTIMATORS)}"
            )
        if windows not in WINDOWS:
            raise ValueError(f"demix model_args: windows={windows!r}: choose one of {', '.join(WINDOWS)}")
        if expert is not None:
            if not is_demix:
                raise ValueError(
                    f"demix model_args: expert={expert}: {checkpoint} is a {kind} checkpoint, it has "
                    "no experts"
                )
            if str(expert) not in kept:
                raise ValueError(
                    f"demix model_args: expert={expert!r} is not an expert of {checkpoint}"
                    + (" (excluded)" if str(expert) in exclude else "")
                    + f"; experts: {', '.join(kept)}"
                )
            if mode is not None:
                raise ValueError(
                    f"demix model_args: give expert=NAME (one expert) or mode={mode} (a mixture), not both"
                )
        if not is_demix and mode not in (None, "naive"):
            _say(f"{checkpoint} is a {kind} checkpoint: mode={mode} ignored (one model, no mixture)")
        topk = int(topk or 0)
        if topk < 0 or (topk and (not is_demix or expert is not None or (mode or "cached") != "cached")):
            raise ValueError(
                f"demix model_args: topk={topk}: top-k mixes the experts of highest cached prior; "
                "it needs a DEMix checkpoint, mode=cached and no expert"
            )
        cached_blocks = positive_int.parse(cached_blocks, "demix model_args: cached_blocks")
        decay = unit_left_open.parse(decay, "demix model_args: decay")
        max_gen_toks = positive_int.parse(max_gen_toks, "demix model_args: max_gen_toks")
        if device not in (None, "cpu"):
            _say(
                f"device={device} ignored: the project's evaluation functions build their inputs on the CPU, "
                "so the model runs there"
            )

        self.checkpoint, self.posterior, self.cached_estimator = str(checkpoint), posterior, cached_estimator
        self.cached_blocks, self.decay, self.topk = int(cached_blocks), float(decay), topk
        self.windows, self.dev_split, self.max_gen_toks = windows, dev_split, int(max_gen_toks)
        self.batch_size = _batch_size(batch_size)
        self._device = torch.device("cpu")
        if exclude:  # opt-out: those experts' shards are never read
            from launcher.expert_surgery import load_without

            c = load_without(checkpoint, exclude)
        else:
            c = load_consolidated(checkpoint)
        self.consolidated = c
        self.model = c.build_model().eval()
        self.seq_len = int(c.cfg.model.seq_len)
        self.tok = load_export_tokenizer(c, data)
        self.data = str(data if data is not None else c.cfg.data.path)
        self.prepared_tokenizer = str(c.meta.get("tokenizer", c.cfg.data.tokenizer))
        self.experts: list[str] = list(c.domains) if demix_expert_ids(self.model) else []
        self.expert = None if expert is None else str(expert)
        self.expert_ids = [self.experts.index(self.expert)] if self.expert is not None else None
        self.mode = ("expert" if self.expert else (mode or "cached")) if self.experts else "dense"
        try:
            self.manifest: Optional[dict[str, Any]] = check_checkpoint_data(
                c, self.data, self.prepared_tokenizer
            )
        except (FileNotFoundError, ValueError) as e:  # e.g. gpt2 without prepared data: no cached priors
            self.manifest = None
            if self.mode == "cached":
                _say(f"no prepared data for cached priors ({e}): every document uses the updating prior")
        self._priors: dict[Optional[str], Optional[mx.CachedPrior]] = {}

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
        """log p(every token of tok.encode(text) | bos, preceding tokens), per request (module docstring)."""
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
        """(sum log p(continuation tokens | bos, context), is_greedy) per request (module docstring)."""
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

    def _streams(self, requests: Sequence[Any]) -> dict[tuple[Optional[str], Optional[str]], list[int]]:
        """Request indices grouped by (task, domain), each in document order: the stream an updating prior runs
        over and the set a naive oracle is chosen on."""
        groups: dict[tuple[Optional[str], Optional[str]], list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault((getattr(req, "task_name", None), _domain_of(req)), []).append(i)
        for key, idxs in groups.items():
            idxs.sort(key=lambda i: (getattr(requests[i], "doc_id", None) or 0, i))
        return groups

    def _ll(self, tokens_NT: torch.Tensor, targets_NT: torch.Tensor) -> torch.Tensor:
        """ll E x N x T of the experts this model mixes (one for expert=NAME or dense), evaluate's batched pass."""
        return stream_log_likelihoods(self.model, tokens_NT, targets_NT, self.expert_ids, self.batch_size)

    def _cached(self, domain: Optional[str]) -> Optional[mx.CachedPrior]:
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
                _say(
                    f"domain {domain!r}: no cached prior (no {self.dev_split} blocks in {self.data}); its documents "
                    "use the updating prior"
                )
            self._priors[domain] = prior
        return self._priors[domain]

    def _mixture(
        self, ll: torch.Tensor, W: Windows, domain: Optional[str], rolling: bool
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(log p of every target, N x T, from model/mixture.py; the log mixing weights E x N x T, None for a
        single model) under this model's mode for a stream of `domain` (module docstring)."""
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
    def _greedy(self, W: Windows, log_w: Optional[torch.Tensor]) -> list[bool]:
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


# ---------------------------------------------------------------- evaluate's side -------------------------------


def evaluate_documents(
    ckpt: Union[str, Path, Consolidated],
    data_root: Union[str, Path],
    texts: Mapping[str, Sequence[str]],
    *,
    modes: Sequence[str] = DEMIX_MODES,
    posterior: str = "prefix",
    cached_estimator: str = "mean",
    cached_blocks: int = mx.CACHED_PRIOR_BLOCKS,
    decay: float = mx.UPDATING_DECAY,
    topk: int = 2,
    batch_size: int = 4,
    dev_split: str = "valid",
    exclude_experts: Sequence[str] = (),
) -> dict[str, Any]:
    """Per-domain perplexity of `texts` ({domain: documents}) by `launcher.evaluation.evaluate`'s own functions:
    each domain's documents, one stream of per-document windows (`document_windows`, blocks) in order, scored by
    `stream_log_likelihoods`, mixed by `_demix_domain` with the cached prior of `_cached_prior` on the domain's
    `dev_split` blocks (DEMix) or `mx.perplexity` of the one model (dense). Returns

        {"kind", "experts", "seq_len", "domains": {domain: {"documents", "windows", "tokens", "ppl": {mode: ppl},
         DEMix: "expert_ppl": {expert: ppl}, "naive_expert": name, "cached_prior": {expert: p} | None}}}

    (dense: the one mode "ppl")."""
    if exclude_experts:
        from launcher.expert_surgery import load_without

        c = load_without(ckpt, list(exclude_experts))
    else:
        c = ckpt if isinstance(ckpt, Consolidated) else load_consolidated(ckpt)
    tok = load_export_tokenizer(c, data_root)
    tokenizer = str(c.meta.get("tokenizer", c.cfg.data.tokenizer))
    model = c.build_model().eval()
    T = int(c.cfg.model.seq_len)
    experts = list(c.domains) if demix_expert_ids(model) else []
    manifest = check_checkpoint_data(c, data_root, tokenizer) if experts else None
    out: dict[str, Any] = {"kind": c.cfg.model.ffn.kind, "experts": experts, "seq_len": T, "domains": {}}
    for domain, docs in texts.items():
        wins = [w for text in docs for w in document_windows(tok.encode(text), T, tok.bos_id, "blocks")]
        if not wins:
            continue
        W = pack_windows(wins, range(len(wins)), tok.eod_id)
        ll = stream_log_likelihoods(model, W.tokens_NT, W.targets_NT, None, batch_size)
        entry: dict[str, Any] = {
            "documents": len(docs),
            "windows": len(wins),
            "tokens": int(W.score_NT.sum()),
        }
        if experts:
            cached = None
            if any(m in modes for m in ("cached", "topk")) and domain in manifest["domains"]:
                dev = load_blocks(data_root, tokenizer, domain, dev_split, T, cached_blocks)
                cached, _ = _cached_prior(
                    model, dev, experts, cached_blocks, decay, batch_size, cached_estimator, posterior
                )
            own = experts.index(domain) if domain in experts else None
            res = _demix_domain(ll, W.score_NT, own, experts, list(modes), cached, topk, decay, posterior)
            entry.update(
                ppl=res["ppl"],
                expert_ppl=res["expert_ppl"],
                naive_expert=res["naive_expert"],
                cached_prior=None if cached is None else dict(zip(cached.domains, cached.probs)),
            )
        else:
            entry["ppl"] = {"ppl": mx.perplexity(ll[0], W.score_NT)}
        out["domains"][domain] = entry
    return out


# ---------------------------------------------------------------- task files ------------------------------------


def process_ppl_results(doc, results):
    """lm-eval process_results of a demix_ppl task: the harness's rolling metrics plus token_perplexity, each
    (loglikelihood, weight) for weighted_perplexity / bits_per_byte aggregation."""
    (loglikelihood,) = results
    text = doc["text"]
    n_words = len(re.split(r"\s+", text))
    n_bytes = len(text.encode("utf-8"))
    return {
        "word_perplexity": (loglikelihood, n_words),
        "byte_perplexity": (loglikelihood, n_bytes),
        "bits_per_byte": (loglikelihood, n_bytes),
        "token_perplexity": (loglikelihood, int(doc["n_tokens"])),
    }


def utils_source() -> str:
    """utils.py written beside the task YAMLs: self-contained (the tasks load without this project)."""
    return (
        '"""process_results of the demix_ppl tasks (written by launcher.evaluation.harness tasks)."""\n\n'
        "import re\n\n\n" + inspect.getsource(process_ppl_results)
    )


def _metric(name: str, aggregation: str, higher_is_better: bool) -> dict[str, Any]:
    return {"metric": name, "aggregation": aggregation, "higher_is_better": higher_is_better}


def ppl_task_yaml(domain: str, data_file: Path, split: str) -> str:
    """YAML of the perplexity task of one domain (loglikelihood_rolling over its documents' text)."""
    cfg = {
        "task": PPL_PREFIX + domain,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_file)}},
        "output_type": "loglikelihood_rolling",
        "test_split": "test",
        "doc_to_text": "",
        "doc_to_target": "text",
        "metric_list": [
            _metric("word_perplexity", "weighted_perplexity", False),
            _metric("byte_perplexity", "weighted_perplexity", False),
            _metric("bits_per_byte", "bits_per_byte", False),
            _metric("token_perplexity", "weighted_perplexity", False),
        ],
        "metadata": {"version": 1.0, "domain": domain, "split": split},
    }
    return yaml.safe_dump(cfg, sort_keys=False) + "process_results: !function utils.process_ppl_results\n"


def group_yaml(tasks: Sequence[str]) -> str:
    cfg = {
        "group": PPL_GROUP,
        "task": list(tasks),
        "aggregate_metric_list": [
            {"metric": "token_perplexity", "aggregation": "mean", "weight_by_size": False}
        ],
        "metadata": {"version": 1.0},
    }
    return yaml.safe_dump(cfg, sort_keys=False)


def mc_task_yaml(data_file: Path) -> str:
    cfg = {
        "task": MC_TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_file)}},
        "output_type": "multiple_choice",
        "test_split": "test",
        "doc_to_text": "context",
        "doc_to_choice": "choices",
        "doc_to_target": "gold",
        "target_delimiter": "",
        "metric_list": [_metric("acc", "mean", True), _metric("acc_norm", "mean", True)],
        "metadata": {"version": 1.0},
    }
    return yaml.safe_dump(cfg, sort_keys=False)


def _span(tok: Any, ids: Sequence[int], text: str, start: int, stop: int) -> Optional[tuple[str, str]]:
    """(text of ids[:start], text of ids[start:stop]) as a prefix and the next piece of `text`; None when the
    decoded tokens are not a prefix of the text (a cut inside a character) or the piece is blank."""
    head, full = tok.decode(list(ids[:start])), tok.decode(list(ids[:stop]))
    if not text.startswith(full) or not full.startswith(head) or not full[len(head) :].strip():
        return None
    return head, full[len(head) :]


def continuation_docs(
    tok: Any,
    texts: Mapping[str, Sequence[str]],
    seed: int = 0,
    context_tokens: int = CONTEXT_TOKENS,
    continuation_tokens: int = CONTINUATION_TOKENS,
) -> list[dict[str, Any]]:
    """The multiple-choice documents: per document with enough tokens, its first `context_tokens` tokens' text,
    and as choices its true next `continuation_tokens` tokens and DISTRACTORS spans at the same offset of documents
    of other domains (random.Random(seed)); {"domain", "doc_index", "context", "choices", "gold"}."""
    rng = random.Random(seed)
    spans: dict[str, list[tuple[int, str, str]]] = {}
    for d, docs in texts.items():
        for i, text in enumerate(docs):
            ids = tok.encode(text)
            if len(ids) >= context_tokens + continuation_tokens:
                s = _span(tok, ids, text, context_tokens, context_tokens + continuation_tokens)
                if s is not None:
                    spans.setdefault(d, []).append((i, *s))
    out = []
    for d in texts:
        others = [o for o in spans if o != d]
        if not others:
            continue
        for i, context, cont in spans.get(d, []):
            pick = (
                rng.sample(others, DISTRACTORS)
                if len(others) >= DISTRACTORS
                else rng.choices(others, k=DISTRACTORS)
            )
            choices = [cont] + [rng.choice(spans[o])[2] for o in pick]
            order = list(range(len(choices)))
            rng.shuffle(order)
            out.append(
                {
                    "domain": d,
                    "doc_index": i,
                    "context": context,
                    "choices": [choices[k] for k in order],
                    "gold": order.index(0),
                    "distractor_domains": pick,
                }
            )
    return out


def write_tasks(
    data_root: Union[str, Path],
    tokenizer: str,
    out: Union[str, Path],
    split: str = "test",
    max_docs: Optional[int] = None,
    domains: Optional[Sequence[str]] = None,
    seed: int = 0,
    docs_from: Optional[str] = None,
) -> dict[str, Any]:
    """Write the task folder `out` (module docstring): <task>.yaml, utils.py, data/*.jsonl and demix_tasks.json
    (the record, returned). Documents: the first `max_docs` of each domain's `split`, with their token count under
    the prepared `tokenizer`."""
    from data.tokenizer import load_prepared_tokenizer

    out = Path(out).resolve()
    docs_from = docs_from or tokenizer
    manifest = Path(data_root) / docs_from / "manifest.json"
    if not manifest.is_file():
        raise FileNotFoundError(
            f"{manifest} not found: --data is a prepared tokens root (data.prepare) and "
            f"--tokenizer one of its tokenizers"
        )
    names = ["demix_tasks.json", "utils.py", "data", f"{PPL_GROUP}.yaml", f"{MC_TASK}.yaml"]
    check_output_dir(
        out, [TASKS_FORMAT, *_OLD_TASKS_FORMATS], names, inputs=[Path(data_root)], manifest="demix_tasks.json"
    )
    tok = load_prepared_tokenizer(data_root, tokenizer)
    texts, notes = split_documents_text(data_root, docs_from, split, max_docs)
    if notes["changed_corpus_files"]:
        _say(
            f"warning: {', '.join(notes['changed_corpus_files'])} changed since {data_root}/{docs_from} was "
            "prepared: these are not exactly the tokenised documents"
        )
    if domains:
        unknown = [d for d in domains if d not in texts]
        if unknown:
            raise ValueError(f"domains {unknown} are not in {manifest}; domains: {', '.join(texts)}")
        texts = {d: texts[d] for d in domains}
    texts = {d: ts for d, ts in texts.items() if ts}
    if not texts:
        raise ValueError(f"no {split} documents in {data_root}/{docs_from}")
    with staged_dir(out, manifest="demix_tasks.json") as tmp:  # a failed write leaves no half task folder
        (tmp / "data").mkdir()
        record: dict[str, Any] = {
            "format": TASKS_FORMAT,
            "data": str(Path(data_root).resolve()),
            "tokenizer": tokenizer,
            "docs_from": docs_from,
            "split": split,
            "max_docs": max_docs,
            "seed": seed,
            "group": PPL_GROUP,
            "domains": {},
            "changed_corpus_files": notes["changed_corpus_files"],
        }
        tasks = []
        for d, docs in texts.items():
            rows = [
                {"domain": d, "doc_index": i, "text": t, "n_tokens": len(tok.encode(t))}
                for i, t in enumerate(docs)
            ]
            name = f"ppl_{d}.jsonl"
            (tmp / "data" / name).write_text(
                "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8"
            )
            (tmp / f"{PPL_PREFIX}{d}.yaml").write_text(
                ppl_task_yaml(d, out / "data" / name, split), encoding="utf-8"
            )
            tasks.append(PPL_PREFIX + d)
            record["domains"][d] = {
                "task": PPL_PREFIX + d,
                "documents": len(rows),
                "tokens": sum(r["n_tokens"] for r in rows),
            }
        (tmp / f"{PPL_GROUP}.yaml").write_text(group_yaml(tasks), encoding="utf-8")
        mc = continuation_docs(tok, texts, seed)
        (tmp / "data" / "continuation.jsonl").write_text(
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in mc), encoding="utf-8"
        )
        if mc:
            (tmp / f"{MC_TASK}.yaml").write_text(
                mc_task_yaml(out / "data" / "continuation.jsonl"), encoding="utf-8"
            )
        record["tasks"] = tasks + ([MC_TASK] if mc else [])
        record["continuation"] = {
            "task": MC_TASK if mc else None,
            "documents": len(mc),
            "context_tokens": CONTEXT_TOKENS,
            "continuation_tokens": CONTINUATION_TOKENS,
            "distractors": DISTRACTORS,
        }
        (tmp / "utils.py").write_text(utils_source(), encoding="utf-8")
        record["files"] = file_hashes(
            tmp
        )  # what `check` verifies before lm-eval imports anything from the folder
        write_json_atomic(tmp / "demix_tasks.json", record)
    return record


def file_hashes(root: Union[str, Path]) -> dict[str, str]:
    """sha256 of every file under `root` by relative POSIX path, the folder's record (demix_tasks.json) excepted;
    a symbolic link to a directory is listed as "<link>" (never followed)."""
    root, out = Path(root), {}
    for top, dirs, files in os.walk(root):
        for name in sorted(files) + sorted(d for d in dirs if os.path.islink(os.path.join(top, d))):
            path = Path(top) / name
            rel = path.relative_to(root).as_posix()
            if rel != "demix_tasks.json":
                out[rel] = "<link>" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def verify_tasks_dir(tasks_dir: Union[str, Path]) -> dict[str, Any]:
    """The record of a task folder, after checking that its files are exactly those `write_tasks` wrote, unchanged
    (the sha256 it recorded). lm-eval imports the folder's utils.py for the `!function` of its task YAMLs (and Python
    would load a `__pycache__` beside it instead), so a changed or added .py, .yaml or bytecode file would run code:
    ValueError naming them, before anything in the folder is imported."""
    root = Path(tasks_dir)
    path = root / "demix_tasks.json"
    rec = read_json_object(path, {"format": str, "domains": dict}, what="harness task folder record")
    if rec["format"] != TASKS_FORMAT:
        raise ValueError(
            f"{path}: format {rec['format']!r}, not {TASKS_FORMAT!r} (a folder written before its files "
            "were fingerprinted, or not by `harness tasks`): write it again with `python -m "
            "launcher.evaluation.harness tasks`"
        )
    check_shape(rec, {"files": dict}, path, "harness task folder record")
    now, then = file_hashes(root), rec["files"]
    diff = {
        "changed": sorted(f for f in then if f in now and now[f] != then[f]),
        "added": sorted(f for f in now if f not in then),
        "missing": sorted(f for f in then if f not in now),
    }
    if any(diff.values()):
        listed = "; ".join(f"{k}: {', '.join(v[:5])}" for k, v in diff.items() if v)
        raise ValueError(
            f"{root} is not as `harness tasks` wrote it ({listed}); nothing in it was imported (lm-eval "
            "would import its utils.py and follow its YAMLs: a changed or added file could run code). "
            "Write the folder again with `python -m launcher.evaluation.harness tasks`"
        )
    return rec


def read_task_documents(
    tasks_dir: Union[str, Path], domains: Optional[Sequence[str]] = None
) -> dict[str, list[str]]:
    """{domain: texts} of the perplexity tasks in a folder written by `write_tasks` (the documents they score)."""
    rec = read_json_object(
        Path(tasks_dir) / "demix_tasks.json", {"domains": dict}, what="harness task folder record"
    )
    out = {}
    for d in domains or list(rec["domains"]):
        if d not in rec["domains"]:
            raise ValueError(f"domain {d!r} has no task in {tasks_dir}; domains: {', '.join(rec['domains'])}")
        path = Path(tasks_dir) / "data" / f"ppl_{d}.jsonl"
        try:
            out[d] = [
                json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines() if line
            ]
        except (OSError, ValueError, LookupError, TypeError) as e:
            raise ValueError(
                f"{path} is not a task data file of `harness tasks` ({type(e).__name__}: {e})"
            ) from None
    return out


# ---------------------------------------------------------------- running lm-eval -------------------------------


def harness_metrics(
    model: str,
    model_args: str,
    tasks: Sequence[str],
    tasks_dir: Union[str, Path],
    limit: Optional[int] = None,
) -> dict[str, dict[str, Any]]:
    """lm_eval.simple_evaluate on the task folder (its tasks only, offline); returns results per task with the
    ",none" filter suffix dropped from metric names."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    verify_tasks_dir(tasks_dir)  # lm-eval imports the folder's utils.py: only the one `write_tasks` wrote
    bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # no __pycache__ left in the folder
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = lm_eval.simple_evaluate(
                model=model,
                model_args=model_args,
                tasks=list(tasks),
                limit=limit,
                task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
                log_samples=False,
                bootstrap_iters=0,
                device="cpu",
            )
    finally:
        sys.dont_write_bytecode = bytecode
    return {t: {k.split(",")[0]: v for k, v in r.items()} for t, r in res["results"].items()}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-300)


def check(
    ckpt: str,
    tasks_dir: Union[str, Path],
    data: str,
    domains: Optional[Sequence[str]] = None,
    modes: Sequence[str] = ("cached", "naive"),
    hf_domain: Optional[str] = None,
    batch_size: int = 8,
    extra_args: str = "",
) -> dict[str, Any]:
    """Harness token perplexity vs `evaluate_documents` per domain and mode (DEMix; dense: one number); with
    `hf_domain`, the stock `hf` model on that expert's export vs `expert=<hf_domain>` (both window conventions)."""
    from lm_eval.utils import simple_parse_args_string

    verify_tasks_dir(tasks_dir)  # before anything is read from the folder, let alone imported
    docs = read_task_documents(tasks_dir, domains)
    tasks = [PPL_PREFIX + d for d in docs]
    meta = read_meta(ckpt)
    is_demix = meta["config"]["model"]["ffn"]["kind"] == "demix"
    extra = simple_parse_args_string(extra_args)
    same = {
        k: extra[k]
        for k in ("posterior", "cached_estimator", "cached_blocks", "decay", "topk", "dev_split")
        if k in extra
    }  # what evaluate_documents must be told to compute the same thing
    if "exclude_experts" in extra:
        same["exclude_experts"] = _names(extra["exclude_experts"])
    topk = int(extra.get("topk", 0) or 0)
    ev_mode = {
        m: ("topk" if m == "cached" and topk else m) for m in modes
    }  # harness cached + topk = evaluate's topk
    ev = evaluate_documents(
        ckpt, data, docs, modes=list(ev_mode.values()) if is_demix else ["ppl"], batch_size=batch_size, **same
    )
    base = f"checkpoint={ckpt},data={data},batch_size={batch_size}" + (f",{extra_args}" if extra_args else "")
    rows = []
    for mode in modes if is_demix else ["ppl"]:
        args = base + (f",mode={mode}" if is_demix else "")
        got = harness_metrics("demix", args, tasks, tasks_dir)
        for d in docs:
            h, e = got[PPL_PREFIX + d]["token_perplexity"], ev["domains"][d]["ppl"][ev_mode.get(mode, mode)]
            rows.append(
                {
                    "domain": d,
                    "mode": mode,
                    "harness": h,
                    "evaluate_documents": e,
                    "rel_diff": _rel(h, e),
                    "tokens": ev["domains"][d]["tokens"],
                }
            )
    result: dict[str, Any] = {"checkpoint": ckpt, "tasks_dir": str(tasks_dir), "rows": rows}
    if hf_domain:
        import tempfile

        from launcher.modular.hf_export import export

        if hf_domain not in docs:
            raise ValueError(f"--hf-domain {hf_domain}: not among the checked domains {', '.join(docs)}")
        c = load_consolidated(ckpt)
        with tempfile.TemporaryDirectory(prefix="demix-hf-") as tmp:
            hf_dir = Path(tmp) / hf_domain
            rec = export(
                c,
                hf_dir,
                domain=hf_domain if is_demix else None,
                tokenizer=load_export_tokenizer(c, data),
                source=ckpt,
            )
            task = [PPL_PREFIX + hf_domain]
            hf_args = f"pretrained={hf_dir},tokenizer={hf_dir},dtype=float32,add_bos_token=False"
            hf = harness_metrics("hf", hf_args, task, tasks_dir)[task[0]]["token_perplexity"]
            hf_default = harness_metrics("hf", hf_args.replace(",add_bos_token=False", ""), task, tasks_dir)[
                task[0]
            ]["token_perplexity"]
        one = f"checkpoint={ckpt},data={data},batch_size={batch_size}" + (
            f",expert={hf_domain}" if is_demix else ""
        )
        blocks = harness_metrics("demix", one, task, tasks_dir)[task[0]]["token_perplexity"]
        lm_eval_w = harness_metrics("demix", one + ",windows=lm_eval", task, tasks_dir)[task[0]][
            "token_perplexity"
        ]
        ev_d = ev["domains"][hf_domain]
        ev_expert = ev_d["expert_ppl"][hf_domain] if is_demix else ev_d["ppl"]["ppl"]
        pad = padding_log_mass(c, docs[hf_domain], data, hf_domain if is_demix else None, batch_size)
        result["hf"] = {
            "domain": hf_domain,
            "hf_add_bos_token_false": hf,
            "hf_default_tokenizer_bos": hf_default,
            "demix_expert_lm_eval_windows": lm_eval_w,
            "demix_expert_blocks": blocks,
            "evaluate_documents_expert": ev_expert,
            "rel_hf_vs_demix_lm_eval_windows": _rel(hf, lm_eval_w),
            "rel_demix_blocks_vs_evaluate": _rel(blocks, ev_expert),
            "max_abs_logit_diff": rec.get("max_abs_logit_diff"),
            "padding_log_mass": pad,
            "hf_predicted_from_padding": lm_eval_w * math.exp(-pad),
            "rel_hf_vs_predicted": _rel(hf, lm_eval_w * math.exp(-pad)),
        }
    return result


@torch.no_grad()
def padding_log_mass(
    c: Consolidated,
    texts: Sequence[str],
    data: Union[str, Path],
    expert: Optional[str] = None,
    batch_size: int = 8,
) -> float:
    """Mean over the scored tokens (lm_eval windows) of log Z_all - log Z_real: the log-probability mass our model
    gives the padding rows of its embedding (ids >= the tokenizer's vocabulary; never targets), which an export with
    a trimmed vocabulary leaves out of its softmax. The export's perplexity is ours times exp(-this)."""
    tok = load_export_tokenizer(c, data)
    model = c.build_model().eval()
    ids = None if expert is None else [c.domains.index(expert)]
    wins = [
        w
        for t in texts
        for w in document_windows(tok.encode(t), int(c.cfg.model.seq_len), tok.bos_id, "lm_eval")
    ]
    W = pack_windows(wins, range(len(wins)), tok.eod_id)
    total, n = 0.0, 0.0
    for s in range(0, len(wins), batch_size):
        logits = model.lm_head(expert_hidden_states(model, W.tokens_NT[s : s + batch_size], ids)[0]).double()
        gap = torch.logsumexp(logits, -1) - torch.logsumexp(logits[..., : tok.vocab_size], -1)
        total += float((gap * W.score_NT[s : s + batch_size]).sum())
        n += float(W.score_NT[s : s + batch_size].sum())
    return total / max(n, 1.0)


def _print_check(res: dict[str, Any], out: Any = None) -> None:
    out = out or sys.stdout
    print("| domain | mode | tokens | harness token ppl | evaluate_documents ppl | rel. diff |", file=out)
    print("|---|---|---|---|---|---|", file=out)
    for r in res["rows"]:
        print(
            f"| {r['domain']} | {r['mode']} | {r['tokens']} | {r['harness']:.6f} | {r['evaluate_documents']:.6f} | "
            f"{r['rel_diff']:.2e} |",
            file=out,
        )
    if "hf" in res:
        h = res["hf"]
        print(f"\nhf export of {h['domain']} (max |logit diff| vs ours {h['max_abs_logit_diff']}):", file=out)
        for k in (
            "hf_add_bos_token_false",
            "demix_expert_lm_eval_windows",
            "hf_predicted_from_padding",
            "hf_default_tokenizer_bos",
            "demix_expert_blocks",
            "evaluate_documents_expert",
            "padding_log_mass",
        ):
            print(f"  {k}: {h[k]:.6g}", file=out)
        print(
            f"  rel hf vs demix expert (lm_eval windows): {h['rel_hf_vs_demix_lm_eval_windows']:.2e}; hf vs that "
            f"corrected for the padding rows' mass: {h['rel_hf_vs_predicted']:.2e}; "
            f"demix expert (blocks) vs evaluate: {h['rel_demix_blocks_vs_evaluate']:.2e}",
            file=out,
        )


# ---------------------------------------------------------------- CLI -------------------------------------------


def run_lm_eval(argv: Sequence[str]) -> int:
    """lm-eval's own CLI (`lm-eval run ...`) with the demix model registered."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    import launcher.evaluation.harness  # noqa: F401  (registers "demix" under the module's real name)

    argv = list(argv)
    for i, arg in enumerate(
        argv
    ):  # a folder `tasks` wrote is verified as `check` does before lm-eval imports it
        path = (
            argv[i + 1]
            if arg == "--include_path" and i + 1 < len(argv)
            else (arg.partition("=")[2] if arg.startswith("--include_path=") else None)
        )
        if path and (Path(path) / "demix_tasks.json").is_file():
            verify_tasks_dir(path)
    saved, bytecode = sys.argv, sys.dont_write_bytecode
    sys.argv = ["lm-eval"] + (argv if argv and argv[0] in ("run", "ls", "validate") else ["run"] + argv)
    sys.dont_write_bytecode = (
        True  # no __pycache__ left in a task folder (`verify_tasks_dir` would refuse it)
    )
    try:
        setup_logging()
        cli = HarnessCLI()
        cli.execute(cli.parse_args())
    finally:
        sys.argv, sys.dont_write_bytecode = saved, bytecode
    return 0


@cli_main
def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":  # everything after `run` is lm-eval's
        return run_lm_eval(argv[1:])
    p = argparse.ArgumentParser(
        prog="python -m launcher.evaluation.harness", description=__doc__.split("\n\n")[0]
    )
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tasks", help="write local lm-eval tasks (YAML + JSONL) from a prepared split")
    t.add_argument("--data", required=True, help="prepared tokens root, e.g. artifacts/demo/tokens")
    t.add_argument(
        "--tokenizer",
        default="gpt2",
        choices=("gpt2", "sentencepiece"),
        help="tokenizer of the stored n_tokens (the models' tokenizer)",
    )
    t.add_argument("--out", required=True, help="task folder (pass it to lm-eval as --include_path)")
    t.add_argument("--split", default="test", choices=("train", "valid", "test"))
    t.add_argument("--max-docs", type=positive_int, default=None, help="first N documents of each domain")
    t.add_argument("--domains", help="comma-separated subset of the domains (default: all)")
    t.add_argument("--seed", type=random_seed, default=0, help="distractors of the multiple-choice task")
    t.add_argument(
        "--docs-from",
        choices=("gpt2", "sentencepiece"),
        help="prepared dataset whose corpus and split give the documents (default: --tokenizer's)",
    )
    sub.add_parser(
        "run", help="lm-eval's CLI with model demix registered: run ARGS... (lm-eval run's arguments)"
    )
    c = sub.add_parser("check", help="harness token perplexity vs evaluate_documents (and an hf export)")
    c.add_argument("checkpoint")
    c.add_argument("--tasks-dir", required=True)
    c.add_argument("--data", required=True)
    c.add_argument("--domains", help="comma-separated (default: every task's domain)")
    c.add_argument("--modes", default="cached,naive", help=f"comma-separated subset of {','.join(MODES)}")
    c.add_argument("--hf-domain", help="also export this expert and run the stock hf model on its task")
    c.add_argument("--batch-size", type=positive_int, default=8)
    c.add_argument("--model-args", default="", help="extra demix model_args, e.g. posterior=previous_token")
    c.add_argument(
        "--tolerance", type=nonneg_float, default=1e-4, help="largest relative difference accepted"
    )
    c.add_argument("--json", help="also write the result here")
    a = p.parse_args(argv)
    if a.command == "tasks":
        rec = write_tasks(
            a.data,
            a.tokenizer,
            a.out,
            a.split,
            a.max_docs,
            [d.strip() for d in a.domains.split(",")] if a.domains else None,
            a.seed,
            a.docs_from,
        )
        for d, r in rec["domains"].items():
            print(f"{r['task']}: {r['documents']} documents, {r['tokens']} tokens")
        print(f"{MC_TASK}: {rec['continuation']['documents']} documents")
        print(f"written: {a.out} (lm-eval --include_path {a.out} --tasks {PPL_GROUP},{MC_TASK})")
        return 0
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"--modes {bad}: choose from {', '.join(MODES)}")
    res = check(
        a.checkpoint,
        a.tasks_dir,
        a.data,
        [d.strip() for d in a.domains.split(",")] if a.domains else None,
        modes,
        a.hf_domain,
        a.batch_size,
        a.model_args,
    )
    _print_check(res)
    if a.json:
        write_json_atomic(Path(a.json), res)
    worst = max((r["rel_diff"] for r in res["rows"]), default=0.0)
    if worst > a.tolerance:
        print(
            f"error: harness and evaluate_documents differ by {worst:.2e} relative (> {a.tolerance})",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    from launcher.evaluation.harness import main as _main  # the registered module, not this __main__ copy

    exit_process(_main())
