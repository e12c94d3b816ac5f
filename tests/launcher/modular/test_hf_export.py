"""Export to Hugging Face: a domain's model (its expert + shared weights), a merged model and a dense model load
with `transformers.GPT2LMHeadModel.from_pretrained` (safetensors) and reproduce the project's logits; with the
project's tokenizer the folder alone serves `transformers.pipeline` with the same greedy text as
`launcher.evaluation.generate`."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from launcher.checkpoint import load_consolidated, save_consolidated  # noqa: E402
from launcher.config import RunConfig  # noqa: E402
from launcher.modular.hf_export import dense_model, export, main  # noqa: E402
from model.config import FFNConfig, ModelConfig  # noqa: E402
from model.gpt import GPT  # noqa: E402

DOMAINS = ["a", "b", "c"]


def _ckpt(tmp_path, kind: str):
    cfg = RunConfig(
        model=ModelConfig(
            n_layers=2,
            d_model=48,
            n_heads=3,
            seq_len=24,
            vocab_size=300,
            ffn=FFNConfig(kind=kind, num_experts=3 if kind == "demix" else 0),
        )
    )
    model = GPT(cfg.model, init_seed=7)
    with torch.no_grad():  # non-trivial biases and norms, so a layout mistake cannot hide behind zeros
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln" in name or "ln_f" in name:
                p.add_(0.1 * torch.randn_like(p))
    return save_consolidated(
        tmp_path / kind, model.state_dict(), cfg, DOMAINS if kind == "demix" else ["all"]
    )


def _hf_logits(path, tokens):
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(path).eval()
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()  # tied
    with torch.no_grad():
        return hf(input_ids=tokens).logits


def test_domain_export_reproduces_the_demix_model(tmp_path):
    path = _ckpt(tmp_path, "demix")
    c = load_consolidated(path)
    rec = export(path, tmp_path / "hf_b", domain="b")
    assert (tmp_path / "hf_b" / "model.safetensors").is_file() and rec["max_abs_logit_diff"] < 1e-4
    cfg = json.loads((tmp_path / "hf_b" / "config.json").read_text())
    assert (
        cfg["activation_function"] == "gelu"
        and cfg["n_inner"] == 4 * 48
        and cfg["layer_norm_epsilon"] == 1e-5
    )
    tokens = torch.randint(0, 300, (3, 24))
    with torch.no_grad():
        # the DEMix model routed to expert "b"
        ours = c.build_model().eval()(tokens, torch.full((3,), 1)).logits
        other = c.build_model().eval()(tokens, torch.full((3,), 0)).logits
    hf = _hf_logits(tmp_path / "hf_b", tokens)
    assert (ours - hf).abs().max() < 1e-4
    assert (other - hf).abs().max() > 1e-3  # the check can tell experts apart


def test_merged_export_is_the_weighted_average_of_experts(tmp_path):
    path = _ckpt(tmp_path, "demix")
    c = load_consolidated(path)
    prior = tmp_path / "prior.json"
    prior.write_text(
        json.dumps(
            {
                "format": "demix-cached-prior/1",
                "domains": DOMAINS,
                "probs": [0.5, 0.3, 0.2],
                "blocks": 4,
                "decay": 0.3,
            }
        )
    )
    assert (
        main([str(path), "--merge-prior", str(prior), "--out", str(tmp_path / "hf_m"), "--no-tokenizer"]) == 0
    )
    sd = c.state_dict
    ref = dense_model(c, [0.5, 0.3, 0.2])
    want = sum(w * sd[f"blocks.1.ffn.experts.{j}.fc1.weight"] for j, w in enumerate([0.5, 0.3, 0.2]))
    assert torch.allclose(ref.state_dict()["blocks.1.ffn.mlp.fc1.weight"], want, atol=1e-6)
    tokens = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        ours = ref(tokens).logits
    assert (ours - _hf_logits(tmp_path / "hf_m", tokens)).abs().max() < 1e-4
    meta = json.loads((tmp_path / "hf_m" / "demix_export.json").read_text())
    assert meta["merge_weights"] == {"a": 0.5, "b": 0.3, "c": 0.2}


def test_dense_export_and_cli_errors(tmp_path):
    path = _ckpt(tmp_path, "dense")
    c = load_consolidated(path)
    export(path, tmp_path / "hf_d")
    tokens = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        ours = c.build_model().eval()(tokens).logits
    assert (ours - _hf_logits(tmp_path / "hf_d", tokens)).abs().max() < 1e-4
    demix = _ckpt(tmp_path, "demix")
    assert main([str(demix), "--out", str(tmp_path / "x")]) == 2  # DEMix needs a domain or merge weights
    assert main([str(demix), "--domain", "zz", "--out", str(tmp_path / "x")]) == 2


@pytest.mark.parametrize("kind", ["demix", "dense"])
def test_folder_alone_generates_what_the_project_generates(tmp_path, tiny_tokens, random_checkpoint, kind):
    """From only the exported folder: AutoTokenizer ids equal the project's tokenizer (BOS prepended), the
    vocabulary is the tokenizer's (no padding id can be sampled), special ids are set, the model card is there, and
    `pipeline("text-generation")` greedy text equals `launcher.evaluation.generate`'s for the same expert."""
    pytest.importorskip("launcher.modular.hf_tokenizer")
    from transformers import AutoTokenizer, pipeline

    from data.tokenizer import load_prepared_tokenizer
    from launcher.evaluation.generate import generate

    path = random_checkpoint(tmp_path / kind / "model", kind)
    out = tmp_path / f"hf_{kind}"
    args = [str(path), "--out", str(out), "--data", str(tiny_tokens)] + (
        ["--domain", "sailing"] if kind == "demix" else []
    )
    assert main(args) == 0
    tok = load_prepared_tokenizer(tiny_tokens, "gpt2")
    hf_tok = AutoTokenizer.from_pretrained(out)
    prompt = "The hull and the mast of"
    assert hf_tok(prompt)["input_ids"] == [tok.bos_id] + tok.encode(prompt)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == tok.vocab_size == 50257
    assert cfg["bos_token_id"] == cfg["eos_token_id"] == cfg["pad_token_id"] == 50256
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 50256
    card = (out / "README.md").read_text()
    assert "training tokens: 12,345" in card and "cooking, sailing, finance" in card and str(path) in card
    c = load_consolidated(path)
    model = c.build_model().eval()
    ours = generate(
        model,
        [tok.bos_id] + tok.encode(prompt),
        expert=1 if kind == "demix" else None,
        temperature=0.0,
        max_new_tokens=12,
        stop_id=tok.eod_id,
        vocab_limit=tok.vocab_size,
    )
    pipe = pipeline("text-generation", model=str(out))
    theirs = pipe(prompt, max_new_tokens=12, do_sample=False, return_full_text=False)[0]["generated_text"]
    assert theirs == tok.decode(ours.new_ids) and len(ours.new_ids) > 0
    rec = json.loads((out / "demix_export.json").read_text())
    assert rec["trimmed"] and rec["max_abs_logit_diff"] < 1e-4


def test_export_refuses_a_tokenizer_that_is_not_the_models(tmp_path, tiny_tokens, random_checkpoint):
    path = random_checkpoint(tmp_path / "dense" / "model", "dense")
    meta = json.loads((path / "meta.json").read_text())
    meta["tokenizer_sha256"] = "0" * 64
    (path / "meta.json").write_text(json.dumps(meta))
    assert main([str(path), "--out", str(tmp_path / "x"), "--data", str(tiny_tokens)]) == 2
    assert not (tmp_path / "x").exists()
    # gpt2: offline files
    assert main([str(path), "--out", str(tmp_path / "y"), "--data", str(tmp_path / "nowhere")]) == 0


# ---------------------------------------------------------------------------------------------------------------
# The model card: the evaluation where evaluate writes it, its block count, an adapted expert's own tokens
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, tiny_tokens, random_checkpoint):
    """A DEMix checkpoint at RUN/model evaluated as the README says (`launcher.evaluation.evaluate CKPT --data`,
    no --max-blocks, default --out): its eval.json is CKPT/eval/eval.json."""
    from launcher.evaluation.evaluate import main as evaluate

    path = random_checkpoint(tmp_path_factory.mktemp("evaluated") / "run" / "model", "demix")
    assert evaluate([str(path), "--data", str(tiny_tokens), "--modes", "naive", "--device", "cpu"]) == 0
    res = json.loads((path / "eval" / "eval.json").read_text())
    assert res["max_blocks"] is None  # what printed "None blocks"
    return path, res


def _card(ckpt, out, *more):
    assert main([str(ckpt), "--out", str(out), "--no-tokenizer", "--no-check", *more]) == 0
    return (out / "README.md").read_text()


def test_card_finds_the_evaluation_where_evaluate_writes_it(tmp_path, evaluated):
    import shutil

    path, _ = evaluated
    card = _card(path, tmp_path / "hf1", "--domain", "sailing")
    assert "| sailing (this export) | train |" in card and str(path / "eval" / "eval.json") in card
    assert "No evaluation" not in card
    # the run directory's RUN/eval (the export's older default, launcher/demo.py's layout) is still found
    run_eval = path.parent / "eval"
    shutil.copytree(path / "eval", run_eval)
    shutil.move(str(path / "eval"), str(tmp_path / "moved"))
    try:
        card = _card(path, tmp_path / "hf2", "--domain", "sailing")
        assert "| sailing (this export) | train |" in card and str(run_eval / "eval.json") in card
        shutil.rmtree(run_eval)
        card = _card(path, tmp_path / "hf3", "--domain", "sailing")
        assert "No evaluation of the source checkpoint was found" in card
        assert str(path / "eval" / "eval.json") in card and str(run_eval / "eval.json") in card
    finally:
        shutil.rmtree(run_eval, ignore_errors=True)
        shutil.move(str(tmp_path / "moved"), str(path / "eval"))
    # a given file that is not there is refused
    assert (
        main(
            [
                str(path),
                "--out",
                str(tmp_path / "x"),
                "--no-tokenizer",
                "--domain",
                "sailing",
                "--eval-json",
                str(tmp_path / "nosuch.json"),
            ]
        )
        == 2
    )


def test_card_renders_the_block_count_of_an_eval_json(tmp_path, evaluated):
    path, res = evaluated
    blocks = {r["blocks"] for r in res["domains"].values()}
    given = tmp_path / "given.json"
    given.write_text(json.dumps(res))
    card = _card(path, tmp_path / "hf", "--domain", "cooking", "--eval-json", str(given))
    assert "None" not in card and "| cooking (this export) | train |" in card
    if len(blocks) == 1:
        assert f"({blocks.pop()} blocks of 32 tokens per domain; " in card
    else:
        assert f"({min(blocks)} to {max(blocks)} blocks of 32 tokens per domain; " in card
    # no per-domain counts and no cap recorded: the phrase is left out, never "None blocks"
    bare = {
        "domains": {"cooking": {"role": "train", "ppl": {"naive": 12.5}}},
        "max_blocks": None,
        "seq_len": 32,
    }
    given.write_text(json.dumps(bare))
    card = _card(path, tmp_path / "hf2", "--domain", "cooking", "--eval-json", str(given))
    assert "None" not in card and "source checkpoint (32-token blocks; `naive`" in card
    assert "| cooking (this export) | train | 12.50 | – |" in card
    bare["domains"]["sailing"] = {"role": "train", "ppl": {"naive": 9.0}, "blocks": 7}
    bare["domains"]["cooking"]["blocks"] = 3
    given.write_text(json.dumps(bare))
    assert "(3 to 7 blocks of 32 tokens per domain; " in _card(
        path, tmp_path / "hf3", "--domain", "cooking", "--eval-json", str(given)
    )


def test_card_gives_an_adapted_experts_own_training_tokens(tmp_path, tiny_tokens, random_checkpoint):
    """`experts add` copies the base model's meta (train_tokens 12,345): the added expert has trained on none of
    its own. A DEMix-DAPT run (train.init_from, trainable=experts, data.domains=[new]) counts only its own tokens:
    the adapted expert's, while the other experts are the base model's."""
    from dataclasses import replace

    from launcher.expert_surgery import remove_experts_state
    from launcher.modular.experts import add_expert

    base = load_consolidated(random_checkpoint(tmp_path / "base" / "model", "demix"))
    two = remove_experts_state(base, ["finance"])
    two.meta.pop("removed_experts")
    added_path = tmp_path / "added"
    added, _ = add_expert(two, "finance", added_path, data=str(tiny_tokens), tokenizer="gpt2", dev_blocks=2)
    card = _card(added_path, tmp_path / "hf_added", "--domain", "finance")
    assert (
        "- training tokens: none of its own (the finance expert was added by `launcher.modular.experts add`"
        in card
    )
    assert "- training tokens: 12,345\n" not in card and "the model it was added to: 12,345 tokens" in card
    assert "- training tokens: 12,345\n" in _card(added_path, tmp_path / "hf_old", "--domain", "cooking")

    cfg = added.cfg
    cfg = replace(
        cfg,
        train=replace(cfg.train, init_from=str(added_path), trainable="experts"),
        data=replace(cfg.data, domains=["finance"]),
    )
    keep = ("tokenizer", "vocab_size", "tokenizer_sha256", "bos_id", "eod_id")
    dapt = save_consolidated(
        tmp_path / "dapt" / "model",
        added.state_dict,
        cfg,
        added.domains,
        step=4,
        extra={**{k: added.meta[k] for k in keep}, "train_tokens": 4096},
    )
    card = _card(dapt, tmp_path / "hf_dapt", "--domain", "finance")
    assert "- training tokens: 4,096 of finance, this expert's own (DEMix-DAPT from" in card
    assert "trained on 12,345 tokens" in card
    card = _card(dapt, tmp_path / "hf_dapt_old", "--domain", "sailing")
    assert "- training tokens: this expert was not trained by this run (DEMix-DAPT of finance)" in card
    assert "4,096" not in card and "12,345 tokens" in card
