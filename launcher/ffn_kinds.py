"""One strategy per feed-forward kind: everything the run does differently for dense, DEMix, GShard and CSE.

The model builds each kind's layer itself (`model/ffn.py`'s registry). Everything around the model that
depends on the kind lives here, behind one small interface (`FFNKind`), so that the planner, the trainer,
the dry run, the export and the expert tools ask the strategy instead of branching on `model.ffn.kind`:

    kind = ffn_kind(cfg)                      # the strategy of cfg.model.ffn.kind
    kind.resolve_num_experts(cfg, domains, world_size)
    kind.layout_problems(cfg, domains, world_size)
    kind.topology_domains(domains)            # what the topology lays out: domains (DEMix) or one "all"
    kind.rank_experts(cfg, topo, rank, ...)   # the expert ids this rank builds (None: dense layers only)
    kind.rank_data(topo, rank, n_domains)     # which domains this rank reads, and its shard of them
    kind.expert_replicas(cfg, topo, rank)     # how many ranks hold (and ZeRO-partition) its experts
    kind.build_engine(model, cfg, groups)     # DeepSpeed engine, with `prepare_parallel` after TP
    kind.export_parts(model, topo, groups, rank)
    kind.state_names(model, topo, rank)       # parameter -> plain-model name, and the ranks that can write its state
    kind.step_hook(model, cfg, groups, optimizer, domain_names)

A fifth kind is declared once (model/config.py `declare_ffn_kind`, with its traits), gets its layer in `model/`
(model/ffn.py `register_ffn`) and, where it behaves unlike dense outside the model, one subclass here
(`register_kind` adds it to `KINDS`); a declared kind without a strategy behaves as dense does here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

import torch
import torch.nn as nn

from launcher.config import RunConfig
from model.config import FFN_KINDS
from model.gpt import expert_of_key, split_by_expert
from parallel.cse import CSEController
from parallel.demix_sync import distribute_demix_experts
from parallel.engine import EngineBundle, build_engine
from parallel.gshard import (
    apply_gshard,
    gshard_export_parts,
    gshard_layout_for,
    gshard_layout_problems,
    gshard_state_names,
    resolve_num_experts,
)
from parallel.topology import Topology, unequal_data_note

Tensors = dict[str, torch.Tensor]


class StepHook(Protocol):
    """Called after every optimizer step (CSE clusters here); returns a record to log, or None."""

    def after_step(
        self, step: int, batch_fn: Callable[[int], dict[str, torch.Tensor]]
    ) -> dict[str, Any] | None: ...


class FFNKind:
    """The dense baseline's behaviour; the expert kinds override what they change."""

    name = "dense"
    has_experts = False  # parameters that belong to one expert (train.trainable=experts is possible)
    sharded_experts = False  # consolidated checkpoints keep each expert in a shard of its own

    @property
    def domain_experts(self) -> bool:
        """One expert per training domain, trained on that domain alone (DEMix): the model's `domain_routed`
        trait (model/config.py FFN_KINDS), read, not declared again."""
        traits = FFN_KINDS.get(self.name)
        return bool(traits and traits.domain_routed)

    def resolve_num_experts(self, cfg: RunConfig, domain_names: Sequence[str], world_size: int) -> int:
        """`model.ffn.num_experts` with 0 (= derive) filled in from the domains or the layout."""
        return cfg.model.ffn.num_experts

    def resolve(self, cfg: RunConfig, domain_names: Sequence[str], world_size: int) -> RunConfig:
        """`cfg` with the expert count resolved."""
        n = self.resolve_num_experts(cfg, domain_names, world_size)
        if n == cfg.model.ffn.num_experts:
            return cfg
        return replace(cfg, model=replace(cfg.model, ffn=replace(cfg.model.ffn, num_experts=n)))

    def layout_problems(self, cfg: RunConfig, domain_names: Sequence[str], world_size: int) -> list[str]:
        """What this kind forbids in the data mixture and the parallel layout (all at once)."""
        out = []
        if cfg.data.mixture == "by_domain" and len(domain_names) > 1:
            out.append(
                f"data.mixture=by_domain gives each rank one domain; for kind={self.name!r} use natural, "
                "balanced or domain_token"
            )
        if cfg.parallel.allocation is not None:
            out.append(
                f"parallel.allocation={list(cfg.parallel.allocation)} is only used with model.ffn.kind=demix "
                f"(ranks per domain), not {self.name!r}"
            )
        if cfg.train.trainable == "experts" and not self.has_experts:
            out.append(f"train.trainable=experts needs an expert model, not {self.name!r}")
        return out

    def topology_domains(self, domain_names: Sequence[str]) -> list[str]:
        """The 'domains' the topology lays over the data-parallel ranks: one group of everything by default."""
        return ["all"]

    def data_note(self, topo: Topology) -> str | None:
        """A layout that is allowed but worth announcing (None: nothing to say)."""
        return None

    def rank_experts(
        self, cfg: RunConfig, topo: Topology, rank: int, expert_of_domain: Sequence[int]
    ) -> list[int] | None:
        """The expert ids this rank's model holds (None: no expert layers)."""
        return None

    def rank_expert_groups(self, cfg: RunConfig, topo: Topology, rank: int) -> dict[str, list[int]]:
        """This rank's expert process groups, by name (for the dry run's report)."""
        return {}

    def expert_replicas(self, cfg: RunConfig, topo: Topology, rank: int) -> int:
        """How many data-parallel ranks hold (and reduce, and ZeRO-partition) this rank's experts."""
        return topo.dp_size

    def rank_data(self, topo: Topology, rank: int, num_domains: int) -> tuple[list[int], int, int]:
        """(domains this rank reads, its shard index, the number of shards): every domain, sharded by data rank."""
        info = topo.rank_info(rank)
        return list(range(num_domains)), info.dp_rank, topo.dp_size

    def prepare_parallel(self, model: nn.Module, cfg: RunConfig, groups: Any) -> Any | None:
        """Make the (tensor-parallel) model's experts distributed before the optimizer exists; returns the
        per-step expert gradient scale, if the kind has one."""
        return None

    def build_engine(self, model: nn.Module, cfg: RunConfig, groups: Any) -> EngineBundle:
        """parallel.engine.build_engine with this kind's `prepare_parallel` (an EngineBundle)."""
        return build_engine(
            model,
            cfg.train,
            cfg.parallel,
            groups,
            prepare=lambda m: self.prepare_parallel(m, cfg, groups),
            extra_deepspeed=cfg.extra_deepspeed,
        )

    def export_parts(
        self, model: nn.Module, topo: Topology, groups: Any, rank: int
    ) -> tuple[Tensors, dict[int, Tensors], bool]:
        """(shared tensors, this rank's expert shards by id, whether this rank writes those shards) of the
        plain (TP=1) model. Collective: every rank calls it."""
        if topo.tensor_parallel > 1:
            # megatron-core: only where TP is used
            from parallel.tensor_parallel import (
                gather_full_state_dict,
            )

            full = gather_full_state_dict(model, groups.tp_group)
        else:
            full = {k: v.detach() for k, v in model.state_dict().items()}
        full = {k: v for k, v in full.items() if not k.endswith("_extra_state")}
        return full, {}, False

    def state_names(
        self, model: nn.Module, topo: Topology, rank: int
    ) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Each engine parameter's name in the plain single-process model (the training state is kept by those
        names, so any layout can load it), and the global ranks that hold its whole value while a state is
        written (ZeRO partitions all-reduced over the group that holds it, tensor-parallel shards all-gathered):
        any of them can write its files, and launcher/state.py spreads the files over them. A parameter every
        rank holds (all of the dense model's): every rank."""
        everyone = tuple(range(topo.world_size))
        return {n: (n, everyone) for n, _ in model.named_parameters()}

    def step_hook(
        self, model: nn.Module, cfg: RunConfig, groups: Any, optimizer: Any, domain_names: Sequence[str]
    ) -> StepHook | None:
        """Something to run after every optimizer step (None: nothing)."""
        return None

    def checkpoint_domains(self, meta: dict[str, Any]) -> tuple[str, ...]:
        """The expert-id -> domain names a consolidated checkpoint's meta.json gives this kind (DEMix)."""
        return ()


class Dense(FFNKind):
    """Dense, dense-balanced and +domain-token: the data mixture makes the difference."""


class Demix(FFNKind):
    """DEMix (Gururangan et al. §3): one expert per domain; the domain's ranks read only that domain and
    reduce its expert's gradients among themselves."""

    name = "demix"
    has_experts = sharded_experts = True

    def resolve_num_experts(self, cfg: RunConfig, domain_names: Sequence[str], world_size: int) -> int:
        return cfg.model.ffn.num_experts or len(domain_names)

    def layout_problems(self, cfg: RunConfig, domain_names: Sequence[str], world_size: int) -> list[str]:
        out = []
        if cfg.data.mixture != "by_domain":
            out.append(
                f"model.ffn.kind=demix trains each expert on its own domain: set data.mixture=by_domain "
                f"(not {cfg.data.mixture!r})"
            )
        n = cfg.model.ffn.num_experts
        if n not in (0, len(domain_names)):
            out.append(
                f"model.ffn.num_experts={n} but there are {len(domain_names)} domains "
                f"({', '.join(domain_names)}): DEMix has one expert per domain; set num_experts=0 (derive) "
                "or match the domain count"
            )
        return out

    def topology_domains(self, domain_names: Sequence[str]) -> list[str]:
        return list(domain_names)

    def data_note(self, topo: Topology) -> str | None:
        return unequal_data_note(topo)

    def rank_experts(
        self, cfg: RunConfig, topo: Topology, rank: int, expert_of_domain: Sequence[int]
    ) -> list[int] | None:
        return [expert_of_domain[d] for d in topo.rank_info(rank).domains]

    def rank_expert_groups(self, cfg: RunConfig, topo: Topology, rank: int) -> dict[str, list[int]]:
        return {str(g): list(r) for g, r in topo.expert_groups_of_rank(rank).items()}

    def expert_replicas(self, cfg: RunConfig, topo: Topology, rank: int) -> int:
        return topo.rank_info(rank).num_shards  # the ranks of its domain (1 when domains share a rank)

    def rank_data(self, topo: Topology, rank: int, num_domains: int) -> tuple[list[int], int, int]:
        info = topo.rank_info(rank)
        return list(info.domains), info.shard_index, info.num_shards

    def prepare_parallel(self, model: nn.Module, cfg: RunConfig, groups: Any) -> Any | None:
        return distribute_demix_experts(
            model, cfg.model.ffn.num_experts, groups, cfg.parallel.expert_grad_scaling
        )

    def export_parts(
        self, model: nn.Module, topo: Topology, groups: Any, rank: int
    ) -> tuple[Tensors, dict[int, Tensors], bool]:
        full, _, _ = super().export_parts(model, topo, groups, rank)
        shared, experts = split_by_expert(full)
        info = topo.rank_info(rank)
        # the first rank of its domain group(s)
        return (
            shared,
            experts,
            info.tp_rank == 0 and info.shard_index == 0,
        )

    def state_names(
        self, model: nn.Module, topo: Topology, rank: int
    ) -> dict[str, tuple[str, tuple[int, ...]]]:
        names = super().state_names(model, topo, rank)
        # experts: every rank of their domain, all TP ranks (a rank holding several domains is their only rank)
        domain_ranks = topo.ranks_of_domain(topo.rank_info(rank).domains[0])
        return {
            n: (plain, domain_ranks if expert_of_key(n) is not None else holders)
            for n, (plain, holders) in names.items()
        }

    def checkpoint_domains(self, meta: dict[str, Any]) -> tuple[str, ...]:
        return tuple(meta["domains"])


class GShard(FFNKind):
    """GShard top-2 (Lepikhin et al.) on DeepSpeed's MoE layer: one expert per GPU by default (DEMix §A.5)."""

    name = "gshard"
    has_experts = sharded_experts = True

    def resolve_num_experts(self, cfg: RunConfig, domain_names: Sequence[str], world_size: int) -> int:
        return resolve_num_experts(cfg.model, world_size)

    def layout_problems(self, cfg: RunConfig, domain_names: Sequence[str], world_size: int) -> list[str]:
        return super().layout_problems(cfg, domain_names, world_size) + gshard_layout_problems(
            cfg.model, world_size, cfg.parallel.tensor_parallel
        )

    def rank_experts(
        self, cfg: RunConfig, topo: Topology, rank: int, expert_of_domain: Sequence[int]
    ) -> list[int] | None:
        return list(gshard_layout_for(cfg.model, topo, rank).local_experts)  # init is per parameter name

    def expert_replicas(self, cfg: RunConfig, topo: Topology, rank: int) -> int:
        return len(gshard_layout_for(cfg.model, topo, rank).edp_ranks)

    def rank_expert_groups(self, cfg: RunConfig, topo: Topology, rank: int) -> dict[str, list[int]]:
        lay = gshard_layout_for(cfg.model, topo, rank)
        return {"expert_parallel": list(lay.ep_ranks), "expert_data_parallel": list(lay.edp_ranks)}

    def prepare_parallel(self, model: nn.Module, cfg: RunConfig, groups: Any) -> Any | None:
        apply_gshard(model, cfg.model, groups)  # swaps the plain top-k layers for DeepSpeed's MoE layer
        return None

    def export_parts(
        self, model: nn.Module, topo: Topology, groups: Any, rank: int
    ) -> tuple[Tensors, dict[int, Tensors], bool]:
        return gshard_export_parts(model, groups)

    def state_names(
        self, model: nn.Module, topo: Topology, rank: int
    ) -> dict[str, tuple[str, tuple[int, ...]]]:
        names = super().state_names(model, topo, rank)
        for n, (plain, holders) in gshard_state_names(model).items():  # DeepSpeed's local names -> plain ones
            names[n] = (plain, names[n][1] if holders is None else holders)
        return names


class CSE(FFNKind):
    """Cluster-guided sparse experts (Gururangan et al. 2023): dense warm-up, then experts by sequence cluster."""

    name = "cse"
    has_experts = True

    def resolve_num_experts(self, cfg: RunConfig, domain_names: Sequence[str], world_size: int) -> int:
        return cfg.model.ffn.num_experts or cfg.model.ffn.cse.max_clusters  # slots, activated at clustering

    def step_hook(
        self, model: nn.Module, cfg: RunConfig, groups: Any, optimizer: Any, domain_names: Sequence[str]
    ) -> StepHook | None:
        # warm-up, then cluster sequence embeddings and copy the FFN (CSE Alg. 1)
        return CSEController(
            model, cfg.model.ffn.cse, cfg.train.steps, groups, optimizer=optimizer, domain_names=domain_names
        )


KINDS: dict[str, FFNKind] = {}


def register_kind(kind: FFNKind) -> FFNKind:
    """Add a strategy to the registry under its `name` (a kind model/config.py declares: without a strategy of its
    own, a declared kind behaves as dense here)."""
    KINDS[kind.name] = kind
    return kind


for _kind in (Dense(), Demix(), GShard(), CSE()):
    register_kind(_kind)


def ffn_kind(cfg: RunConfig | str) -> FFNKind:
    """The strategy of a run config's `model.ffn.kind` (or of a kind's name)."""
    name = cfg if isinstance(cfg, str) else cfg.model.ffn.kind
    if name in KINDS:
        return KINDS[name]
    if name in FFN_KINDS:  # declared with no strategy of its own: dense's behaviour, under its name
        return type(f"Declared_{name}", (Dense,), {"name": name})()
    raise ValueError(f"feed-forward kind {name!r} has no strategy registered; known: {sorted(KINDS)}")
