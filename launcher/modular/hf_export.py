"""Export one domain's model (its expert + the shared weights) or a merged model as a Hugging Face `transformers`
GPT2LMHeadModel (safetensors), with the same logits as the project's model.

    python -m launcher.modular.hf_export CKPT --domain legal --out hf/legal
    python -m launcher.modular.hf_export CKPT --merge-prior cached_priors/speeches.json --out hf/speeches-merged
    python -m launcher.modular.hf_export CKPT --merge-domain-data speeches [--data DIR --tokenizer TOK --dev-blocks 100] --out DIR
    python -m launcher.modular.hf_export CKPT --merge-weights legal=0.7,news=0.3 --out DIR
    python -m launcher.modular.hf_export DENSE_CKPT --out DIR                  # a dense checkpoint as it is

Shape legend: D model dim, F ffn dim (4D), H heads, K head dim, V (padded) vocabulary, E experts.

Our GPT and GPT-2 are the same network up to layout:

* qkv: our nn.Linear weight is [3D, D] whose output is head-major [H, 3, K]; GPT-2's `c_attn` is a Conv1D with
  weight [D, 3D] (x @ W) whose output is [q; k; v], each [H, K]. So W_gpt2 = W.view(H, 3, K, D).transpose(0, 1)
  .reshape(3D, D).T, and the bias the same without the transpose.
* every other Linear (attn proj, fc1, fc2) -> Conv1D: transpose. LayerNorms, wte, wpe copy; the LM head is tied.
* activation: our F.gelu is the exact erf GELU -> `activation_function="gelu"` (not GPT-2's default gelu_new);
  layer norm eps 1e-5; n_inner = F; attention scaled by 1/sqrt(K) in both; dropout 0 (evaluation).
* vocabulary: the padded embedding (V = cfg.padded_vocab_size) is exported whole, so logits have the same width;
  rows past the tokenizer's vocabulary are padding and never targets.

Merged model (a single-expert model standing for a mixture): every expert tensor is the weighted average
W = sum_j w_j W_j with w the domain posterior of the target domain (the cached prior of §5.1 from a file, estimated
on its development data, or given). This averages parameters, an approximation of the output mixture (eq. 6),
exact only when the experts agree.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from launcher.checkpoint import CheckpointError, Consolidated, load_consolidated, write_json_atomic
from launcher.ffn_kinds import ffn_kind
from model import mixture as mx
from data.atomic import atomic_dir, commit_dir
from data.cli import check_output_dir, cli_main

HF_EXPORT_FORMAT = "demix-hf-export/1"
_EXPERT_PARAMS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


def expert_weights(c: Consolidated, domain: Optional[str] = None, weights: Optional[dict[str, float]] = None) -> list[float]:
    """Weights over the checkpoint's experts: one-hot on `domain`, or `weights` by name (normalised to sum 1)."""
    if (domain is None) == (weights is None):
        raise CheckpointError("give exactly one of a domain or merge weights")
    if domain is not None:
        if domain not in c.domains:
            raise CheckpointError(f"no expert for {domain!r}; experts: {', '.join(c.domains)}")
        return [1.0 if d == domain else 0.0 for d in c.domains]
    unknown = [d for d in weights if d not in c.domains]
    if unknown or any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
        raise CheckpointError(f"merge weights {weights}: need non-negative weights over the experts {c.domains}")
    total = sum(weights.values())
    return [weights.get(d, 0.0) / total for d in c.domains]


def dense_state_dict(c: Consolidated, weights_E: Optional[Sequence[float]] = None) -> dict[str, torch.Tensor]:
    """The checkpoint as a dense model's state dict (our names): shared tensors unchanged, each DEMix layer's FFN
    the weighted sum of its experts, sum_j w_j W_j (one-hot: one domain's expert, bit-exact)."""
    kind = ffn_kind(c.cfg)
    if not kind.has_experts:
        return dict(c.state_dict)
    if not kind.domain_experts:
        raise CheckpointError(f"export supports dense and DEMix checkpoints, not {kind.name!r}")
    if weights_E is None or len(weights_E) != len(c.domains):
        raise CheckpointError(f"need {len(c.domains)} expert weights, got {weights_E}")
    out = {k: v for k, v in c.state_dict.items() if ".ffn.experts." not in k}
    for layer in range(c.cfg.model.n_layers):
        for name in _EXPERT_PARAMS:
            parts = [(w, c.state_dict[f"blocks.{layer}.ffn.experts.{j}.{name}"]) for j, w in enumerate(weights_E) if w]
            if len(parts) == 1 and parts[0][0] == 1.0:
                merged = parts[0][1].clone()
            else:
                merged = sum(w * t.double() for w, t in parts).to(parts[0][1].dtype)
            out[f"blocks.{layer}.ffn.mlp.{name}"] = merged
    return out


def dense_model(c: Consolidated, weights_E: Optional[Sequence[float]] = None) -> torch.nn.Module:
    """Our own GPT (dense FFN) holding `dense_state_dict`: the reference the export must reproduce."""
    from model.gpt import GPT

    cfg = replace(c.cfg.model, ffn=replace(c.cfg.model.ffn, kind="dense", num_experts=0))
    model = GPT(cfg, init_seed=0)
    model.load_state_dict(dense_state_dict(c, weights_E))
    return model.eval()


def gpt2_config(c: Consolidated, vocab_rows: int) -> Any:
    from transformers import GPT2Config

    m = c.cfg.model
    bos = c.meta.get("bos_id")
    return GPT2Config(vocab_size=vocab_rows, n_positions=m.seq_len, n_embd=m.d_model, n_layer=m.n_layers,
                      n_head=m.n_heads, n_inner=m.d_ffn, activation_function="gelu", resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5, initializer_range=m.init_std,
                      scale_attn_weights=True, tie_word_embeddings=True,
                      bos_token_id=bos, eos_token_id=bos)


def to_gpt2_state_dict(dense: dict[str, torch.Tensor], n_layers: int, n_heads: int) -> dict[str, torch.Tensor]:
    """Our dense names/layouts -> GPT2LMHeadModel's (see the module docstring)."""
    out = {"transformer.wte.weight": dense["wte.weight"], "transformer.wpe.weight": dense["wpe.weight"],
           "transformer.ln_f.weight": dense["ln_f.weight"], "transformer.ln_f.bias": dense["ln_f.bias"]}
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


def build_hf_model(c: Consolidated, weights_E: Optional[Sequence[float]] = None) -> Any:
    """A GPT2LMHeadModel with the (single-domain or merged) weights of `c`, in eval mode."""
    from transformers import GPT2LMHeadModel

    rows = c.state_dict["wte.weight"].shape[0]
    paddings = sorted({c.cfg.model.padded_vocab_size(t) for t in (1, c.cfg.parallel.tensor_parallel)})
    if rows not in paddings:
        raise CheckpointError(f"{rows} embedding rows match none of the config's padded vocabularies {paddings}")
    dense = dense_state_dict(c, weights_E)
    model = GPT2LMHeadModel(gpt2_config(c, dense["wte.weight"].shape[0]))
    sd = to_gpt2_state_dict(dense, c.cfg.model.n_layers, c.cfg.model.n_heads)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" and not k.endswith((".attn.bias", ".attn.masked_bias"))]
    if missing or unexpected:
        raise CheckpointError(f"GPT-2 mapping incomplete: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    if model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr():
        model.lm_head.weight = model.transformer.wte.weight
    return model.eval()


@torch.no_grad()
def max_logit_diff(c: Consolidated, hf_model: Any, weights_E: Optional[Sequence[float]] = None,
                   tokens_BT: Optional[torch.Tensor] = None, seed: int = 0) -> float:
    """max |logits_ours - logits_hf| on `tokens_BT` (default: 2 random sequences of the full context)."""
    ours = dense_model(c, weights_E)
    if tokens_BT is None:
        gen = torch.Generator().manual_seed(seed)
        vocab = int(c.meta.get("vocab_size") or c.cfg.model.vocab_size)
        tokens_BT = torch.randint(0, vocab, (2, c.cfg.model.seq_len), generator=gen)
    a = ours(tokens_BT).logits
    b = hf_model(input_ids=tokens_BT).logits
    return float((a - b).abs().max())


def merge_weights_from_data(c: Consolidated, domain: str, data: Optional[str], tokenizer: Optional[str],
                            dev_blocks: int) -> mx.CachedPrior:
    """The target domain's cached prior over the experts, estimated on its development blocks (§5.1)."""
    from launcher.modular.experts import estimate_domain_prior

    return estimate_domain_prior(c, domain, data, tokenizer, "valid", dev_blocks)


def export(ckpt: Union[str, Path, Consolidated], out: Union[str, Path], domain: Optional[str] = None,
           merge: Optional[dict[str, float]] = None, check: bool = True, merge_source: Optional[str] = None
           ) -> dict[str, Any]:
    """Write `out` (config.json + model.safetensors via save_pretrained, and demix_export.json). Returns the record
    (source, domain or merge weights, logit check)."""
    c = ckpt if isinstance(ckpt, Consolidated) else load_consolidated(ckpt)
    weights = expert_weights(c, domain, merge) if ffn_kind(c.cfg).has_experts else None
    model = build_hf_model(c, weights)
    record = {"format": HF_EXPORT_FORMAT, "source": None if isinstance(ckpt, Consolidated) else str(ckpt),
              "kind": c.cfg.model.ffn.kind, "domain": domain,
              "merge_weights": dict(zip(c.domains, weights)) if merge is not None else None,
              "merge_source": merge_source, "tokenizer": c.meta.get("tokenizer", c.cfg.data.tokenizer),
              "tokenizer_vocab_size": c.meta.get("vocab_size"), "padded_vocab_size": model.config.vocab_size,
              "activation_function": "gelu (exact erf, as torch.nn.functional.gelu)"}
    if check:
        record["max_abs_logit_diff"] = max_logit_diff(c, model, weights)
    out = Path(out)
    tmp = atomic_dir(out)  # published whole by commit_dir: a killed export leaves no half model at `out`
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        write_json_atomic(tmp / "demix_export.json", record)
        commit_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return record


def _parse_weights(s: str) -> dict[str, float]:
    out = {}
    for part in s.split(","):
        name, _, w = part.partition("=")
        try:
            out[name.strip()] = float(w)
        except ValueError:
            raise CheckpointError(f"--merge-weights {s!r}: {part!r} is not NAME=WEIGHT with a number") from None
    return out


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="consolidated checkpoint directory")
    p.add_argument("--out", required=True)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--domain", help="export this domain's expert with the shared weights")
    g.add_argument("--merge-prior", metavar="FILE", help="merge experts weighted by a cached prior (CachedPrior JSON)")
    g.add_argument("--merge-domain-data", metavar="DOMAIN", help="merge weighted by DOMAIN's posterior on its dev data")
    g.add_argument("--merge-weights", metavar="A=W,...", help="merge with these weights")
    p.add_argument("--data", help="prepared tokens root (--merge-domain-data; default: the checkpoint's)")
    p.add_argument("--tokenizer", help="tokenizer directory name (default: the checkpoint's)")
    p.add_argument("--dev-blocks", type=int, default=mx.CACHED_PRIOR_BLOCKS)
    p.add_argument("--no-check", action="store_true", help="skip the logit comparison with the project's model")
    return p.parse_args(argv)


@cli_main
def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        check_output_dir(Path(args.out), (HF_EXPORT_FORMAT,), ["config.json", "model.safetensors", "demix_export.json"],
                         inputs=[Path(args.checkpoint)], manifest="demix_export.json")
        c = load_consolidated(args.checkpoint)
        merge, source = None, None
        if args.merge_prior:
            prior = mx.CachedPrior.load(args.merge_prior)
            merge, source = dict(zip(prior.domains, prior.probs)), args.merge_prior
        elif args.merge_domain_data:
            prior = merge_weights_from_data(c, args.merge_domain_data, args.data, args.tokenizer, args.dev_blocks)
            merge, source = dict(zip(prior.domains, prior.probs)), f"posterior on {args.merge_domain_data} dev data"
        elif args.merge_weights:
            merge, source = _parse_weights(args.merge_weights), "given"
        if ffn_kind(c.cfg).domain_experts and args.domain is None and merge is None:
            raise CheckpointError("a DEMix checkpoint needs --domain or one of the --merge-* options")
        rec = export(c, args.out, args.domain, merge, check=not args.no_check, merge_source=source)
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({**rec, "source": args.checkpoint, "out": args.out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
