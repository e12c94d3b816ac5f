"""parallel/demix_sync.py's table of what one training step reduces, checked against a real step.

On 4 gloo ranks (2 domains x 2 ranks) one optimizer step runs through the real engine for DEMix at ZeRO 0/1/2 and
dense at ZeRO 0/1, with parallel/comm_stats.py counting every collective by the ranks of its group. Per group, the
table's gradient rows must account for the bytes moved: shared gradients over the data-parallel group, expert
gradients over the rank's domain group only, each `per step` times (1, or grad_accum at ZeRO 2), plus a few scalars
(the norm rows), with the table's collective and no group the table does not name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from parallel.demix_sync import SyncRow
from tests.harness.multirank import run_ranks
from tests.harness.sync_table import sync_rows
from tests.multirank.test_demix_sync import GAS, _batch, _cfg

RUNS = (("demix", (0, 1, 2)), ("dense", (0, 1)))
SCALARS = 64  # bytes the norm rows may add to a group (a few fp32/fp64 scalars)


def _worker(rank: int, world: int) -> dict:
    from launcher.ffn_kinds import ffn_kind
    from launcher.train import train_step
    from model.gpt import GPT
    from parallel.comm_stats import CommStats
    from parallel.demix_sync import is_expert_param
    from parallel.groups import ProcessGroups
    from parallel.topology import build_topology

    out = {}
    for kind, zeros in RUNS:
        topo = build_topology(world, 1, 2 if kind == "demix" else 1)
        info = topo.rank_info(rank)
        for zero in zeros:
            cfg = _cfg(kind, 2, zero)
            groups = ProcessGroups.create(topo)
            torch.manual_seed(0)
            model = GPT(cfg.model, expert_ids=list(info.domains) if kind == "demix" else None)
            bundle = ffn_kind(cfg).build_engine(model, cfg, groups)
            stats = CommStats().install()  # groups named by their ranks
            doms = info.domains if kind == "demix" else (0,)
            train_step(bundle, cfg, [_batch(info.dp_rank, 0, m, doms) for m in range(GAS)], 2)
            stats.uninstall()
            trainable = [p for p in model.parameters() if p.requires_grad]
            out[(kind, zero)] = {
                "counts": {k: (v[0], v[1]) for k, v in stats.counts.items()},
                "shared": sum(4 * p.numel() for p in trainable if not is_expert_param(p)),
                "expert": sum(4 * p.numel() for p in trainable if is_expert_param(p)),
                "groups": {
                    "data-parallel": "ranks_" + "_".join(map(str, groups.dp_ranks)),
                    "e's domain": "ranks_" + "_".join(map(str, groups.expert_ranks)),
                    "world": "ranks_" + "_".join(map(str, range(world))),
                },
            }
    return out


def _expected(
    kind: str, zero: int, r: dict, rows: Callable[[int, str], list[SyncRow]] = sync_rows
) -> dict[tuple[str, str], int]:
    """(group, collective) -> gradient bytes per step, from the table's gradient rows."""
    want: dict[tuple[str, str], int] = {}
    for row in rows(zero, kind):
        key = (r["groups"][row.group], row.collective)
        times = GAS if row.per_step == "grad_accum" else 1
        if row.gradients in ("shared", "expert e"):
            want[key] = want.get(key, 0) + times * r["shared" if row.gradients == "shared" else "expert"]
        elif row.collective != "all_gather":  # DeepSpeed's all-gather is bound before CommStats can count it
            want.setdefault(key, 0)
    return want


@pytest.fixture(scope="module")
def results() -> list:
    """Every rank's counts of one real step per (kind, ZeRO stage) of RUNS."""
    return run_ranks(_worker, 4)


def _problems(results: list, rows: Callable[[int, str], list[SyncRow]] = sync_rows) -> list[str]:
    """Where the collectives counted in `results` differ from the table `rows` gives (none: they agree)."""
    problems = []
    for kind, zeros in RUNS:
        for zero in zeros:
            for rank, res in enumerate(results):
                r = res[(kind, zero)]
                want = _expected(kind, zero, r, rows)
                got = {k: b for k, (b, calls) in r["counts"].items()}
                if set(got) != set(want):
                    problems.append(
                        f"{kind} ZeRO {zero} rank {rank}: collectives {sorted(got)}, table {sorted(want)}"
                    )
                    continue
                for key, b in want.items():
                    if not b <= got[key] < b + SCALARS:
                        problems.append(
                            f"{kind} ZeRO {zero} rank {rank}: {key} moved {got[key]} bytes, table's gradient rows "
                            f"{b} (+ < {SCALARS} of scalars)"
                        )
    return problems


def test_the_sync_table_matches_the_collectives_of_a_real_step(results):
    problems = _problems(results)
    assert not problems, "\n".join(problems)
    # the layout is what the table's test needs: the domain group is a strict subset of the data-parallel group
    r = results[0][("demix", 0)]
    assert r["groups"]["e's domain"] == "ranks_0_1" and r["groups"]["data-parallel"] == "ranks_0_1_2_3"


def test_the_control_a_table_reducing_experts_over_every_rank_is_caught(results):
    """The same counts against a planted table whose expert rows reduce over the data-parallel group (what a dense
    model does, and DEMix must not): the comparison reports it."""

    def planted(zero: int, kind: str) -> list[SyncRow]:
        return [
            dataclasses.replace(row, group="data-parallel") if row.gradients == "expert e" else row
            for row in sync_rows(zero, kind)
        ]

    problems = _problems(results, planted)
    assert problems and all(p.startswith("demix ") for p in problems), problems
