"""The DEMix mixture inside EleutherAI's lm-evaluation-harness (lm_eval 0.4), offline.

    python -m launcher.harness tasks --data artifacts/demo/tokens --tokenizer sentencepiece --out DIR
    python -m launcher.harness run --model demix --include_path DIR --tasks demix_ppl \\
        --model_args checkpoint=CKPT,data=artifacts/demo/tokens,mode=cached
    python -m launcher.harness check CKPT --tasks-dir DIR --data artifacts/demo/tokens --domains legal,code

Importing this package registers the model "demix" with lm_eval (model.py). One file per concern: windows.py (how
a document is cut into model inputs), model_args.py and model.py (the lm-eval model), documents.py (evaluate's
side), tasks.py and task_folder.py (the task folder and its fingerprint), lm_eval_runner.py, check.py and
hf_parity.py (the comparison), cli.py. The design - token conventions, windows, which prior per document, the tasks,
the hf export - is docs/harness.md.
"""

from launcher.harness.check import check, print_check
from launcher.harness.cli import main
from launcher.harness.documents import evaluate_documents
from launcher.harness.hf_parity import hf_parity, padding_log_mass
from launcher.harness.lm_eval_runner import harness_metrics, run_lm_eval
from launcher.harness.model import DemixLM
from launcher.harness.model_args import MODES, DemixArgs, parse_model_args
from launcher.harness.task_folder import (
    TASKS_FORMAT,
    file_hashes,
    read_task_documents,
    verify_tasks_dir,
)
from launcher.harness.tasks import (
    CONTEXT_TOKENS,
    CONTINUATION_TOKENS,
    DISTRACTORS,
    MC_TASK,
    PPL_GROUP,
    PPL_PREFIX,
    continuation_docs,
    process_ppl_results,
    utils_source,
    write_tasks,
)
from launcher.harness.windows import WINDOWS, Windows, document_windows, pack_windows

__all__ = [
    "CONTEXT_TOKENS",
    "CONTINUATION_TOKENS",
    "DISTRACTORS",
    "MC_TASK",
    "MODES",
    "PPL_GROUP",
    "PPL_PREFIX",
    "TASKS_FORMAT",
    "WINDOWS",
    "DemixArgs",
    "DemixLM",
    "Windows",
    "check",
    "continuation_docs",
    "document_windows",
    "evaluate_documents",
    "file_hashes",
    "harness_metrics",
    "hf_parity",
    "main",
    "pack_windows",
    "padding_log_mass",
    "parse_model_args",
    "print_check",
    "process_ppl_results",
    "read_task_documents",
    "run_lm_eval",
    "utils_source",
    "verify_tasks_dir",
    "write_tasks",
]
