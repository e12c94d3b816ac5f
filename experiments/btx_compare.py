"""DEMix vs BTX (DEMix upcycled into a GShard MoE + MiX finetuning) vs GShard, on equal extra tokens (demo corpus).

    python -m experiments.btx_compare [--steps 200] [--nproc 2] [--max-blocks 64] [--cached-blocks 100]
        [--demix DIR] [--gshard DIR] [--layers every_other,all] [--router-init data|zero] [--out runs/btx/compare]
        [--record experiments/results/btx_compare.md]

Arms, each evaluated by launcher.evaluation.evaluate.evaluate_checkpoint on the test split (in-domain and novel
average perplexity, 95 % bootstrap intervals over blocks):

  (a) demix   the trained DEMix checkpoint as is: the cached-prior mixture (DEMix §5), and each training domain's own
              expert (naive) for reference; 0 extra tokens.
  (b0) btx-0  the BTX-upcycled model (launcher/modular/btx/) before any finetuning; 0 extra tokens. One per
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
stages under --out are reused (same checkpoint, steps and evaluation settings); a run directory trained with other
settings is refused (pass another --out), never resumed with the new ones.

Seeded mode: BTX as the paper runs it, every arm from ONE trained dense seed checkpoint (e.g. the reproduce arm
dense-s1), N branch-train steps and M MiX steps:

    python -m experiments.btx_compare --seed-dense runs/reproduce/arms/dense-s1/model --branch-steps N --steps M
        [--nproc 2] [--layers all] [--router-init data] [--data-seed 11] [--out runs/btx/seeded] [--record FILE]

  (seed) the dense seed as is; 0 extra tokens.
  (s) dense  the seed continued with its own recipe (the reproduce dense arm's config and budget overrides) for as
             many steps as (d) + (b) together: exactly their tokens (checked before training, from the three configs).
  (d) demix  the seed branched (launcher/modular/btx/ `branch`: every expert = the dense FFN) and trained N steps
             with the DEMix recipe (the sibling reproduce DEMix arm's config and overrides: each expert on its own
             domain, the rest on all); the cached-prior mixture (and naive) evaluation.
  (b0) btx-0 (d) upcycled (`--layers`, default all; `--router-init`, default data); N steps' extra tokens.
  (b) btx    (b0) + M steps of configs/btx/finetune.yaml, as in the default mode; N + M steps' extra tokens.

The recipes restart their learning-rate schedule (warm-up, decay to 0) at their own step counts, as the reproduce arms
did. Every continuation reads its data with `--data-seed` (not the seed's own data.seed), so no arm replays the seed
run's batch order. The recipe is the seed's sibling arm's `reproduce_arm.json` (`<arms>/demix-s<k>` next to
`<arms>/dense-s<k>`) when there, else the reproduce budget (configs/reproduce/full.yaml) with benchmarks.reproduce's
arm config.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.machine import uptime
from data.argtypes import positive_int, random_seed
from launcher.tables import markdown_table

ROOT = Path(__file__).resolve().parents[1]
FINETUNE = ROOT / "configs" / "btx" / "finetune.yaml"
BUDGET = ROOT / "configs" / "reproduce" / "full.yaml"
ARM_ROOTS = (ROOT / "runs" / "reproduce" / "arms", ROOT / "runs" / "reproduce-1500" / "arms")
LAYOUTS = ("every_other", "all")


def default_checkpoint(arm: str) -> Path | None:
    """The first `<root>/<arm>/model` among ARM_ROOTS that is a finished consolidated checkpoint."""
    for root in ARM_ROOTS:
        if (root / arm / "model" / "meta.json").is_file():
            return root / arm / "model"
    return None


def _meta(ckpt: Path) -> dict[str, Any]:
    return json.loads((Path(ckpt) / "meta.json").read_text())


def train_tokens(ckpt: Path) -> int | None:
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
    return (
        None
        if world is None
        else int(meta["step"]) * t["micro_batch"] * t["grad_accum"] * world * m["seq_len"]
    )


def launch_run(
    config: Path, sets: Sequence[str], run_dir: Path, steps: int, nproc: int, settings: dict[str, Any]
) -> Path:
    """`steps` steps of run config `config` + `sets` through launcher.launch on `nproc` ranks into `run_dir`: reused
    when finished with the same `settings` (recorded in `run_dir`/btx_compare.json), resumed when interrupted, refused
    when `run_dir` holds a run of other settings (resuming it would mix the two). Returns the exported model."""
    from launcher.launch import main as launch

    recorded = run_dir / "btx_compare.json"
    if recorded.is_file() and json.loads(recorded.read_text()) != settings:
        raise SystemExit(
            f"[btx] {run_dir} holds a run of other settings than asked for ({recorded}); delete it to "
            "retrain, or pass another --out"
        )
    if (
        recorded.is_file()
        and (run_dir / "model" / "meta.json").is_file()
        and _meta(run_dir / "model")["step"] == steps
    ):
        print(f"[btx] {run_dir.name}: finished earlier, reused", flush=True)
        return run_dir / "model"
    run_dir.mkdir(parents=True, exist_ok=True)
    recorded.write_text(json.dumps(settings, indent=1))
    argv = ["--config", str(config), "--nproc", str(nproc), "--run-dir", str(run_dir), "--resume", "auto"]
    argv += [a for s in sets for a in ("--set", s)]
    print(f"[btx] {run_dir.name}: python -m launcher.launch {shlex.join(argv)}", flush=True)
    if launch(argv) != 0:
        raise SystemExit(f"[btx] training {run_dir} failed; rerun to resume")
    return run_dir / "model"


def finetune(ckpt: Path, run_dir: Path, steps: int, nproc: int, extra_sets: Sequence[str] = ()) -> Path:
    """N steps of configs/btx/finetune.yaml from `ckpt` (its shape's overrides, E / nproc experts per rank, then
    `extra_sets`) through `launch_run`. Returns the exported model."""
    from launcher.modular.btx import finetune_overrides

    E = int(_meta(ckpt)["config"]["model"]["ffn"]["num_experts"])
    per_rank = E // nproc if E % nproc == 0 else E
    sets = finetune_overrides(ckpt) + [
        f"model.ffn.gshard.experts_per_rank={per_rank}",
        f"train.steps={steps}",
        f"logging.out_dir={run_dir}",
        "logging.progress_bar=false",
        *extra_sets,
    ]
    settings = {"checkpoint": str(Path(ckpt).resolve()), "checkpoint_step": _meta(ckpt)["step"], "sets": sets}
    return launch_run(FINETUNE, sets, run_dir, steps, nproc, settings)


def upcycle_arms(
    demix: Path,
    layouts: Sequence[str],
    router_init: str,
    out: Path,
    steps: int,
    nproc: int,
    stages: Stages,
    extra_sets: Sequence[str] = (),
) -> tuple[dict[str, Any], dict[str, tuple[Path, Path]]]:
    """(b0) and (b) of every layout: `demix` upcycled into `out`/upcycled-<layout> (reused when made from the same
    checkpoint, step and router init) and finetuned `steps` steps into `out`/btx-<layout>-ft. Returns (the upcycle
    records, {"btx-<layout>": (upcycled, finetuned)})."""
    from launcher.checkpoint import write_json_atomic
    from launcher.modular.btx import upcycle

    recs, runs = {}, {}
    for layout in layouts:
        up, rec_file = out / f"upcycled-{layout}", out / f"upcycle-{layout}.json"
        rec = json.loads(rec_file.read_text()) if rec_file.is_file() else {}
        if (
            (up / "meta.json").is_file()
            and rec.get("source") == str(demix)
            and rec.get("router_init") == router_init
            and rec.get("source_step", _meta(demix)["step"]) == _meta(demix)["step"]
        ):
            recs[layout] = rec
        else:
            recs[layout] = upcycle(demix, up, layers=layout, router_init=router_init, overwrite=True)
            write_json_atomic(rec_file, recs[layout])
        runs[f"btx-{layout}"] = (up, finetune(up, out / f"btx-{layout}-ft", steps, nproc, extra_sets))
        stages.done(f"upcycle + finetune btx {layout}")
    return recs, runs


class Stages:
    """Wall seconds of a comparison's named stages, in the order they finished."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._mark = time.perf_counter()

    def done(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = now - self._mark
        self._mark = now


def _reusable(
    path: Path, ckpt: Path, settings: dict[str, Any], modes: Sequence[str]
) -> dict[str, Any] | None:
    """An eval.json at `path` made of `ckpt`'s step with these settings and modes, else None."""
    if not path.is_file():
        return None
    res = json.loads(path.read_text())
    ok = res.get("step") == _meta(ckpt)["step"] and all(res.get(k) == v for k, v in settings.items())
    return res if ok and set(modes) <= set(res.get("modes", ())) else None


def evaluate(
    ckpt: Path,
    out_dir: Path,
    settings: dict[str, Any],
    demix: bool = False,
    also_read: Sequence[Path] = (),
    no_capacity_limit: bool = False,
) -> dict[str, Any]:
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
    return evaluate_checkpoint(
        target,
        str(ROOT / "artifacts" / "demo" / "tokens"),
        modes=modes,
        out_dir=out_dir,
        progress=False,
        **settings,
    ).to_dict()


def _row(
    name: str,
    res: dict[str, Any],
    mode: str,
    extra: int | None,
    total: int | None,
    nocap: dict[str, Any] | None = None,
) -> dict[str, Any]:
    t = res["tables"]
    row = {
        "arm": name,
        "mode": mode,
        "in_domain": t["in_domain_average"].get(mode),
        "in_domain_ci": t["in_domain_average_ci"].get(mode),
        "novel": t["novel_average"].get(mode),
        "novel_ci": t["novel_average_ci"].get(mode),
        "extra_tokens": extra,
        "total_tokens": total,
    }
    if nocap is not None:
        row["in_domain_nocap"] = nocap["tables"]["in_domain_average"].get(mode)
        row["novel_nocap"] = nocap["tables"]["novel_average"].get(mode)
    return row


def evaluate_moe(
    runs: dict[str, tuple[Path, Path]],
    out: Path,
    settings: dict[str, Any],
    res: dict[str, Any],
    read_own: Sequence[str] = (),
) -> None:
    """Into `res`: `<name>-0` (the start) and `<name>` (finetuned) of every MoE run, each also without capacity limit
    (`/nocap`). `read_own`: keys whose checkpoint's own run evaluation (`<run>/eval/eval.json`, read only) may be
    reused, e.g. a reproduce arm's."""
    for name, (start, end) in runs.items():
        for key, ckpt in ((name + "-0", start), (name, end)):
            also = [ckpt.parent / "eval" / "eval.json"] if key in read_own else []
            res[key] = evaluate(ckpt, out / f"eval-{key}", settings, also_read=also)
            res[key + "/nocap"] = evaluate(ckpt, out / f"eval-{key}-nocap", settings, no_capacity_limit=True)


def _losses(run_dir: Path) -> dict[str, Any]:
    from launcher.metrics import read_metrics

    train = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    if not train:
        return {}
    return {
        "first_step": train[0]["step"],
        "last_step": train[-1]["step"],
        "first_loss": train[0]["loss"],
        "last_loss": train[-1]["loss"],
        "first_aux": train[0].get("aux_loss"),
        "last_aux": train[-1].get("aux_loss"),
        "step_time_s": train[-1].get("step_time_s"),
    }


def _fmt(v: Any, ci: Any = None) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


def _header(rep: dict[str, Any], title: str) -> list[str]:
    m = rep["machine"]
    return [
        f"# {title}",
        "",
        f"Command: `{rep['command']}`  ",
        f"Date: {rep['date']}; {rep['seconds']:.0f} s in all.  ",
        f"Machine: {m['cores']} cores ({m['cpu'] or 'unknown CPU'}), torch {m['torch']}, deepspeed "
        f"{m['deepspeed']}; no GPU used.  ",
        f"`uptime` before: `{rep['uptime_before']}`  ",
        f"`uptime` after: `{rep['uptime_after']}`",
        "",
    ]


def _table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The results table: one row per (arm, evaluation mode), `_row`'s fields."""
    return markdown_table(
        [
            "arm",
            "mode",
            "in-domain avg ppl [95 %]",
            "novel avg ppl [95 %]",
            "extra tokens",
            "total tokens",
            "in-domain, no capacity limit",
            "novel, no capacity limit",
        ],
        [
            [
                r["arm"],
                r["mode"],
                _fmt(r["in_domain"], r["in_domain_ci"]),
                _fmt(r["novel"], r["novel_ci"]),
                f"{r['extra_tokens']:,}",
                f"{r['total_tokens']:,}" if r["total_tokens"] else "-",
                _fmt(r.get("in_domain_nocap")),
                _fmt(r.get("novel_nocap")),
            ]
            for r in rows
        ],
    )


def _upcycle_lines(recs: dict[str, Any]) -> list[str]:
    lines = [
        "Upcycling records: router (data init) per MoE layer on the calibration tokens (scale s, entropy / "
        "log E, share of a domain's tokens whose first choice / top-2 holds its own expert, mean p_own), and the "
        "averaged layers' ||mean expert|| / mean ||expert|| (1 = equal experts, 1/sqrt(E) = unrelated):",
        "",
    ]
    for layout, rec in recs.items():
        coh = ", ".join(f"layer {l}: {r:.3f}" for l, r in rec.get("average_coherence", {}).items()) or "none"
        lines.append(
            f"- `{layout}`: MoE layers {rec['moe_layers']}, averaged layers {rec['averaged_layers']} ({coh}); "
            f"{rec['seconds']:.1f} s"
        )
        for l, s in rec.get("router", {}).items():
            lines.append(
                f"  - layer {l}: s = {s['scale']:.3f}, H/log E = {s['entropy_fraction']:.3f}, own top-1 "
                f"{s['own_top1']:.3f}, own in top-2 {s['own_top2']:.3f}, mean p_own {s['own_prob']:.3f}"
            )
    return lines


def _training_lines(runs: dict[str, Any], what: str) -> list[str]:
    lines = [
        f"{what} (training loss incl. the mixture's domains; aux = weighted load-balancing loss; first and last "
        "logged steps):",
        "",
    ]
    for arm, f in runs.items():
        if f:
            aux = (
                f"; aux {f['first_aux']:.4f} -> {f['last_aux']:.4f}" if f.get("first_aux") is not None else ""
            )
            lines.append(
                f"- {arm}: loss {f['first_loss']:.3f} (step {f.get('first_step', 1)}) -> {f['last_loss']:.3f} "
                f"(step {f.get('last_step', '?')}){aux}; {f['step_time_s']:.2f} s/step"
            )
    return lines


def _footer(rep: dict[str, Any]) -> list[str]:
    lines = ["", "Stages (s): " + ", ".join(f"{k} {v:.0f}" for k, v in rep["stage_seconds"].items())]
    return lines + ([""] + [f"Note: {n}" for n in rep["notes"]] if rep.get("notes") else [])


def markdown(rep: dict[str, Any]) -> str:
    """The results file: command, machine, load, what was compared, the table, the router and finetune records."""
    lines = _header(rep, "BTX vs DEMix vs GShard on equal extra tokens (demo corpus)")
    lines += [
        f"DEMix checkpoint: `{rep['demix']}` (step {rep['demix_step']}); GShard checkpoint: `{rep['gshard']}` "
        f"(step {rep['gshard_step']}, {rep['gshard_experts']} experts). Finetuning: {rep['steps']} steps of "
        f"`configs/btx/finetune.yaml` on {rep['nproc']} ranks = {rep['extra_tokens']:,} extra tokens per arm. "
        f"Upcycling: `--layers {' / '.join(rep['layers'])} --router-init {rep['router_init']}`. Evaluation: "
        f"{rep['eval']['max_blocks']} test blocks per domain (cached prior from {rep['eval']['cached_blocks']} "
        "dev blocks); perplexity averages are plain means over domains, intervals 95 % bootstrap over blocks.",
        "",
        "The last two columns evaluate the MoE models again with eval_capacity_factor = E (no route "
        "dropped): the evaluator batches 4 blocks of one domain, so a router that sends a domain to its own "
        "expert overflows that expert's C = S/E x 2 x 2.0 = S/2 slots, which a domain-agnostic router never "
        "does.",
        "",
    ]
    lines += _table(rep["rows"]) + [""] + _upcycle_lines(rep["upcycle"]) + [""]
    lines += _training_lines(rep["finetune"], "Finetuning")
    return "\n".join(lines + _footer(rep)) + "\n"


def markdown_seeded(rep: dict[str, Any]) -> str:
    """The seeded mode's results file: the same header, table and records, with the seed and the three recipes."""
    lines = _header(
        rep, "BTX from one dense seed: continued Dense vs branched DEMix vs BTX on equal tokens (demo corpus)"
    )
    t = rep["tokens_per_step"]
    r = rep["recipes"]
    lines += [
        f"Seed: `{rep['seed']}` (step {rep['seed_step']}, {rep['seed_tokens'] or 0:,} tokens), branched into "
        f"{rep['num_experts']} experts (every expert = the dense FFN; `launcher.modular.btx branch`). Steps: "
        f"(d) {rep['branch_steps']} branch-train steps of `{r['demix']['config']}` ({t['demix']:,} tokens/step), "
        f"(b) {rep['steps']} MiX steps of `configs/btx/finetune.yaml` ({t['finetune']:,} tokens/step), (s) "
        f"{rep['dense_steps']} steps of `{r['dense']['config']}` ({t['dense']:,} tokens/step) = the tokens of "
        f"(d) + (b); {rep['nproc']} ranks, data seed {rep['data_seed']}; recipe overrides from "
        f"`{r['demix']['source']}` and `{r['dense']['source']}`. Upcycling: `--layers "
        f"{' / '.join(rep['layers'])} --router-init {rep['router_init']}`. Evaluation: "
        f"{rep['eval']['max_blocks']} test blocks per domain (cached prior from {rep['eval']['cached_blocks']} "
        "dev blocks); perplexity averages are plain means over domains, intervals 95 % bootstrap over blocks; "
        "the last two columns with eval_capacity_factor = E.",
        "",
    ]
    lines += _table(rep["rows"]) + [""] + _upcycle_lines(rep["upcycle"]) + [""]
    lines += _training_lines(rep["training"], "Training")
    return "\n".join(lines + _footer(rep)) + "\n"


def _finish(rep: dict[str, Any], out: Path, record: str | None, render: Any, t0: float) -> dict[str, Any]:
    """Add the closing load and time, write report.json / report.md (and `record`), print the markdown."""
    from launcher.checkpoint import write_json_atomic

    rep["uptime_after"] = uptime()
    rep["seconds"] = time.perf_counter() - t0
    write_json_atomic(out / "report.json", rep)
    (out / "report.md").write_text(render(rep))
    if record:
        Path(record).write_text(render(rep))
    print(render(rep))
    return rep


def _start(argv: Sequence[str]) -> dict[str, Any]:
    from benchmarks.machine import machine_info

    return {
        "command": "python -m experiments.btx_compare " + shlex.join(argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine_info(),
        "uptime_before": uptime(),
    }


def _upcycled_rows(
    args: argparse.Namespace, res: dict[str, Any], extra: int, base_d: int | None, base_g: int | None
) -> list[dict[str, Any]]:
    """The table's rows: (a) DEMix cached and naive, (b0)/(b) BTX per layout, (c0)/(c) GShard."""
    rows = [
        _row("(a) DEMix", res["demix"], "cached", 0, base_d),
        _row("(a) DEMix", res["demix"], "naive", 0, base_d),
    ]
    for layout in args.layers:
        rows += [
            _row(
                f"(b0) BTX {layout}, no finetune",
                res[f"btx-{layout}-0"],
                "ppl",
                0,
                base_d,
                res[f"btx-{layout}-0/nocap"],
            ),
            _row(
                f"(b) BTX {layout} + {args.steps} steps",
                res[f"btx-{layout}"],
                "ppl",
                extra,
                base_d and base_d + extra,
                res[f"btx-{layout}/nocap"],
            ),
        ]
    rows += [
        _row("(c0) GShard, no finetune", res["gshard-0"], "ppl", 0, base_g, res["gshard-0/nocap"]),
        _row(
            f"(c) GShard + {args.steps} steps",
            res["gshard"],
            "ppl",
            extra,
            base_g and base_g + extra,
            res["gshard/nocap"],
        ),
    ]
    return rows


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    """(a), (b0), (b), (c0), (c) from the reproduce run's DEMix and GShard checkpoints (module docstring)."""
    t0 = time.perf_counter()
    rep = _start(argv)
    demix = Path(args.demix) if args.demix else default_checkpoint("demix-s1")
    gshard = Path(args.gshard) if args.gshard else default_checkpoint("gshard-s1")
    if demix is None or gshard is None:
        raise SystemExit(
            "error: no DEMix / GShard checkpoint: run `make reproduce` or pass --demix / --gshard"
        )
    out, stages, notes = Path(args.out), Stages(), list(args.note)
    settings = {"max_blocks": args.max_blocks, "cached_blocks": args.cached_blocks, "split": "test"}
    res: dict[str, Any] = {}
    recs, runs = upcycle_arms(demix, args.layers, args.router_init, out, args.steps, args.nproc, stages)
    runs["gshard"] = (gshard, finetune(gshard, out / "gshard-ft", args.steps, args.nproc))
    stages.done("finetune gshard")
    # the reproduce run's own evaluation (read only), when made with these settings
    res["demix"] = evaluate(
        demix, out / "eval-demix", settings, demix=True, also_read=[demix.parent / "eval" / "eval.json"]
    )
    stages.done("eval demix")
    evaluate_moe(runs, out, settings, res, read_own=["gshard-0"])  # gshard-0: the reproduce arm's own eval
    stages.done("eval moe")
    t = _meta(runs["gshard"][1])["config"]
    extra = (
        args.steps * args.nproc * t["train"]["micro_batch"] * t["train"]["grad_accum"] * t["model"]["seq_len"]
    )
    base_d, base_g = train_tokens(demix), train_tokens(gshard)
    rows = _upcycled_rows(args, res, extra, base_d, base_g)
    if base_d != base_g:
        notes.append(
            f"the DEMix and GShard checkpoints were trained on different token counts ({base_d} vs {base_g})"
        )
    rep.update(
        {
            "demix": str(demix),
            "demix_step": _meta(demix)["step"],
            "gshard": str(gshard),
            "gshard_step": _meta(gshard)["step"],
            "gshard_experts": _meta(gshard)["config"]["model"]["ffn"]["num_experts"],
            "steps": args.steps,
            "nproc": args.nproc,
            "extra_tokens": extra,
            "layers": list(args.layers),
            "router_init": args.router_init,
            "eval": settings,
            "upcycle": recs,
            "rows": rows,
            "finetune": {name: _losses(end.parent) for name, (_, end) in runs.items()},
            "stage_seconds": stages.seconds,
            "notes": notes,
        }
    )
    return _finish(rep, out, args.record, markdown, t0)


# --------------------------------------------------------------------------------------------------
# Seeded mode: every arm from one dense seed (branch -> train -> mix)
# --------------------------------------------------------------------------------------------------


def seed_recipe(seed: Path, arm: str) -> dict[str, Any]:
    """{"config", "sets"} of reproduce arm `arm` at the seed's budget: the record (`reproduce_arm.json`) of `arm`'s run
    beside the seed's run (`<arms>/<arm>-s<k>` for a seed in `<arms>/<x>-s<k>/model`), else configs/demo's arm config
    from benchmarks.reproduce.ARMS with the reproduce budget's overrides and the seed run's train.seed."""
    from benchmarks.reproduce import ARMS, Budget

    run = Path(seed).resolve().parent
    _, sep, k = run.name.rpartition("-s")
    sibling = run.parent / f"{arm}-s{k}" / "reproduce_arm.json"
    if sep and k.isdigit() and sibling.is_file():
        rec = json.loads(sibling.read_text())
        return {"config": rec["config"], "sets": list(rec["sets"]), "source": str(sibling)}
    b = Budget.load(BUDGET)
    config, arm_sets = ARMS[arm]
    sets = [
        f"train.seed={_meta(seed)['config']['train']['seed']}",
        "logging.wandb_mode=disabled",
        f"train.save_interval={b.save_interval}",
        "train.keep_checkpoints=1",
        *b.sets,
        *arm_sets,
    ]
    return {
        "config": config,
        "sets": sets,
        "source": f"{BUDGET.relative_to(ROOT)} + benchmarks.reproduce.ARMS",
    }


_OURS = ("train.steps=", "train.init_from=", "data.seed=", "logging.out_dir=", "logging.progress_bar=")


def recipe_sets(
    recipe: dict[str, Any], steps: int, data_seed: int, run_dir: Path, extra: Sequence[str] = ()
) -> list[str]:
    """The recipe's overrides (less the ones set here) + `extra` + steps, data seed and run directory."""
    return (
        [s for s in recipe["sets"] if not s.startswith(_OURS)]
        + list(extra)
        + [
            f"train.steps={steps}",
            f"data.seed={data_seed}",
            f"logging.out_dir={run_dir}",
            "logging.progress_bar=false",
        ]
    )


def tokens_per_step(config: Path, sets: Sequence[str], nproc: int) -> int:
    """Training tokens one optimizer step of this run config reads over `nproc` ranks: data-parallel ranks x
    micro_batch x grad_accum x seq_len (every DEMix rank reads its domain's full micro-batches too)."""
    from launcher.config import load_run_config

    cfg = load_run_config(config, sets, check=False)
    t = cfg.train
    return nproc // cfg.parallel.tensor_parallel * t.micro_batch * t.grad_accum * cfg.model.seq_len


def equal_token_steps(branch_steps: int, steps: int, tps: dict[str, int]) -> int:
    """Steps of the dense continuation that read exactly the tokens of `branch_steps` DEMix steps + `steps` MiX steps;
    SystemExit when no whole number of steps does."""
    total = branch_steps * tps["demix"] + steps * tps["finetune"]
    if total % tps["dense"]:
        raise SystemExit(
            f"error: (d) + (b) read {total:,} tokens, not a whole number of dense steps of "
            f"{tps['dense']:,} tokens: choose --branch-steps / --steps, or batch overrides, that divide"
        )
    return total // tps["dense"]


def branched_seed(seed: Path, out: Path) -> Path:
    """`out`/branched: the seed branched into one expert per training domain; reused when made from this seed,
    refused when `out` holds another seed's."""
    from launcher.modular.btx import branch

    path = out / "branched"
    if (path / "meta.json").is_file():
        made = _meta(path).get("branch", {})
        if made.get("source") == str(Path(seed).resolve()) and made.get("source_step") == _meta(seed)["step"]:
            print(f"[btx] {path}: branched earlier, reused", flush=True)
            return path
        raise SystemExit(
            f"[btx] {path} was branched from {made.get('source')} (step {made.get('source_step')}), not "
            f"{seed}: pass another --out"
        )
    from launcher.checkpoint import CheckpointError

    try:
        branch(seed, path)
    except (
        CheckpointError
    ) as e:  # a seed that is not dense, or an --out in the way: the message says what to do
        raise SystemExit(f"error: --seed-dense {seed}: {e}") from None
    return path


def _seeded_plan(
    args: argparse.Namespace, seed: Path, branched: Path, recipes: dict[str, dict[str, Any]], out: Path
) -> tuple[list[str], list[str], dict[str, int], int]:
    """The overrides of (d) and (s), tokens per step of each run, and the dense steps that read (d) + (b)'s tokens."""
    from launcher.modular.btx import demix_overrides

    seq = _meta(seed)["config"]["model"]["seq_len"]
    d_sets = recipe_sets(
        recipes["demix"], args.branch_steps, args.data_seed, out / "demix-branched", demix_overrides(branched)
    )
    s_base = [f"train.init_from={seed.resolve()}"]
    tps = {
        "demix": tokens_per_step(ROOT / recipes["demix"]["config"], d_sets, args.nproc),
        "finetune": tokens_per_step(FINETUNE, [f"model.seq_len={seq}"], args.nproc),
        "dense": tokens_per_step(ROOT / recipes["dense"]["config"], recipes["dense"]["sets"], args.nproc),
    }
    dense_steps = equal_token_steps(args.branch_steps, args.steps, tps)
    s_sets = recipe_sets(recipes["dense"], dense_steps, args.data_seed, out / "dense-continued", s_base)
    return d_sets, s_sets, tps, dense_steps


def _seeded_rows(
    args: argparse.Namespace,
    res: dict[str, Any],
    base: int | None,
    extra: dict[str, int],
    dense_steps: int,
    notes: list[str],
) -> list[dict[str, Any]]:
    """The table's rows: (seed), (s), (d) cached and naive, (b0)/(b) per layout; a note where (s) and (d) + (b)
    read different token counts."""
    rows = [
        _row("(seed) Dense seed", res["seed"], "ppl", 0, base),
        _row(
            f"(s) Dense + {dense_steps} steps",
            res["dense"],
            "ppl",
            extra["dense"],
            base and base + extra["dense"],
        ),
        _row(
            f"(d) DEMix branched + {args.branch_steps} steps",
            res["demix"],
            "cached",
            extra["demix"],
            base and base + extra["demix"],
        ),
        _row(
            f"(d) DEMix branched + {args.branch_steps} steps",
            res["demix"],
            "naive",
            extra["demix"],
            base and base + extra["demix"],
        ),
    ]
    for layout in args.layers:
        mixed = extra["demix"] + extra[f"btx-{layout}"]
        rows += [
            _row(
                f"(b0) BTX {layout} from (d), no finetune",
                res[f"btx-{layout}-0"],
                "ppl",
                extra["demix"],
                base and base + extra["demix"],
                res[f"btx-{layout}-0/nocap"],
            ),
            _row(
                f"(b) BTX {layout} + {args.steps} steps",
                res[f"btx-{layout}"],
                "ppl",
                mixed,
                base and base + mixed,
                res[f"btx-{layout}/nocap"],
            ),
        ]
        if mixed != extra["dense"]:
            notes.append(f"(s) read {extra['dense']:,} extra tokens, (d) + (b) {layout} {mixed:,}: not equal")
    return rows


def _train_seeded(
    args: argparse.Namespace,
    recipes: dict[str, dict[str, Any]],
    sets: tuple[list[str], list[str]],
    dense_steps: int,
    ident: dict[str, Any],
    out: Path,
    stages: Stages,
) -> tuple[Path, dict[str, Any], dict[str, tuple[Path, Path]], Path]:
    """Train (d) the branched DEMix, then (b0)/(b) the upcycled arms from it, then (s) the dense continuation:
    (d's checkpoint, upcycle records, upcycled runs, s's checkpoint)."""
    d_sets, s_sets = sets
    d = launch_run(
        ROOT / recipes["demix"]["config"],
        d_sets,
        out / "demix-branched",
        args.branch_steps,
        args.nproc,
        {**ident, "config": recipes["demix"]["config"], "sets": d_sets},
    )
    stages.done(f"train branched demix {args.branch_steps} steps")
    recs, runs = upcycle_arms(
        d, args.layers, args.router_init, out, args.steps, args.nproc, stages, [f"data.seed={args.data_seed}"]
    )
    s = launch_run(
        ROOT / recipes["dense"]["config"],
        s_sets,
        out / "dense-continued",
        dense_steps,
        args.nproc,
        {**ident, "config": recipes["dense"]["config"], "sets": s_sets},
    )
    stages.done(f"train dense {dense_steps} steps")
    return d, recs, runs, s


def run_seeded(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    """(seed), (s), (d), (b0), (b) from the dense seed `args.seed_dense` (module docstring)."""
    t0 = time.perf_counter()
    rep = _start(argv)
    seed = Path(args.seed_dense)
    if not (seed / "meta.json").is_file():
        raise SystemExit(
            f"error: --seed-dense {seed}: no consolidated checkpoint there (RUN_DIR/model of a dense run)"
        )
    out, stages, notes = Path(args.out), Stages(), list(args.note)
    settings = {"max_blocks": args.max_blocks, "cached_blocks": args.cached_blocks, "split": "test"}
    # the seed's own reproduce arm: dense or balanced
    run_name = seed.resolve().parent.name.rpartition("-s")[0]
    recipes = {
        "dense": seed_recipe(seed, run_name if run_name in ("dense", "dense-balanced") else "dense"),
        "demix": seed_recipe(seed, "demix"),
    }
    branched = branched_seed(seed, out)
    stages.done("branch")
    d_sets, s_sets, tps, dense_steps = _seeded_plan(args, seed, branched, recipes, out)
    ident = {"seed": str(seed.resolve()), "seed_step": _meta(seed)["step"]}
    d, recs, runs, s = _train_seeded(args, recipes, (d_sets, s_sets), dense_steps, ident, out, stages)
    res = {
        "seed": evaluate(seed, out / "eval-seed", settings, also_read=[seed.parent / "eval" / "eval.json"]),
        "dense": evaluate(s, out / "eval-dense", settings),
        "demix": evaluate(d, out / "eval-demix", settings, demix=True),
    }
    evaluate_moe(runs, out, settings, res)
    stages.done("eval")
    base = train_tokens(seed)
    extra = {
        "dense": train_tokens(s),
        "demix": train_tokens(d),
        **{name: train_tokens(end) for name, (_, end) in runs.items()},
    }
    rows = _seeded_rows(args, res, base, extra, dense_steps, notes)
    rep.update(
        {
            "seed": str(seed),
            "seed_step": _meta(seed)["step"],
            "seed_tokens": base,
            "num_experts": len(_meta(branched)["domains"]),
            "branch_steps": args.branch_steps,
            "steps": args.steps,
            "dense_steps": dense_steps,
            "nproc": args.nproc,
            "data_seed": args.data_seed,
            "tokens_per_step": tps,
            "recipes": recipes,
            "layers": list(args.layers),
            "router_init": args.router_init,
            "eval": settings,
            "upcycle": recs,
            "rows": rows,
            "training": {
                "dense": _losses(s.parent),
                "demix-branched": _losses(d.parent),
                **{name: _losses(end.parent) for name, (_, end) in runs.items()},
            },
            "stage_seconds": stages.seconds,
            "notes": notes,
        }
    )
    return _finish(rep, out, args.record, markdown_seeded, t0)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        prog="python -m experiments.btx_compare", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--steps",
        type=positive_int,
        default=200,
        help="finetune (MiX) steps of (b) and (c) (the extra tokens)",
    )
    p.add_argument("--nproc", type=positive_int, default=2)
    p.add_argument("--max-blocks", type=positive_int, default=64, help="test blocks per domain")
    p.add_argument(
        "--cached-blocks", type=positive_int, default=100, help="dev blocks for DEMix's cached prior"
    )
    p.add_argument("--demix", help="DEMix checkpoint (default: the reproduce arm demix-s1)")
    p.add_argument("--gshard", help="GShard checkpoint (default: the reproduce arm gshard-s1)")
    p.add_argument(
        "--seed-dense",
        help="seeded mode: the dense seed checkpoint every arm starts from "
        "(e.g. runs/reproduce/arms/dense-s1/model)",
    )
    p.add_argument(
        "--branch-steps", type=positive_int, default=600, help="seeded mode: DEMix steps of the branches (d)"
    )
    p.add_argument(
        "--data-seed",
        type=random_seed,
        default=11,
        help="seeded mode: data.seed of every continuation (the reproduce arms used 1 and 2)",
    )
    p.add_argument(
        "--layers",
        help="comma-separated BTX layouts to compare: every_other (GShard's placement), all "
        "(default: both; seeded mode: all)",
    )
    p.add_argument("--router-init", choices=("data", "zero"), default="data")
    p.add_argument(
        "--out", help="where the stages go (default: runs/btx/compare; seeded mode: runs/btx/seeded)"
    )
    p.add_argument(
        "--record", help="also write the markdown report here (e.g. experiments/results/btx_compare.md)"
    )
    p.add_argument("--note", action="append", default=[], help="a note to add to the report (repeatable)")
    args = p.parse_args(argv)
    seeded = args.seed_dense is not None
    args.layers = [x for x in (args.layers or ("all" if seeded else ",".join(LAYOUTS))).split(",") if x]
    bad = [x for x in args.layers if x not in LAYOUTS]
    if bad:
        p.error(f"--layers: unknown {bad}; choose from {', '.join(LAYOUTS)}")
    if seeded and (args.demix or args.gshard):
        p.error(
            "--seed-dense starts every arm from the dense seed: --demix / --gshard belong to the default mode"
        )
    if min(args.steps, args.branch_steps) < 1:
        p.error("--steps and --branch-steps must be >= 1")
    args.out = args.out or str(ROOT / "runs" / "btx" / ("seeded" if seeded else "compare"))
    if seeded:
        run_seeded(args, argv)
    else:
        run(args, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
