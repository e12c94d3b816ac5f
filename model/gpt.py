"""A GPT-3-style decoder in plain PyTorch: pre-LayerNorm, learned positions, GELU MLP of width 4d,
tied input/output embeddings, dropout, SDPA attention, and a feed-forward seam (model/ffn.py).

Shape legend: B batch (sequences), T tokens, D model dim, H heads (local to this rank under tensor
parallelism), K head dim, V vocabulary (local shard under tensor parallelism).

The model never looks up a process group. Tensor parallelism (parallel/) swaps the linear layers, the
embedding, the LM head and the loss from outside; the attention infers its local head count from the
width of its qkv projection, and the qkv output is laid out head-major ([H, 3, K]) so that a contiguous
column split gives each tensor-parallel rank whole heads.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from model.config import ModelConfig
from model.ffn import FFNOutput, build_ffn


@dataclass
class GPTOutput:
    """Named results of a forward pass."""

    logits: torch.Tensor | None  # B T V (V local under tensor parallelism); None when not requested
    loss: torch.Tensor | None = None  # mean LM loss over scored tokens
    token_loss: torch.Tensor | None = None  # B T, per-token negative log-likelihood (0 where unscored)
    aux_loss: torch.Tensor | None = None  # sum of the FFN layers' auxiliary losses (weighted)
    ffn_stats: dict[str, torch.Tensor] = field(default_factory=dict)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)  # output laid out as [H, 3, K]
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        # scaled init (GPT.reset_parameters). A plain flag: torch types Module.__setattr__ for tensors and modules only
        self.proj.is_residual_projection = True  # type: ignore[assignment]
        self.dropout_p = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        qkv_BTH3K = self.qkv(x_BTD).view(B, T, -1, 3, self.head_dim)
        q_BHTK, k_BHTK, v_BHTK = (qkv_BTH3K[:, :, :, i].transpose(1, 2) for i in range(3))
        y_BHTK = F.scaled_dot_product_attention(
            q_BHTK, k_BHTK, v_BHTK, is_causal=True, dropout_p=self.dropout_p if self.training else 0.0
        )
        y_BTD = y_BHTK.transpose(1, 2).reshape(B, T, -1)
        return self.resid_dropout(self.proj(y_BTD))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, expert_ids: Sequence[int]) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.ffn = build_ffn(cfg, layer_idx, expert_ids)

    def forward(
        self, x_BTD: torch.Tensor, domain_ids_B: torch.Tensor | None
    ) -> tuple[torch.Tensor, FFNOutput]:
        x_BTD = x_BTD + self.attn(self.ln1(x_BTD))
        f = self.ffn(self.ln2(x_BTD), domain_ids_B)
        return x_BTD + f.hidden, f


class TiedLMHead(nn.Module):
    """logits = h @ W_emb^T, sharing the token embedding's weight."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embedding = [embedding]  # a list: do not register the embedding twice as a submodule

    def forward(self, h_BTD: torch.Tensor) -> torch.Tensor:
        return F.linear(h_BTD, self.embedding[0].weight)


class TokenCrossEntropy(nn.Module):
    """Per-token cross-entropy (B T), float32 for stability. Tensor parallelism swaps in the vocab-parallel one."""

    def forward(self, logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        B, T, V = logits_BTV.shape
        return F.cross_entropy(
            logits_BTV.float().view(B * T, V), targets_BT.reshape(-1), reduction="none"
        ).view(B, T)


# A chunk of the loss holds at most this many logits: 2^26, i.e. 256 MiB as float32 (1334 rows of a 50,304-entry
# vocabulary). Whole-vocabulary logits at micro-batch 8 x 2048 are 824 M entries: 6.1 GiB of loss temporaries
# plus ~3 GiB saved for backward at gpt3-small (experiments/results/loss_memory.md); one chunk's temporaries
# measured 0.59 GiB (bf16 logits, fp32 copy, log-softmax and its gradient, ~9.4 bytes per entry), while
# 1334 x 50k x d matmuls are still large enough to run at full speed on a GPU (M >= 1024). Smaller budgets save
# little more (the model's other activations are GiBs) and launch more, smaller kernels.
LOSS_CHUNK_LOGITS = 1 << 26


def chunked_token_loss(
    head_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x_BTX: torch.Tensor,
    targets_BT: torch.Tensor,
    rows: int,
) -> torch.Tensor:
    """head_loss(x, targets) -> per-token loss, evaluated `rows` tokens at a time so that no B x T x V
    logits (or their fp32 copies) ever exist; returns B T.

    Each chunk runs under non-reentrant activation checkpointing: its forward keeps nothing but its loss
    (the inputs are views of `x_BTX`), and backward recomputes that chunk's logits and differentiates them,
    one chunk at a time. Every row's arithmetic is today's (the cross-entropy is row-wise), so loss and
    gradients equal the unchunked ones up to matmul blocking; the gradient of a weight shared by the chunks
    (the tied embedding) is summed by autograd in the weight's own dtype (fp32 master weights under autocast).
    Cost: the head's forward runs twice (8 N V D FLOPs instead of 6 N V D). With B T <= rows it is one plain
    call, no recompute."""
    B, T = targets_BT.shape
    N = B * T
    if N <= rows:
        return head_loss(x_BTX, targets_BT)
    x_NX, t_N = x_BTX.reshape(N, -1), targets_BT.reshape(N)
    # split: its backward concatenates the chunks' gradients once
    chunks = zip(x_NX.split(rows), t_N.split(rows))
    # evaluation: nothing to save, nothing to recompute
    if not (torch.is_grad_enabled() and x_BTX.requires_grad):
        parts = [head_loss(x_cX[None], t_c[None]) for x_cX, t_c in chunks]
    else:
        parts = [
            checkpoint(head_loss, x_cX[None], t_c[None], use_reentrant=False, preserve_rng_state=False)
            for x_cX, t_c in chunks
        ]
    return torch.cat(parts, dim=1).view(B, T)


class GPT(nn.Module):
    """The decoder. `expert_ids` are the global expert ids this instance holds in its expert layers
    (default: all of them). `num_experts` is the resolved number of experts (domains for DEMix)."""

    # swapped from outside for their vocab-parallel versions (parallel/tensor_parallel.py)
    lm_head: nn.Module
    loss_fn: nn.Module

    def __init__(
        self,
        cfg: ModelConfig,
        expert_ids: Sequence[int] | None = None,
        tensor_parallel: int = 1,
        init_seed: int | None = None,
        vocab_rows: int | None = None,
    ) -> None:
        super().__init__()
        if init_seed is None:  # follows torch.manual_seed; drawn before module construction consumes the RNG
            init_seed = int(torch.randint(0, 2**31 - 1, (), device="cpu").item())
        self.cfg = cfg
        n_exp = max(1, cfg.ffn.num_experts)
        self.expert_ids = sorted(expert_ids) if expert_ids is not None else list(range(n_exp))
        bad = [e for e in self.expert_ids if not 0 <= e < n_exp]
        if bad:
            raise ValueError(f"expert ids {bad} are out of range for {n_exp} experts")
        # Embedding rows: the vocabulary padded for `tensor_parallel` ranks, or `vocab_rows` (a checkpoint's own
        # padding: a run at tp=2 pads further than tp=1, and its padding rows take part in the softmax).
        self.vocab_size = vocab_rows or cfg.padded_vocab_size(tensor_parallel)
        if self.vocab_size < cfg.vocab_size:
            raise ValueError(f"vocab_rows={vocab_rows} is smaller than model.vocab_size={cfg.vocab_size}")
        self.wte = nn.Embedding(self.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i, self.expert_ids) for i in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = TiedLMHead(self.wte)
        self.loss_fn = TokenCrossEntropy()
        self.loss_chunk_logits = LOSS_CHUNK_LOGITS  # see chunked_token_loss; a plain attribute, not state
        self.reset_parameters(init_seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """GPT-2 initialisation, N(0, 0.02) with residual projections scaled by 1/sqrt(2L), where every
        tensor's values are a pure function of (seed, its name, its device type). A rank that builds only its
        own experts therefore gets exactly the weights the full model would have (DEMix: experts start
        equal-seeded per layer and domain, independent of the parallel layout).

        Each tensor is drawn by a generator on its own device: a model built on the host draws on the CPU
        generator; one built directly on a GPU (`with torch.device("cuda"): GPT(...)`) draws on the CUDA
        generator, equally deterministic, but its values differ from the host-built model's."""
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and not module.weight.is_meta:
                std = self.cfg.init_std
                if getattr(module, "is_residual_projection", False):
                    std = std / math.sqrt(2 * self.cfg.n_layers)
                device = module.weight.device
                gen = torch.Generator(device=device).manual_seed(
                    (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)
                )
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen, device=device) * std)
                bias = getattr(module, "bias", None)  # nn.Embedding has none, a Linear may have None
                if bias is not None:
                    bias.zero_()
            elif isinstance(module, nn.LayerNorm) and not module.weight.is_meta:
                module.reset_parameters()

    def forward(
        self,
        tokens_BT: torch.Tensor,
        domain_ids_B: torch.Tensor | None = None,
        targets_BT: torch.Tensor | None = None,
        loss_mask_BT: torch.Tensor | None = None,
        return_logits: bool = True,
    ) -> GPTOutput:
        """Run the decoder. With `targets_BT`, also the LM loss (mean over tokens where `loss_mask_BT`
        is 1, e.g. excluding a prepended domain token) and per-token losses. With `return_logits=False` (the
        trainer's path) the head and the loss run `chunked_token_loss`'s chunks of tokens, so B x T x V logits
        never exist, and without targets the head is not run at all."""
        B, T = tokens_BT.shape
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence of {T} tokens exceeds the model's context of {self.cfg.seq_len}")
        pos_T = torch.arange(T, device=tokens_BT.device)
        x_BTD = self.drop(self.wte(tokens_BT) + self.wpe(pos_T))
        aux, stats = None, {}
        for i, block in enumerate(self.blocks):
            x_BTD, f = block(x_BTD, domain_ids_B)
            if f.aux_loss is not None:
                aux = f.aux_loss if aux is None else aux + f.aux_loss
            stats.update({f"layer{i}/{k}": v for k, v in f.stats.items()})
        h_BTD = self.ln_f(x_BTD)
        # Without logits to return, the loss goes from hidden states to per-token losses a chunk of tokens at a
        # time and the full B x T x V logits never exist; nothing is computed when there is no loss either.
        logits_BTV = self.lm_head(h_BTD) if return_logits else None
        out = GPTOutput(logits=logits_BTV, aux_loss=aux, ffn_stats=stats)
        if targets_BT is not None:
            if logits_BTV is None:
                tok_BT = chunked_token_loss(self._head_loss, h_BTD, targets_BT, self._loss_chunk_rows())
            else:  # the logits exist anyway: chunk only the float32 loss over them
                rows = max(1, self.loss_chunk_logits // logits_BTV.shape[-1])
                tok_BT = chunked_token_loss(self.loss_fn, logits_BTV, targets_BT, rows)
            if loss_mask_BT is None:
                out.loss = tok_BT.mean()
            else:
                mask_BT = loss_mask_BT.to(tok_BT.dtype)
                tok_BT = tok_BT * mask_BT
                out.loss = tok_BT.sum() / mask_BT.sum().clamp_min(1.0)
            out.token_loss = tok_BT
        return out

    def _head_loss(self, h_BTD: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.lm_head(h_BTD), targets_BT)

    def _loss_chunk_rows(self) -> int:
        """Tokens per loss chunk: the budget over the head's (local, under tensor parallelism) vocabulary."""
        emb = getattr(self.lm_head, "embedding", None)
        V = emb[0].weight.shape[0] if emb else self.vocab_size
        return max(1, self.loss_chunk_logits // V)

    def expert_parameters(self) -> dict[int, list[nn.Parameter]]:
        """Parameters of each global expert id held here (empty for dense)."""
        by_expert: dict[int, list[nn.Parameter]] = {}
        for (
            name,
            p,
        ) in self.named_parameters():  # `expert_of_key` is the one answer to "whose parameter is this?"
            e = expert_of_key(name)
            if e is not None:
                by_expert.setdefault(e, []).append(p)
        return by_expert

    def num_parameters(self) -> int:
        """Parameters held by this instance (tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())


_EXPERT_KEY = re.compile(r"\.ffn\.experts\.(\d+)\.")


def expert_of_key(key: str) -> int | None:
    """The expert id a state-dict key belongs to (`blocks.<i>.ffn.experts.<id>.`), else None."""
    m = _EXPERT_KEY.search(key)
    return int(m.group(1)) if m else None


def split_by_expert(
    state_dict: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
    """(shared tensors, {expert id: that expert's tensors})."""
    shared: dict[str, torch.Tensor] = {}
    experts: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in state_dict.items():
        e = expert_of_key(k)
        (shared if e is None else experts.setdefault(e, {}))[k] = v
    return shared, experts
