"""Modular experts (DEMix §6-7): add an expert for a new domain, adapt it (DEMix-DAPT, and the Dense-DAPT
baseline), remove experts, and report both in the paper's shape (Tables 6, 7, 13). The commands and what each
does: launcher/modular/experts/cli.py (`python -m launcher.modular.experts`).

The package: scoring.py (per-domain log-likelihoods, masked mixtures), editing.py (add and remove experts), dapt.py
(the DAPT runs), tables.py (Tables 6, 7, 13 as numbers), report_files.py (as Markdown and JSON), cli.py.
"""

from launcher.modular.experts.cli import main, parse_args, run_demo
from launcher.modular.experts.dapt import dapt_overrides, run_dapt
from launcher.modular.experts.editing import (
    add_expert,
    add_expert_state,
    estimate_domain_prior,
    remove_experts,
    save,
)
from launcher.modular.experts.report_files import (
    adaptation_markdown,
    check_report_out,
    removal_markdown,
    write_report,
)
from launcher.modular.experts.scoring import domain_log_likelihoods, evaluate_experts, masked_mixture
from launcher.modular.experts.tables import (
    ADAPT_REPORT_FORMAT,
    REMOVAL_REPORT_FORMAT,
    adaptation_report,
    removal_report,
)

__all__ = [
    "ADAPT_REPORT_FORMAT",
    "REMOVAL_REPORT_FORMAT",
    "adaptation_markdown",
    "adaptation_report",
    "add_expert",
    "add_expert_state",
    "check_report_out",
    "dapt_overrides",
    "domain_log_likelihoods",
    "estimate_domain_prior",
    "evaluate_experts",
    "main",
    "masked_mixture",
    "parse_args",
    "removal_markdown",
    "removal_report",
    "remove_experts",
    "run_dapt",
    "run_demo",
    "save",
    "write_report",
]
