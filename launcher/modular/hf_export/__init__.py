"""Export one domain's model (its expert + the shared weights) or a merged model as a Hugging Face `transformers`
GPT2LMHeadModel (safetensors), with the same logits as the project's model. The command and what the folder holds:
launcher/modular/hf_export/cli.py (`python -m launcher.modular.hf_export`).

The package: merging.py (a DEMix checkpoint as one dense model), gpt2.py (our layout -> GPT-2's), model_card.py
(README.md), folder.py (`export`: the folder), cli.py.
"""

from launcher.modular.hf_export.cli import main, parse_args
from launcher.modular.hf_export.folder import HF_EXPORT_FORMAT, export
from launcher.modular.hf_export.gpt2 import (
    build_hf_model,
    gpt2_config,
    max_logit_diff,
    special_ids,
    to_gpt2_state_dict,
)
from launcher.modular.hf_export.merging import (
    dense_model,
    dense_state_dict,
    expert_weights,
    merge_weights_from_data,
    merge_weights_over,
)
from launcher.modular.hf_export.model_card import (
    eval_json_candidates,
    find_eval_json,
    model_card,
    training_tokens_line,
)

__all__ = [
    "HF_EXPORT_FORMAT",
    "build_hf_model",
    "dense_model",
    "dense_state_dict",
    "eval_json_candidates",
    "expert_weights",
    "export",
    "find_eval_json",
    "gpt2_config",
    "main",
    "max_logit_diff",
    "merge_weights_from_data",
    "merge_weights_over",
    "model_card",
    "parse_args",
    "special_ids",
    "to_gpt2_state_dict",
    "training_tokens_line",
]
