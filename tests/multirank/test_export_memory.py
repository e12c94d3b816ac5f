"""The consolidated export at 8 ranks / 8 domains: no rank holds more than its own weights plus one expert.

The export used to all-gather every expert onto every rank (`all_gather_object`), about world x expert size per
GPU: tens to hundreds of GB at gpt3-medium/large on 64-128 GPUs, after the whole training run. Now each domain
group's first rank writes its own expert shard and rank 0 the shared tensors. This test measures each rank's
peak resident memory during the real export (Linux's VmHWM, reset just before) with experts large enough that
gathering them would show.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.harness.multirank import run_ranks

WORLD = DOMAINS = 8
NAMES = [f"d{i}" for i in range(DOMAINS)]


def _mem_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _export_worker(rank: int, world: int, out: str) -> dict:
    from launcher.config import load_run_config
    from launcher.plan import Plan
    from launcher.state import export_consolidated
    from model.gpt import GPT
    from parallel.groups import ProcessGroups
    from parallel.topology import build_topology

    cfg = load_run_config(
        None,
        [
            "model.preset=tiny",
            "model.n_layers=4",
            "model.d_model=512",
            "model.n_heads=4",
            "model.vocab_size=512",
            "model.seq_len=32",
            "model.ffn.kind=demix",
            f"model.ffn.num_experts={DOMAINS}",
        ],
        check=False,
    )
    topo = build_topology(world, 1, DOMAINS, domain_names=NAMES)
    groups = ProcessGroups.create(topo)
    model = GPT(cfg.model, expert_ids=list(topo.rank_info(rank).domains), init_seed=0)
    catalog = SimpleNamespace(
        train_domains=tuple(NAMES),
        tokenizer="gpt2",
        vocab_size=512,
        tokenizer_sha256="0" * 64,
        bos_id=1,
        eod_id=2,
    )
    plan = Plan(cfg, catalog, topo)
    bundle = SimpleNamespace(engine=SimpleNamespace(module=model), groups=groups)
    expert_bytes = sum(p.numel() * p.element_size() for ps in model.expert_parameters().values() for p in ps)
    shared_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - expert_bytes
    import torch.distributed as dist

    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak resident set size to the current one
    before = _mem_kib("VmRSS")
    export_consolidated(bundle, plan, rank, Path(out), step=1)
    peak = _mem_kib("VmHWM")
    return {
        "peak_increase": (peak - before) * 1024,
        "expert_bytes": expert_bytes,
        "shared_bytes": shared_bytes,
    }


def _can_reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return "VmHWM" in Path("/proc/self/status").read_text()
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(
    not _can_reset_peak_rss(), reason="needs Linux /proc/self/clear_refs to reset the peak RSS"
)
def test_export_of_8_ranks_8_domains_holds_no_other_expert(tmp_path):
    results = run_ranks(_export_worker, WORLD, args=(str(tmp_path / "model"),))
    expert, shared = results[0]["expert_bytes"], results[0]["shared_bytes"]
    assert expert > 30e6  # large enough that gathering the other 7 experts (> 200 MB) would show
    slack = 16 * 2**20  # allocator and serialisation noise
    for rank, r in enumerate(results):
        assert r["peak_increase"] <= shared + expert + slack, (rank, r)
    from launcher.checkpoint import load_consolidated

    ckpt = load_consolidated(tmp_path / "model")
    assert ckpt.domains == NAMES
    model = ckpt.build_model()  # every expert present, loadable on one process
    assert sorted(model.expert_parameters()) == list(range(DOMAINS))
    from model.gpt import GPT

    reference = GPT(ckpt.cfg.model, init_seed=0).state_dict()  # initialisation is per parameter name
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in reference.items())
    print(
        {rank: round(r["peak_increase"] / 2**20, 1) for rank, r in enumerate(results)},
        "MiB;",
        f"expert {expert / 2**20:.1f} MiB, shared {shared / 2**20:.1f} MiB",
    )
