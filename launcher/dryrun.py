"""Dry run: check a run's config and parallel layout for N GPUs with no GPU and no process started.

    python -m launcher.dryrun [CONFIG.yaml] --world-size 128 --set model.preset=gpt3-xl model.ffn.kind=demix \
        --set parallel.tensor_parallel=2 [--domains 8] [--data TOKENS_ROOT | --no-data] [--out runs/dryrun/summary.json]

It (a) validates the config and the layout, reporting every problem at once; (b) builds the topology and
prints its description; (c) builds the model of rank 0 and of the last rank on the meta device and prints
their parameter counts; (d) writes a JSON summary. The DeepSpeed config belongs to the trainer: a caller
may pass `deepspeed_config(cfg, topology) -> dict` to `main`, and the dry run writes it beside the summary.

Data: when the run names its data (data.path in the config or a --set, or --data DIR), the dry run plans it
exactly as launch does (launcher/plan.py `make_plan`: the token manifest's training and novel domains, its
tokenizer and vocabulary against model.vocab_size, tokens per split, train.init_from), so a run it accepts launch
accepts too. Without (or with --no-data) it plans the layout alone, over data.domains or domains it invents
(domain0..N-1, --domains N) and says so: nothing is checked against a tokenizer then.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from data.argtypes import positive_float, positive_int
from data.cli import cli_main, exit_process, usage_error
from data.readers import read_yaml
from launcher.config import ConfigError, RunConfig, load_run_config, parse_overrides
from launcher.ffn_kinds import ffn_kind
from launcher.plan import Layout, make_plan, plan_layout
from model.gpt import GPT
from parallel.ds_expert_groups import deepspeed_equivalent
from parallel.topology import Topology

DEFAULT_DOMAINS = 8
DEFAULT_OUT = "runs/dryrun/summary.json"
DeepSpeedConfigFn = Callable[[RunConfig, Topology], dict]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m launcher.dryrun", description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", help="run YAML (default: the built-in defaults plus --set overrides)")
    p.add_argument("--world-size", type=positive_int, required=True, help="number of GPUs to lay out")
    p.add_argument(
        "--domains",
        type=positive_int,
        default=None,
        help=f"number of training domains (default: len(data.domains), else {DEFAULT_DOMAINS})",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help="config overrides, e.g. model.preset=gpt3-xl model.ffn.kind=demix",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--data",
        metavar="TOKENS_ROOT",
        help="prepared tokens root (as --set data.path=...): plan its domains and vocabulary as launch does",
    )
    src.add_argument(
        "--no-data",
        action="store_true",
        help="plan the layout alone even when data.path is set (domains from data.domains or invented)",
    )
    p.add_argument("--out", default=DEFAULT_OUT, help=f"JSON summary path (default {DEFAULT_OUT})")
    p.add_argument(
        "--gpu-memory-gb",
        type=positive_float,
        default=None,
        help="memory of one GPU in GiB for the fit verdict (default: the --device table's, e.g. V100 32)",
    )
    p.add_argument(
        "--device",
        default=None,
        help="the cluster's accelerator (v100, a100, h100, ... as in model/accounting.py): checks that "
        "train.precision is one it has (e.g. no bf16 on V100)",
    )
    return p.parse_args(argv)


def resolve_domains(cfg: RunConfig, domains: int | None) -> tuple[list[str], list[str]]:
    """Domain names (from data.domains, else domain0..N-1) and any disagreement between the two sources."""
    named = cfg.data.domains
    if named is not None and domains is not None and len(named) != domains:
        return list(named), [
            f"--domains {domains} disagrees with data.domains ({len(named)} names: {named}): "
            "drop one or match them"
        ]
    if named is not None:
        return list(named), []
    n = DEFAULT_DOMAINS if domains is None else domains
    return [f"domain{g}" for g in range(n)], []


def data_path_set(config: str | None, overrides: Sequence[str]) -> bool:
    """Whether the run names its data: data.path in the config file or in an override (the built-in default,
    which launch would read too, does not count: a dry run for a cluster need not have the data here)."""
    raws = [read_yaml(config) if config else {}, parse_overrides(overrides)]
    return any(isinstance(r, dict) and isinstance(r.get("data"), dict) and "path" in r["data"] for r in raws)


def plan_with_data(cfg: RunConfig, world_size: int, domains: int | None) -> tuple[Layout, dict[str, Any]]:
    """The layout planned as launch plans it (`make_plan`, which reads data.path's token manifest with
    data/catalog.py `load_catalog`), and what the data is: its path, tokenizer, vocabulary, training and novel
    domains. Problems (the data's, the vocabulary's with its fix, the layout's) are in the Layout."""
    try:
        plan = make_plan(cfg, world_size)
    except ConfigError as e:
        problems = list(e.problems)
        if not (Path(cfg.data.path) / cfg.data.tokenizer / "manifest.json").is_file():
            problems.append(
                f"(the dry run reads data.path={cfg.data.path} as launch does: give the prepared tokens "
                "root with --data DIR, or plan the layout alone with --no-data)"
            )
        return Layout(cfg, None, problems), {}
    cat, pcfg = plan.catalog, plan.cfg
    problems = []
    if domains is not None and domains != len(cat.train_domains):
        problems.append(
            f"--domains {domains} disagrees with the {len(cat.train_domains)} training domains of "
            f"{cat.root} ({', '.join(cat.train_domains)}): drop --domains or pick the domains in "
            "data.domains"
        )
    data = {
        "source": "manifest",
        "path": str(cat.root),
        "tokenizer": cat.tokenizer,
        "tokenizer_vocab_size": cat.vocab_size,
        "token_ids": cat.total_vocab_size(pcfg.data.mixture == "domain_token"),
        "model_vocab_size": pcfg.model.vocab_size,
        "padded_vocab_size": pcfg.model.padded_vocab_size(pcfg.parallel.tensor_parallel),
        "train_domains": list(cat.train_domains),
        "novel_domains": list(cat.novel_domains),
    }
    return Layout(pcfg, plan.topo, problems, plan.notes), data


def plan_without_data(cfg: RunConfig, world_size: int, domains: int | None) -> tuple[Layout, dict[str, Any]]:
    """The data-free layout (`plan_layout`) over data.domains or invented domain0..N-1, with a note saying which
    and that no tokenizer was checked."""
    names, problems = resolve_domains(cfg, domains)
    layout = plan_layout(cfg, world_size, names)
    invented = cfg.data.domains is None
    where = (
        f"the domains {names[0]}..{names[-1]} are invented (--domains N sets how many)"
        if invented
        else "the domains come from data.domains"
    )
    note = (
        f"no data read: {where}, not read from prepared data, and model.vocab_size is not checked against a "
        "tokenizer; set data.path (or --data TOKENS_ROOT) to plan the data's own domains as launch does"
    )
    data = {"source": "invented" if invented else "data.domains", "train_domains": names, "novel_domains": []}
    return Layout(layout.cfg, layout.topo, problems + layout.problems, (*layout.notes, note)), data


def param_counts(model: GPT, tp: int) -> dict:
    """Full-layer counts (TP is not applied on meta) and the per-tensor-parallel-rank share, computed
    Megatron-style: column-parallel linears (qkv, fc1) split weight and bias, row-parallel ones (proj, fc2;
    the residual projections) split the weight only, the token embedding is vocab-parallel, the rest
    (positions, layer norms, row-parallel biases) is replicated. GShard gates and experts stay whole: each
    GPU holds its own experts (parallel/gshard.py)."""
    from model.gshard import GShardFFN

    whole = {id(m) for f in model.modules() if isinstance(f, GShardFFN) for m in f.modules()}  # gate, experts
    by_expert = model.expert_parameters()
    expert_ids = {id(p) for ps in by_expert.values() for p in ps}
    sharded = expert_sharded = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and id(module) not in whole:
            n = module.weight.numel()
            if module.bias is not None and not getattr(module, "is_residual_projection", False):
                n += module.bias.numel()
            sharded += n
            expert_sharded += n if id(module.weight) in expert_ids else 0
    sharded += model.wte.weight.numel()
    total = model.num_parameters()
    expert = sum(p.numel() for ps in by_expert.values() for p in ps)
    per_expert = expert // max(1, len(by_expert))
    per_tp_rank = (total - sharded) + sharded // tp
    expert_per_tp_rank = (expert - expert_sharded) + expert_sharded // tp
    return {
        "total": total,
        "shared": total - expert,
        "expert": expert,
        "per_expert": per_expert,
        "model_all_experts": total - expert + per_expert * model.cfg.ffn.num_experts if by_expert else total,
        "per_tp_rank": per_tp_rank,
        "tp_sharded": sharded,
        "shared_per_tp_rank": per_tp_rank - expert_per_tp_rank,
        "expert_per_tp_rank": expert_per_tp_rank,
    }


class _SkipMetaNormal(TorchFunctionMode):
    """Random init of a meta tensor does nothing, yet torch routes `normal_` on meta through a Python
    reference that first imports torch._dynamo (seconds on a busy machine); skip the call instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.nn.init.normal_, torch.Tensor.normal_):
            tensor = args[0] if args else kwargs["tensor"]
            if tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def rank_summaries(cfg: RunConfig, topo: Topology, ranks: Sequence[int]) -> list[dict]:
    """Build each listed rank's model on the meta device (no memory, no process) and count parameters."""
    kind, out = ffn_kind(cfg), []
    for rank in ranks:
        info = topo.rank_info(rank)
        expert_ids = kind.rank_experts(cfg, topo, rank, range(topo.num_domains))
        groups = kind.rank_expert_groups(cfg, topo, rank)
        with torch.device("meta"), _SkipMetaNormal():
            model = GPT(cfg.model, expert_ids=expert_ids, tensor_parallel=topo.tensor_parallel)
        out.append(
            {
                "rank": rank,
                "tp_rank": info.tp_rank,
                "dp_rank": info.dp_rank,
                "domains": list(info.domains),
                "domain_names": [topo.domain_names[g] for g in info.domains],
                "shard_index": info.shard_index,
                "num_shards": info.num_shards,
                "expert_ids": model.expert_ids if expert_ids is not None else [],
                "expert_groups": groups,
                "expert_replicas": kind.expert_replicas(cfg, topo, rank),
                "params": param_counts(model, topo.tensor_parallel),
            }
        )
    return out


def _print_report(cfg: RunConfig, topo: Topology, ranks: list[dict], elapsed: float) -> None:
    m = cfg.model
    print(
        f"dry run: {m.name} ({m.n_layers} x {m.d_model}, ffn={m.ffn.kind}, experts={max(1, m.ffn.num_experts)}) "
        f"on {topo.world_size} GPUs"
    )
    print(topo.describe_text())
    for r in ranks:
        p = r["params"]
        print(
            f"rank {r['rank']} (tp {r['tp_rank']}, dp {r['dp_rank']}): domains {r['domain_names']} "
            f"shard {r['shard_index']}/{r['num_shards']}, experts {r['expert_ids']}; params {p['total']:,} "
            f"(shared {p['shared']:,}, experts {p['expert']:,}); per tp rank ~{p['per_tp_rank']:,} "
            f"(sharded layers / {topo.tensor_parallel})"
        )
        if "expert_parallel" in r["expert_groups"]:
            ep, edp = r["expert_groups"]["expert_parallel"], r["expert_groups"]["expert_data_parallel"]
            print(
                f"  gshard: all-to-all over {len(ep)} ranks ({ep[0]}-{ep[-1]}), each expert on {len(edp)} rank(s)"
            )
    print(f"built in {elapsed:.2f} s")


def memory_report(
    cfg: RunConfig, topo: Topology, ranks: list[dict], device: str | None, gpu_memory_gb: float | None
) -> dict:
    """Per-GPU memory by ZeRO stage (parallel/memory.py) for the summarised rank holding the most parameters,
    against the GPU's memory (`--gpu-memory-gb`, else the device table's, else no verdict)."""
    from model.accounting import lookup_device
    from parallel.memory import GIB, RankParams, estimate_activations, memory_rows
    from parallel.precision import normalise_precision

    dev = lookup_device(device) if device else None
    gib = gpu_memory_gb if gpu_memory_gb is not None else (dev.memory_gb if dev is not None else None)
    r = max(ranks, key=lambda x: x["params"]["per_tp_rank"])
    p = r["params"]
    params = RankParams(p["shared_per_tp_rank"], p["expert_per_tp_rank"], topo.dp_size, r["expert_replicas"])
    precision = normalise_precision(cfg.train.precision)
    act = estimate_activations(
        cfg.model, cfg.train.micro_batch, topo.tensor_parallel, precision, r["expert_ids"] or None
    )
    rows = memory_rows(
        params,
        cfg.model,
        cfg.train.micro_batch,
        topo.tensor_parallel,
        cfg.train.precision,
        None if gib is None else gib * GIB,
        act,
        grad_reduce=cfg.parallel.grad_reduce,
        bucket_override=cfg.parallel.bucket_elements,
        grad_reduce_dtype=cfg.train.grad_reduce_dtype,
    )
    return {
        "rank": r["rank"],
        "gpu": dev.label if dev else None,
        "gpu_memory_gib": gib,
        "activations": {
            "method": act.method,
            "fallback_reason": act.reason,
            "seconds": round(act.seconds, 2),
        },
        "precision": cfg.train.precision,
        "micro_batch": cfg.train.micro_batch,
        "recompute_configured": cfg.train.activation_checkpointing == "full",
        "params": {
            "shared": params.shared,
            "expert": params.expert,
            "dp_size": params.dp_size,
            "expert_replicas": params.expert_replicas,
        },
        "rows": rows,
    }


def _print_memory(mem: dict) -> None:
    from parallel.memory import GIB

    gpu = (
        f"{mem['gpu'] or 'GPU'} {mem['gpu_memory_gib']:g} GiB"
        if mem["gpu_memory_gib"]
        else "no GPU given (--device)"
    )
    pr = mem["params"]
    print(
        f"memory per GPU (rank {mem['rank']}: {pr['shared']:,} shared params over {pr['dp_size']} data-parallel "
        f"ranks, {pr['expert']:,} expert params over {pr['expert_replicas']}; {mem['precision']}, micro-batch "
        f"{mem['micro_batch']}) against {gpu}, GiB:"
    )
    a = mem["activations"]
    if a["method"] == "traced":
        print(
            f"  activations: traced (this rank's model, forward+backward on fake tensors, {a['seconds']:.1f} s)"
        )
    else:
        print(f"  activations: formula (Korthikanti et al.; not traced: {a['fallback_reason']})")
    print(
        "  ZeRO | params | grads | optim | buffers | activ. | activ. recompute | total | total recompute | fits "
        "(no recompute / recompute)"
    )
    for row in mem["rows"]:
        verdict = " / ".join(
            "-" if row[f"fits_{m}"] is None else ("yes" if row[f"fits_{m}"] else "NO")
            for m in ("no_recompute", "recompute")
        )
        print(
            f"  {row['zero_stage']:>4} | {row['params'] / GIB:6.2f} | {row['grads'] / GIB:5.2f} | "
            f"{row['optimizer'] / GIB:5.2f} | {row['buffers'] / GIB:7.2f} | "
            f"{row['activations_no_recompute'] / GIB:6.2f}"
            f" | {row['activations_recompute'] / GIB:16.2f} | {row['total_no_recompute'] / GIB:5.2f} | "
            f"{row['total_recompute'] / GIB:15.2f} | {verdict}"
        )
    est = mem["rows"][2].get("deepspeed_estimate")
    if est is not None:
        ours = mem["rows"][2]["model_states"]
        print(
            f"  model states at ZeRO 2: {ours / GIB:.2f} GiB here, {est / GIB:.2f} GiB by DeepSpeed's "
            f"estimate_zero2_model_states_mem_needs ({(ours - est) / est:+.1%})"
        )


def _print_data(data: dict[str, Any]) -> None:
    """One line on the data the dry run planned from its token manifest (nothing without: a note says so)."""
    if data.get("source") != "manifest":
        return
    extra = data["token_ids"] - data["tokenizer_vocab_size"]
    print(
        f"data: {data['path']} ({data['tokenizer']} tokenizer, {data['tokenizer_vocab_size']:,} tokens"
        + (f" + {extra} domain tokens" if extra else "")
        + f"; model.vocab_size {data['model_vocab_size']:,}, "
        f"padded {data['padded_vocab_size']:,}); training domains: {', '.join(data['train_domains'])}; novel "
        f"(held out): {', '.join(data['novel_domains']) or 'none'}"
    )


@cli_main
def main(argv: Sequence[str] | None = None, deepspeed_config: DeepSpeedConfigFn | None = None) -> int:
    """Returns 0 on success, 2 (after printing every problem to stderr) when the config or layout is impossible."""
    args = parse_args(argv)
    start = time.perf_counter()
    overrides = [*args.overrides, *([f"data.path={json.dumps(args.data)}"] if args.data else [])]
    try:
        cfg = load_run_config(args.config, overrides)
        with_data = not args.no_data and data_path_set(args.config, overrides)
        layout, data = (plan_with_data if with_data else plan_without_data)(
            cfg, args.world_size, args.domains
        )
        problems = list(layout.problems)
        if args.device is not None:
            from model.accounting import lookup_device
            from parallel.precision import device_precision_problems

            problems += device_precision_problems(cfg.train.precision, lookup_device(args.device))
        if problems:
            raise ConfigError(problems, f"the layout for {args.world_size} GPUs")
        cfg, topo = layout.cfg, layout.topo
        ranks = rank_summaries(cfg, topo, sorted({0, topo.world_size - 1}))
    except (
        ConfigError,
        ValueError,
    ) as e:  # ValueError: a model that cannot be built (e.g. an unregistered kind)
        return usage_error(f"dry run failed: {e}")
    _print_data(data)
    _print_report(cfg, topo, ranks, time.perf_counter() - start)
    memory = memory_report(cfg, topo, ranks, args.device, args.gpu_memory_gb)
    _print_memory(memory)
    for note in layout.notes:
        print(f"note: {note}")
    model = {
        "name": cfg.model.name,
        "ffn": cfg.model.ffn.kind,
        "num_experts": max(1, cfg.model.ffn.num_experts),
    }
    summary = {
        "model": model,
        "domains": data["train_domains"],
        "data": data,
        "topology": topo.describe(),
        "notes": list(layout.notes),
        "deepspeed_equivalent": deepspeed_equivalent(topo) if ffn_kind(cfg).domain_experts else None,
        "ranks": ranks,
        "memory": memory,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if deepspeed_config is not None:  # the trainer's generator; the dry run only records its output
        ds_path = out.parent / "deepspeed_config.json"
        ds_path.write_text(json.dumps(deepspeed_config(cfg, topo), indent=2) + "\n")
        summary["deepspeed_config"] = str(ds_path)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    exit_process(main())
