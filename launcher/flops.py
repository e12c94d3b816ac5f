"""FLOPs and parameter accounting from the command line (DEMix Tables 2 and 9).

    python -m launcher.flops --paper [--json] [--markdown benchmarks/results/flops_paper.md]
    python -m launcher.flops --config gpt3-small --set model.ffn.kind=demix --set model.ffn.num_experts=8 \\
        --gpus 32 --micro-batch 2 --grad-accum 8 [--seconds-per-update 18 --device v100 --precision fp16]

`--config` takes a run YAML or a model preset name. The arithmetic lives in `model/accounting.py`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from data.argtypes import positive_float, positive_int
from data.cli import cli_main, exit_process, usage_error
from launcher.config import RunConfig, load_run_config, model_presets
from launcher.ffn_kinds import ffn_kind
from launcher.tables import markdown_table
from launcher.typed import ConfigError
from model import accounting as acc
from model.config import ModelConfig


def paper_configs() -> list[tuple[acc.PaperSetting, ModelConfig]]:
    """Each (size, arch) of Tables 2/9 as a (setting, model config) pair, built from the shipped presets."""
    out = []
    for setting in acc.PAPER_TABLE:
        for arch in acc.PAPER_ARCHS:
            overrides = [
                f"model.preset={setting.preset}",
                f"model.ffn.kind={arch}",
                f"model.ffn.num_experts={acc.paper_num_experts(arch, setting.gpus)}",
            ]
            cfg = load_run_config(None, overrides).model
            if (cfg.seq_len, cfg.vocab_size) != (acc.PAPER_SEQ_LEN, acc.PAPER_VOCAB):
                raise ConfigError(
                    [f"preset {setting.preset}: expected seq_len 1024 and vocab 50264 (the paper's)"]
                )
            out.append((setting, cfg))
    return out


def _human(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3f}{unit}" if abs(n) < 10 * scale else f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


_PAPER_COLUMNS = (
    ("size", "size"),
    ("arch", "arch"),
    ("GPUs", "gpus"),
    ("experts", "experts"),
    ("params", "total_params"),
    ("paper", "paper_total_params"),
    ("err", "params_rel_err"),
    ("active", "active_params"),
    ("TFLOPs/upd", "tflops_per_update"),
    ("paper", "paper_tflops_per_update"),
    ("err", "tflops_rel_err"),
    ("no-recomp", "tflops_per_update_no_recompute"),
    ("paper TFLOPs/GPU", "paper_tflops_per_gpu"),
    ("MFU V100", "paper_mfu"),
)


def _cell(key: str, value: object) -> str:
    if key.endswith("_params"):
        return _human(float(value))
    if key.endswith("rel_err"):
        return f"{100 * float(value):+.2f}%"
    if key == "paper_mfu":
        return "-" if value is None else f"{100 * float(value):.0f}%"
    if key.startswith(("tflops", "paper_tflops")):
        return f"{float(value):,.1f}" if key.startswith("tflops") else f"{float(value):,.0f}"
    return str(value)


def format_table(rows: Sequence[dict], markdown: bool = False) -> str:
    """The paper rows as an aligned text table (or a Markdown table)."""
    header = [name for name, _ in _PAPER_COLUMNS]
    body = [[_cell(key, row[key]) for _, key in _PAPER_COLUMNS] for row in rows]
    if markdown:
        return "\n".join(markdown_table(header, body))
    widths = [max(len(c) for c in col) for col in zip(header, *body)]

    def fmt(cells: Sequence[str]) -> str:  # size and arch left-aligned, numbers right-aligned
        return "  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in body])


_NOTES = (
    "TFLOPs/update: Narayanan et al. (2021) eq. (3) with recomputation, "
    "F = 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)), B = GPUs x 2 x 8, s = 1024, V = 50,264 (the paper truncates);\n"
    "no-recomp: F = 72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h)). GShard counts its top-2 FFNs in every other layer.\n"
    "params: unpadded vocabulary, tied head counted once. MFU V100: the paper's TFLOPs/GPU over 125 (V100 fp16)."
)


def _run_paper(args: argparse.Namespace) -> int:
    rows = acc.paper_rows(paper_configs())
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(format_table(rows))
        print()
        print(_NOTES)
    if args.markdown:
        path = Path(args.markdown)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = "# DEMix Tables 2 and 9, recomputed (`python -m launcher.flops --paper`)\n\n"
        path.write_text(
            text + format_table(rows, markdown=True) + "\n\n" + _NOTES.replace("\n", "\n\n") + "\n"
        )
    return 0


def _load(config: str, overrides: Sequence[str]) -> RunConfig:
    if config in model_presets():
        return load_run_config(None, [f"model.preset={config}", *overrides])
    return load_run_config(config, overrides)


def _resolve_experts(cfg: RunConfig, gpus: int) -> int | None:
    """Experts per expert layer when the config says 0 (= derive), as the trainer resolves them
    (launcher/ffn_kinds.py): domains for DEMix (from data.domains), one per GPU for GShard, slots for CSE."""
    kind, ffn = ffn_kind(cfg), cfg.model.ffn
    if not kind.has_experts or ffn.num_experts > 0:
        return None
    if kind.domain_experts and not cfg.data.domains:
        raise ConfigError(
            [
                f"model.ffn.num_experts=0 cannot be derived for kind {ffn.kind!r} without data.domains: "
                "set one of them"
            ]
        )
    return kind.resolve_num_experts(cfg, cfg.data.domains or [], gpus)


def _run_config(args: argparse.Namespace) -> int:
    cfg = _load(args.config, args.set)
    micro = args.micro_batch or cfg.train.micro_batch
    accum = args.grad_accum or cfg.train.grad_accum
    data_parallel = args.gpus // cfg.parallel.tensor_parallel
    row = acc.accounting_row(cfg.model, data_parallel, micro, accum, _resolve_experts(cfg, args.gpus))
    row = {"model": cfg.model.name, **row, "gpus": args.gpus}
    if args.seconds_per_update:
        tpg = acc.tflops_per_gpu(row["tflops_per_update"] * 1e12, args.seconds_per_update, args.gpus)
        precision = args.precision or cfg.train.precision
        row.update(
            tflops_per_gpu=tpg,
            mfu=acc.mfu(tpg, args.device, precision),
            device=args.device,
            precision=precision,
        )
    if args.json:
        print(json.dumps(row, indent=1))
        return 0
    for key, value in row.items():
        if key == "mfu":
            shown = "n/a (no peak for this device/precision)" if value is None else f"{100 * value:.1f}%"
        elif key.endswith("_params"):
            shown = _human(value)
        else:
            shown = f"{value:,.2f}" if isinstance(value, float) else value
        print(f"{key:32s} {shown}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launcher.flops", description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--paper", action="store_true", help="reproduce DEMix Tables 2 and 9")
    mode.add_argument(
        "--config", help="run YAML, or a model preset name (" + ", ".join(model_presets()) + ")"
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)"
    )
    p.add_argument(
        "--gpus",
        type=positive_int,
        default=1,
        help="GPUs in the run (B = data-parallel GPUs x micro x accum)",
    )
    p.add_argument(
        "--micro-batch", type=positive_int, help="sequences per GPU per step (default: train.micro_batch)"
    )
    p.add_argument("--grad-accum", type=positive_int, help="accumulation steps (default: train.grad_accum)")
    p.add_argument(
        "--seconds-per-update", type=positive_float, help="measured step time, to report TFLOPs/GPU and MFU"
    )
    p.add_argument(
        "--device", default="cpu", help="device for MFU: a key (h100-sxm, v100) or a torch device name"
    )
    p.add_argument("--precision", help="precision for MFU (default: train.precision)")
    p.add_argument("--json", action="store_true", help="print only JSON")
    p.add_argument("--markdown", help="with --paper: also write the table as Markdown to this path")
    return p


def _problems(args: argparse.Namespace) -> list[str]:
    out = []  # the numbers' ranges are the argparse types' (data/argtypes.py)
    if args.paper and (args.set or args.seconds_per_update):
        out.append("--paper takes no --set or --seconds-per-update (the paper's settings are fixed)")
    return out


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    problems = _problems(args)
    if problems:
        parser.error("; ".join(problems))
    try:
        return _run_paper(args) if args.paper else _run_config(args)
    except (ConfigError, ValueError) as e:
        return usage_error(e)


if __name__ == "__main__":
    exit_process(main())
