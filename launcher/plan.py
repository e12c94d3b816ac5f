"""Planning: resolve and validate a run for N ranks before any process, model or GPU exists.

One module for the launcher, the trainer and the dry run, so the three can never disagree:

* `plan_layout(cfg, world_size, domain_names)`: the data-free part (config, FFN kind, tensor-parallel
  sharding, topology), which the dry run runs for a cluster it does not have;
* `make_plan(cfg, world_size)`: the same plus the data (catalog, vocabulary, tokens per split), the
  `train.init_from` checkpoint and, where this machine is the training device, its precision support.

Both report every problem at once (`ConfigError`), each with the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from data.catalog import Catalog, DataError, load_catalog
from launcher.checkpoint import read_meta
from launcher.config import ConfigError, RunConfig
from launcher.ffn_kinds import ffn_kind
from parallel.topology import Topology, build_topology, model_sharding_problems, topology_problems


@dataclass(frozen=True)
class Plan:
    """A validated run: the resolved config, its data and its layout."""

    cfg: RunConfig  # resolved: expert count, vocabulary
    catalog: Catalog
    topo: Topology
    expert_domains: tuple[str, ...] = ()  # expert id -> domain name (DEMix); from train.init_from when given
    notes: tuple[str, ...] = ()  # allowed but worth announcing (e.g. unequal data per domain)

    @property
    def expert_of_domain(self) -> list[int]:
        """Data domain id (position in catalog.train_domains) -> expert id of the model."""
        if not self.expert_domains:
            return list(range(len(self.catalog.train_domains)))
        return [self.expert_domains.index(d) for d in self.catalog.train_domains]


@dataclass(frozen=True)
class Layout:
    """The data-free result of planning: resolved config, topology (None when impossible), problems, notes."""

    cfg: RunConfig
    topo: Topology | None
    problems: list[str]
    notes: tuple[str, ...] = ()


def plan_layout(
    cfg: RunConfig, world_size: int, domain_names: Sequence[str], expert_domains: Sequence[str] = ()
) -> Layout:
    """Resolve the expert count and lay out `world_size` ranks over `domain_names` for cfg's FFN kind.
    `expert_domains`: the experts of a `train.init_from` checkpoint, when they differ from the domains."""
    kind = ffn_kind(cfg)
    experts_for = list(expert_domains or domain_names)
    problems = kind.layout_problems(cfg, experts_for, world_size)
    cfg = kind.resolve(cfg, experts_for, world_size)
    tp = cfg.parallel.tensor_parallel
    problems += model_sharding_problems(cfg.model.n_heads, cfg.model.d_ffn, tp)
    laid_out = kind.topology_domains(domain_names)
    allocation = cfg.parallel.allocation if kind.domain_experts else None
    topo_problems = topology_problems(world_size, tp, len(laid_out), allocation, laid_out)
    problems += [f"parallel: {p}" for p in topo_problems]
    topo = None if topo_problems else build_topology(world_size, tp, len(laid_out), allocation, laid_out)
    note = kind.data_note(topo) if topo is not None else None
    return Layout(cfg, topo, problems, (note,) if note else ())


def init_checkpoint_problems(cfg: RunConfig, catalog: Catalog) -> tuple[list[str], tuple[str, ...]]:
    """Checks of `train.init_from` against this run (reads only its meta.json); returns (problems, expert domains)."""
    path = Path(cfg.train.init_from)
    if not (path / "meta.json").is_file():
        return [f"train.init_from={str(path)!r}: not a consolidated checkpoint (no meta.json)"], ()
    try:
        meta = read_meta(path)
    except ValueError as e:  # CheckpointError, ConfigError: the message names the file
        return [f"train.init_from={str(path)!r}: {e}"], ()
    m = meta["config"]["model"]
    out = []
    sha = meta.get("tokenizer_sha256")
    if sha and sha != catalog.tokenizer_sha256:
        out.append(
            f"train.init_from: the checkpoint was trained on tokens of another tokenizer (fingerprint "
            f"{sha[:12]}) than {catalog.root} (fingerprint {catalog.tokenizer_sha256[:12]}); prepare the data "
            "with the checkpoint's tokenizer"
        )
    for key in ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size", "ffn_mult"):
        if m.get(key) != getattr(cfg.model, key):
            out.append(
                f"train.init_from: model.{key} is {m.get(key)} in the checkpoint, {getattr(cfg.model, key)} here"
            )
    if m["ffn"]["kind"] != cfg.model.ffn.kind:
        out.append(
            f"train.init_from: a {m['ffn']['kind']!r} checkpoint cannot start a {cfg.model.ffn.kind!r} run"
        )
    domains = ffn_kind(cfg).checkpoint_domains(meta)
    missing = [d for d in catalog.train_domains if domains and d not in domains]
    if missing:
        out.append(
            f"train.init_from has no expert for {missing} (experts: {', '.join(domains)}); add one first with "
            "`python -m launcher.modular.experts add`"
        )
    return out, domains


def vocab_problems(cfg: RunConfig, catalog: Catalog) -> list[str]:
    """The model's (padded) vocabulary against the token ids the data uses (the tokenizer's, plus one domain token
    per training domain with `data.mixture=domain_token`), with the fix: the one rule launch, train and the dry run
    apply. The suggested `model.vocab_size` is the ids needed rounded up to `model.make_vocab_size_divisible_by`
    (GPT-2: 50,257 -> 50304), which `padded_vocab_size` keeps as it is."""
    domain_tokens = cfg.data.mixture == "domain_token"
    need = catalog.total_vocab_size(domain_tokens)
    have = cfg.model.padded_vocab_size(cfg.parallel.tensor_parallel)
    if need <= have:
        return []
    multiple = cfg.model.make_vocab_size_divisible_by
    fix = -(-need // multiple) * multiple
    ids = (
        f"{catalog.vocab_size} tokenizer tokens + {len(catalog.train_domains)} domain tokens"
        if domain_tokens
        else "the tokenizer's vocabulary"
    )
    return [
        f"model.vocab_size={cfg.model.vocab_size} (padded {have}) is smaller than the {need} token ids the "
        f"{catalog.tokenizer} data uses{' with domain tokens' if domain_tokens else ''}; fix: "
        f"`--set model.vocab_size={fix}` (or `vocab_size: {fix}` under model: in the config: {ids} rounded up to "
        f"a multiple of model.make_vocab_size_divisible_by={multiple}), or use data prepared with a tokenizer "
        f"of at most {have - (len(catalog.train_domains) if domain_tokens else 0)} tokens"
    ]


def data_problems(cfg: RunConfig, catalog: Catalog) -> list[str]:
    """The data against the (resolved) config: vocabulary size (`vocab_problems`) and at least one block per domain
    and split."""
    out = vocab_problems(cfg, catalog)
    min_tokens = cfg.model.seq_len + 1
    for d in catalog.train_domains:
        for split in ("train", "valid"):
            if catalog.tokens(d, split) < min_tokens:
                out.append(
                    f"domain {d!r} has {catalog.tokens(d, split)} {split} tokens, fewer than one block of {min_tokens}"
                )
    return out


def make_plan(cfg: RunConfig, world_size: int, check_local_device: bool = False) -> Plan:
    """Resolve and validate a run for `world_size` ranks; raise ConfigError listing every problem
    (the config's own, the data's and the layout's, together). `check_local_device`: this machine's device
    is the training device (a local launch, or a rank itself), so its precision support is checked too."""
    problems = cfg.problems()
    if check_local_device and not problems:
        from parallel.precision import local_precision_problems

        problems += local_precision_problems(cfg.train.precision)
    try:
        catalog = load_catalog(cfg.data.path, cfg.data.tokenizer, cfg.data.domains)
    except DataError as e:
        problems.append(str(e))
        problems += model_sharding_problems(cfg.model.n_heads, cfg.model.d_ffn, cfg.parallel.tensor_parallel)
        raise ConfigError(problems, "run") from None
    if problems:  # a broken config would make the data/layout checks below misleading
        problems += model_sharding_problems(cfg.model.n_heads, cfg.model.d_ffn, cfg.parallel.tensor_parallel)
        raise ConfigError(problems, "run")
    expert_domains: tuple[str, ...] = ()
    if cfg.train.init_from:
        problems, expert_domains = init_checkpoint_problems(cfg, catalog)
    layout = plan_layout(cfg, world_size, catalog.train_domains, expert_domains)
    problems += layout.problems + data_problems(layout.cfg, catalog)
    if problems:
        raise ConfigError(problems, "run")
    return Plan(layout.cfg, catalog, layout.topo, expert_domains, notes=layout.notes)
