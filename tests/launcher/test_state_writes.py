"""Training-state writes are spread over the ranks (launcher/state.py `plan_state_writers`, parallel/universal.py
`assign_writers`): each parameter file is written by exactly one of the ranks that hold the parameter, and the
bytes each rank writes are balanced.

The bound checked everywhere is the one greedy largest-first scheduling guarantees: no rank writes more than the
mean plus the largest single file (`assign_writers`' docstring). A planted imbalance shows the check can fail.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from parallel.universal import assign_writers
from tests.harness.multirank import run_ranks


def _loads(
    assignment: dict[str, int], sizes: dict[str, int], ranks: list[int], start: dict[int, int] | None = None
) -> dict[int, int]:
    out = {r: (start or {}).get(r, 0) for r in ranks}
    for name, rank in assignment.items():
        out[rank] += sizes[name]
    return out


def _within_bound(loads: dict[int, int], largest: int, slack: int = 0) -> bool:
    """max_r - min_r <= the largest file (+ slack): LPT's guarantee, so max <= mean + largest."""
    return max(loads.values()) - min(loads.values()) <= largest + slack


def test_assignment_is_deterministic_covers_every_file_once_and_is_balanced():
    rng = random.Random(0)
    for trial in range(200):
        ranks = sorted(rng.sample(range(64), rng.randint(1, 16)))
        sizes = {
            f"p{i}/{k}": rng.choice([4, 4096, rng.randint(1, 10**6), 10**7])
            for i in range(rng.randint(0, 80))
            for k in ("fp32", "exp_avg")
        }
        got = assign_writers(sizes, ranks)
        assert set(got) == set(sizes) and set(got.values()) <= set(ranks)  # every file, exactly one writer
        shuffled = dict(rng.sample(list(sizes.items()), len(sizes)))
        # order of names or ranks does not matter
        assert assign_writers(shuffled, list(reversed(ranks))) == got
        if sizes:
            assert _within_bound(_loads(got, sizes, ranks), max(sizes.values())), trial


def test_assignment_fills_the_least_loaded_ranks_first():
    """`load`: bytes ranks write already (a DEMix domain's experts). Rank 0 starts 10 files ahead and gets none;
    the totals end within one file of each other."""
    sizes = {f"f{i}": 100 for i in range(12)}
    got = assign_writers(sizes, [0, 1, 2], load={0: 1000})
    assert 0 not in got.values()
    loads = _loads(got, sizes, [0, 1, 2], {0: 1000})
    assert loads == {0: 1000, 1: 600, 2: 600} and _within_bound(loads, 400)


def test_a_planted_imbalance_fails_the_bound():
    """The check is not vacuous: every file on one rank (the old rule: rank 0 wrote every shared parameter) or one
    file moved from a balanced assignment onto the fullest rank breaks it."""
    sizes = {f"w{i}": s for i, s in enumerate([50, 40, 30, 30, 20, 20, 10, 10, 5, 5])}
    ranks = [0, 1, 2, 3]
    good = assign_writers(sizes, ranks)
    assert _within_bound(_loads(good, sizes, ranks), 50)
    assert not _within_bound(_loads({n: 0 for n in sizes}, sizes, ranks), 50)
    loads = _loads(good, sizes, ranks)
    fullest, emptiest = max(loads, key=loads.get), min(loads, key=loads.get)
    moved = dict(good, **{next(n for n, r in good.items() if r == emptiest and sizes[n] >= 20): fullest})
    assert not _within_bound(_loads(moved, sizes, ranks), 50)


def _plan(rank: int, world: int, files_of_rank: dict[int, dict]) -> object:
    from launcher.state import plan_state_writers
    from parallel.universal import UniversalStateError

    files = {tuple(h): f for h, f in files_of_rank[rank].items()}
    try:
        return plan_state_writers(files, world, rank, torch.device("cpu"))
    except UniversalStateError as e:
        return str(e)


def test_group_files_stay_in_their_group_and_shared_files_even_out_the_totals():
    """4 ranks, 2 domains of 2 ranks: each domain's expert files go to its own ranks; the shared files fill up
    the ranks with the fewest expert bytes. Every rank computes the same writers (for the files it holds)."""
    shared = {f"s{i}/fp32": 1000 + 10 * i for i in range(10)}
    experts = {d: {f"e{d}.{i}/fp32": 700 for i in range(3)} for d in (0, 1)}
    files = {r: {(0, 1, 2, 3): shared, (2 * (r // 2), 2 * (r // 2) + 1): experts[r // 2]} for r in range(4)}
    got = run_ranks(_plan, 4, args=(files,))
    for r, writers in enumerate(got):
        assert {n: w for n, w in writers.items() if n.startswith("s")} == {
            n: w for n, w in got[0].items() if n.startswith("s")
        }
        assert all(writers[n] in (2 * (r // 2), 2 * (r // 2) + 1) for n in experts[r // 2])
    every = {**got[0], **got[2]}
    sizes = {**shared, **experts[0], **experts[1]}
    assert set(every) == set(sizes)
    assert _within_bound(_loads(every, sizes, [0, 1, 2, 3]), max(sizes.values()))


def test_ranks_that_disagree_on_their_files_all_stop():
    """A rank holding another shape of a shared parameter (a bug) stops every rank with the same error before
    anything is written, instead of a missing or doubly written file."""
    files = {0: {(0, 1): {"a/fp32": 400, "b/fp32": 400}}, 1: {(0, 1): {"a/fp32": 400, "b/fp32": 404}}}
    got = run_ranks(_plan, 2, args=(files,))
    assert all(isinstance(g, str) and "ranks [1]" in g for g in got), got


def _save_and_record(rank: int, world: int, sets: list[str], run_dir: str) -> dict[str, int]:
    """One training step, then `save_training_state` with the project's `_save` wrapped to record what this rank
    wrote (relative path -> bytes on disk)."""
    import launcher.state as state
    from launcher.config import load_run_config
    from launcher.plan import make_plan
    from launcher.train import Trainer, train_step

    plan = make_plan(load_run_config(None, sets, check=False), world)
    trainer = Trainer.setup(plan, Path(run_dir), resume="never")
    train_step(trainer.bundle, plan.cfg, trainer.batches(0), len(plan.catalog.train_domains))
    mine: dict[str, int] = {}
    real = state.save_hashed

    def recording(obj, path: Path) -> str:
        digest = real(obj, path)
        mine[str(Path(path).relative_to(Path(run_dir) / "checkpoints" / ".step_00000001.tmp"))] = (
            Path(path).stat().st_size
        )
        return digest

    state.save_hashed = recording
    try:
        state.save_training_state(Path(run_dir), 1, trainer.bundle, plan, rank)
    finally:
        state.save_hashed = real
    return mine


def _sets(tokens: Path, kind: str, *extra: str) -> list[str]:
    return [
        "model.preset=tiny",
        "model.n_layers=2",
        "model.d_model=64",
        "model.n_heads=2",
        "model.seq_len=32",
        f"model.ffn.kind={kind}",
        f"data.path={tokens}",
        "data.tokenizer=gpt2",
        "data.domains=[cooking,finance]",
        f"data.mixture={'by_domain' if kind == 'demix' else 'natural'}",
        "train.steps=4",
        "train.micro_batch=2",
        "train.grad_accum=1",
        "parallel.zero_stage=1",
        "logging.wandb_mode=disabled",
        "logging.progress_bar=false",
        *extra,
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,extra",
    [("demix", ()), ("dense", ("parallel.tensor_parallel=2",))],
    ids=["demix-4ranks-zero1", "dense-tp2-4ranks-zero1"],
)
def test_every_rank_writes_a_balanced_share_of_the_state(tiny_tokens, tmp_path, kind, extra):
    """4 ranks, ZeRO 1 (each rank holds a partition of the fp32 masters and moments). DEMix: 2 domains of 2 ranks,
    experts written inside their domain. Dense with tp=2: the TP-gathered whole tensors are written by ranks of
    either TP rank. Every parameter file of the published state was written by exactly one rank, every rank
    wrote some, meta.json's `param_bytes_by_rank` is what they wrote, and no rank wrote more than the mean plus
    the largest file (plus FILE_OVERHEAD_BYTES per file: the planner counts that much per file, torch.save
    writes less)."""
    from launcher.state import FILE_OVERHEAD_BYTES

    run = tmp_path / "run"
    records = run_ranks(
        _save_and_record, 4, args=(_sets(tiny_tokens, kind, *extra), str(run)), device_strict=True
    )
    ckpt = run / "checkpoints" / "step_00000001"
    on_disk = {str(p.relative_to(ckpt)): p.stat().st_size for p in (ckpt / "zero").glob("*/*.pt")}
    params = [
        {k: v for k, v in rec.items() if k.count("/") == 2 and k.startswith("zero/")} for rec in records
    ]
    written = [name for rec in params for name in rec]
    assert sorted(written) == sorted(on_disk)  # every file, each by exactly one rank
    assert all(rec for rec in params), [len(rec) for rec in params]  # every rank wrote some
    by_rank = [sum(rec.values()) for rec in params]
    assert json.loads((ckpt / "meta.json").read_text())["param_bytes_by_rank"] == by_rank
    mean_files = len(on_disk) / 4
    slack = int((mean_files + 1) * FILE_OVERHEAD_BYTES)
    assert max(by_rank) <= sum(by_rank) / 4 + max(on_disk.values()) + slack, by_rank
    if kind == "demix":  # an expert's files stay with its domain's ranks (0, 1: cooking; 2, 3: finance)
        for r, rec in enumerate(params):
            assert all(f".experts.{r // 2}." in n for n in rec if ".experts." in n), (r, sorted(rec))
    else:  # written whole: the gathered tensor, from either TP rank
        assert any(params[r] for r in (1, 3))
        qkv = torch.load(ckpt / "zero" / "blocks.0.attn.qkv.weight" / "fp32.pt", weights_only=True)
        assert qkv["param"].shape == (3 * 64, 64) and qkv["cat_dim"] == 0


def _save_failing_on(rank: int, world: int, sets: list[str], run_dir: str, bad_rank: int) -> str:
    """One training step, then `save_training_state` where rank `bad_rank` cannot write its RNG file (a full disk,
    a lost mount); returns the error each rank ended with."""
    import errno

    import launcher.state as state
    from launcher.config import load_run_config
    from launcher.plan import make_plan
    from launcher.train import Trainer, train_step

    plan = make_plan(load_run_config(None, sets, check=False), world)
    trainer = Trainer.setup(plan, Path(run_dir), resume="never")
    train_step(trainer.bundle, plan.cfg, trainer.batches(0), len(plan.catalog.train_domains))
    real = state.save_hashed

    def failing(obj, path: Path) -> str:
        if rank == bad_rank and Path(path).parent.name == "rng":
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real(obj, path)

    state.save_hashed = failing
    try:
        state.save_training_state(Path(run_dir), 1, trainer.bundle, plan, rank)
    except Exception as e:  # noqa: BLE001 - what each rank ends with is the result
        return f"{type(e).__name__}: {e}"
    finally:
        state.save_hashed = real
    return "saved"


@pytest.mark.slow
def test_a_save_failing_on_one_rank_leaves_no_staging_folder_and_stops_every_rank(tiny_tokens, tmp_path):
    """Rank 1 cannot write its part of the state: every rank learns it at the next agreement (no rank waits at a
    barrier for it), every rank removes the shared staging folder, nothing is published."""
    run = tmp_path / "run"
    got = run_ranks(_save_failing_on, 2, args=(_sets(tiny_tokens, "dense"), str(run), 1), timeout=300)
    assert got[1].startswith("OSError") and "Input/output error" in got[1], got
    assert got[0].startswith("CheckpointError: ranks [1] could not write step_00000001"), got
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [], list(
        (run / "checkpoints").iterdir()
    )
