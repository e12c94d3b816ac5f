"""Which processes of a launched job are its ranks: `python -m launcher.train` (mpirun, srun, torchrun, or a rank
started by hand) or DeepSpeed's runner's script `launcher/_rank_entry.py` (what `launch` gives the runner)."""

from __future__ import annotations


def is_rank_command(cmdline: list[str]) -> bool:
    """Whether a process's command line is a training rank (never the per-node launcher that starts them)."""
    if "launcher.node_launch" in cmdline or "deepspeed.launcher.launch" in cmdline:  # whole arguments: a run
        return False  # directory may be named after a test "..._per_node_launcher_..."
    return "launcher.train" in cmdline or any(a.endswith("launcher/_rank_entry.py") for a in cmdline)
