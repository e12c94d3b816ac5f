"""Every expert in one batched pass: per-expert token log-likelihoods for the inference-time mixture (DEMix §5).

Shape legend: E experts evaluated, B sequences, T tokens, D model dim, F ffn dim, N rows (tokens) of one
expert's group (= B*T), V vocabulary, R rows of a log-prob chunk.

A DEMix LM routed to expert j computes p(x_t | x_<t, D = j). Since every layer is a DEMix layer, the hidden
states of the E routings differ from the first expert layer on, so the E "models" share weights but not
activations. Instead of E passes (or E model copies), the batch is replicated E times (E*B sequences) from the
first expert layer on; attention, layer norms and embeddings run once on the E*B batch with the shared weights,
and each DEMix layer runs as a grouped matmul over stacked expert weights:

    h_END = gelu(x_END @ W1_EFD^T + b1_EF)        (torch.baddbmm, E independent (N x D) @ (D x F) products)
    y_END = h_ENF @ W2_EDF^T + b2_ED

Rows e*B + b of the replicated batch are sequence b routed to expert expert_ids[e]. Layers before the first
expert layer (GShard/CSE put dense layers first) run once on B sequences. The target log-probabilities

    ll[e, b, t] = log softmax(h_t W_emb^T)[x_{t+1}]

are computed R rows at a time, so E*B*T*V logits are never materialised. Dense models (no DEMix layer) give E = 1.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from model.demix import DemixFFN

DEFAULT_LOGIT_BUDGET = 1 << 23  # logits (floats) per chunk: 32 MiB in float32


def demix_expert_ids(model: torch.nn.Module) -> list[int]:
    """Global expert ids held by every DEMix layer of `model` ([] when it has none)."""
    ids = [list(b.ffn.expert_ids) for b in model.blocks if isinstance(b.ffn, DemixFFN)]
    if not ids:
        return []
    if any(i != ids[0] for i in ids):
        raise ValueError(f"DEMix layers hold different experts: {ids}")
    return ids[0]


def grouped_expert_ffn(ffn: DemixFFN, x_END: torch.Tensor, expert_ids: Sequence[int]) -> torch.Tensor:
    """Group e of `x_END` through expert `expert_ids[e]` of one DEMix layer, as one batched matmul per linear."""
    mlps = [ffn.experts[str(e)] for e in expert_ids]
    w1_EFD = torch.stack([m.fc1.weight for m in mlps])
    b1_E1F = torch.stack([m.fc1.bias for m in mlps])[:, None]
    w2_EDF = torch.stack([m.fc2.weight for m in mlps])
    b2_E1D = torch.stack([m.fc2.bias for m in mlps])[:, None]
    h_ENF = F.gelu(torch.baddbmm(b1_E1F, x_END, w1_EFD.transpose(1, 2)))
    return mlps[0].dropout(torch.baddbmm(b2_E1D, h_ENF, w2_EDF.transpose(1, 2)))


def expert_hidden_states(
    model: torch.nn.Module, tokens_BT: torch.Tensor, expert_ids: Optional[Sequence[int]] = None,
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
    if T > model.cfg.seq_len:
        raise ValueError(f"sequence of {T} tokens exceeds the model's context of {model.cfg.seq_len}")
    pos_T = torch.arange(T, device=tokens_BT.device)
    x = model.drop(model.wte(tokens_BT) + model.wpe(pos_T))  # B T D until the first expert layer, then E*B T D
    replicated = False
    for block in model.blocks:
        x = x + block.attn(block.ln1(x))
        h = block.ln2(x)
        if isinstance(block.ffn, DemixFFN):
            if not replicated:
                x, h = (t.unsqueeze(0).expand(E, *t.shape).reshape(E * B, T, -1) for t in (x, h))
                replicated = True
            y = grouped_expert_ffn(block.ffn, h.reshape(E, B * T, -1), experts).reshape(E * B, T, -1)
        else:
            y = block.ffn(h, torch.zeros(h.shape[0], dtype=torch.long, device=h.device)).hidden
        x = x + y
    if not replicated:
        x = x.unsqueeze(0).expand(E, *x.shape).reshape(E * B, T, -1)
    return model.ln_f(x).view(E, B, T, -1)


def target_log_probs(
    model: torch.nn.Module, h_ND: torch.Tensor, targets_N: torch.Tensor, logit_budget: int = DEFAULT_LOGIT_BUDGET,
) -> torch.Tensor:
    """log p(target | h) for each row, N, through the tied LM head, R rows at a time (float32 log-softmax)."""
    rows = max(1, logit_budget // model.vocab_size)
    out_N = torch.empty(h_ND.shape[0], dtype=torch.float32, device=h_ND.device)
    for s in range(0, h_ND.shape[0], rows):
        logits_RV = model.lm_head(h_ND[s:s + rows]).float()
        tgt_R = targets_N[s:s + rows]
        out_N[s:s + rows] = logits_RV.gather(1, tgt_R[:, None])[:, 0] - torch.logsumexp(logits_RV, dim=1)
    return out_N


@torch.no_grad()
def expert_log_likelihoods(
    model: torch.nn.Module, tokens_BT: torch.Tensor, targets_BT: torch.Tensor,
    expert_ids: Optional[Sequence[int]] = None, logit_budget: int = DEFAULT_LOGIT_BUDGET,
) -> torch.Tensor:
    """ll[e, b, t] = log p(targets[b, t] | tokens[b, :t+1], D = expert_ids[e]), E B T, in one batched pass."""
    h_EBTD = expert_hidden_states(model, tokens_BT, expert_ids)
    E, B, T, D = h_EBTD.shape
    targets_N = targets_BT.reshape(1, B * T).expand(E, B * T).reshape(-1)
    return target_log_probs(model, h_EBTD.reshape(E * B * T, D), targets_N, logit_budget).view(E, B, T)


@torch.no_grad()
def sequential_log_likelihoods(
    model: torch.nn.Module, tokens_BT: torch.Tensor, targets_BT: torch.Tensor,
    expert_ids: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """The reference: E ordinary forward passes, pass e routing every sequence to expert_ids[e], E B T."""
    held = demix_expert_ids(model)
    experts = list(held if expert_ids is None else expert_ids) if held else [None]
    out = []
    for e in experts:
        dom_B = torch.full((tokens_BT.shape[0],), 0 if e is None else e, dtype=torch.long, device=tokens_BT.device)
        out.append(-model(tokens_BT, dom_B, targets_BT, return_logits=False).token_loss)
    return torch.stack(out)


@torch.no_grad()
def next_token_log_probs(
    model: torch.nn.Module, tokens_BT: torch.Tensor, expert_ids: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """Each expert's next-token distribution after the last position, log-softmaxed, E B V (for generation)."""
    h_EBD = expert_hidden_states(model, tokens_BT, expert_ids)[:, :, -1]
    return torch.log_softmax(model.lm_head(h_EBD).float(), dim=-1)
