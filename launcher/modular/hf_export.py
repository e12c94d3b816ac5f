"""Export one domain's model (its expert + the shared weights) or a merged model as a Hugging Face `transformers`
GPT2LMHeadModel (safetensors), with the same logits as the project's model.

    python -m launcher.modular.hf_export CKPT --domain legal --out hf/legal
    python -m launcher.modular.hf_export CKPT --merge-prior cached_priors/speeches.json --out hf/speeches-merged
    python -m launcher.modular.hf_export CKPT --merge-domain-data speeches [--data DIR --tokenizer TOK --dev-blocks 100] --out DIR
    python -m launcher.modular.hf_export CKPT --merge-weights legal=0.7,news=0.3 --out DIR
    python -m launcher.modular.hf_export DENSE_CKPT --out DIR                  # a dense checkpoint as it is
    [--data TOKENS_ROOT]  the prepared data the model was trained on, for its tokenizer (default: its data.path)

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
  `generate` can never emit an id that is no token. Without a tokenizer (`tokenizer=None`, CLI `--no-tokenizer`)
  the padded embedding is exported whole.

What a user with only the folder gets (CLI default): config.json (bos/eos/pad ids), generation_config.json,
model.safetensors, the tokenizer as a Hugging Face fast tokenizer that reproduces the project's ids and prepends the
beginning-of-document token as training and `launcher.evaluation.generate` do (launcher/modular/hf_tokenizer.py),
README.md (a model card: domains, the expert or merge weights, training tokens (an added or DAPT-adapted
expert's own, `training_tokens_line`), the source model's perplexities from `launcher.evaluation.evaluate`'s
CKPT/eval/eval.json, else the run's CKPT/../eval/eval.json, or --eval-json) and demix_export.json (the record). The tokenizer comes from the prepared data the model was trained on (`--data`,
default the checkpoint's `data.path`), checked against the checkpoint's tokenizer fingerprint.

Merged model (a single-expert model standing for a mixture): every expert tensor is the weighted average
W = sum_j w_j W_j with w the domain posterior of the target domain (the cached prior of §5.1 from a file, estimated
on its development data, or given). This averages parameters, an approximation of the output mixture (eq. 6),
exact only when the experts agree.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from data.argtypes import nonneg_float, positive_int
from data.atomic import staged_dir
from data.cli import check_output_dir, cli_main, exit_process
from data.readers import read_json_object
from launcher.checkpoint import CheckpointError, Consolidated, load_consolidated, read_meta, write_json_atomic
from launcher.checkpoint_data import load_export_tokenizer
from launcher.ffn_kinds import ffn_kind
from model import mixture as mx

HF_EXPORT_FORMAT = "demix-hf-export/2"
_READ_FORMATS = ("demix-hf-export/1", HF_EXPORT_FORMAT)  # an older export folder may be replaced
_EXPERT_PARAMS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


def expert_weights(
    c: Consolidated, domain: Optional[str] = None, weights: Optional[dict[str, float]] = None
) -> list[float]:
    """Weights over the checkpoint's experts: one-hot on `domain`, or `weights` by name (normalised to sum 1)."""
    if (domain is None) == (weights is None):
        raise CheckpointError("give exactly one of a domain or merge weights")
    if domain is not None:
        if domain not in c.domains:
            raise CheckpointError(f"no expert for {domain!r}; experts: {', '.join(c.domains)}")
        return [1.0 if d == domain else 0.0 for d in c.domains]
    return merge_weights_over(c.domains, weights)


def merge_weights_over(domains: Sequence[str], weights: dict[str, float]) -> list[float]:
    """`weights` by expert name as a normalised list over `domains` (mixture_weights' rule: finite, >= 0, sum > 0);
    CheckpointError for a name that is not an expert or weights that are not a mixture."""
    unknown = [d for d in weights if d not in domains]
    if unknown:
        raise CheckpointError(
            f"merge weights {weights}: {unknown} are not experts of the checkpoint ({list(domains)})"
        )
    try:
        return mx.mixture_weights(
            [weights.get(d, 0.0) for d in domains], f"merge weights over {list(domains)}"
        )
    except ValueError as e:
        raise CheckpointError(str(e)) from None


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
            parts = [
                (w, c.state_dict[f"blocks.{layer}.ffn.experts.{j}.{name}"])
                for j, w in enumerate(weights_E)
                if w
            ]
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


def special_ids(c: Consolidated, tok: Any = None) -> dict[str, Optional[int]]:
    """bos/eos/pad ids: the tokenizer's (pad = end of document: GPT-2 has no pad token), else the checkpoint's
    meta.json (written by the trainer), else None."""
    bos = tok.bos_id if tok is not None else c.meta.get("bos_id")
    eos = tok.eod_id if tok is not None else c.meta.get("eod_id", bos)
    return {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos}


def gpt2_config(c: Consolidated, vocab_rows: int, ids: Optional[dict[str, Optional[int]]] = None) -> Any:
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


def build_hf_model(c: Consolidated, weights_E: Optional[Sequence[float]] = None, tok: Any = None) -> Any:
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
    weights_E: Optional[Sequence[float]] = None,
    tokens_BT: Optional[torch.Tensor] = None,
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


def merge_weights_from_data(
    c: Consolidated, domain: str, data: Optional[str], tokenizer: Optional[str], dev_blocks: int
) -> mx.CachedPrior:
    """The target domain's cached prior over the experts, estimated on its development blocks (§5.1)."""
    from launcher.modular.experts import estimate_domain_prior

    return estimate_domain_prior(c, domain, data, tokenizer, "valid", dev_blocks)


def eval_json_candidates(checkpoint: Union[str, Path], exclude: Sequence[str] = ()) -> list[Path]:
    """Where `launcher.evaluation.evaluate CKPT` leaves its eval.json, in the order the export looks: its default
    --out `CKPT/eval` (`CKPT/eval-without-<names>` for an evaluation with --exclude-experts, when the export opts
    the same experts out), then the run directory's `CKPT/../eval` (benchmarks/demo.py, reproduce.py; the export's
    older default)."""
    ckpt = Path(checkpoint)
    without = [ckpt / f"eval-without-{'-'.join(exclude)}" / "eval.json"] if exclude else []
    return [*without, ckpt / "eval" / "eval.json", ckpt.parent / "eval" / "eval.json"]


def find_eval_json(checkpoint: Union[str, Path], exclude: Sequence[str] = ()) -> Optional[Path]:
    """The first `eval_json_candidates` that is a file, else None."""
    return next((p for p in eval_json_candidates(checkpoint, exclude) if p.is_file()), None)


def _blocks_phrase(res: dict[str, Any]) -> str:
    """'N blocks of T tokens per domain' from the domains' own block counts (evaluate records `blocks` per domain;
    `max_blocks` is only the cap, None without --max-blocks); without either, the count is left out."""
    counts = sorted({r["blocks"] for r in res["domains"].values() if isinstance(r.get("blocks"), int)})
    n = (
        f"{counts[0]:,}"
        if len(counts) == 1
        else f"{counts[0]:,} to {counts[-1]:,}"
        if counts
        else f"at most {res['max_blocks']:,}"
        if isinstance(res.get("max_blocks"), int)
        else None
    )
    seq = f" of {res['seq_len']} tokens" if isinstance(res.get("seq_len"), int) else ""
    return (
        f"{n} blocks{seq} per domain; "
        if n
        else f"{res['seq_len']}-token blocks; "
        if isinstance(res.get("seq_len"), int)
        else ""
    )


def _eval_table(eval_json: Optional[Path], domain: Optional[str], looked: Sequence[Path] = ()) -> list[str]:
    """Markdown rows of the source model's test perplexities (launcher.evaluation.evaluate's eval.json); `looked`:
    where the default search looked, named when nothing was found."""
    if eval_json is None or not eval_json.is_file():
        where = (
            ", ".join(f"`{p}`" for p in looked) if looked else "eval/eval.json in the checkpoint directory"
        )
        return [
            f"No evaluation of the source checkpoint was found (looked for {where}; run `python -m "
            "launcher.evaluation.evaluate CKPT`, which writes CKPT/eval/eval.json, or pass --eval-json)."
        ]
    res = read_json_object(eval_json, {"domains": dict}, what="the source's evaluation")
    try:
        modes = [
            m
            for m in ("ppl", "naive", "cached")
            if any(m in r.get("ppl", {}) for r in res["domains"].values())
        ]
        split = res.get("split") if isinstance(res.get("split"), str) else "test"
        lines = [
            f"{split.capitalize()} perplexity of the source checkpoint ({_blocks_phrase(res)}`naive` = each "
            "domain's own expert, `cached` = the expert mixture with the cached prior, DEMix §5; unigram = the "
            f"domain's own unigram model; from `{eval_json}`):",
            "",
            "| domain | role | " + " | ".join(modes) + " | unigram |",
            "|---|---|" + "---|" * (len(modes) + 1),
        ]
        for d, r in sorted(res["domains"].items()):
            mark = " (this export)" if d == domain else ""
            vals = " | ".join(f"{r['ppl'][m]:.2f}" if m in r.get("ppl", {}) else "–" for m in modes)
            uni = r.get("unigram", {}).get("ppl")
            lines.append(
                f"| {d}{mark} | {r['role']} | {vals} | {uni:.2f} |"
                if uni
                else f"| {d}{mark} | {r['role']} | {vals} | – |"
            )
    except (LookupError, TypeError, AttributeError, ValueError) as e:
        raise CheckpointError(
            f"{eval_json} (the source's evaluation): an entry of the wrong shape "
            f"({type(e).__name__}: {e}); pass another --eval-json"
        ) from None
    return lines


def _base_tokens(init_from: str) -> Optional[int]:
    """`train_tokens` of the checkpoint a run started from (train.init_from), None when it cannot be read."""
    try:
        tokens = read_meta(init_from).get("train_tokens")
    except (CheckpointError, OSError, ValueError):
        return None
    return tokens if isinstance(tokens, int) else None


def training_tokens_line(c: Consolidated, domain: Optional[str]) -> str:
    """The model card's training-token line. An exported expert that `launcher.modular.experts add` appended (its
    `added_experts` record in meta.json) has none of its own: the count in meta.json is the model it was added to.
    A run started from a checkpoint (`train.init_from`: DAPT) counts only its own tokens in `train_tokens`: with
    `train.trainable=experts` (DEMix-DAPT) those are the tokens of the experts of data.domains, and any other
    expert is the starting checkpoint's."""
    tokens = c.meta.get("train_tokens")
    added = next(
        (
            r
            for r in c.meta.get("added_experts", [])
            if isinstance(r, dict) and r.get("domain") == domain and domain is not None
        ),
        None,
    )
    if added is not None:
        base = f"; the model it was added to: {tokens:,} tokens" if isinstance(tokens, int) else ""
        return (
            f"- training tokens: none of its own (the {domain} expert was added by `launcher.modular.experts add` "
            f"as a copy of the {added.get('source')} expert and not trained since: adapt it with `experts dapt`)"
            + base
        )
    if not isinstance(tokens, int) or not tokens:
        return "- training tokens: not recorded by this checkpoint"
    t = c.cfg.train
    if not t.init_from:
        return f"- training tokens: {tokens:,}"
    base_tokens = _base_tokens(t.init_from)
    base = f"{base_tokens:,} tokens" if base_tokens is not None else "a count not at hand"
    trained = list(c.cfg.data.domains or c.domains)
    if t.trainable == "experts" and domain is not None:
        if domain not in trained:
            return (
                f"- training tokens: this expert was not trained by this run (DEMix-DAPT of {', '.join(trained)}): "
                f"it is `{t.init_from}`'s, trained on {base}"
            )
        own = (
            f"{tokens:,} of {domain}, this expert's own"
            if trained == [domain]
            else f"{tokens:,} over {', '.join(trained)} (this expert's share of them by the run's allocation)"
        )
        return (
            f"- training tokens: {own} (DEMix-DAPT from `{t.init_from}`: only the experts of "
            f"{', '.join(trained)} trained; the shared weights and the other experts are that checkpoint's, "
            f"trained on {base})"
        )
    what = "DEMix-DAPT of the experts of" if t.trainable == "experts" else "continued training on"
    return f"- training tokens: {tokens:,} ({what} {', '.join(trained)}) after `{t.init_from}`'s {base}"


def model_card(
    c: Consolidated, record: dict[str, Any], eval_json: Optional[Path] = None, looked: Sequence[Path] = ()
) -> str:
    """README.md of the export: what the model is, how to load it, what it was trained on, how well it does
    (`looked`: where the evaluation was searched for, named when none was found)."""
    m = c.cfg.model
    if record["domain"]:
        what = f"the **{record['domain']}** expert of a DEMix model (its expert FFNs with the shared weights)"
    elif record["merge_weights"]:
        w = ", ".join(f"{d} {x:.3f}" for d, x in record["merge_weights"].items() if x)
        what = (
            f"a DEMix model with its experts' parameters averaged by the weights {w} ({record['merge_source']}): "
            "an approximation of the output mixture (DEMix eq. 6), exact only where the experts agree"
        )
    else:
        what = f"a {record['kind']} GPT"
    lines = [
        f"# {Path(record['out']).name}",
        "",
        f"Exported from `{record['source']}` (step {c.step}): {what}.",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline",
        "tok = AutoTokenizer.from_pretrained(DIR)         # prepends the beginning-of-document token",
        "model = AutoModelForCausalLM.from_pretrained(DIR)",
        'print(pipeline("text-generation", model=DIR)("The patient", max_new_tokens=20, do_sample=False))',
        "```",
        "",
        f"- architecture: GPT-2 layout, {m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads, FFN {m.d_ffn}, "
        f"exact-erf GELU, context {m.seq_len} tokens (the model has no positions past it: keep prompt + new tokens "
        f"<= {m.seq_len})",
        f"- tokenizer: {record['tokenizer']} ({record['tokenizer_vocab_size']} tokens; vocabulary "
        f"{'trimmed to them' if record['trimmed'] else 'padded to ' + str(record['padded_vocab_size'])})",
        f"- training domains: {', '.join(c.domains)}"
        + (
            f"; experts opted out (not in this model; their weights were never read): "
            f"{', '.join(record['excluded_experts'])}"
            if record["excluded_experts"]
            else ""
        ),
        training_tokens_line(c, record["domain"]),
        f"- logits vs the project's model: max |diff| {record['max_abs_logit_diff']}"
        if record.get("max_abs_logit_diff") is not None
        else "- logits vs the project's model: not compared (--no-check)",
        "",
        *_eval_table(eval_json, record["domain"], looked),
        "",
    ]
    return "\n".join(lines)


def export(
    ckpt: Union[str, Path, Consolidated],
    out: Union[str, Path],
    domain: Optional[str] = None,
    merge: Optional[dict[str, float]] = None,
    check: bool = True,
    merge_source: Optional[str] = None,
    tokenizer: Any = None,
    eval_json: Optional[Union[str, Path]] = None,
    source: Optional[str] = None,
) -> dict[str, Any]:
    """Write `out` (config.json, generation_config.json, model.safetensors via save_pretrained; with the project's
    `tokenizer`, the fast tokenizer files and a trimmed vocabulary; README.md; demix_export.json). Returns the record
    (source, domain or merge weights, logit check). `eval_json`: the source's evaluation for the model card
    (default: the first of `eval_json_candidates`, where `launcher.evaluation.evaluate` writes it); `source`: the
    checkpoint's path when `ckpt` is already loaded."""
    c = ckpt if isinstance(ckpt, Consolidated) else load_consolidated(ckpt)
    weights = expert_weights(c, domain, merge) if ffn_kind(c.cfg).has_experts else None
    model = build_hf_model(c, weights, tokenizer)
    record = {
        "format": HF_EXPORT_FORMAT,
        "source": source if isinstance(ckpt, Consolidated) else str(ckpt),
        "out": str(out),
        "kind": c.cfg.model.ffn.kind,
        "domain": domain,
        "merge_weights": dict(zip(c.domains, weights)) if merge is not None else None,
        "merge_source": merge_source,
        "tokenizer": c.meta.get("tokenizer", c.cfg.data.tokenizer),
        "tokenizer_vocab_size": tokenizer.vocab_size if tokenizer is not None else c.meta.get("vocab_size"),
        "padded_vocab_size": c.state_dict["wte.weight"].shape[0],
        "trimmed": tokenizer is not None,
        "vocab_size": model.config.vocab_size,
        **special_ids(c, tokenizer),
        "excluded_experts": list(c.meta.get("removed_experts", [])),
        "activation_function": "gelu (exact erf, as torch.nn.functional.gelu)",
    }
    if check:
        record["max_abs_logit_diff"] = max_logit_diff(c, model, weights)
    looked: list[Path] = []
    if eval_json is None and record["source"] is not None:
        looked = eval_json_candidates(record["source"], record["excluded_experts"])
        eval_json = find_eval_json(record["source"], record["excluded_experts"])
    out = Path(out)
    # staged and published whole (data/atomic.py `staged_dir`): a failed or killed export leaves no half model
    with staged_dir(out, manifest="demix_export.json") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            from launcher.modular.hf_tokenizer import save_hf_tokenizer

            record["hf_tokenizer"] = save_hf_tokenizer(tokenizer, tmp)
        (tmp / "README.md").write_text(model_card(c, record, Path(eval_json) if eval_json else None, looked))
        write_json_atomic(tmp / "demix_export.json", record)
    return record


def _parse_weights(s: str) -> dict[str, float]:
    out = {}
    for part in s.split(","):
        name, _, w = part.partition("=")
        try:
            out[name.strip()] = nonneg_float(w)
        except argparse.ArgumentTypeError as e:
            raise CheckpointError(
                f"--merge-weights {s!r}: {part!r} is not NAME=WEIGHT with a weight {e}"
            ) from None
    return out


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="consolidated checkpoint directory")
    p.add_argument("--out", required=True)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--domain", help="export this domain's expert with the shared weights")
    g.add_argument(
        "--merge-prior", metavar="FILE", help="merge experts weighted by a cached prior (CachedPrior JSON)"
    )
    g.add_argument(
        "--merge-domain-data", metavar="DOMAIN", help="merge weighted by DOMAIN's posterior on its dev data"
    )
    g.add_argument("--merge-weights", metavar="A=W,...", help="merge with these weights")
    p.add_argument(
        "--data",
        help="prepared tokens root: the tokenizer, and --merge-domain-data's dev blocks "
        "(default: the checkpoint's data.path)",
    )
    p.add_argument("--tokenizer", help="tokenizer directory name (default: the checkpoint's)")
    p.add_argument("--dev-blocks", type=positive_int, default=mx.CACHED_PRIOR_BLOCKS)
    p.add_argument(
        "--no-check", action="store_true", help="skip the logit comparison with the project's model"
    )
    p.add_argument(
        "--no-tokenizer",
        action="store_true",
        help="export the weights only (padded vocabulary, no tokenizer files): not usable on its own",
    )
    p.add_argument(
        "--exclude-experts",
        default="",
        help="comma-separated DEMix experts to opt out: never read, "
        "no part in the export (merges renormalise over the rest)",
    )
    p.add_argument(
        "--eval-json",
        help="the source's eval.json for the model card (default: where "
        "launcher.evaluation.evaluate writes it, CKPT/eval/eval.json, else the run's CKPT/../eval/eval.json)",
    )
    return p.parse_args(argv)


@cli_main
def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        check_output_dir(
            Path(args.out),
            _READ_FORMATS,
            [
                "config.json",
                "model.safetensors",
                "demix_export.json",
                "tokenizer.json",
                "README.md",
                "generation_config.json",
            ],
            inputs=[Path(args.checkpoint)],
            manifest="demix_export.json",
        )
        exclude = [e.strip() for e in args.exclude_experts.split(",") if e.strip()]
        eval_json = Path(args.eval_json) if args.eval_json else find_eval_json(args.checkpoint, exclude)
        if args.eval_json and not eval_json.is_file():
            raise CheckpointError(
                f"--eval-json {args.eval_json}: no such file (evaluate writes CKPT/eval/eval.json)"
            )
        _eval_table(eval_json, args.domain)  # the model card's input, checked before any tensor is read
        merge, source = None, None
        if args.merge_prior:
            prior = mx.CachedPrior.load(args.merge_prior)
            merge, source = dict(zip(prior.domains, prior.probs)), args.merge_prior
        elif args.merge_weights:
            merge, source = _parse_weights(args.merge_weights), "given"
        meta = read_meta(args.checkpoint)
        if merge is not None and ffn_kind(meta["config"]["model"]["ffn"]["kind"]).domain_experts:
            # names and weights against the checkpoint's experts, before a tensor is read
            merge_weights_over(
                [d for d in meta["domains"] if d not in exclude],
                {d: w for d, w in merge.items() if d not in exclude},
            )
        if exclude:  # opt-out: those experts' weights are never read (launcher/expert_surgery.py)
            from launcher.expert_surgery import load_without

            c = load_without(args.checkpoint, exclude)
        else:
            c = load_consolidated(args.checkpoint)
        tok = None if args.no_tokenizer else load_export_tokenizer(c, args.data)
        if args.merge_domain_data:
            prior = merge_weights_from_data(
                c, args.merge_domain_data, args.data, args.tokenizer, args.dev_blocks
            )
            merge, source = (
                dict(zip(prior.domains, prior.probs)),
                f"posterior on {args.merge_domain_data} dev data",
            )
        if ffn_kind(c.cfg).domain_experts and args.domain is None and merge is None:
            raise CheckpointError("a DEMix checkpoint needs --domain or one of the --merge-* options")
        if merge is not None and exclude:
            merge = {d: w for d, w in merge.items() if d not in exclude}  # renormalised by expert_weights
        rec = export(
            c,
            args.out,
            args.domain,
            merge,
            check=not args.no_check,
            merge_source=source,
            tokenizer=tok,
            eval_json=eval_json,
            source=args.checkpoint,
        )
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({**rec, "source": args.checkpoint, "out": args.out}))
    return 0


if __name__ == "__main__":
    exit_process(main())
