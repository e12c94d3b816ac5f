"""Throughput sweep: model sizes x architectures x world sizes (x ZeRO stages x tensor-parallel sizes),
each point trained for a few steps through the normal launcher, summarised in one results.json.

    python -m benchmarks.sweep configs/sweeps/cpu.yaml [--sweep-dir runs/sweeps/cpu] [--reuse]
                               [--only SUBSTRING ...] [--dry-run]

Every point runs as `python -m launcher.launch --config <base_config> --nproc N --run-dir <sweep-dir>/<point-id>
--resume never --master-port P --set ...` in a subprocess, so a point is exactly what a user would launch; its
output goes to `<sweep-dir>/<point-id>/sweep.log` and its summary to `<sweep-dir>/<point-id>/point.json`. A failed
point (bad layout, crash, timeout) is recorded with the tail of its error and the sweep continues.

Points run one after another. The rendezvous port P of a local point is reserved, not guessed (`reserve_port`):
a socket bound to a port the kernel picked as free (no listener, no connection, nothing in TIME_WAIT) stays open
while the point runs, so no other process on the machine can take it, and only rank 0's rendezvous store (which
binds with SO_REUSEADDR, as this socket does) can listen on it. Multi-node points (launch.hostfile) keep the
launcher's own choice: their rendezvous is on the first host.

A rerun re-times every point it reports. With --reuse, points whose point.json says "ok" and whose launch
command is unchanged are kept instead (the others run): their rows keep their own timings and load and say
`reused_from` (the date they finished), and the report marks them.

Per point (results.json, one row each):
    throughput   means over the logged intervals *after the first* (the first includes start-up/warm-up):
                 tokens/s (global), tokens/s per rank, step time, TFLOPs/GPU in both FLOP conventions
                 (recompute = the paper's, Narayanan eq. 3 with 4 forward passes; no_recompute = 3), MFU
                 (None where the device's peak is unknown, e.g. CPU), peak memory (max over ranks).
    accounting   TFLOPs/update and parameters from model/accounting.py on the run's resolved config.
    scaling      within each (size, arch, ZeRO, TP) group, relative to its smallest world size N0
                 (weak scaling: every rank keeps its micro-batch, so ideal tokens/s grows linearly):
                     scaling_efficiency = (tok/s(N) / N) / (tok/s(N0) / N0)
                     overhead_share     = 1 - step_time(N0) / step_time(N)
                 overhead_share is the share of the N-rank step spent beyond the N0-rank step: communication
                 *plus* contention for cores. `core_efficiency` divides by min(N, cores) instead of N, i.e.
                 the speed-up the machine could give; with more ranks than cores it is the fairer figure.
    comm_share   measured: host time inside collectives per update (the trainer's `comm/<group>/<op>/seconds`,
                 rank 0, parallel/comm_stats.py) / step time, mean over the warm intervals; with gloo the calls
                 block, so this is the time in communication (on NCCL it would be launch time only).
    comm_bytes   measured bytes per update handed to each collective, per group (`comm/<group>/<op>/bytes`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import StrictBool, StrictInt
from pydantic.dataclasses import dataclass as pydantic_dataclass

from benchmarks.machine import OtherLoad, machine_info
from data.catalog import DataError, load_catalog
from data.cli import usage_error
from data.config import TOKENIZERS
from data.readers import InputFileError, read_yaml
from launcher.typed import ConfigError, build_lenient, to_dict
from model.config import CONFIG

ROOT = Path(__file__).resolve().parents[1]
ARCHS: tuple[str, ...] = ("dense", "demix", "gshard", "cse")
DEFAULT_MIXTURE: dict[str, str] = {
    "dense": "natural",
    "demix": "by_domain",
    "gshard": "natural",
    "cse": "natural",
}
MEAN_KEYS: tuple[str, ...] = (
    "tokens_per_s",
    "step_time_s",
    "tflops_per_gpu_recompute",
    "tflops_per_gpu_no_recompute",
    "tflops_per_gpu",
    "mfu",
    "hfu",
    "aux_loss",
)


# --------------------------------------------------------------------------------------------------
# The typed sweep configuration
# --------------------------------------------------------------------------------------------------


@pydantic_dataclass(frozen=True, config=CONFIG)
class SizeSpec:
    """One model size: a preset from configs/model/ and/or `model.*` overrides (e.g. {n_layers: 2})."""

    name: str
    preset: str | None = None
    model: dict[str, Any] = field(default_factory=dict)


@pydantic_dataclass(frozen=True, config=CONFIG)
class LaunchSpec:
    """How points are started. Without a hostfile every point is N local processes; with one, a world size
    of W runs on ceil(W / gpus_per_node) nodes with min(W, gpus_per_node) processes each."""

    hostfile: str | None = None
    gpus_per_node: StrictInt = 8
    timeout_s: StrictInt = 900  # per point; the point is recorded as failed when it runs longer


@pydantic_dataclass(frozen=True, config=CONFIG)
class SweepConfig:
    """A grid of training runs. Empty `zero_stages` / `tensor_parallel` keep the base config's value
    (and leave them out of the point ids)."""

    name: str
    base_config: str  # a run YAML (configs/...): data, train, logging defaults for every point
    sizes: list[SizeSpec]
    archs: list[str] = field(default_factory=lambda: ["dense", "demix", "gshard"])
    world_sizes: list[StrictInt] = field(default_factory=lambda: [1])
    zero_stages: list[StrictInt] = field(default_factory=list)
    tensor_parallel: list[StrictInt] = field(default_factory=list)
    steps: StrictInt = 10
    log_interval: StrictInt = 1
    mixture: dict[str, str] = field(default_factory=dict)  # per arch; missing archs use DEFAULT_MIXTURE
    set: list[str] = field(default_factory=list)  # extra KEY=VALUE overrides for every point
    launch: LaunchSpec = field(default_factory=LaunchSpec)
    cluster: str | None = None  # a cost-model cluster preset: the report adds predicted TFLOPs/GPU
    keep_checkpoints: StrictBool = (
        False  # checkpoints and exports are deleted after a point (benchmarks need neither)
    )

    def mixture_for(self, arch: str) -> str:
        return self.mixture.get(arch, DEFAULT_MIXTURE.get(arch, "natural"))

    def problems(self) -> list[str]:
        """Value checks of the sweep itself (every problem; the launcher checks each point's layout)."""
        from data.config import MIXTURES
        from launcher.config import model_presets

        out = []
        if not (ROOT / self.base_config).is_file() and not Path(self.base_config).is_file():
            out.append(f"base_config={self.base_config!r}: no such file")
        if not self.sizes:
            out.append("sizes: give at least one model size")
        sizes = [s for s in self.sizes if s is not None]
        names = [s.name for s in sizes]
        if len(set(names)) != len(names):
            out.append(f"sizes: names must be unique, got {names}")
        for i, s in enumerate(sizes):
            if not s.name or not all(c.isalnum() or c in "._" for c in s.name):
                out.append(
                    f"sizes[{i}].name={s.name!r}: use letters, digits, '.' and '_' (it names run directories)"
                )
            if s.preset is not None and s.preset not in model_presets():
                out.append(
                    f"sizes[{i}].preset={s.preset!r}: no such preset; shipped: {', '.join(model_presets())}"
                )
        for a in self.archs:
            if a not in ARCHS:
                out.append(f"archs: {a!r} is not an architecture; choose from {', '.join(ARCHS)}")
        if not self.archs or not self.world_sizes:
            out.append("archs and world_sizes must not be empty")
        for name, values, ok in (
            ("world_sizes", self.world_sizes, lambda v: v >= 1),
            ("zero_stages", self.zero_stages, lambda v: v in (0, 1, 2)),
            ("tensor_parallel", self.tensor_parallel, lambda v: v >= 1),
        ):
            bad = [v for v in values if not ok(v)]
            if bad:
                out.append(f"{name}={values}: invalid value(s) {bad}")
            if len(set(values)) != len(values):
                out.append(f"{name}={values}: duplicates")
        if self.steps < 2 or self.log_interval < 1 or self.steps // max(1, self.log_interval) < 2:
            out.append(
                f"steps={self.steps}, log_interval={self.log_interval}: need >= 2 logged intervals "
                "(the first is warm-up and left out of the means)"
            )
        for arch, mix in self.mixture.items():
            if arch not in ARCHS or mix not in MIXTURES:
                out.append(
                    f"mixture.{arch}={mix!r}: keys are architectures, values one of {', '.join(MIXTURES)}"
                )
        out += [f"set: {s!r} is not KEY=VALUE" for s in self.set if "=" not in s]
        if self.launch.gpus_per_node < 1 or self.launch.timeout_s < 1:
            out.append("launch.gpus_per_node and launch.timeout_s must be >= 1")
        if self.cluster is not None:
            from benchmarks.costmodel.cluster import cluster_presets

            if self.cluster not in cluster_presets():
                out.append(
                    f"cluster={self.cluster!r}: no such cluster preset; shipped: {', '.join(cluster_presets())}"
                )
        return out


def load_sweep(path: str | Path) -> SweepConfig:
    """Parse and validate a sweep YAML; one ConfigError lists every unknown key, wrong type and bad value,
    and every (size, arch) whose run config would not load."""
    path = Path(path)
    try:
        raw = read_yaml(path) if path.is_file() else None
    except InputFileError as e:
        raise ConfigError([str(e)], str(path)) from None
    if raw is None:
        raise ConfigError([f"{path}: no such file or empty"], str(path))
    return sweep_from_dict(raw, str(path))


def sweep_from_dict(raw: Any, source: str = "sweep") -> SweepConfig:
    cfg, problems = build_lenient(SweepConfig, raw)
    if cfg is not None:
        problems += cfg.problems()  # broken fields fell back to defaults: check the rest too
    if cfg is not None and not problems:
        problems = run_config_problems(cfg)
    if problems or cfg is None:
        raise ConfigError(problems, source)
    return cfg


def run_config_problems(cfg: SweepConfig) -> list[str]:
    """Load each (size, arch) run config (no data, no layout: those are per point) to catch typos early."""
    from launcher.config import load_run_config

    out: list[str] = []
    for size in cfg.sizes:
        for arch in cfg.archs:
            try:
                load_run_config(
                    base_config_path(cfg), point_overrides(cfg, Point(size.name, arch, 1, None, None))
                )
            except ConfigError as e:
                out += [f"size {size.name}: {p}" for p in e.problems if f"size {size.name}: {p}" not in out]
    return out


# --------------------------------------------------------------------------------------------------
# Points
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    size: str
    arch: str
    world_size: int
    zero_stage: int | None
    tensor_parallel: int | None

    @property
    def id(self) -> str:
        pid = f"{self.size}-{self.arch}-w{self.world_size}"
        if self.zero_stage is not None:
            pid += f"-z{self.zero_stage}"
        if self.tensor_parallel is not None:
            pid += f"-tp{self.tensor_parallel}"
        return pid


def points(cfg: SweepConfig) -> list[Point]:
    """The grid in report order: size, arch, ZeRO, TP, world size."""
    return [
        Point(s.name, a, w, z, t)
        for s in cfg.sizes
        for a in cfg.archs
        for z in (cfg.zero_stages or [None])
        for t in (cfg.tensor_parallel or [None])
        for w in cfg.world_sizes
    ]


def base_config_path(cfg: SweepConfig) -> str:
    return str(ROOT / cfg.base_config) if (ROOT / cfg.base_config).is_file() else cfg.base_config


def _flatten(prefix: str, value: Any) -> list[str]:
    if isinstance(value, dict):
        return [o for k, v in value.items() for o in _flatten(f"{prefix}.{k}", v)]
    return [f"{prefix}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"]


def point_overrides(cfg: SweepConfig, point: Point) -> list[str]:
    """The `--set` overrides of one point: size, arch (+ its data mixture), layout, steps, quiet logging."""
    size = next(s for s in cfg.sizes if s.name == point.size)
    out = [f"model.preset={size.preset}"] if size.preset else []
    out += _flatten("model", size.model) if size.model else []
    out += [f"model.ffn.kind={point.arch}", f"data.mixture={cfg.mixture_for(point.arch)}"]
    if point.zero_stage is not None:
        out.append(f"parallel.zero_stage={point.zero_stage}")
    if point.tensor_parallel is not None:
        out.append(f"parallel.tensor_parallel={point.tensor_parallel}")
    out += [
        f"train.steps={cfg.steps}",
        f"logging.log_interval={cfg.log_interval}",
        "logging.progress_bar=false",
    ]
    return out + list(cfg.set)


def launch_command(
    cfg: SweepConfig, point: Point, run_dir: Path, dry_run: bool = False, master_port: int | None = None
) -> list[str]:
    """The `launcher.launch` command line of one point; `master_port`: its rendezvous port (None: the launcher's)."""
    cmd = [
        sys.executable,
        "-m",
        "launcher.launch",
        "--config",
        cfg.base_config,
        "--run-dir",
        str(run_dir),
        "--resume",
        "never",
    ]
    if master_port is not None:
        cmd += ["--master-port", str(master_port)]
    if cfg.launch.hostfile:
        per_node = min(point.world_size, cfg.launch.gpus_per_node)
        nodes = -(-point.world_size // cfg.launch.gpus_per_node)
        cmd += ["--hostfile", cfg.launch.hostfile, "--num-nodes", str(nodes), "--nproc", str(per_node)]
    else:
        cmd += ["--nproc", str(point.world_size)]
    for o in point_overrides(cfg, point):
        cmd += ["--set", o]
    return cmd + (["--dry-run"] if dry_run else [])


def resolve_tokenizer(path: str | Path, tokenizer: str | None = None) -> str | None:
    """`tokenizer`, or the only tokenizer with a token manifest under `path` (None when there is none). DataError
    when several are there and none was chosen."""
    if tokenizer is not None:
        return tokenizer
    found = [t for t in TOKENIZERS if (Path(path) / t / "manifest.json").is_file()]
    if len(found) > 1:
        raise DataError(
            f"{path} holds tokens of several tokenizers ({', '.join(found)}): choose one with --tokenizer"
        )
    return found[0] if found else None


def with_data(cfg: SweepConfig, path: str | Path, tokenizer: str | None = None) -> SweepConfig:
    """`cfg` with every point training on the prepared corpus at `path` (`<path>/<tokenizer>/manifest.json`, as
    data/prepare.py writes it): `data.path`, `data.tokenizer` and `model.vocab_size` (the tokenizer's vocabulary
    plus one domain token per training domain, as the demo configs count it) are added last to the sweep's `set`.
    Checked first with data/catalog.py's loader (DataError, its message) against the base config's data.domains;
    `tokenizer` None: the only one prepared there, else the base config's."""
    from launcher.config import load_run_config

    path = Path(path).resolve()
    base = load_run_config(base_config_path(cfg), point_overrides(cfg, points(cfg)[0]), check=False)
    tokenizer = resolve_tokenizer(path, tokenizer) or base.data.tokenizer
    catalog = load_catalog(path, tokenizer, base.data.domains)
    data = [
        f"data.path={json.dumps(str(path))}",
        f"data.tokenizer={tokenizer}",
        f"model.vocab_size={catalog.total_vocab_size(with_domain_tokens=True)}",
    ]
    return dataclasses.replace(cfg, set=[*cfg.set, *data])


# --------------------------------------------------------------------------------------------------
# Rendezvous ports
# --------------------------------------------------------------------------------------------------


def reserve_port() -> socket.socket:
    """A socket bound, not listening, to a TCP port the kernel picked as free on every address of this host (no
    listener, no connection, nothing in TIME_WAIT); close it once the launch that uses the port has ended.

    While it is open, no other process gets the port: an explicit bind without SO_REUSEADDR fails (EADDRINUSE),
    the kernel hands it to no other bind(port 0) or outgoing connection. It is bound with SO_REUSEADDR, so a
    rendezvous store that binds with SO_REUSEADDR too (torch's TCPStore, both backends) can still listen on it:
    the reservation is for the launch's rank 0, not against it. Dual-stack (IPv4 and IPv6) where the host has it."""
    family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(("::" if family == socket.AF_INET6 else "", 0))
    except OSError:
        sock.close()
        raise
    return sock


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """A port reserved (`reserve_port`) for the `with` block; released when it ends."""
    sock = reserve_port()
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def point_port(cfg: SweepConfig) -> contextlib.AbstractContextManager[int | None]:
    """The rendezvous port of a point for the `with` block around its launch: reserved here for a local point;
    None (the launcher chooses) for a multi-node one, whose rendezvous is on the hostfile's first host."""
    return contextlib.nullcontext(None) if cfg.launch.hostfile else reserved_port()


# --------------------------------------------------------------------------------------------------
# Running one point and summarising it
# --------------------------------------------------------------------------------------------------


def run_point(cfg: SweepConfig, point: Point, sweep_dir: Path, reuse: bool = False) -> dict[str, Any]:
    """Run (time) one point and return its results row; never raises for the point's own failures. `reuse`: return
    the row of an earlier run of the same launch that finished ok instead, marked `reused_from` (`reusable_row`)."""
    run_dir = sweep_dir / point.id
    summary = run_dir / "point.json"
    row = reusable_row(cfg, point, run_dir) if reuse else None
    if row is not None:
        print(f"[sweep] {point.id}: reused from {row['reused_from']} (--reuse; not re-timed)", flush=True)
        return row
    if run_dir.exists():  # metrics.jsonl is appended to: start clean
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    print(f"[sweep] {point.id}: running on {point.world_size} rank(s) ...", flush=True)
    load0 = os.getloadavg()[0]
    with point_port(cfg) as port, OtherLoad() as others:  # the port stays reserved until the launch has ended
        cmd = launch_command(cfg, point, run_dir, master_port=port)
        rc, wall, timed_out = _run_logged(cmd, run_dir / "sweep.log", cfg.launch.timeout_s)
    row = summarise_point(cfg, point, run_dir, rc, wall, timed_out)
    row.update(
        command=shlex.join(cmd),
        finished=time.strftime("%Y-%m-%d %H:%M:%S"),
        load={
            "loadavg_1m_start": round(load0, 2),
            "loadavg_1m_end": round(os.getloadavg()[0], 2),
            "others_cores": others.result()["others_cores"],
        },
    )
    if not cfg.keep_checkpoints:
        for sub in ("checkpoints", "model", "wandb"):
            shutil.rmtree(run_dir / sub, ignore_errors=True)
    summary.write_text(json.dumps(row, indent=1) + "\n")
    if row["status"] == "ok":
        msg = f"{row['tokens_per_s']:,.0f} tok/s, {row['step_time_s']:.3f} s/step"
    else:
        msg = "FAILED: " + " | ".join((row["error"] or "").strip().splitlines()[:3])[:300]
    print(f"[sweep] {point.id}: {msg} ({wall:.0f} s)", flush=True)
    return row


def _launch_key(command: Sequence[str]) -> list[str]:
    """A launch command without what differs between two runs of the same point: the interpreter, the run
    directory (where point.json lies) and the rendezvous port."""
    out, skip = [], False
    for i, arg in enumerate(command):
        if skip or i == 0:
            skip = False
            continue
        if arg in ("--master-port", "--port", "--run-dir"):
            skip = True
            continue
        out.append(arg)
    return out


def reusable_row(cfg: SweepConfig, point: Point, run_dir: Path) -> dict[str, Any] | None:
    """The row of `run_dir/point.json` when that point finished ok with the launch this sweep would make now (same
    config, overrides and ranks), marked `reused_from` (when it finished); else None (run it)."""
    summary = run_dir / "point.json"
    try:
        row = json.loads(summary.read_text()) if summary.is_file() else None
    except (OSError, ValueError):
        return None
    if not isinstance(row, dict) or row.get("status") != "ok" or not isinstance(row.get("command"), str):
        return None
    if _launch_key(shlex.split(row["command"])) != _launch_key(launch_command(cfg, point, run_dir)):
        print(
            f"[sweep] {point.id}: the earlier run was another launch (config, data or overrides changed): "
            "running it",
            flush=True,
        )
        return None
    finished = row.get("finished") or time.strftime(
        "%Y-%m-%d %H:%M:%S", time.localtime(summary.stat().st_mtime)
    )
    return {**row, "reused_from": finished}


def _run_logged(cmd: list[str], log: Path, timeout_s: int) -> tuple[int, float, bool]:
    """Run `cmd` in its own process group with output to `log`; on timeout end that group (our processes only)."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc, timed_out = 124, True
    return rc, time.perf_counter() - t0, timed_out


def error_tail(log: Path, lines: int = 15) -> str:
    """The launcher's `error:` block if it printed one, else the last lines of the log."""
    text = log.read_text(errors="replace").splitlines() if log.is_file() else []
    for i in range(len(text) - 1, -1, -1):
        if text[i].startswith("error:"):
            block = [text[i]] + [t for t in text[i + 1 :] if t.startswith("  ")]
            return "\n".join(block[:40])
    return "\n".join([t for t in text if t.strip()][-lines:])


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarise_point(
    cfg: SweepConfig, point: Point, run_dir: Path, rc: int, wall: float, timed_out: bool
) -> dict[str, Any]:
    """One results row from a point's run directory (config.yaml, metrics.jsonl, sweep.log)."""
    from launcher.metrics import read_metrics

    row: dict[str, Any] = {
        "id": point.id,
        "size": point.size,
        "arch": point.arch,
        "world_size": point.world_size,
        "zero_stage": point.zero_stage,
        "tensor_parallel": point.tensor_parallel,
        "wall_s": wall,
        "status": "failed",
        "error": None,
        "comm_share": None,
    }
    row.update(accounting(run_dir / "config.yaml", point.world_size))
    metrics = run_dir / "metrics.jsonl"
    recs = read_metrics(metrics) if metrics.is_file() else []
    train = [r for r in recs if r.get("kind") == "train"]
    if rc != 0 or not train:
        why = f"timed out after {cfg.launch.timeout_s} s\n" if timed_out else f"exit code {rc}\n"
        row["error"] = why + error_tail(run_dir / "sweep.log")
        return row
    start = next((r for r in recs if r.get("kind") == "start"), {})
    warm = train[1:] or train  # the first interval includes start-up
    row.update(
        status="ok",
        device=start.get("device"),
        intervals=len(warm),
        steps=train[-1]["step"],
        final_loss=train[-1].get("loss"),
    )
    for key in MEAN_KEYS:
        row[key] = _mean([r.get(key) for r in warm])
    row["tokens_per_s_per_rank"] = row["tokens_per_s"] / point.world_size if row["tokens_per_s"] else None
    row["peak_mem_gb"] = max((r.get("peak_mem_gb") or 0.0) for r in train)
    dropped = [r.get(k) for r in warm for k in r if k.startswith("dropped")]
    row["dropped_fraction"] = _mean([d for d in dropped if isinstance(d, (int, float))])
    shares = [
        sum(v for k, v in r.items() if k.startswith("comm/") and k.endswith("/seconds")) / r["step_time_s"]
        for r in warm
        if r.get("step_time_s")
    ]
    row["comm_share"] = _mean(shares) if any(k.startswith("comm/") for r in warm for k in r) else None
    row["comm_bytes"] = {
        k[len("comm/") : -len("/bytes")]: v
        for k, v in warm[-1].items()
        if k.startswith("comm/") and k.endswith("/bytes")
    }
    return row


def accounting(config_yaml: Path, world_size: int) -> dict[str, Any]:
    """Resolved model, batch and FLOPs/parameters of a point from the config the launcher wrote (empty when the
    launcher rejected the point before writing it)."""
    from launcher.config import RunConfig
    from launcher.typed import from_dict
    from model.accounting import flops_per_update, param_counts

    if not config_yaml.is_file():
        return {}
    cfg = from_dict(RunConfig, read_yaml(config_yaml), str(config_yaml))
    dp = max(1, world_size // cfg.parallel.tensor_parallel)
    batch = cfg.train.micro_batch * cfg.train.grad_accum * dp
    flops = flops_per_update(cfg.model, batch, vocab_size=cfg.model.vocab_size)
    params = param_counts(cfg.model)
    return {
        "model": to_dict(cfg.model),
        "micro_batch": cfg.train.micro_batch,
        "grad_accum": cfg.train.grad_accum,
        "data_parallel": dp,
        "global_batch": batch,
        "seq_len": cfg.model.seq_len,
        "precision": cfg.train.precision,
        "activation_checkpointing": cfg.train.activation_checkpointing,
        "zero_stage_run": cfg.parallel.zero_stage,
        "tensor_parallel_run": cfg.parallel.tensor_parallel,
        "num_experts": params.num_experts,
        "total_params": params.total,
        "active_params": params.active,
        "tflops_per_update": flops.recompute / 1e12,
        "tflops_per_update_no_recompute": flops.no_recompute / 1e12,
    }


def add_scaling(rows: list[dict[str, Any]], cores: int) -> None:
    """Scaling efficiency, core-normalised efficiency and overhead share against each group's smallest world
    size (see the module docstring); in place, None where the group has no successful base point."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        r.update(scaling_base_world=None, scaling_efficiency=None, core_efficiency=None, overhead_share=None)
        if r["status"] == "ok":
            groups.setdefault((r["size"], r["arch"], r["zero_stage"], r["tensor_parallel"]), []).append(r)
    for group in groups.values():
        base = min(group, key=lambda r: r["world_size"])
        n0, tok0, t0 = base["world_size"], base["tokens_per_s"], base["step_time_s"]
        for r in group:
            n = r["world_size"]
            r["scaling_base_world"] = n0
            r["scaling_efficiency"] = (r["tokens_per_s"] / n) / (tok0 / n0)
            r["core_efficiency"] = r["tokens_per_s"] / (tok0 * min(n, cores) / min(n0, cores))
            r["overhead_share"] = max(0.0, 1.0 - t0 / r["step_time_s"])


# --------------------------------------------------------------------------------------------------
# The sweep
# --------------------------------------------------------------------------------------------------


def run_sweep(
    cfg: SweepConfig,
    sweep_dir: Path,
    *,
    reuse: bool = False,
    only: Sequence[str] = (),
    command: str = "",
    config_path: str = "",
) -> dict[str, Any]:
    """Run and time every point (those matching `only`, if given), write and return `<sweep_dir>/results.json`.
    `reuse`: keep points that finished ok earlier with the same launch (`run_point`), listed under "reused"."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    t0, started = time.perf_counter(), time.strftime("%Y-%m-%d %H:%M:%S")
    machine = machine_info()
    rows = []
    for p in points(cfg):
        if only and not any(s in p.id for s in only):
            continue
        rows.append(run_point(cfg, p, sweep_dir, reuse))
    add_scaling(rows, machine["cores"] or 1)
    machine["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    results = {
        "sweep": to_dict(cfg),
        "config_path": config_path,
        "command": command,
        "started": started,
        "wall_s": time.perf_counter() - t0,
        "machine": machine,
        "comm_share_note": "comm_share = measured time inside collectives (rank 0, gloo: blocking) / step "
        "time; overhead_share = 1 - step_time(N0)/step_time(N) is communication + contention.",
        "reused": [{"id": r["id"], "reused_from": r["reused_from"]} for r in rows if r.get("reused_from")],
        "points": rows,
    }
    (sweep_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    n_ok = sum(r["status"] == "ok" for r in rows)
    reused = (
        f" ({len(results['reused'])} reused from earlier runs, not re-timed)" if results["reused"] else ""
    )
    print(
        f"[sweep] {n_ok}/{len(rows)} points ok{reused} in {results['wall_s']:.0f} s; "
        f"wrote {sweep_dir / 'results.json'}",
        flush=True,
    )
    return results


def dry_run(cfg: SweepConfig, sweep_dir: Path) -> int:
    """Validate every point through `launcher.launch --dry-run` (config, data, layout); start nothing."""
    bad = 0
    for p in points(cfg):
        proc = subprocess.run(
            launch_command(cfg, p, sweep_dir / p.id, dry_run=True), cwd=ROOT, capture_output=True, text=True
        )
        bad += proc.returncode != 0
        print(
            f"[sweep] {p.id}: " + ("ok" if proc.returncode == 0 else proc.stderr.strip().splitlines()[-1]),
            flush=True,
        )
    return 1 if bad else 0


def add_reuse_args(p: argparse.ArgumentParser) -> None:
    """--reuse, and --force (the default now, kept so that old command lines still work)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--reuse",
        action="store_true",
        help="keep points that finished ok earlier with the same launch (marked 'reused from <date>' in "
        "the results and the report) instead of re-timing them",
    )
    g.add_argument("--force", action="store_true", help="re-time every point (the default)")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="sweep YAML (configs/sweeps/...)")
    p.add_argument(
        "--sweep-dir", help="where point run directories and results.json go (default runs/sweeps/<name>)"
    )
    add_reuse_args(p)
    p.add_argument(
        "--only", nargs="+", default=[], metavar="SUBSTRING", help="run only points whose id contains one"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="validate every point with the launcher; train nothing"
    )
    args = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        cfg = load_sweep(args.config)
    except ConfigError as e:
        return usage_error(e)
    sweep_dir = Path(args.sweep_dir or ROOT / "runs" / "sweeps" / cfg.name)
    if args.dry_run:
        return dry_run(cfg, sweep_dir)
    results = run_sweep(
        cfg,
        sweep_dir,
        reuse=args.reuse,
        only=args.only,
        command="python -m benchmarks.sweep " + shlex.join(argv),
        config_path=args.config,
    )
    return 0 if any(r["status"] == "ok" for r in results["points"]) else 1


if __name__ == "__main__":
    sys.exit(main())
