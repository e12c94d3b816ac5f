"""BTX upcycling (launcher/modular/btx/): a DEMix checkpoint becomes a GShard one whose shared tensors are the
DEMix ones bit for bit, whose MoE experts are the domain experts and whose other FFNs are their mean; routed by
force to expert j it computes exactly what the DEMix model routed to j computes (with the averaged layers in
place); the data router is the centred, normalised domain mean at the calibrated scale; the result starts a
GShard run (`train.init_from`) whose first logged loss is the upcycled model's loss on the same batches."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from launcher.checkpoint import CheckpointError, load_consolidated, save_consolidated
from launcher.config import ConfigError
from launcher.modular.btx import finetune_overrides, fit_router, layout_problems, main, upcycle
from model.gshard import GShardFFN, Routing

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def demix(random_checkpoint, tmp_path_factory) -> Path:
    """A random 2-layer, 3-domain DEMix checkpoint over `tiny_tokens` (experts differ: init is per tensor name)."""
    return random_checkpoint(tmp_path_factory.mktemp("btx") / "demix", "demix")


def _ffn_free(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if ".ffn." not in k}


def test_every_other_keeps_experts_averages_the_rest_and_copies_shared_tensors(demix, tmp_path):
    rec = upcycle(demix, tmp_path / "btx", layers="every_other", router_init="zero")
    a, b = load_consolidated(demix), load_consolidated(tmp_path / "btx")
    assert rec["moe_layers"] == [1] and rec["averaged_layers"] == [0] and rec["num_experts"] == 3
    assert b.cfg.model.ffn.kind == "gshard" and b.cfg.model.ffn.num_experts == 3
    assert (
        b.cfg.model.ffn.gshard.moe_every == 2 and b.cfg.data.mixture == "natural" and b.domains == a.domains
    )
    shared_a, shared_b = _ffn_free(a.state_dict), _ffn_free(b.state_dict)
    assert shared_a.keys() == shared_b.keys() and all(torch.equal(shared_a[k], shared_b[k]) for k in shared_a)
    for j in range(3):
        for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
            key = f"blocks.1.ffn.experts.{j}.{name}"
            assert torch.equal(b.state_dict[key], a.state_dict[key])
    for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
        mean = torch.stack([a.state_dict[f"blocks.0.ffn.experts.{j}.{name}"] for j in range(3)]).mean(0)
        assert torch.equal(b.state_dict[f"blocks.0.ffn.mlp.{name}"], mean)
    assert not any(k.startswith("blocks.0.ffn.experts.") for k in b.state_dict)
    # independently initialised experts
    assert rec["average_coherence"]["0"] == pytest.approx(3**-0.5, abs=0.05)
    assert torch.equal(b.state_dict["blocks.1.ffn.gate.weight"], torch.zeros(3, 32))
    model = b.build_model()  # exactly the tensors a GShard GPT of this config has
    assert isinstance(model.blocks[1].ffn, GShardFFN) and set(model.state_dict()) == set(b.state_dict)
    for key in ("tokenizer_sha256", "bos_id", "eod_id", "train_tokens"):
        assert b.meta[key] == a.meta[key]
    assert b.step == a.step and b.meta["btx"]["expert_domains"] == {
        "0": "cooking",
        "1": "sailing",
        "2": "finance",
    }


def _force_route(layer: GShardFFN, expert: int) -> None:
    """Route every token to `expert` alone with combine weight exactly 1 (top-1, no capacity limit)."""
    E = layer.num_experts

    def route(x_SD: torch.Tensor) -> Routing:
        S = x_SD.shape[0]
        probs_SE = torch.nn.functional.one_hot(torch.full((S,), expert), E).float()
        return Routing(
            experts_KS=torch.full((1, S), expert),
            slots_KS=torch.arange(S)[None],
            kept_KS=torch.ones(1, S, dtype=torch.bool),
            weights_KS=torch.ones(1, S),
            probs_SE=probs_SE,
            counts_E=probs_SE.sum(0).long(),
            capacity=S,
            l_aux=torch.tensor(1.0),
        )

    layer.route = route


@pytest.mark.parametrize("layers", ["all", "every_other"])
def test_forced_routing_equals_the_demix_model_routed_to_that_expert(demix, tmp_path, layers):
    """Exact (torch.equal on the logits): the MoE layers' experts are the domain experts, the averaged layers are
    what a DEMix model whose experts of that layer were all replaced by their mean computes, the rest is shared."""
    upcycle(demix, tmp_path / "btx", layers=layers, router_init="zero")
    a, b = load_consolidated(demix), load_consolidated(tmp_path / "btx")
    moe = set(b.cfg.model.moe_layer_ids())
    state = dict(a.state_dict)
    for l in range(a.cfg.model.n_layers):
        if l not in moe:  # the reference: DEMix with this layer's experts all equal to their mean
            for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
                mean = torch.stack([state[f"blocks.{l}.ffn.experts.{j}.{name}"] for j in range(3)]).mean(0)
                state.update({f"blocks.{l}.ffn.experts.{j}.{name}": mean for j in range(3)})
    ref = replace(a, state_dict=state).build_model().eval()
    up = b.build_model().eval()
    x_BT = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(0))
    for j in range(3):
        for l in moe:
            _force_route(up.blocks[l].ffn, j)
        with torch.no_grad():
            want = ref(x_BT, torch.full((2,), j)).logits
            got = up(x_BT).logits
        assert torch.equal(got, want), (layers, j, (got - want).abs().max())
    if layers == "all":  # nothing averaged: the DEMix model itself
        assert all(state[k] is a.state_dict[k] for k in state)


def _ffn_inputs(model, tokens_BT: torch.Tensor, expert: int) -> list[torch.Tensor]:
    """ln2 outputs of every layer of a DEMix GPT routed to `expert`, by walking the blocks by hand."""
    x = model.wte(tokens_BT) + model.wpe(torch.arange(tokens_BT.shape[1]))
    out = []
    for block in model.blocks:
        x = x + block.attn(block.ln1(x))
        h = block.ln2(x)
        out.append(h.reshape(-1, h.shape[-1]))
        x = x + block.ffn(h, torch.full((tokens_BT.shape[0],), expert)).hidden
    return out


def test_data_router_is_the_centred_domain_mean_at_the_calibrated_entropy(demix, tiny_tokens, tmp_path):
    from launcher.checkpoint_data import block_inputs, load_blocks

    rec = upcycle(demix, tmp_path / "btx", layers="all", router_init="data", data=str(tiny_tokens), blocks=4)
    a, b = load_consolidated(demix), load_consolidated(tmp_path / "btx")
    model = a.build_model().eval()
    means = []
    with torch.no_grad():
        for j, dom in enumerate(a.domains):
            tokens = block_inputs(load_blocks(tiny_tokens, "gpt2", dom, "train", 32, 4))[0]
            means.append([h.double().mean(0) for h in _ffn_inputs(model, tokens, j)])
    for l in (0, 1):
        mu_GD = torch.stack([m[l] for m in means])
        c_GD = mu_GD - mu_GD.mean(0)
        u_GD = c_GD / c_GD.norm(dim=1, keepdim=True)
        W = b.state_dict[f"blocks.{l}.ffn.gate.weight"].double()
        stats = rec["router"][str(l)]
        torch.testing.assert_close(W, stats["scale"] * u_GD, rtol=1e-5, atol=1e-6)
        assert stats["entropy_fraction"] == pytest.approx(0.5, abs=1e-6)
        assert stats["own_top1"] > 0.5 and stats["own_top2"] >= stats["own_top1"]  # chance: 1/3
    assert b.meta["btx"]["router_data"]["blocks"] == 4


def test_fit_router_scale_sets_the_entropy_and_separable_domains_route_home():
    g = torch.Generator().manual_seed(0)
    centres_GD = torch.randn(4, 16, generator=g) * 3
    x_GND = centres_GD[:, None, :] + torch.randn(4, 200, 16, generator=g)
    for frac in (0.2, 0.5, 0.8):
        W, stats = fit_router(x_GND.mean(1), x_GND, frac)
        p_SE = torch.softmax(x_GND.reshape(-1, 16) @ W.T, dim=1)
        H = float(-(p_SE * p_SE.log()).sum(1).mean())
        assert H / math.log(4) == pytest.approx(frac, abs=1e-4) and stats[
            "entropy_fraction"
        ] == pytest.approx(frac)
    assert stats["own_top1"] > 0.9


def test_layout_and_input_errors(demix, random_checkpoint, tiny_tokens, tmp_path):
    dense = random_checkpoint(tmp_path / "dense", "dense")
    with pytest.raises(CheckpointError, match="DEMix checkpoint"):
        upcycle(dense, tmp_path / "x", router_init="zero")
    (tmp_path / "taken").mkdir()
    with pytest.raises(CheckpointError, match="exists"):
        upcycle(demix, tmp_path / "taken", router_init="zero")
    with pytest.raises(ConfigError, match="not divisible by --experts-per-rank=2"):
        upcycle(demix, tmp_path / "x", router_init="zero", experts_per_rank=2)
    with pytest.raises(ConfigError, match="does not divide --world-size=4"):
        upcycle(demix, tmp_path / "x", router_init="zero", world_size=4)
    assert layout_problems(8, 4, 2) == [] and layout_problems(8, 2, 4) == [] and layout_problems(8, 2, 2)
    c = load_consolidated(demix)  # an expert whose domain the data lacks: --router-init data cannot fit it
    save_consolidated(
        tmp_path / "renamed",
        c.state_dict,
        c.cfg,
        ["cooking", "sailing", "knitting"],
        c.step,
        extra={k: v for k, v in c.meta.items() if k in ("tokenizer", "tokenizer_sha256", "vocab_size")},
    )
    with pytest.raises(CheckpointError, match="knitting"):
        upcycle(tmp_path / "renamed", tmp_path / "x", data=str(tiny_tokens))
    assert not (tmp_path / "x").exists()


def test_cli(demix, tmp_path, capsys):
    assert main([str(demix), "--out", str(tmp_path / "btx"), "--router-init", "zero", "--layers", "all"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert (
        rec["moe_layers"] == [0, 1]
        and load_consolidated(tmp_path / "btx").cfg.model.ffn.gshard.moe_every == 1
    )
    assert main([str(demix), "--out", str(tmp_path / "btx"), "--router-init", "zero"]) == 2  # exists
    assert "--overwrite" in capsys.readouterr().err
    assert main([str(tmp_path / "nope"), "--out", str(tmp_path / "y")]) == 2
    assert "error:" in capsys.readouterr().err


def test_upcycled_checkpoint_plans_and_loads_as_init_from(demix, tmp_path):
    """launcher/plan.py accepts it as `train.init_from` of configs/btx/finetune.yaml (with its shape's overrides),
    and every rank's model loads its own experts from it (3 experts, one per rank, on 3 ranks)."""
    from launcher.config import load_run_config
    from launcher.ffn_kinds import ffn_kind
    from launcher.plan import make_plan
    from launcher.state import load_init_weights
    from model.gpt import GPT

    upcycle(demix, tmp_path / "btx", router_init="zero")
    sets = finetune_overrides(tmp_path / "btx") + ["model.ffn.gshard.experts_per_rank=1"]
    cfg = load_run_config(REPO / "configs/btx/finetune.yaml", sets, check=False)
    plan = make_plan(cfg, 3)
    full = load_consolidated(tmp_path / "btx").state_dict
    for rank in range(3):
        experts = ffn_kind(plan.cfg).rank_experts(plan.cfg, plan.topo, rank, plan.expert_of_domain)
        assert experts == [rank]
        model = GPT(plan.cfg.model, expert_ids=experts, init_seed=5)
        load_init_weights(model, plan.cfg)
        assert all(torch.equal(v, full[k]) for k, v in model.state_dict().items())


# ----------------------------------------------------------------------------------------------------
# The MiX stage through the launcher: 4 gloo ranks, 4 experts, 2 per rank (expert-parallel groups of 2)
# ----------------------------------------------------------------------------------------------------

_FOUR = {
    "cooking": "oven flour butter sugar whisk simmer garlic onion pan bake roast salt pepper dough knead stir".split(),
    "sailing": "hull mast keel tack jib wind harbour anchor bow stern rudder sail knot tide buoy starboard".split(),
    "finance": "bond yield equity market rate loan asset credit debt fund price stock share return cash bank".split(),
    "garden": "soil seed rake hoe bloom weed root spade compost hedge tulip rose shrub mulch prune water".split(),
}


def _four_domain_demix(root: Path) -> tuple[Path, Path]:
    """A prepared 4-domain corpus (GPT-2 BPE) and a random 2-layer DEMix checkpoint over it."""
    import random

    from data.catalog import tokenizer_fingerprint
    from data.prepare import prepare_corpus
    from launcher.config import RunConfig
    from model.config import FFNConfig, ModelConfig
    from model.gpt import GPT

    rng = random.Random(0)
    corpus = root / "corpus"
    corpus.mkdir(parents=True)
    manifest = {
        "format": "test",
        "corpus_dir": str(corpus),
        "domains": {},
        "train_domains": list(_FOUR),
        "novel_domains": [],
    }
    for d, words in _FOUR.items():
        with open(corpus / f"{d}.jsonl", "w") as f:
            for i in range(40):
                text = " ".join(
                    " ".join(rng.choice(words) for _ in range(rng.randint(6, 14))).capitalize() + "."
                    for _ in range(6)
                )
                f.write(json.dumps({"id": f"{d}-{i:04d}", "domain": d, "text": text}) + "\n")
        manifest["domains"][d] = {"split_role": "train"}
    (corpus / "manifest.json").write_text(json.dumps(manifest))
    tokens = root / "tokens"
    prepare_corpus(
        corpus, tokens, tokenizer="gpt2", workers=1, progress=False, valid_fraction=0.15, test_fraction=0.15
    )
    tok = json.loads((tokens / "gpt2" / "manifest.json").read_text())["tokenizer"]
    domains = sorted(_FOUR)  # the catalog's order
    cfg = RunConfig(
        model=ModelConfig(
            n_layers=2,
            d_model=32,
            n_heads=2,
            seq_len=32,
            vocab_size=50257,
            ffn=FFNConfig(kind="demix", num_experts=4),
        )
    )
    cfg = replace(cfg, data=replace(cfg.data, path=str(tokens), tokenizer="gpt2", mixture="by_domain"))
    extra = {
        "tokenizer": "gpt2",
        "vocab_size": tok["vocab_size"],
        "tokenizer_sha256": tokenizer_fingerprint(tok),
        "bos_id": tok["bos_id"],
        "eod_id": tok["eod_id"],
    }
    state = GPT(cfg.model, init_seed=11).state_dict()
    ckpt = save_consolidated(root / "demix", state, cfg, domains, step=9, extra=extra)
    return tokens, ckpt


def _first_step_loss(btx: Path, run: Path, world: int) -> tuple[float, float | None]:
    """(loss over every rank's first micro-batch, rank 0's aux loss: None without one, e.g. DEMix) of checkpoint
    `btx` (upcycled, or branched: tests/launcher/modular/test_btx_branch.py) evaluated directly on the batches the
    trainer's samplers give each rank at step 0, in training mode with the run's routing settings (the deterministic
    `all` policy, the training capacity factor)."""
    from launcher.batches import build_rank_sampler, to_model_batch
    from launcher.config import load_run_config
    from launcher.plan import make_plan

    plan = make_plan(load_run_config(run / "config.yaml", check=False), world)
    # with the run's GShard settings (policy, capacity factor), not the checkpoint's
    c = load_consolidated(btx)
    model = replace(c, cfg=replace(c.cfg, model=plan.cfg.model)).build_model().train()
    total, count, aux0 = 0.0, 0.0, None
    with torch.no_grad():
        for rank in range(world):
            b = to_model_batch(build_rank_sampler(plan, rank).batch(0, 0), torch.device("cpu"), plan)
            out = model(b["tokens"], b["expert_ids"], targets_BT=b["targets"], loss_mask_BT=b["loss_mask"])
            total += float(out.token_loss.double().sum())
            count += float(b["loss_mask"].sum())
            if rank == 0 and out.aux_loss is not None:
                aux0 = float(out.aux_loss)
    return total / count, aux0


@pytest.mark.slow
def test_mix_finetune_on_four_ranks_with_expert_parallelism(tmp_path):
    """Upcycle (data router) -> `launcher.launch --config configs/btx/finetune.yaml --nproc 4` with 2 experts per
    rank (30 s on 2 idle cores, 90 s on a loaded one: marked slow): finite losses, the aux loss logged, a GShard
    checkpoint written whose experts moved, and the first step's loss equal to the upcycled model's own loss on the
    same batches."""
    from launcher.metrics import read_metrics

    tokens, demix4 = _four_domain_demix(tmp_path)
    rec = upcycle(demix4, tmp_path / "btx", router_init="data", blocks=4, experts_per_rank=2, world_size=4)
    assert rec["ep_size"] == 2 and all(s["own_top1"] > 0.4 for s in rec["router"].values())  # chance: 1/4
    run = tmp_path / "run"
    sets = finetune_overrides(tmp_path / "btx") + [
        "model.ffn.gshard.experts_per_rank=2",
        "model.ffn.gshard.second_expert_policy=all",
        "model.ffn.gshard.capacity_factor=2.0",
        "train.steps=3",
        "train.micro_batch=2",
        "train.warmup_fraction=0.0",
        "train.eval_batches=1",
        "logging.log_interval=1",
        "logging.progress_bar=false",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    argv = ["--config", str(REPO / "configs/btx/finetune.yaml"), "--nproc", "4", "--run-dir", str(run)]
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.launch", *argv, *[a for s in sets for a in ("--set", s)]],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    train = [r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "train"]
    assert [r["step"] for r in train] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in train)
    assert all(math.isfinite(r["aux_loss"]) and r["aux_loss"] > 0 for r in train)
    assert sum(train[0]["layer1/expert_load_E"]) == pytest.approx(1.0, abs=1e-6)
    loss, aux = _first_step_loss(tmp_path / "btx", run, 4)
    assert train[0]["loss"] == pytest.approx(loss, rel=1e-6), (train[0]["loss"], loss)
    assert train[0]["aux_loss"] == pytest.approx(aux, rel=1e-6)
    out, start = load_consolidated(run / "model"), load_consolidated(tmp_path / "btx")
    assert out.cfg.model.ffn.kind == "gshard" and out.cfg.model.ffn.num_experts == 4 and out.step == 3
    assert set(out.state_dict) == set(start.state_dict)
    for j in range(4):
        key = f"blocks.1.ffn.experts.{j}.fc1.weight"
        assert not torch.equal(out.state_dict[key], start.state_dict[key])  # every expert trained
    assert (run / "checkpoints" / "latest").is_file()
