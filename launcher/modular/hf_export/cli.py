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
"""  # noqa: E501 (the usage lines, as --help shows them)

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from data.argtypes import nonneg_float, positive_int
from data.cli import check_output_dir, cli_main, usage_error
from launcher.checkpoint import CheckpointError, load_consolidated, read_meta
from launcher.checkpoint_data import load_export_tokenizer
from launcher.ffn_kinds import ffn_kind
from launcher.modular.hf_export.folder import READ_FORMATS, export
from launcher.modular.hf_export.merging import merge_weights_from_data, merge_weights_over
from launcher.modular.hf_export.model_card import eval_table, find_eval_json
from model import mixture as mx


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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="hf_export.py",  # what it was as a module: usage lines and errors unchanged
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
def main(argv: Sequence[str] | None = None) -> int:
    """The command line: status 0 with the record on stdout, or 2 with one `error:` line."""
    args = parse_args(argv)
    try:
        check_output_dir(
            Path(args.out),
            READ_FORMATS,
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
        eval_table(eval_json, args.domain)  # the model card's input, checked before any tensor is read
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
        return usage_error(e)
    print(json.dumps({**rec, "source": args.checkpoint, "out": args.out}))
    return 0
