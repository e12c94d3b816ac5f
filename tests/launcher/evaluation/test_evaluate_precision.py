"""Evaluation runs on the training device in the training precision.

* The standalone evaluator (`launcher.evaluation.evaluate`) picks its device (`--device auto|cpu|cuda`) and
  precision (`--precision auto|fp32|bf16|fp16`); under bf16 the model's matmuls really run in bf16 (CPU autocast
  is real bf16 arithmetic), the log-likelihood sums stay fp32.
* The trainer's in-run evaluation (`launcher.train.evaluate`) runs the forward in the regime the training step
  runs it in: at ZeRO 0 with bf16 DeepSpeed trains by torch autocast over fp32 weights, and evaluating the bare
  module skipped it.
* One rule for both: `parallel.precision.forward_precision`.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.harness.multirank import run_ranks


@pytest.fixture(scope="module")
def demix_ckpt(random_checkpoint, tmp_path_factory):
    return random_checkpoint(tmp_path_factory.mktemp("eval_precision") / "demix", "demix")


EVAL_KW = dict(
    max_blocks=2, cached_blocks=2, modes=["naive", "uniform", "cached"], progress=False, unigram=False
)


def _ppl(res: dict) -> dict[str, dict[str, float]]:
    return {d: r["ppl"] for d, r in res["domains"].items()}


# ---------------------------------------------------------------- the shared rule ----------------------------------


def test_forward_precision_is_autocast_over_fp32_weights_only():
    """bf16/fp16 over fp32 parameters: autocast (DeepSpeed's ZeRO 0 bf16 `torch_autocast`, and the standalone
    evaluator's fp32 checkpoint); a module DeepSpeed already cast (bf16 at ZeRO >= 1, fp16) runs as cast; fp32 as is."""
    from parallel.precision import forward_precision

    def seen(module: torch.nn.Module, precision: str) -> tuple[bool, torch.dtype]:
        with forward_precision(module, precision, "cpu"):
            return torch.is_autocast_enabled("cpu"), module(torch.ones(2, 4, dtype=module.weight.dtype)).dtype

    lin = torch.nn.Linear(4, 3)
    assert seen(lin, "fp32") == (False, torch.float32)
    assert seen(lin, "bf16") == (True, torch.bfloat16)
    assert seen(lin, "bfloat16") == (True, torch.bfloat16)  # the config's aliases
    assert seen(lin.to(torch.bfloat16), "bf16") == (False, torch.bfloat16)
    assert not torch.is_autocast_enabled("cpu")


# ---------------------------------------------------------------- the standalone evaluator ---------------------------


def test_standalone_bf16_evaluation_is_autocast_and_within_bf16_tolerance_of_fp32(demix_ckpt, tiny_tokens):
    from launcher.evaluation.evaluate import evaluate_checkpoint

    fp32 = evaluate_checkpoint(demix_ckpt, tiny_tokens, device="cpu", precision="fp32", **EVAL_KW).to_dict()
    bf16 = evaluate_checkpoint(demix_ckpt, tiny_tokens, device="cpu", precision="bf16", **EVAL_KW).to_dict()
    assert (fp32["device"], fp32["precision"]) == ("cpu", "fp32")
    assert (bf16["device"], bf16["precision"]) == ("cpu", "bf16")
    a, b = _ppl(fp32), _ppl(bf16)
    assert a.keys() == b.keys() and len(a) == 3
    for d in a:
        assert a[d].keys() == b[d].keys() == {"naive", "uniform", "cached"}
        for m in a[d]:
            assert math.isfinite(b[d][m]) and b[d][m] == pytest.approx(a[d][m], rel=2e-2), (d, m)
            assert b[d][m] != a[d][m], (d, m)  # bf16 arithmetic really happened: not the fp32 numbers


def test_default_on_a_cpu_machine_is_cpu_fp32_bit_for_bit(demix_ckpt, tiny_tokens, monkeypatch):
    """Library callers (benchmarks, `experts`, the demo) get the numbers they always got on a CPU machine."""
    from launcher.evaluation.evaluate import evaluate_checkpoint

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    default = evaluate_checkpoint(demix_ckpt, tiny_tokens, **EVAL_KW).to_dict()
    explicit = evaluate_checkpoint(
        demix_ckpt, tiny_tokens, device="cpu", precision="fp32", **EVAL_KW
    ).to_dict()
    assert (default["device"], default["precision"]) == ("cpu", "fp32")
    assert _ppl(default) == _ppl(explicit)
    # auto = the checkpoint's train.precision, but only on CUDA: a bf16-trained checkpoint is still fp32 on CPU
    from launcher.checkpoint import load_consolidated
    from launcher.evaluation.device import resolve_eval_precision

    c = load_consolidated(demix_ckpt)
    assert resolve_eval_precision("auto", "bf16", torch.device("cpu")) == "fp32"
    assert resolve_eval_precision("bf16", c.cfg.train.precision, torch.device("cpu")) == "bf16"


def test_auto_on_cuda_is_the_checkpoints_precision_where_the_gpu_has_it(monkeypatch):
    import launcher.evaluation.device as ev

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(ev, "local_precision_problems", lambda p: [])
    assert ev.resolve_eval_precision("auto", "bf16", gpu) == "bf16"
    assert ev.resolve_eval_precision("auto", "fp16", gpu) == "fp16"
    assert ev.resolve_eval_precision("auto", "fp32", gpu) == "fp32"
    monkeypatch.setattr(ev, "local_precision_problems", lambda p: [f"{p}: no"] if p == "bf16" else [])
    assert ev.resolve_eval_precision("auto", "bf16", gpu) == "fp32"  # e.g. V100: no bf16, evaluate in fp32
    with pytest.raises(ValueError, match="bf16: no"):  # asked for explicitly: refused, with the reason
        ev.resolve_eval_precision("bf16", "fp32", gpu)


def test_cli_bf16_writes_its_precision_and_device(demix_ckpt, tiny_tokens, tmp_path, capsys):
    from launcher.evaluation.evaluate import main

    out = tmp_path / "out"
    assert (
        main(
            [
                str(demix_ckpt),
                "--data",
                str(tiny_tokens),
                "--max-blocks",
                "2",
                "--cached-blocks",
                "2",
                "--modes",
                "naive",
                "--device",
                "cpu",
                "--precision",
                "bf16",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rec = json.loads((out / "eval.json").read_text())
    assert (rec["device"], rec["precision"]) == ("cpu", "bf16")
    assert "bf16" in (out / "eval.md").read_text()


def _call(argv: list[str], capsys) -> tuple[int, str]:
    from launcher.evaluation.evaluate import main

    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's usage errors
        rc = e.code
    return rc, capsys.readouterr().err


def test_device_cuda_without_cuda_is_refused_before_anything_is_loaded(
    demix_ckpt, tiny_tokens, tmp_path, capsys, monkeypatch
):
    import launcher.checkpoint as ckpt_mod
    import launcher.evaluation.evaluate as ev

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    loaded = []
    monkeypatch.setattr(ckpt_mod, "read_meta", lambda *a, **k: loaded.append(a) or {})
    monkeypatch.setattr(ev, "read_meta", lambda *a, **k: loaded.append(a) or {})
    monkeypatch.setattr(ev, "load_consolidated", lambda *a, **k: loaded.append(a))
    out = tmp_path / "out"
    rc, err = _call(
        [str(demix_ckpt), "--data", str(tiny_tokens), "--device", "cuda", "--out", str(out)], capsys
    )
    assert rc == 2 and "CUDA is not available" in err and "--device cpu" in err, err
    assert "Traceback" not in err and not loaded and not out.exists()
    assert ev.resolve_eval_device("auto") == torch.device("cpu")
    rc, err = _call([str(demix_ckpt), "--data", str(tiny_tokens), "--precision", "fp8"], capsys)
    assert rc == 2 and "fp8" in err  # argparse names the choices


# ---------------------------------------------------------------- the trainer's evaluation ----------------------------


def _trainer_eval(rank: int, world: int, tokens: str, zeros: tuple) -> dict:
    """For each ZeRO stage: the trainer's `evaluate` on a real DeepSpeed engine (bf16), whether each forward ran
    under autocast, and the same validation batches through the engine's own forward (the training regime)."""
    from launcher.batches import build_rank_sampler, to_model_batch
    from launcher.config import load_run_config
    from launcher.ffn_kinds import ffn_kind
    from launcher.plan import make_plan
    from launcher.train import domain_loss_sums, evaluate
    from model.gpt import GPT
    from parallel.groups import ProcessGroups

    out = {}
    for zero in zeros:
        sets = [
            "model.preset=tiny",
            "model.n_layers=2",
            "model.d_model=64",
            "model.n_heads=2",
            "model.seq_len=32",
            "model.ffn.kind=dense",
            f"data.path={tokens}",
            "data.tokenizer=gpt2",
            "data.domains=[cooking, sailing]",
            "data.mixture=natural",
            "train.steps=2",
            "train.micro_batch=2",
            "train.grad_accum=1",
            "train.eval_batches=3",
            "train.precision=bf16",
            f"parallel.zero_stage={zero}",
            "logging.wandb_mode=disabled",
            "logging.progress_bar=false",
        ]
        plan = make_plan(load_run_config(None, sets, check=False), world)
        cfg, device = plan.cfg, torch.device("cpu")
        torch.manual_seed(0)
        model = GPT(cfg.model, init_seed=1)
        bundle = ffn_kind(cfg).build_engine(model, cfg, ProcessGroups.create(plan.topo))
        module = bundle.engine.module
        seen = []
        hook = module.register_forward_pre_hook(
            lambda m, a, seen=seen: seen.append(
                (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
            )
        )
        metrics = evaluate(bundle, plan, rank, device)
        hook.remove()
        sampler, n = build_rank_sampler(plan, rank, "valid"), len(plan.catalog.train_domains)
        sums = torch.zeros(2, n, dtype=torch.float64)
        module.eval()
        with torch.no_grad():
            for i in range(cfg.train.eval_batches):
                b = to_model_batch(sampler.batch(i, 0), device, plan)
                o = bundle.engine(
                    b["tokens"],
                    b["expert_ids"],
                    targets_BT=b["targets"],
                    loss_mask_BT=b["loss_mask"],
                    return_logits=False,
                )
                sums += domain_loss_sums(o.token_loss, b["loss_mask"], b["domain_ids"], n)
        module.train()
        engine_loss = {
            f"val_loss/{d}": float(sums[0, i] / sums[1, i]) for i, d in enumerate(plan.catalog.train_domains)
        }
        out[zero] = {
            "seen": seen,
            "metrics": metrics,
            "engine_loss": engine_loss,
            "param_dtype": str(next(module.parameters()).dtype),
        }
    return out


def test_trainer_evaluation_runs_in_the_training_steps_precision(tiny_tokens):
    """ZeRO 0 bf16 trains by autocast over fp32 weights: the evaluation forward must run under the same autocast
    (it ran in fp32). ZeRO 1 bf16 trains a bf16-cast module: evaluation runs it as cast, without autocast. Either
    way the validation loss equals the engine's own forward on the same batches, bit for bit."""
    res = run_ranks(_trainer_eval, 1, args=(str(tiny_tokens), (0, 1)), timeout=300, device_strict=True)[0]
    assert res[0]["param_dtype"] == "torch.float32" and res[1]["param_dtype"] == "torch.bfloat16"
    assert res[0]["seen"] and all(s == (True, torch.bfloat16) for s in res[0]["seen"]), res[0]["seen"]
    assert res[1]["seen"] and all(not on for on, _ in res[1]["seen"]), res[1]["seen"]
    for zero in (0, 1):
        r = res[zero]
        for key, loss in r["engine_loss"].items():
            assert r["metrics"][key] == loss, (zero, key, r["metrics"][key], loss)
