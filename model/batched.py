"""Every expert in one batched pass: per-expert token log-likelihoods for the inference-time mixture (DEMix §5).

Shape legend: E experts evaluated, B sequences, T tokens, D model dim, N rows (tokens) of one expert's group
(= B*T), V vocabulary, R rows and C vocabulary entries of one LM-head block.

A DEMix LM routed to expert j computes p(x_t | x_<t, D = j). Since every layer is a DEMix layer, the hidden
states of the E routings differ from the first expert layer on, so the E "models" share weights but not
activations. Instead of E passes (or E model copies), the batch fans out E ways at the first expert layer:

* layers before it (GShard/CSE put dense layers first), the embeddings and that layer's attention and layer
  norm run once on B sequences;
* the first expert layer feeds the one shared input to every expert and adds each output to the one shared
  residual stream (a broadcast: the batch is never replicated), giving E*B sequences, row e*B + b being
  sequence b routed to expert expert_ids[e];
* from there attention and layer norms run once on the E*B batch with the shared weights, and each DEMix layer
  runs every expert on its own B*T rows (the expert's own weights, in place: no stacked copy to build or cache;
  on CPU this is as fast as a grouped torch.baddbmm over stacked weights, which would cost a copy of every
  evaluated expert per call or a second resident copy of the expert weights if cached).

`shared_trunk_features` is that one shared input of the first expert layer (its `ln2` output, B T D): the
representation the router vectors route on (model/mixture.py, router eqs. R1-R4); it reads shared weights only.

`expert_log_likelihoods` fans out at most DEFAULT_FANOUT_TOKENS expert-tokens (E*B*T) at once, taking the
experts in groups beyond that, so the activations held at once stay ~fanout x D whatever E and B are (a group
repeats only the shared layers).

The target log-probabilities go through the tied LM head without ever materialising logits beyond one block:

    ll[e, b, t] = h_t . W_emb[x_{t+1}]  -  logsumexp_v (h_t . W_emb[v])

The target logit is a gather of embedding rows (a D-dot per token); the log-partition is computed R rows x C
vocabulary entries at a time (one GEMM block, then exp and sum in place on it: two passes over the block) and
the per-block sums are added at the end of each row block. No max is subtracted: in float32 exp(l) is exact to
rounding for l in (-87, 88.7), and a row is taken on this fast path only when it is safe,

    sum_v exp(l_v) finite  and  l_target >= -50,

so nothing overflowed and the sum is at least exp(-50) while the terms that underflow (l_v < -87) add at most
V * exp(-87) ~ 1e-33 for V = 50k, a relative error below 1e-11. Any other row (logits beyond float32's exp range,
never seen in a trained LM) is recomputed by the shifted log-sum-exp (torch.logsumexp). This removes the max and
subtract passes of the shifted form, a fifth of the head's time on CPU. Peak memory of the head is one R x C block
plus O(R * V / C) scalars, independent of E, B, T and V (DEFAULT_LOGIT_BUDGET logits per block: 2 MiB of
float32 on CPU, sized to stay in the L2 cache, which makes the head faster than one big GEMM followed by a
full log-softmax; larger on CUDA where a block is a kernel launch). Dense models (no DEMix layer) give E = 1.

With the GPT-2 vocabulary the LM head is most of the FLOPs at small width (2*D*V per expert-token, the same in
a batched and in a sequential pass), so the batched pass cannot beat E passes that use the same head by more
than the shared embedding and first-layer attention; `expert_log_likelihoods(model, x, y, [j])` is that
sequential pass for expert j. `sequential_log_likelihoods` is the reference through GPT.forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from model.demix import DemixFFN
from model.gpt import GPT, Block, TiedLMHead
from model.mlp import MLP, autocast_dtype

DEFAULT_LOGIT_BUDGET = 1 << 19  # logits per LM-head block on CPU: 2 MiB of float32 (one L2 cache)
DEFAULT_LOGIT_BUDGET_CUDA = 1 << 26  # on accelerators a block is a kernel launch: 256 MiB of float32
DEFAULT_HEAD_ROWS = 1024  # rows per block: keeps the head GEMM large (M = 1024, K = D, N = C)
DEFAULT_FANOUT_TOKENS = 8192  # expert-tokens (E*B*T) fanned out at once: bounds the E-way activations
# rows whose target logit is lower take the shifted log-sum-exp (module docstring)
MIN_FAST_TARGET_LOGIT = -50.0


def demix_expert_ids(model: GPT) -> list[int]:
    """Global expert ids held by every DEMix layer of `model` ([] when it has none)."""
    ids = [list(b.ffn.expert_ids) for b in model.blocks if isinstance(b.ffn, DemixFFN)]
    if not ids:
        return []
    if any(i != ids[0] for i in ids):
        raise ValueError(f"DEMix layers hold different experts: {ids}")
    return ids[0]


def grouped_expert_ffn(ffn: DemixFFN, x_END: torch.Tensor, expert_ids: Sequence[int]) -> torch.Tensor:
    """Group e of `x_END` through expert `expert_ids[e]` of one DEMix layer, E N D. `x_END` may be a stride-0
    expansion of one N x D input (the first expert layer): nothing is copied for it."""
    first = ffn.experts[str(expert_ids[0])]
    assert isinstance(first, MLP)  # a DEMix expert
    out_END = torch.empty(
        x_END.shape[0],
        x_END.shape[1],
        first.fc2.out_features,
        dtype=x_END.dtype,
        device=x_END.device,
    )
    for e, j in enumerate(expert_ids):
        out_END[e] = ffn.experts[str(j)](x_END[e])
    return out_END


def _shared_trunk(model: GPT, tokens_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """The layers every routing shares: embeddings, then each block up to the first expert layer's FFN input.
    Returns (residual x, h = ln2(x) of the first DEMix block, its index); for a model without DEMix layers
    (x after every block, None, number of blocks)."""
    T = tokens_BT.shape[1]
    if T > model.cfg.seq_len:
        raise ValueError(f"sequence of {T} tokens exceeds the model's context of {model.cfg.seq_len}")
    pos_T = torch.arange(T, device=tokens_BT.device)
    x = model.drop(model.wte(tokens_BT) + model.wpe(pos_T))
    for i, block in enumerate(model.blocks):
        assert isinstance(block, Block)
        x = x + block.attn(block.ln1(x))
        h = block.ln2(x)
        if isinstance(block.ffn, DemixFFN):
            return x, h, i
        x = x + block.ffn(h, torch.zeros(h.shape[0], dtype=torch.long, device=h.device)).hidden
    return x, None, len(model.blocks)


def shared_trunk_features(model: GPT, tokens_BT: torch.Tensor) -> torch.Tensor:
    """f(x)_t, B T D: the input of the first DEMix layer's FFN (`block.ln2(x)` of the first block whose ffn is a
    DemixFFN, after the embeddings, the dense blocks before it and its attention) - the one shared input that
    `expert_hidden_states` fans out to every expert. It reads only shared weights, so every model holding the
    same shared weights gives the same features whichever experts it holds (router vectors, model/mixture.py
    "router eqs. R1-R4"). ValueError for a model without a DEMix layer."""
    h = _shared_trunk(model, tokens_BT)[1] if demix_expert_ids(model) else None
    if h is None:
        raise ValueError("this model has no DEMix layer: there is no expert layer input to route on")
    return h


def expert_hidden_states(
    model: GPT,
    tokens_BT: torch.Tensor,
    expert_ids: Sequence[int] | None = None,
) -> torch.Tensor:
    """Final (post ln_f) hidden states of `model` routed to each of `expert_ids` (default: all it holds),
    E B T D. For a model without DEMix layers E = 1 and `expert_ids` must be None."""
    held = demix_expert_ids(model)
    if not held:
        if expert_ids is not None:
            raise ValueError("this model has no DEMix layers: there are no experts to choose")
        experts: list[int] = []
    else:
        experts = list(held if expert_ids is None else expert_ids)
        missing = [e for e in experts if e not in held]
        if missing or not experts:
            raise ValueError(f"expert ids {experts}: need a non-empty subset of the held experts {held}")
    E, (B, T) = max(1, len(experts)), tokens_BT.shape
    # B T D until the first expert layer (`_shared_trunk`), then E*B T D
    x, h, first = _shared_trunk(model, tokens_BT)
    if h is None:  # no expert layer: E = 1
        return model.ln_f(x).unsqueeze(0)
    # one shared input for every expert, one shared residual broadcast over E
    first_ffn = model.blocks[first].ffn
    assert isinstance(first_ffn, DemixFFN)
    y_EBTD = grouped_expert_ffn(first_ffn, h.reshape(1, B * T, -1).expand(E, -1, -1), experts)
    x = (x + y_EBTD.view(E, B, T, -1)).view(E * B, T, -1)
    for block in list(model.blocks)[first + 1 :]:
        assert isinstance(block, Block)
        x = x + block.attn(block.ln1(x))
        h = block.ln2(x)
        if isinstance(block.ffn, DemixFFN):
            x = x + grouped_expert_ffn(block.ffn, h.reshape(E, B * T, -1), experts).view(E * B, T, -1)
        else:
            x = x + block.ffn(h, torch.zeros(h.shape[0], dtype=torch.long, device=h.device)).hidden
    return model.ln_f(x).view(E, B, T, -1)


def _default_budget(device: torch.device) -> int:
    return DEFAULT_LOGIT_BUDGET if device.type == "cpu" else DEFAULT_LOGIT_BUDGET_CUDA


def target_log_probs(
    model: GPT,
    h_ND: torch.Tensor,
    targets_N: torch.Tensor,
    logit_budget: int | None = None,
    rows: int = DEFAULT_HEAD_ROWS,
) -> torch.Tensor:
    """log p(target | h) for each row, N (float32), through the tied LM head, in blocks of at most
    `logit_budget` logits: R = min(N, rows, budget) rows x C = budget // R vocabulary entries."""
    budget = logit_budget or _default_budget(h_ND.device)
    head = model.lm_head
    if type(head) is not TiedLMHead:  # e.g. a vocab-parallel head: its own logits, whole rows at a time
        return _target_log_probs_rows(head, h_ND, targets_N, budget, model.vocab_size)
    W_VD = head.embedding[0].weight
    (N, _), V = h_ND.shape, W_VD.shape[0]
    R = max(1, min(N, rows, budget))
    C = max(1, min(V, budget // R))
    n_blocks = -(-V // C)
    # torch.mm(..., out=) is never autocast: under autocast (evaluation in the training precision) take the
    # allocating mm, which is, and upcast its bf16/fp16 block
    f32 = (
        h_ND.dtype == torch.float32
        and W_VD.dtype == torch.float32
        and autocast_dtype(h_ND.device.type) is None
    )
    buf = torch.empty(R * C, dtype=torch.float32, device=h_ND.device) if f32 else None
    sum_KR = torch.empty(n_blocks, R, dtype=torch.float32, device=h_ND.device)  # per block: sum exp(l)
    out_N = torch.empty(N, dtype=torch.float32, device=h_ND.device)
    for s in range(0, N, R):
        h_RD = h_ND[s : s + R]
        r = h_RD.shape[0]
        for k, v in enumerate(range(0, V, C)):
            w_CD = W_VD[v : v + C]
            if buf is not None:  # f32
                l_RC = torch.mm(h_RD, w_CD.t(), out=buf[: r * w_CD.shape[0]].view(r, w_CD.shape[0]))
            else:
                l_RC = torch.mm(h_RD, w_CD.t()).float()
            torch.sum(l_RC.exp_(), dim=1, out=sum_KR[k, :r])
        lse_R = sum_KR[:, :r].sum(dim=0).log_()
        tgt_R = (h_RD.float() * W_VD[targets_N[s : s + R]].float()).sum(dim=1)
        unsafe_R = ~(torch.isfinite(lse_R) & (tgt_R >= MIN_FAST_TARGET_LOGIT))
        if unsafe_R.any():  # outside float32's exp range: the shifted log-sum-exp for those rows
            rows_I = unsafe_R.nonzero()[:, 0]
            lse_R[rows_I] = _log_partition_rows(head, h_RD[rows_I], budget)
        out_N[s : s + r] = tgt_R - lse_R
    return out_N


def _log_partition_rows(head: TiedLMHead, h_ND: torch.Tensor, budget: int) -> torch.Tensor:
    """logsumexp over the vocabulary of each row's logits, shifted by the row max (torch.logsumexp), whole rows
    of logits at a time within `budget`."""
    rows = max(1, budget // head.embedding[0].weight.shape[0])
    return torch.cat(
        [torch.logsumexp(head(h_ND[s : s + rows]).float(), dim=1) for s in range(0, h_ND.shape[0], rows)]
    )


def _target_log_probs_rows(head, h_ND, targets_N, budget: int, vocab: int) -> torch.Tensor:
    rows = max(1, budget // vocab)
    out_N = torch.empty(h_ND.shape[0], dtype=torch.float32, device=h_ND.device)
    for s in range(0, h_ND.shape[0], rows):
        logits_RV = head(h_ND[s : s + rows]).float()
        out_N[s : s + rows] = logits_RV.gather(1, targets_N[s : s + rows, None])[:, 0] - torch.logsumexp(
            logits_RV, 1
        )
    return out_N


def expert_log_likelihoods(
    model: GPT,
    tokens_BT: torch.Tensor,
    targets_BT: torch.Tensor,
    expert_ids: Sequence[int] | None = None,
    logit_budget: int | None = None,
    fanout_tokens: int = DEFAULT_FANOUT_TOKENS,
) -> torch.Tensor:
    """ll[e, b, t] = log p(targets[b, t] | tokens[b, :t+1], D = expert_ids[e]), E B T, in one batched pass.
    Experts fan out at most max(1, fanout_tokens // (B*T)) at a time, which bounds the activations held at once
    to ~fanout_tokens x D (groups repeat only the shared layers). With one expert id this is the efficient
    single-expert pass (the fair sequential baseline)."""
    held = demix_expert_ids(model)
    experts = held if expert_ids is None else list(expert_ids)
    B, T = targets_BT.shape
    groups: list[Sequence[int] | None] = [expert_ids]  # one group (checked by expert_hidden_states)
    if held and experts:
        per = max(1, fanout_tokens // (B * T))
        groups = [experts[i : i + per] for i in range(0, len(experts), per)]
    out = []
    with torch.inference_mode():
        for group in groups:
            h_EBTD = expert_hidden_states(model, tokens_BT, group)
            D = h_EBTD.shape[-1]
            # the head per expert: an expert's numbers never depend on which other experts run beside it
            out += [
                target_log_probs(model, h_BTD.reshape(B * T, D), targets_BT.reshape(-1), logit_budget).view(
                    1, B, T
                )
                for h_BTD in h_EBTD
            ]
        ll = out[0] if len(out) == 1 else torch.cat(out)
    return ll.clone()  # an ordinary tensor: callers may update it in place


@torch.no_grad()
def sequential_log_likelihoods(
    model: GPT,
    tokens_BT: torch.Tensor,
    targets_BT: torch.Tensor,
    expert_ids: Sequence[int] | None = None,
) -> torch.Tensor:
    """The reference: E ordinary forward passes (GPT.forward: full B x T x V logits, cross-entropy), pass e
    routing every sequence to expert_ids[e], E B T."""
    held = demix_expert_ids(model)
    experts = list(held if expert_ids is None else expert_ids) if held else [None]
    out = []
    for e in experts:
        dom_B = torch.full(
            (tokens_BT.shape[0],), 0 if e is None else e, dtype=torch.long, device=tokens_BT.device
        )
        out.append(-model(tokens_BT, dom_B, targets_BT, return_logits=False).token_loss)
    return torch.stack(out)


@torch.no_grad()
def next_token_log_probs(
    model: GPT,
    tokens_BT: torch.Tensor,
    expert_ids: Sequence[int] | None = None,
) -> torch.Tensor:
    """Each expert's next-token distribution after the last position, log-softmaxed, E B V (for generation)."""
    h_EBD = expert_hidden_states(model, tokens_BT, expert_ids)[:, :, -1]
    return torch.log_softmax(model.lm_head(h_EBD).float(), dim=-1)
