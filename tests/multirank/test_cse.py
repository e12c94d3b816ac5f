"""CSE on 2 real processes over gloo: clustering at the warm-up boundary, expert copies (weights and optimizer
state) and the all-reduced centre update keep every replica identical, at ZeRO 0 and ZeRO 1."""

from __future__ import annotations

import torch

from tests.harness.multirank import run_ranks

STEPS, MB, SEQ, VOCAB, SLOTS = 5, 4, 16, 128, 4


def _cfg(zero: int):
    from launcher.config import load_run_config

    return load_run_config(
        None,
        [
            "model.preset=tiny",
            "model.n_layers=2",
            f"model.vocab_size={VOCAB}",
            f"model.seq_len={SEQ}",
            "model.d_model=32",
            "model.n_heads=2",
            "model.ffn.kind=cse",
            f"model.ffn.num_experts={SLOTS}",
            "model.ffn.cse.num_samples=32",
            "model.ffn.cse.dbscan_eps=0.0",
            "model.ffn.cse.dbscan_min_samples=3",
            "model.ffn.cse.warmup_fraction=0.4",
            "model.ffn.cse.centre_momentum=0.9",
            "data.mixture=natural",
            f"parallel.zero_stage={zero}",
            f"train.micro_batch={MB}",
            "train.grad_accum=2",
            f"train.steps={STEPS}",
            "train.lr=1e-2",
            "train.warmup_fraction=0.2",
            "train.clip_grad=1.0",
            "train.weight_decay=0.1",
        ],
    )


def _batch(rank: int, i: int) -> dict[str, torch.Tensor]:
    """Two planted 'domains': sequences drawn from two disjoint sets of 4 tokens (separable sequence means)."""
    g = torch.Generator().manual_seed(1000 * rank + i)
    dom = torch.tensor([0, 1] * (MB // 2))
    tokens = torch.randint(0, 4, (MB, SEQ + 1), generator=g) + (VOCAB // 2) * dom[:, None]
    return {
        "tokens": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "domain_ids": dom,
        "expert_ids": dom,
        "loss_mask": torch.ones(MB, SEQ),
    }


def _worker(rank: int, world: int, zeros: tuple):
    from launcher.ffn_kinds import ffn_kind
    from launcher.train import train_step
    from model.cse import cse_layers
    from model.gpt import GPT
    from parallel.cse import CSEController
    from parallel.groups import ProcessGroups
    from parallel.topology import build_topology
    from tests.harness.full_state import partitioned_state

    topo = build_topology(world, 1, 1)
    out = {}
    for zero in zeros:
        cfg = _cfg(zero)
        groups = ProcessGroups.create(topo)
        torch.manual_seed(0)
        model = GPT(cfg.model, init_seed=7)
        bundle = ffn_kind(cfg).build_engine(model, cfg, groups)
        ctl = CSEController(
            bundle.engine.module,
            cfg.model.ffn.cse,
            cfg.train.steps,
            groups,
            optimizer=bundle.engine.optimizer,
            domain_names=["lo", "hi"],
        )
        records, copies_equal = [], []
        for step in range(STEPS):
            train_step(bundle, cfg, [_batch(rank, 2 * step + m) for m in range(2)], 2)
            rec = ctl.after_step(step + 1, lambda i: _batch(rank, 500 + i))
            if rec is not None:
                records.append((step + 1, rec))
                for layer in cse_layers(model):  # right after the copy: fp32 master weights and moments match
                    for j in range(1, int(layer.num_active)):
                        for p0, pj in zip(
                            layer.experts["0"].parameters(), layer.experts[str(j)].parameters()
                        ):
                            ok = torch.equal(p0, pj)
                            if zero > 0:
                                for key in (None, "exp_avg", "exp_avg_sq"):
                                    s0 = partitioned_state(p0, bundle.engine.optimizer, key)
                                    sj = partitioned_state(pj, bundle.engine.optimizer, key)
                                    ok &= bool(torch.equal(s0, sj) and (key is None or s0.abs().sum() > 0))
                            copies_equal.append(bool(ok))
        sd = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        out[zero] = {"sd": sd, "records": records, "copies_equal": copies_equal}
    return out


def test_cse_2_ranks_replicas_identical_zero_0_and_1():
    results = run_ranks(_worker, 2, args=((0, 1),), device_strict=True)  # collectives as NCCL requires
    for zero in (0, 1):
        r0, r1 = results[0][zero], results[1][zero]
        assert [s for s, _ in r0["records"]] == [2]  # clustered once, at round(0.4 x 5) = 2
        rec = r0["records"][0][1]
        assert rec["samples"] == 32 and set(rec["layers"]) == {"0", "1"}
        assert all(1 <= k <= SLOTS for k in rec["num_clusters"]) and max(rec["num_clusters"]) >= 2, rec
        assert r0["copies_equal"]  # the copy check below is not vacuous
        assert all(r0["copies_equal"]) and all(r1["copies_equal"])
        assert r0["sd"].keys() == r1["sd"].keys()
        for k, v in r0["sd"].items():
            assert torch.equal(v, r1["sd"][k]), f"ZeRO {zero}: {k} differs between replicas"
        for i in (0, 1):
            assert int(r0["sd"][f"blocks.{i}.ffn.num_active"]) == rec["num_clusters"][i]
