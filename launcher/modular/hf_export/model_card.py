"""The export's README.md: what the model is, how to load it, what it was trained on (`training_tokens_line`) and
the source model's test perplexities from `launcher.evaluation.evaluate`'s eval.json (`eval_json_candidates`:
CKPT/eval/eval.json, else the run's CKPT/../eval/eval.json, or --eval-json)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from data.readers import read_json_object
from launcher.checkpoint import CheckpointError, Consolidated, read_meta
from launcher.tables import markdown_table


def eval_json_candidates(checkpoint: str | Path, exclude: Sequence[str] = ()) -> list[Path]:
    """Where `launcher.evaluation.evaluate CKPT` leaves its eval.json, in the order the export looks: its default
    --out `CKPT/eval` (`CKPT/eval-without-<names>` for an evaluation with --exclude-experts, when the export opts
    the same experts out), then the run directory's `CKPT/../eval` (launcher/demo.py, reproduce.py; the export's
    older default)."""
    ckpt = Path(checkpoint)
    without = [ckpt / f"eval-without-{'-'.join(exclude)}" / "eval.json"] if exclude else []
    return [*without, ckpt / "eval" / "eval.json", ckpt.parent / "eval" / "eval.json"]


def find_eval_json(checkpoint: str | Path, exclude: Sequence[str] = ()) -> Path | None:
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


def eval_table(eval_json: Path | None, domain: str | None, looked: Sequence[Path] = ()) -> list[str]:
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
        ]
        rows = []
        for d, r in sorted(res["domains"].items()):
            mark = " (this export)" if d == domain else ""
            vals = [f"{r['ppl'][m]:.2f}" if m in r.get("ppl", {}) else "–" for m in modes]
            uni = r.get("unigram", {}).get("ppl")
            rows.append([f"{d}{mark}", r["role"], *vals, f"{uni:.2f}" if uni else "–"])
        lines += markdown_table(["domain", "role", *modes, "unigram"], rows)
    except (LookupError, TypeError, AttributeError, ValueError) as e:
        raise CheckpointError(
            f"{eval_json} (the source's evaluation): an entry of the wrong shape "
            f"({type(e).__name__}: {e}); pass another --eval-json"
        ) from None
    return lines


def _base_tokens(init_from: str) -> int | None:
    """`train_tokens` of the checkpoint a run started from (train.init_from), None when it cannot be read."""
    try:
        tokens = read_meta(init_from).get("train_tokens")
    except (CheckpointError, OSError, ValueError):
        return None
    return tokens if isinstance(tokens, int) else None


def training_tokens_line(c: Consolidated, domain: str | None) -> str:
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
    c: Consolidated, record: dict[str, Any], eval_json: Path | None = None, looked: Sequence[Path] = ()
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
        *eval_table(eval_json, record["domain"], looked),
        "",
    ]
    return "\n".join(lines)
