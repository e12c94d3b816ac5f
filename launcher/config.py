"""The run configuration: one typed tree (model, data, parallel, train, logging) loaded from YAML.

Each part is defined where it is used: `model/config.py` (the GPT and its FFN kind), `data/config.py`,
`parallel/config.py` (the layout and the training recipe the engine applies); logging and the tree here.

A run YAML names a model preset (`model: {preset: gpt3-small, ffn: {kind: demix}}`) from
`configs/model/`, overrides what it likes, and may be overridden again from the command line
(`--set train.steps=10`). Every problem, per field and across components, is reported at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import field
from pathlib import Path
from typing import Any

from pydantic import StrictBool, StrictInt
from pydantic.dataclasses import dataclass

from data.config import DataConfig
from data.readers import InputFileError, load_yaml, read_yaml
from launcher.typed import ConfigError, build_lenient, deep_merge, set_path
from model.config import CONFIG, ModelConfig
from parallel.config import ParallelConfig, TrainConfig
from parallel.ds_config import extra_deepspeed_problems

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
MODEL_PRESET_DIR = CONFIG_DIR / "model"
WANDB_MODES: tuple[str, ...] = ("offline", "online", "disabled")


@dataclass(frozen=True, config=CONFIG)
class LoggingConfig:
    out_dir: str = "runs/default"
    log_interval: StrictInt = 1
    progress_bar: StrictBool = True
    wandb_mode: str = "offline"  # never required; "online" only when configured
    wandb_project: str = "demix"
    wandb_entity: str | None = None
    wandb_group: str | None = None  # e.g. one group per comparison (dense vs DEMix vs GShard)
    wandb_tags: list[str] = field(default_factory=list)

    def problems(self, prefix: str = "logging") -> list[str]:
        out = []
        if self.log_interval < 1:
            out.append(f"{prefix}.log_interval={self.log_interval}: must be >= 1")
        if self.wandb_mode not in WANDB_MODES:
            out.append(f"{prefix}.wandb_mode={self.wandb_mode!r}: choose one of {', '.join(WANDB_MODES)}")
        return out


@dataclass(frozen=True, config=CONFIG)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    # Merged into the generated DeepSpeed config (comms_logger, flops_profiler, offload, ...); keys the framework
    # sets itself are refused with the setting to use instead (parallel.ds_config.OWNED_DEEPSPEED_KEYS).
    extra_deepspeed: dict[str, Any] = field(default_factory=dict)

    def problems(self) -> list[str]:
        return (
            self.model.problems()
            + self.data.problems()
            + self.parallel.problems()
            + self.train.problems()
            + self.logging.problems()
            + extra_deepspeed_problems(self.extra_deepspeed)
        )


def model_presets() -> list[str]:
    """Names of the shipped model presets (configs/model/*.yaml)."""
    return sorted(p.stem for p in MODEL_PRESET_DIR.glob("*.yaml"))


def _read_yaml(path: Path) -> dict:
    """A YAML mapping from `path` (data/readers.py: safe, alias-budgeted); ConfigError naming the file."""
    try:
        data = read_yaml(path) or {}
    except InputFileError as e:
        raise ConfigError([str(e)], str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: expected a mapping at the top level"], str(path))
    return data


def _expand_model_preset(raw: dict, problems: list[str]) -> dict:
    model = raw.get("model")
    if not isinstance(model, dict) or "preset" not in model:
        return raw
    model = dict(model)
    name = model.pop("preset")
    preset_path = MODEL_PRESET_DIR / f"{name}.yaml"
    if not preset_path.is_file():
        problems.append(
            f"model.preset={name!r}: no such preset; shipped presets: {', '.join(model_presets())}"
        )
        return {**raw, "model": model}
    return {**raw, "model": deep_merge(_read_yaml(preset_path), model)}


def parse_overrides(overrides: Sequence[str]) -> dict:
    """['train.steps=10', 'model.ffn.kind=demix'] -> nested dict (values parsed as YAML scalars)."""
    out: dict = {}
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(
            [f"override {o!r}: expected KEY=VALUE, e.g. train.steps=10" for o in bad], "overrides"
        )
    problems = []
    for o in overrides:
        key, _, value = o.partition("=")
        try:
            set_path(out, key.strip(), load_yaml(value, f"--set {o!r}"))
        except InputFileError as e:
            problems.append(str(e))
    if problems:
        raise ConfigError(problems, "overrides")
    return out


def load_run_config(
    path: str | Path | None = None, overrides: Sequence[str] = (), check: bool = True
) -> RunConfig:
    """Load, merge overrides, type-check and validate a run config; raise one ConfigError with every problem.

    With `check=False` only structural problems (unknown keys, wrong types, missing files) raise; the caller
    runs `cfg.problems()` itself together with its own cross-checks (see launcher.plan.make_plan)."""
    raw = _read_yaml(Path(path)) if path is not None else {}
    raw = deep_merge(raw, parse_overrides(overrides))
    problems: list[str] = []
    raw = _expand_model_preset(raw, problems)
    source = str(path) if path is not None else "config"
    cfg, type_problems = build_lenient(RunConfig, raw)
    problems += type_problems
    if cfg is not None and check:
        problems += cfg.problems()
    if problems or cfg is None:
        raise ConfigError(problems, source)
    return cfg
