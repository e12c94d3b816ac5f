"""Typed model configuration: the GPT shape and the feed-forward seam's kind.

Every config is a frozen pydantic dataclass sharing `CONFIG` (unknown keys are errors) and the strict
scalar types below; launcher/typed.py turns pydantic's errors into our messages. `problems()` returns every
value problem found (never raises), so that the run-level validator can report all of them at once.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field
from typing import Annotated, Any

from pydantic import AllowInfNan, BeforeValidator, ConfigDict, Strict, StrictInt
from pydantic.dataclasses import dataclass

# Shared by every config class (data/, parallel/, launcher/, benchmarks/ import these): unknown keys are
# errors. Fields use StrictInt / StrictBool / Float so that bools are never ints or numbers and "3" is no int.
CONFIG = ConfigDict(extra="forbid")


def _number_from_string(value: Any) -> Any:
    """YAML reads "3e-4" as a string: accept numeric strings as floats (anything else is left to fail)."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


# ints and "3e-4" yes, bools no, nan/inf no (an lr of nan would pass here and fail in every rank minutes later)
Float = Annotated[float, Strict(), AllowInfNan(False), BeforeValidator(_number_from_string)]


@dataclasses.dataclass(frozen=True)
class FFNTraits:
    """What code below launcher/ (parallel/'s memory model and tracing) needs to know of an FFN kind, so that it
    asks this table instead of comparing kind names; launcher/ffn_kinds.py holds the rest, one strategy per kind."""

    domain_routed: bool = False  # routed by the batch's domain ids (DEMix): the trainer passes domain_ids_B
    deepspeed_moe: bool = False  # a learned top-k gate that training swaps for DeepSpeed's MoE layer (GShard)


# The one declaration of the feed-forward kinds: config validation, model/ffn.py's builders and traits and
# launcher/ffn_kinds.py's strategies all derive from it. `declare_ffn_kind` adds one.
FFN_KINDS: dict[str, FFNTraits] = {
    "dense": FFNTraits(),
    "demix": FFNTraits(domain_routed=True),
    "gshard": FFNTraits(deepspeed_moe=True),
    "cse": FFNTraits(),
}


def declare_ffn_kind(name: str, traits: FFNTraits = FFNTraits()) -> FFNTraits:
    """Declare a feed-forward kind (its layer: model/ffn.py `register_ffn`; its strategy outside the model, if it
    differs from dense's: launcher/ffn_kinds.py `register_kind`)."""
    FFN_KINDS[name] = traits
    return traits


SECOND_EXPERT_POLICIES: tuple[str, ...] = ("sampling", "all", "random")


@dataclass(frozen=True, config=CONFIG)
class GShardConfig:
    """Token-routed top-k MoE options (GShard; DEMix paper §A.5)."""

    top_k: StrictInt = 2
    moe_every: StrictInt = 2  # an MoE layer every `moe_every` layers (2 = every other layer, as in the paper)
    experts_per_rank: StrictInt = 1  # total experts = expert-parallel ranks x experts_per_rank
    capacity_factor: Float = 1.0
    eval_capacity_factor: Float = 2.0
    min_capacity: StrictInt = 4
    aux_loss_weight: Float = 0.01
    second_expert_policy: str = "sampling"

    def problems(self, prefix: str = "model.ffn.gshard") -> list[str]:
        out = []
        if self.top_k not in (1, 2):
            out.append(f"{prefix}.top_k={self.top_k}: must be 1 or 2")
        if self.moe_every < 1:
            out.append(f"{prefix}.moe_every={self.moe_every}: must be >= 1")
        if self.experts_per_rank < 1:
            out.append(f"{prefix}.experts_per_rank={self.experts_per_rank}: must be >= 1")
        if self.capacity_factor <= 0 or self.eval_capacity_factor <= 0:
            out.append(f"{prefix}: capacity factors must be > 0")
        if self.aux_loss_weight < 0:
            out.append(f"{prefix}.aux_loss_weight={self.aux_loss_weight}: must be >= 0")
        if self.second_expert_policy not in SECOND_EXPERT_POLICIES:
            out.append(
                f"{prefix}.second_expert_policy={self.second_expert_policy!r}: "
                f"choose one of {', '.join(SECOND_EXPERT_POLICIES)}"
            )
        return out


@dataclass(frozen=True, config=CONFIG)
class CSEConfig:
    """Cluster-guided sparse experts options (CSE paper, Algorithm 1)."""

    last_layers: StrictInt = 2  # experts in the last N layers only
    warmup_fraction: Float = 0.01
    num_samples: StrictInt = 1024
    projection_dim: StrictInt = 64
    dbscan_eps: Float = 0.5  # <= 0: chosen from the data by `dbscan_auto` (parallel/cse.py)
    dbscan_min_samples: StrictInt = 5
    dbscan_auto: str = (
        "median"  # eps from the data: median (2 x median k-distance), knee, or target (cluster counts)
    )
    min_clusters: StrictInt = (
        2  # dbscan_auto=target: at least this many clusters (then most, then least noise)
    )
    centre_momentum: Float = 0.99  # alpha in c_j <- alpha c_j + (1 - alpha) v'
    max_clusters: StrictInt = 16

    def problems(self, prefix: str = "model.ffn.cse") -> list[str]:
        out = []
        if self.last_layers < 1:
            out.append(f"{prefix}.last_layers={self.last_layers}: must be >= 1")
        if not 0.0 <= self.warmup_fraction <= 1.0:
            out.append(f"{prefix}.warmup_fraction={self.warmup_fraction}: must be in [0, 1]")
        if not 0.0 <= self.centre_momentum < 1.0:
            out.append(f"{prefix}.centre_momentum={self.centre_momentum}: must be in [0, 1)")
        if self.projection_dim < 1 or self.num_samples < 1 or self.max_clusters < 1:
            out.append(f"{prefix}: projection_dim, num_samples and max_clusters must be >= 1")
        if self.dbscan_auto not in ("median", "knee", "target"):
            out.append(f"{prefix}.dbscan_auto={self.dbscan_auto!r}: choose median, knee or target")
        if not 1 <= self.min_clusters <= self.max_clusters:
            out.append(
                f"{prefix}.min_clusters={self.min_clusters}: must be in [1, max_clusters={self.max_clusters}]"
            )
        return out


@dataclass(frozen=True, config=CONFIG)
class FFNConfig:
    """The feed-forward seam: which kind, and how many experts.

    `num_experts = 0` means "derive it": the number of training domains for `demix`,
    expert-parallel ranks x experts_per_rank for `gshard`. `dense` always has one.
    """

    kind: str = "dense"
    num_experts: StrictInt = 0
    gshard: GShardConfig = field(default_factory=GShardConfig)
    cse: CSEConfig = field(default_factory=CSEConfig)

    def problems(self, prefix: str = "model.ffn") -> list[str]:
        out = []
        if self.kind not in FFN_KINDS:
            out.append(
                f"{prefix}.kind={self.kind!r}: unknown feed-forward kind; choose one of {', '.join(FFN_KINDS)}"
            )
        if self.num_experts < 0:
            out.append(
                f"{prefix}.num_experts={self.num_experts}: must be >= 0 (0 = derive from domains / ranks)"
            )
        if self.kind == "dense" and self.num_experts > 1:
            out.append(f"{prefix}.num_experts={self.num_experts}: a dense FFN has exactly one expert")
        out += self.gshard.problems(prefix + ".gshard")
        out += self.cse.problems(prefix + ".cse")
        return out


# The integer fields that fix a GPT's shape (each >= 1); a checkpoint's values start a run of the same model.
SHAPE_FIELDS = (
    "n_layers",
    "d_model",
    "n_heads",
    "seq_len",
    "vocab_size",
    "ffn_mult",
    "make_vocab_size_divisible_by",
)


@dataclass(frozen=True, config=CONFIG)
class ModelConfig:
    """A GPT-3-style decoder (pre-LN, learned positions, GELU MLP, tied embeddings)."""

    name: str = "custom"
    n_layers: StrictInt = 2
    d_model: StrictInt = 128
    n_heads: StrictInt = 4
    seq_len: StrictInt = 1024
    vocab_size: StrictInt = 50264
    ffn_mult: StrictInt = 4
    dropout: Float = 0.0
    init_std: Float = 0.02
    make_vocab_size_divisible_by: StrictInt = 128
    ffn: FFNConfig = field(default_factory=FFNConfig)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def d_ffn(self) -> int:
        return self.ffn_mult * self.d_model

    def padded_vocab_size(self, tensor_parallel: int = 1) -> int:
        """Vocabulary padded (Megatron-style) to a multiple of `make_vocab_size_divisible_by * tp`."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def problems(self, prefix: str = "model") -> list[str]:
        out = []
        for name in SHAPE_FIELDS:
            if getattr(self, name) < 1:
                out.append(f"{prefix}.{name}={getattr(self, name)}: must be >= 1")
        if self.n_heads >= 1 and self.d_model % self.n_heads:
            out.append(
                f"{prefix}.d_model={self.d_model} is not divisible by {prefix}.n_heads={self.n_heads}: "
                "pick a head count that divides the hidden size"
            )
        if not 0.0 <= self.dropout < 1.0:
            out.append(f"{prefix}.dropout={self.dropout}: must be in [0, 1)")
        if self.init_std <= 0:
            out.append(f"{prefix}.init_std={self.init_std}: must be > 0")
        out += self.ffn.problems(prefix + ".ffn")
        return out

    def moe_layer_ids(self) -> list[int]:
        """Indices of the layers whose FFN is an expert layer for this kind."""
        kind = self.ffn.kind
        if kind == "demix":
            return list(range(self.n_layers))  # every layer (DEMix §3; interleaving hurt)
        if kind == "gshard":
            every = self.ffn.gshard.moe_every
            return [i for i in range(self.n_layers) if i % every == every - 1]
        if kind == "cse":
            return list(range(max(0, self.n_layers - self.ffn.cse.last_layers), self.n_layers))
        return []
