"""Writing the export folder (`export`): config.json (bos/eos/pad ids), generation_config.json, model.safetensors,
the tokenizer as a Hugging Face fast tokenizer (launcher/modular/hf_tokenizer.py), README.md (the model card) and
demix_export.json (the record), staged and published whole."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from data.atomic import staged_dir
from launcher.checkpoint import Consolidated, load_consolidated, write_json_atomic
from launcher.ffn_kinds import ffn_kind
from launcher.modular.hf_export.gpt2 import build_hf_model, max_logit_diff, special_ids
from launcher.modular.hf_export.merging import expert_weights
from launcher.modular.hf_export.model_card import eval_json_candidates, find_eval_json, model_card

HF_EXPORT_FORMAT = "demix-hf-export/2"
READ_FORMATS = ("demix-hf-export/1", HF_EXPORT_FORMAT)  # an older export folder may be replaced


def export(
    ckpt: str | Path | Consolidated,
    out: str | Path,
    domain: str | None = None,
    merge: dict[str, float] | None = None,
    check: bool = True,
    merge_source: str | None = None,
    tokenizer: Any = None,
    eval_json: str | Path | None = None,
    source: str | None = None,
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
