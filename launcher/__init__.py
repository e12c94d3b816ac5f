"""Config, plan, FFN-kind strategies, the trainer and the command-line entry points."""

from parallel import megatron_warnings  # noqa: F401  (before any megatron-core import: every entry point)
