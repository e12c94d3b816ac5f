"""`python -m launcher.harness check`: the harness's token perplexity (lm-eval running model `demix` on
a task folder) against `evaluate_documents` on the same documents, per domain and mode; with `hf_domain`, also the
stock `hf` model on that expert's export (launcher/harness/hf_parity.py)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from launcher.checkpoint import read_meta
from launcher.ffn_kinds import ffn_kind
from launcher.harness.documents import evaluate_documents
from launcher.harness.hf_parity import hf_parity, relative_difference
from launcher.harness.lm_eval_runner import harness_metrics
from launcher.harness.model_args import expert_names
from launcher.harness.task_folder import read_task_documents, verify_tasks_dir
from launcher.harness.tasks import PPL_PREFIX
from launcher.tables import markdown_table

# the demix model_args `evaluate_documents` must be told too, to compute the same thing
SHARED_ARGS = ("posterior", "cached_estimator", "cached_blocks", "decay", "topk", "dev_split")


def check(
    ckpt: str,
    tasks_dir: str | Path,
    data: str,
    domains: Sequence[str] | None = None,
    modes: Sequence[str] = ("cached", "naive"),
    hf_domain: str | None = None,
    batch_size: int = 8,
    extra_args: str = "",
) -> dict[str, Any]:
    """Harness token perplexity vs `evaluate_documents` per domain and mode (DEMix; dense: one number); with
    `hf_domain`, the stock `hf` model on that expert's export vs `expert=<hf_domain>` (both window conventions)."""
    from lm_eval.utils import simple_parse_args_string

    verify_tasks_dir(tasks_dir)  # before anything is read from the folder, let alone imported
    docs = read_task_documents(tasks_dir, domains)
    tasks = [PPL_PREFIX + d for d in docs]
    meta = read_meta(ckpt)
    is_demix = ffn_kind(meta["config"]["model"]["ffn"]["kind"]).domain_experts
    extra = simple_parse_args_string(extra_args)
    same = {k: extra[k] for k in SHARED_ARGS if k in extra}
    if "exclude_experts" in extra:
        same["exclude_experts"] = expert_names(extra["exclude_experts"])
    topk = int(extra.get("topk", 0) or 0)
    # harness cached + topk = evaluate's topk
    ev_mode = {m: ("topk" if m == "cached" and topk else m) for m in modes}
    ev = evaluate_documents(
        ckpt, data, docs, modes=list(ev_mode.values()) if is_demix else ["ppl"], batch_size=batch_size, **same
    )
    base = f"checkpoint={ckpt},data={data},batch_size={batch_size}" + (f",{extra_args}" if extra_args else "")
    rows = _compare_rows(ev, base, modes if is_demix else ["ppl"], is_demix, ev_mode, docs, tasks, tasks_dir)
    result: dict[str, Any] = {"checkpoint": ckpt, "tasks_dir": str(tasks_dir), "rows": rows}
    if hf_domain:
        result["hf"] = hf_parity(ckpt, tasks_dir, data, docs, ev, hf_domain, is_demix, batch_size)
    return result


def _compare_rows(
    ev: dict[str, Any],
    base: str,
    modes: Sequence[str],
    is_demix: bool,
    ev_mode: dict[str, str],
    docs: dict[str, list[str]],
    tasks: Sequence[str],
    tasks_dir: str | Path,
) -> list[dict[str, Any]]:
    """One row per mode and domain: the harness's token perplexity (one lm-eval run per mode) and evaluate's."""
    rows = []
    for mode in modes:
        args = base + (f",mode={mode}" if is_demix else "")
        got = harness_metrics("demix", args, tasks, tasks_dir)
        for d in docs:
            h, e = got[PPL_PREFIX + d]["token_perplexity"], ev["domains"][d]["ppl"][ev_mode.get(mode, mode)]
            rows.append(
                {
                    "domain": d,
                    "mode": mode,
                    "harness": h,
                    "evaluate_documents": e,
                    "rel_diff": relative_difference(h, e),
                    "tokens": ev["domains"][d]["tokens"],
                }
            )
    return rows


def print_check(res: dict[str, Any], out: Any = None) -> None:
    """The table of `check`'s rows, then the hf export's numbers when there are any."""
    out = out or sys.stdout
    table = markdown_table(
        ["domain", "mode", "tokens", "harness token ppl", "evaluate_documents ppl", "rel. diff"],
        [
            [
                r["domain"],
                r["mode"],
                r["tokens"],
                f"{r['harness']:.6f}",
                f"{r['evaluate_documents']:.6f}",
                f"{r['rel_diff']:.2e}",
            ]
            for r in res["rows"]
        ],
    )
    for line in table:
        print(line, file=out)
    if "hf" in res:
        h = res["hf"]
        print(f"\nhf export of {h['domain']} (max |logit diff| vs ours {h['max_abs_logit_diff']}):", file=out)
        for k in (
            "hf_add_bos_token_false",
            "demix_expert_lm_eval_windows",
            "hf_predicted_from_padding",
            "hf_default_tokenizer_bos",
            "demix_expert_blocks",
            "evaluate_documents_expert",
            "padding_log_mass",
        ):
            print(f"  {k}: {h[k]:.6g}", file=out)
        print(
            f"  rel hf vs demix expert (lm_eval windows): {h['rel_hf_vs_demix_lm_eval_windows']:.2e}; hf vs that "
            f"corrected for the padding rows' mass: {h['rel_hf_vs_predicted']:.2e}; "
            f"demix expert (blocks) vs evaluate: {h['rel_demix_blocks_vs_evaluate']:.2e}",
            file=out,
        )
