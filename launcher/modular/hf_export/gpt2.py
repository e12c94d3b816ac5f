"""Our dense GPT as a Hugging Face `transformers` GPT2LMHeadModel, with the same logits.

Shape legend: D model dim, F ffn dim (4D), H heads, K head dim, V (padded) vocabulary, E experts.

Our GPT and GPT-2 are the same network up to layout:

* qkv: our nn.Linear weight is [3D, D] whose output is head-major [H, 3, K]; GPT-2's `c_attn` is a Conv1D with
  weight [D, 3D] (x @ W) whose output is [q; k; v], each [H, K]. So W_gpt2 = W.view(H, 3, K, D).transpose(0, 1)
  .reshape(3D, D).T, and the bias the same without the transpose.
* every other Linear (attn proj, fc1, fc2) -> Conv1D: transpose. LayerNorms, wte, wpe copy; the LM head is tied.
* activation: our F.gelu is the exact erf GELU -> `activation_function="gelu"` (not GPT-2's default gelu_new);
  layer norm eps 1e-5; n_inner = F; attention scaled by 1/sqrt(K) in both; dropout 0 (evaluation).
* vocabulary: the embedding is trimmed to the tokenizer's real tokens (the rows past them are padding for
  tensor-parallel divisibility, never targets): the exported logits are ours without the padding columns, so
  `generate` can never emit an id that is no token. Without a tokenizer the padded embedding is exported whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from launcher.checkpoint import CheckpointError, Consolidated
from launcher.modular.hf_export.merging import dense_model, dense_state_dict


def special_ids(c: Consolidated, tok: Any = None) -> dict[str, int | None]:
    """bos/eos/pad ids: the tokenizer's (pad = end of document: GPT-2 has no pad token), else the checkpoint's
    meta.json (written by the trainer), else None."""
    bos = tok.bos_id if tok is not None else c.meta.get("bos_id")
    eos = tok.eod_id if tok is not None else c.meta.get("eod_id", bos)
    return {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos}


def gpt2_config(c: Consolidated, vocab_rows: int, ids: dict[str, int | None] | None = None) -> Any:
    from transformers import GPT2Config

    m = c.cfg.model
    return GPT2Config(
        vocab_size=vocab_rows,
        n_positions=m.seq_len,
        n_embd=m.d_model,
        n_layer=m.n_layers,
        n_head=m.n_heads,
        n_inner=m.d_ffn,
        activation_function="gelu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        initializer_range=m.init_std,
        scale_attn_weights=True,
        tie_word_embeddings=True,
        **(ids or special_ids(c)),
    )


def to_gpt2_state_dict(
    dense: dict[str, torch.Tensor], n_layers: int, n_heads: int
) -> dict[str, torch.Tensor]:
    """Our dense names/layouts -> GPT2LMHeadModel's (see the module docstring)."""
    out = {
        "transformer.wte.weight": dense["wte.weight"],
        "transformer.wpe.weight": dense["wpe.weight"],
        "transformer.ln_f.weight": dense["ln_f.weight"],
        "transformer.ln_f.bias": dense["ln_f.bias"],
    }
    for i in range(n_layers):
        src, dst = f"blocks.{i}.", f"transformer.h.{i}."
        w_3DD, b_3D = dense[src + "attn.qkv.weight"], dense[src + "attn.qkv.bias"]
        D = w_3DD.shape[1]
        K = D // n_heads
        # rows [H, 3, K] -> [3, H, K]: q, k, v blocks of all heads, as GPT-2 splits c_attn's output
        out[dst + "attn.c_attn.weight"] = w_3DD.view(n_heads, 3, K, D).transpose(0, 1).reshape(3 * D, D).t()
        out[dst + "attn.c_attn.bias"] = b_3D.view(n_heads, 3, K).transpose(0, 1).reshape(3 * D)
        out[dst + "attn.c_proj.weight"] = dense[src + "attn.proj.weight"].t()
        out[dst + "attn.c_proj.bias"] = dense[src + "attn.proj.bias"]
        out[dst + "mlp.c_fc.weight"] = dense[src + "ffn.mlp.fc1.weight"].t()
        out[dst + "mlp.c_fc.bias"] = dense[src + "ffn.mlp.fc1.bias"]
        out[dst + "mlp.c_proj.weight"] = dense[src + "ffn.mlp.fc2.weight"].t()
        out[dst + "mlp.c_proj.bias"] = dense[src + "ffn.mlp.fc2.bias"]
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            for p in ("weight", "bias"):
                out[f"{dst}{theirs}.{p}"] = dense[f"{src}{ours}.{p}"]
    return {k: v.contiguous().clone() for k, v in out.items()}


def build_hf_model(c: Consolidated, weights_E: Sequence[float] | None = None, tok: Any = None) -> Any:
    """A GPT2LMHeadModel with the (single-domain or merged) weights of `c`, in eval mode; with the project's
    tokenizer `tok`, its vocabulary trimmed to the real tokens and its special ids set (generation config too)."""
    from transformers import GenerationConfig, GPT2LMHeadModel

    rows = c.state_dict["wte.weight"].shape[0]
    paddings = sorted({c.cfg.model.padded_vocab_size(t) for t in (1, c.cfg.parallel.tensor_parallel)})
    if rows not in paddings:
        raise CheckpointError(
            f"{rows} embedding rows match none of the config's padded vocabularies {paddings}"
        )
    dense = dense_state_dict(c, weights_E)
    if tok is not None:
        if c.cfg.data.mixture == "domain_token":
            raise CheckpointError(
                "a +Domain-Token model reads its domain's token before every document, which a "
                "Hugging Face tokenizer cannot add per domain: export it with --no-tokenizer"
            )
        if tok.vocab_size > rows:
            raise CheckpointError(
                f"the tokenizer has {tok.vocab_size} tokens but the model only {rows} embedding "
                "rows: this is not the tokenizer the model was trained with"
            )
        dense["wte.weight"] = dense["wte.weight"][: tok.vocab_size]
    ids = special_ids(c, tok)
    model = GPT2LMHeadModel(gpt2_config(c, dense["wte.weight"].shape[0], ids))
    model.generation_config = GenerationConfig(**ids)
    sd = to_gpt2_state_dict(dense, c.cfg.model.n_layers, c.cfg.model.n_heads)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [
        k for k in missing if k != "lm_head.weight" and not k.endswith((".attn.bias", ".attn.masked_bias"))
    ]
    if missing or unexpected:
        raise CheckpointError(f"GPT-2 mapping incomplete: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    if model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr():
        model.lm_head.weight = model.transformer.wte.weight
    return model.eval()


@torch.no_grad()
def max_logit_diff(
    c: Consolidated,
    hf_model: Any,
    weights_E: Sequence[float] | None = None,
    tokens_BT: torch.Tensor | None = None,
    seed: int = 0,
) -> float:
    """max |logits_ours - logits_hf| on `tokens_BT` (default: 2 random sequences of the full context)."""
    ours = dense_model(c, weights_E)
    if tokens_BT is None:
        gen = torch.Generator().manual_seed(seed)
        vocab = min(int(c.meta.get("vocab_size") or c.cfg.model.vocab_size), hf_model.config.vocab_size)
        tokens_BT = torch.randint(0, vocab, (2, c.cfg.model.seq_len), generator=gen)
    b = hf_model(input_ids=tokens_BT).logits
    a = ours(tokens_BT).logits[..., : b.shape[-1]]  # a trimmed export has no padding columns
    return float((a - b).abs().max())
