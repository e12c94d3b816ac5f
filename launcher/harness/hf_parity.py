"""`harness check --hf-domain`: the stock lm-eval `hf` model on a Hugging Face export of one expert against our
model `demix` with that expert alone (both window conventions) and evaluate's number, with the padding rows' mass
that explains their difference. It uses launcher/modular/'s export, which is why the harness sits above both
launcher/evaluation/ and launcher/modular/ (tests/test_layering.py)."""

from __future__ import annotations

import math
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from launcher.checkpoint import Consolidated, load_consolidated
from launcher.checkpoint_data import load_export_tokenizer
from launcher.harness.lm_eval_runner import harness_metrics
from launcher.harness.tasks import PPL_PREFIX
from launcher.harness.windows import document_windows, pack_windows
from model.batched import expert_hidden_states


def relative_difference(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-300)


def hf_parity(
    ckpt: str,
    tasks_dir: str | Path,
    data: str,
    docs: dict[str, list[str]],
    ev: dict[str, Any],
    hf_domain: str,
    is_demix: bool,
    batch_size: int,
) -> dict[str, Any]:
    """`check`'s "hf" entry: perplexities of `hf_domain`'s task under the export (with and without lm-eval's
    add_bos_token=False), our expert (lm_eval windows, blocks) and `ev` (evaluate_documents), their relative
    differences, and the padding log-mass that predicts the export's from ours."""
    from launcher.modular.hf_export import export  # lazily: importing the harness's model does not need it

    if hf_domain not in docs:
        raise ValueError(f"--hf-domain {hf_domain}: not among the checked domains {', '.join(docs)}")
    c = load_consolidated(ckpt)
    task = [PPL_PREFIX + hf_domain]
    with tempfile.TemporaryDirectory(prefix="demix-hf-") as tmp:
        hf_dir = Path(tmp) / hf_domain
        rec = export(
            c,
            hf_dir,
            domain=hf_domain if is_demix else None,
            tokenizer=load_export_tokenizer(c, data),
            source=ckpt,
        )
        hf_args = f"pretrained={hf_dir},tokenizer={hf_dir},dtype=float32,add_bos_token=False"
        hf = harness_metrics("hf", hf_args, task, tasks_dir)[task[0]]["token_perplexity"]
        hf_default = harness_metrics("hf", hf_args.replace(",add_bos_token=False", ""), task, tasks_dir)[
            task[0]
        ]["token_perplexity"]
    one = f"checkpoint={ckpt},data={data},batch_size={batch_size}" + (
        f",expert={hf_domain}" if is_demix else ""
    )
    blocks = harness_metrics("demix", one, task, tasks_dir)[task[0]]["token_perplexity"]
    lm_eval_w = harness_metrics("demix", one + ",windows=lm_eval", task, tasks_dir)[task[0]][
        "token_perplexity"
    ]
    ev_d = ev["domains"][hf_domain]
    ev_expert = ev_d["expert_ppl"][hf_domain] if is_demix else ev_d["ppl"]["ppl"]
    pad = padding_log_mass(c, docs[hf_domain], data, hf_domain if is_demix else None, batch_size)
    return {
        "domain": hf_domain,
        "hf_add_bos_token_false": hf,
        "hf_default_tokenizer_bos": hf_default,
        "demix_expert_lm_eval_windows": lm_eval_w,
        "demix_expert_blocks": blocks,
        "evaluate_documents_expert": ev_expert,
        "rel_hf_vs_demix_lm_eval_windows": relative_difference(hf, lm_eval_w),
        "rel_demix_blocks_vs_evaluate": relative_difference(blocks, ev_expert),
        "max_abs_logit_diff": rec.get("max_abs_logit_diff"),
        "padding_log_mass": pad,
        "hf_predicted_from_padding": lm_eval_w * math.exp(-pad),
        "rel_hf_vs_predicted": relative_difference(hf, lm_eval_w * math.exp(-pad)),
    }


@torch.no_grad()
def padding_log_mass(
    c: Consolidated,
    texts: Sequence[str],
    data: str | Path,
    expert: str | None = None,
    batch_size: int = 8,
) -> float:
    """Mean over the scored tokens (lm_eval windows) of log Z_all - log Z_real: the log-probability mass our model
    gives the padding rows of its embedding (ids >= the tokenizer's vocabulary; never targets), which an export with
    a trimmed vocabulary leaves out of its softmax. The export's perplexity is ours times exp(-this)."""
    tok = load_export_tokenizer(c, data)
    model = c.build_model().eval()
    ids = None if expert is None else [c.domains.index(expert)]
    wins = [
        w
        for t in texts
        for w in document_windows(tok.encode(t), int(c.cfg.model.seq_len), tok.bos_id, "lm_eval")
    ]
    W = pack_windows(wins, range(len(wins)), tok.eod_id)
    total, n = 0.0, 0.0
    for s in range(0, len(wins), batch_size):
        logits = model.lm_head(expert_hidden_states(model, W.tokens_NT[s : s + batch_size], ids)[0]).double()
        gap = torch.logsumexp(logits, -1) - torch.logsumexp(logits[..., : tok.vocab_size], -1)
        total += float((gap * W.score_NT[s : s + batch_size]).sum())
        n += float(W.score_NT[s : s + batch_size].sum())
    return total / max(n, 1.0)
