"""The windows a document is scored in: `document_windows` cuts `[bos] + ids` into model inputs that score every
token once (evaluate's blocks, or lm-eval's rolling windows), `pack_windows` pads them into one batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

WINDOWS: tuple[str, ...] = ("blocks", "lm_eval")


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
