"""Layout, process groups, tensor parallelism, the DeepSpeed engine."""

from parallel import megatron_warnings  # noqa: F401  (before any megatron-core import)
