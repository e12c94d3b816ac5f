"""DEMix vs BTX (DEMix upcycled into a GShard MoE + MiX finetuning) vs GShard, on equal extra tokens (demo corpus).

    python -m benchmarks.btx_compare [--steps 200] [--nproc 2] [--max-blocks 64] [--cached-blocks 100]
        [--demix DIR] [--gshard DIR] [--layers every_other,all] [--router-init data|zero] [--out runs/btx/compare]
        [--record benchmarks/results/btx_compare.md]

Arms, each evaluated by launcher.evaluation.evaluate.evaluate_checkpoint on the test split (in-domain and novel
average perplexity, 95 % bootstrap intervals over blocks):

  (a) demix   the trained DEMix checkpoint as is: the cached-prior mixture (DEMix §5), and each training domain's own
              expert (naive) for reference; 0 extra tokens.
  (b0) btx-0  the BTX-upcycled model (launcher/modular/btx.py) before any finetuning; 0 extra tokens. One per
              `--layers` layout: every_other (MoE in GShard's layers, the other FFNs averaged) and all (BTX's own).
  (b) btx     the upcycled model + N steps of configs/btx/finetune.yaml (GShard top-2 on DeepSpeed's MoE layer, the
              natural mixture, aux loss), on `nproc` ranks; per layout.
  (c0) gshard-0  the GShard baseline trained alongside DEMix (the `make reproduce` arm: the same steps, tokens and
              8 experts) as is; 0 extra tokens.
  (c) gshard  that GShard model + the same N steps with the same finetune recipe.

Every MoE model is also evaluated with eval_capacity_factor = E (no route dropped): the evaluator's batches hold one
domain's blocks, which overflow the favourite expert of a router that routes by domain (see the results file).

"Equal extra tokens": (b) and (c) both start from a model trained on the same number of tokens (the reproduce budget
gives every arm the same steps x ranks x batch) and then see exactly the same N x nproc x micro_batch x seq_len
extra tokens of the same mixture with the same optimizer restart, schedule and expert layout; they differ only in
where the starting MoE came from. Training GShard from scratch for the DEMix steps + N instead would compare the
same total tokens too, but costs the whole DEMix budget again (~8 min on 2 idle cores), and its learning-rate schedule
would differ from the finetune's; continuing the existing arm is the like-for-like reading. (a) and (b0) spend no
extra tokens: they show what the finetuning buys.

Defaults take runs/reproduce/arms/{demix,gshard}-s1/model when present, else runs/reproduce-1500/arms/...; finished
stages under --out are reused (same checkpoint, steps and evaluation settings).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
FINETUNE = ROOT / "configs" / "btx" / "finetune.yaml"
ARM_ROOTS = (ROOT / "runs" / "reproduce" / "arms", ROOT / "runs" / "reproduce-1500" / "arms")


def default_checkpoint(arm: str) -> Optional[Path]:
    """The first `<root>/<arm>/model` among ARM_ROOTS that is a finished consolidated checkpoint."""
    for root in ARM_ROOTS:
        if (root / arm / "model" / "meta.json").is_file():
            return root / arm / "model"
    return None


def _meta(ckpt: Path) -> dict[str, Any]:
    return json.loads((Path(ckpt) / "meta.json").read_text())


def train_tokens(ckpt: Path) -> Optional[int]:
    """Tokens a checkpoint was trained on: its meta's `train_tokens`, else steps x batch x world size from the run's
    config and metrics (`start` record) next to it."""
    meta = _meta(ckpt)
    if meta.get("train_tokens"):
        return int(meta["train_tokens"])
    metrics = Path(ckpt).parent / "metrics.jsonl"
    if not metrics.is_file():
        return None
    starts = [json.loads(l) for l in metrics.read_text().splitlines() if '"kind": "start"' in l]
    world = starts[0].get("world_size") if starts else None
    t, m = meta["config"]["train"], meta["config"]["model"]
    return None if world is None else int(meta["step"]) * t["micro_batch"] * t["grad_accum"] * world * m["seq_len"]


def finetune(ckpt: Path, run_dir: Path, steps: int, nproc: int) -> Path:
    """N steps of configs/btx/finetune.yaml from `ckpt` (its shape's overrides, E / nproc experts per rank) through
    launcher.launch; reused when finished with the same settings. Returns the exported model."""
    from launcher.launch import main as launch
    from launcher.modular.btx import finetune_overrides

    E = int(_meta(ckpt)["config"]["model"]["ffn"]["num_experts"])
    per_rank = E // nproc if E % nproc == 0 else E
    sets = finetune_overrides(ckpt) + [f"model.ffn.gshard.experts_per_rank={per_rank}", f"train.steps={steps}",
                                       f"logging.out_dir={run_dir}", "logging.progress_bar=false"]
    settings = {"checkpoint": str(Path(ckpt).resolve()), "checkpoint_step": _meta(ckpt)["step"], "sets": sets}
    recorded = run_dir / "btx_compare.json"
    done = run_dir / "model" / "meta.json"
    if done.is_file() and recorded.is_file() and json.loads(recorded.read_text()) == settings \
            and _meta(run_dir / "model")["step"] == steps:
        print(f"[btx] {run_dir.name}: finished earlier, reused", flush=True)
        return run_dir / "model"
    run_dir.mkdir(parents=True, exist_ok=True)
    recorded.write_text(json.dumps(settings, indent=1))
    argv = ["--config", str(FINETUNE), "--nproc", str(nproc), "--run-dir", str(run_dir), "--resume", "auto"]
    argv += [a for s in sets for a in ("--set", s)]
    print(f"[btx] {run_dir.name}: python -m launcher.launch {shlex.join(argv)}", flush=True)
    if launch(argv) != 0:
        raise SystemExit(f"[btx] finetuning {run_dir} failed; rerun to resume")
    return run_dir / "model"


def _reusable(path: Path, ckpt: Path, settings: dict[str, Any], modes: Sequence[str]) -> Optional[dict[str, Any]]:
    """An eval.json at `path` made of `ckpt`'s step with these settings and modes, else None."""
    if not path.is_file():
        return None
    res = json.loads(path.read_text())
    ok = res.get("step") == _meta(ckpt)["step"] and all(res.get(k) == v for k, v in settings.items())
    return res if ok and set(modes) <= set(res.get("modes", ())) else None


def evaluate(ckpt: Path, out_dir: Path, settings: dict[str, Any], demix: bool = False,
             also_read: Sequence[Path] = (), no_capacity_limit: bool = False) -> dict[str, Any]:
    """eval.json of `ckpt`: reused from `out_dir` or one of `also_read` (read only: e.g. the reproduce run's own
    evaluation) when the checkpoint's step, the settings and the modes match; else evaluated into `out_dir`.
    `no_capacity_limit`: a GShard model with eval_capacity_factor = E (C >= S: no route is dropped)."""
    from dataclasses import replace

    from launcher.checkpoint import load_consolidated
    from launcher.evaluation.evaluate import evaluate_checkpoint

    modes = ("naive", "cached") if demix else ("ppl",)
    for path in (out_dir / "eval.json", *also_read):
        res = _reusable(path, ckpt, settings, modes)
        if res is not None:
            print(f"[btx] evaluation of {ckpt} reused ({path})", flush=True)
            return res
    print(f"[btx] evaluating {ckpt}{' without capacity limit' if no_capacity_limit else ''}", flush=True)
    target: Any = ckpt
    if no_capacity_limit:  # the step and checkpoint path recorded as for the checkpoint itself (reuse above)
        c = load_consolidated(ckpt)
        ffn = c.cfg.model.ffn
        ffn = replace(ffn, gshard=replace(ffn.gshard, eval_capacity_factor=float(max(1, ffn.num_experts))))
        target = replace(c, cfg=replace(c.cfg, model=replace(c.cfg.model, ffn=ffn)))
    return evaluate_checkpoint(target, str(ROOT / "artifacts" / "demo" / "tokens"), modes=modes, out_dir=out_dir,
                               progress=False, **settings)


def _row(name: str, res: dict[str, Any], mode: str, extra: Optional[int], total: Optional[int],
         nocap: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    t = res["tables"]
    row = {"arm": name, "mode": mode, "in_domain": t["in_domain_average"].get(mode),
           "in_domain_ci": t["in_domain_average_ci"].get(mode), "novel": t["novel_average"].get(mode),
           "novel_ci": t["novel_average_ci"].get(mode), "extra_tokens": extra, "total_tokens": total}
    if nocap is not None:
        row["in_domain_nocap"] = nocap["tables"]["in_domain_average"].get(mode)
        row["novel_nocap"] = nocap["tables"]["novel_average"].get(mode)
    return row


def _losses(run_dir: Path) -> dict[str, Any]:
    from launcher.metrics import read_metrics

    train = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    if not train:
        return {}
    return {"first_loss": train[0]["loss"], "last_loss": train[-1]["loss"], "first_aux": train[0].get("aux_loss"),
            "last_aux": train[-1].get("aux_loss"), "step_time_s": train[-1].get("step_time_s")}


def _fmt(v: Any, ci: Any = None) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


def markdown(rep: dict[str, Any]) -> str:
    """The results file: command, machine, load, what was compared, the table, the router and finetune records."""
    m = rep["machine"]
    lines = ["# BTX vs DEMix vs GShard on equal extra tokens (demo corpus)", "",
             f"Command: `{rep['command']}`  ", f"Date: {rep['date']}; {rep['seconds']:.0f} s in all.  ",
             f"Machine: {m['cores']} cores ({m['cpu'] or 'unknown CPU'}), torch {m['torch']}, deepspeed "
             f"{m['deepspeed']}; no GPU used.  ", f"`uptime` before: `{rep['uptime_before']}`  ",
             f"`uptime` after: `{rep['uptime_after']}`", "",
             f"DEMix checkpoint: `{rep['demix']}` (step {rep['demix_step']}); GShard checkpoint: `{rep['gshard']}` "
             f"(step {rep['gshard_step']}, {rep['gshard_experts']} experts). Finetuning: {rep['steps']} steps of "
             f"`configs/btx/finetune.yaml` on {rep['nproc']} ranks = {rep['extra_tokens']:,} extra tokens per arm. "
             f"Upcycling: `--layers {' / '.join(rep['layers'])} --router-init {rep['router_init']}`. Evaluation: "
             f"{rep['eval']['max_blocks']} test blocks per domain (cached prior from {rep['eval']['cached_blocks']} "
             "dev blocks); perplexity averages are plain means over domains, intervals 95 % bootstrap over blocks.", "",
             "The last two columns evaluate the MoE models again with eval_capacity_factor = E (no route dropped): the "
             "evaluator batches 4 blocks of one domain, so a router that sends a domain to its own expert overflows "
             "that expert's C = S/E x 2 x 2.0 = S/2 slots, which a domain-agnostic router never does.", "",
             "| arm | mode | in-domain avg ppl [95 %] | novel avg ppl [95 %] | extra tokens | total tokens "
             "| in-domain, no capacity limit | novel, no capacity limit |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rep["rows"]:
        tot = f"{r['total_tokens']:,}" if r["total_tokens"] else "-"
        lines.append(f"| {r['arm']} | {r['mode']} | {_fmt(r['in_domain'], r['in_domain_ci'])} | "
                     f"{_fmt(r['novel'], r['novel_ci'])} | {r['extra_tokens']:,} | {tot} | "
                     f"{_fmt(r.get('in_domain_nocap'))} | {_fmt(r.get('novel_nocap'))} |")
    lines += ["", "Upcycling records: router (data init) per MoE layer on the calibration tokens (scale s, entropy / "
              "log E, share of a domain's tokens whose first choice / top-2 holds its own expert, mean p_own), and the "
              "averaged layers' ||mean expert|| / mean ||expert|| (1 = equal experts, 1/sqrt(E) = unrelated):", ""]
    for layout, rec in rep["upcycle"].items():
        coh = ", ".join(f"layer {l}: {r:.3f}" for l, r in rec.get("average_coherence", {}).items()) or "none"
        lines.append(f"- `{layout}`: MoE layers {rec['moe_layers']}, averaged layers {rec['averaged_layers']} ({coh}); "
                     f"{rec['seconds']:.1f} s")
        for l, s in rec.get("router", {}).items():
            lines.append(f"  - layer {l}: s = {s['scale']:.3f}, H/log E = {s['entropy_fraction']:.3f}, own top-1 "
                         f"{s['own_top1']:.3f}, own in top-2 {s['own_top2']:.3f}, mean p_own {s['own_prob']:.3f}")
    lines += ["", "Finetuning (training loss incl. the mixture's domains; aux = weighted load-balancing loss):", ""]
    for arm, f in rep["finetune"].items():
        if f:
            lines.append(f"- {arm}: loss {f['first_loss']:.3f} (step 1) -> {f['last_loss']:.3f} (step {rep['steps']}); "
                         f"aux {f['first_aux']:.4f} -> {f['last_aux']:.4f}; {f['step_time_s']:.2f} s/step")
    lines += ["", "Stages (s): " + ", ".join(f"{k} {v:.0f}" for k, v in rep["stage_seconds"].items())]
    if rep.get("notes"):
        lines += [""] + [f"Note: {n}" for n in rep["notes"]]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    from benchmarks.machine import machine_info
    from launcher.checkpoint import write_json_atomic
    from launcher.modular.btx import upcycle

    t0 = time.perf_counter()
    uptime_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    demix = Path(args.demix) if args.demix else default_checkpoint("demix-s1")
    gshard = Path(args.gshard) if args.gshard else default_checkpoint("gshard-s1")
    if demix is None or gshard is None:
        raise SystemExit("error: no DEMix / GShard checkpoint: run `make reproduce` or pass --demix / --gshard")
    out, stages, notes = Path(args.out), {}, list(args.note)
    settings = {"max_blocks": args.max_blocks, "cached_blocks": args.cached_blocks, "split": "test"}
    mark = time.perf_counter()

    def stage(name: str) -> None:
        nonlocal mark
        stages[name] = time.perf_counter() - mark
        mark = time.perf_counter()

    recs, res, runs = {}, {}, {}
    for layout in args.layers:
        up = out / f"upcycled-{layout}"
        meta = up / "meta.json"
        rec_file = out / f"upcycle-{layout}.json"
        if meta.is_file() and rec_file.is_file() and json.loads(rec_file.read_text()).get("source") == str(demix) \
                and json.loads(rec_file.read_text()).get("router_init") == args.router_init:
            recs[layout] = json.loads(rec_file.read_text())
        else:
            recs[layout] = upcycle(demix, up, layers=layout, router_init=args.router_init, overwrite=True)
            write_json_atomic(rec_file, recs[layout])
        runs[f"btx-{layout}"] = (up, finetune(up, out / f"btx-{layout}-ft", args.steps, args.nproc))
        stage(f"upcycle + finetune btx {layout}")
    runs["gshard"] = (gshard, finetune(gshard, out / "gshard-ft", args.steps, args.nproc))
    stage("finetune gshard")
    # the reproduce run's own evaluation (read only), when made with these settings
    res["demix"] = evaluate(demix, out / "eval-demix", settings, demix=True,
                            also_read=[demix.parent / "eval" / "eval.json"])
    stage("eval demix")
    for name, (start, end) in runs.items():
        for key, ckpt in ((name + "-0", start), (name, end)):  # gshard-0: the reproduce arm's own eval, read only
            res[key] = evaluate(ckpt, out / f"eval-{key}", settings, also_read=[ckpt.parent / "eval" / "eval.json"]
                                if key == "gshard-0" else ())
            res[key + "/nocap"] = evaluate(ckpt, out / f"eval-{key}-nocap", settings, no_capacity_limit=True)
    stage("eval moe")
    t = _meta(runs["gshard"][1])["config"]
    extra = args.steps * args.nproc * t["train"]["micro_batch"] * t["train"]["grad_accum"] * t["model"]["seq_len"]
    base_d, base_g = train_tokens(demix), train_tokens(gshard)
    rows = [_row("(a) DEMix", res["demix"], "cached", 0, base_d), _row("(a) DEMix", res["demix"], "naive", 0, base_d)]
    for layout in args.layers:
        rows += [_row(f"(b0) BTX {layout}, no finetune", res[f"btx-{layout}-0"], "ppl", 0, base_d,
                      res[f"btx-{layout}-0/nocap"]),
                 _row(f"(b) BTX {layout} + {args.steps} steps", res[f"btx-{layout}"], "ppl", extra,
                      base_d and base_d + extra, res[f"btx-{layout}/nocap"])]
    rows += [_row("(c0) GShard, no finetune", res["gshard-0"], "ppl", 0, base_g, res["gshard-0/nocap"]),
             _row(f"(c) GShard + {args.steps} steps", res["gshard"], "ppl", extra, base_g and base_g + extra,
                  res["gshard/nocap"])]
    if base_d != base_g:
        notes.append(f"the DEMix and GShard checkpoints were trained on different token counts ({base_d} vs {base_g})")
    rep = {"command": "python -m benchmarks.btx_compare " + shlex.join(argv),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine_info(),
           "uptime_before": uptime_before,
           "demix": str(demix), "demix_step": _meta(demix)["step"], "gshard": str(gshard),
           "gshard_step": _meta(gshard)["step"],
           "gshard_experts": _meta(gshard)["config"]["model"]["ffn"]["num_experts"],
           "steps": args.steps, "nproc": args.nproc, "extra_tokens": extra, "layers": list(args.layers),
           "router_init": args.router_init, "eval": settings, "upcycle": recs, "rows": rows,
           "finetune": {name: _losses(end.parent) for name, (_, end) in runs.items()},
           "stage_seconds": stages, "notes": notes}
    rep["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    rep["seconds"] = time.perf_counter() - t0
    write_json_atomic(out / "report.json", rep)
    (out / "report.md").write_text(markdown(rep))
    if args.record:
        Path(args.record).write_text(markdown(rep))
    print(markdown(rep))
    return rep


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.btx_compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="finetune steps of (b) and (c) (the extra tokens)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--max-blocks", type=int, default=64, help="test blocks per domain")
    p.add_argument("--cached-blocks", type=int, default=100, help="dev blocks for DEMix's cached prior")
    p.add_argument("--demix", help="DEMix checkpoint (default: the reproduce arm demix-s1)")
    p.add_argument("--gshard", help="GShard checkpoint (default: the reproduce arm gshard-s1)")
    p.add_argument("--layers", default="every_other,all",
                   help="comma-separated BTX layouts to compare: every_other (GShard's placement), all")
    p.add_argument("--router-init", choices=("data", "zero"), default="data")
    p.add_argument("--out", default=str(ROOT / "runs" / "btx" / "compare"))
    p.add_argument("--record", help="also write the markdown report here (e.g. benchmarks/results/btx_compare.md)")
    p.add_argument("--note", action="append", default=[], help="a note to add to the report (repeatable)")
    args = p.parse_args(argv)
    args.layers = [x for x in args.layers.split(",") if x]
    bad = [x for x in args.layers if x not in ("every_other", "all")]
    if bad:
        p.error(f"--layers: unknown {bad}; choose from every_other, all")
    run(args, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
