"""Branch-Train-MiX (Sukhbaatar et al. 2024) on this project's checkpoints: `branch` a dense seed model into a DEMix
one, `upcycle` a DEMix checkpoint's domain experts into a GShard top-2 MoE, and the `--set` values that start the
Train and MiX runs from them. The method and its measured caveats: docs/btx.md.

The package: branching.py (dense -> DEMix), upcycling.py (DEMix -> GShard), router.py (the router initialised from
data), run_sets.py (the `--set` values of the next run), cli.py (`python -m launcher.modular.btx`).
"""

from launcher.modular.btx.branching import (
    branch,
    branch_config,
    branch_domains,
    branch_source_problems,
    branch_state,
    catalog_domains,
)
from launcher.modular.btx.cli import main, parse_args, parse_branch_args
from launcher.modular.btx.router import domain_ffn_inputs, fit_router
from launcher.modular.btx.run_sets import demix_overrides, finetune_overrides
from launcher.modular.btx.upcycling import (
    LAYERS,
    ROUTER_INITS,
    average_coherence,
    btx_config,
    layout_problems,
    upcycle,
    upcycle_state,
)

__all__ = [
    "LAYERS",
    "ROUTER_INITS",
    "average_coherence",
    "branch",
    "branch_config",
    "branch_domains",
    "branch_source_problems",
    "branch_state",
    "btx_config",
    "catalog_domains",
    "demix_overrides",
    "domain_ffn_inputs",
    "finetune_overrides",
    "fit_router",
    "layout_problems",
    "main",
    "parse_args",
    "parse_branch_args",
    "upcycle",
    "upcycle_state",
]
