"""The hardware of a cluster (`ClusterSpec`): one kind of node, repeated; the shipped presets in
configs/clusters/*.yaml and loading a cluster YAML. docs/costmodel.md."""

from __future__ import annotations

from pathlib import Path

from pydantic import StrictInt
from pydantic.dataclasses import dataclass as pydantic_dataclass

from data.readers import InputFileError, read_yaml
from launcher.typed import ConfigError, build_lenient
from model import accounting as acc
from model.config import CONFIG, Float

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_DIR = ROOT / "configs" / "clusters"


# HBM bandwidth per GPU, GB/s (vendor datasheets; the largest-memory variant where model/accounting's device
# table lists that memory). Used only by the memory-bound GShard terms; a cluster YAML may override it.
HBM_GBYTES_PER_S: dict[str, float] = {
    "v100-sxm2": 900.0,
    "v100-pcie": 900.0,
    "v100s": 1134.0,
    "a100": 2039.0,
    "h100-sxm": 3350.0,
    "h100-pcie": 2000.0,
    "h100-nvl": 3900.0,
    "h200": 4800.0,
    "l40s": 864.0,
    "l4": 300.0,
    "a10": 600.0,
    "rtx4090": 1008.0,
    "mi250x": 3277.0,
    "mi300x": 5300.0,
}


@pydantic_dataclass(frozen=True, config=CONFIG)
class ClusterSpec:
    """The hardware: one kind of node, repeated. Bandwidths are *one direction, per GPU* for NVLink
    (what a ring step can push: 600 GB/s "bidirectional" NVSwitch is 300 GB/s here) and *total per node*
    for the inter-node fabric (all NICs of a node together, in Gbit/s as NICs are sold)."""

    name: str
    device: str  # a key or name model.accounting knows ("v100-sxm2", "a100", "h100-sxm")
    gpus_per_node: StrictInt
    nvlink_gbytes_per_s: Float  # intra-node, per GPU, one direction, GB/s
    nvlink_latency_us: Float
    internode_gbits_per_s_per_node: Float  # e.g. 4 x 100 Gb/s EDR = 400
    internode_latency_us: Float
    precision: str = "fp16"
    peak_tflops: Float | None = None  # overrides the device table
    efficiency_max: Float | None = None  # compute efficiency e(h) for this device; None = V100 fit
    efficiency_h_half: Float | None = None
    memory_gbytes_per_s: Float | None = None  # HBM bandwidth per GPU; None = HBM_GBYTES_PER_S[device]
    gpu_memory_gib: Float | None = None  # memory per GPU; None = model/accounting's device table
    description: str = ""

    def problems(self) -> list[str]:
        out = []
        if self.gpus_per_node < 1:
            out.append(f"gpus_per_node={self.gpus_per_node}: must be >= 1")
        for name in ("nvlink_gbytes_per_s", "internode_gbits_per_s_per_node"):
            if getattr(self, name) <= 0:
                out.append(f"{name}={getattr(self, name)}: must be > 0")
        for name in ("nvlink_latency_us", "internode_latency_us"):
            if getattr(self, name) < 0:
                out.append(f"{name}={getattr(self, name)}: must be >= 0")
        try:
            acc.normalise_precision(self.precision)
        except ValueError as e:
            out.append(str(e))
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            out.append(f"peak_tflops={self.peak_tflops}: must be > 0")
        if self.peak_tflops is None and acc.match_device_name(self.device) is None:
            out.append(
                f"device={self.device!r}: unknown; set peak_tflops or use one of "
                f"{', '.join(d.key for d in acc.DEVICES)}"
            )
        elif self.peak_tflops is None and acc.peak_tflops(self.device, self.precision) is None:
            out.append(
                f"device={self.device!r} has no {self.precision} peak in model/accounting: set peak_tflops"
            )
        if (self.efficiency_max is None) != (self.efficiency_h_half is None):
            out.append("efficiency_max and efficiency_h_half: give both or neither")
        if self.efficiency_max is not None and not 0 < self.efficiency_max <= 1:
            out.append(f"efficiency_max={self.efficiency_max}: must be in (0, 1]")
        if self.efficiency_h_half is not None and self.efficiency_h_half < 0:
            out.append(f"efficiency_h_half={self.efficiency_h_half}: must be >= 0")
        for name in ("memory_gbytes_per_s", "gpu_memory_gib"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                out.append(f"{name}={getattr(self, name)}: must be > 0")
        return out

    @property
    def peak(self) -> float:
        """Dense peak TFLOP/s per GPU in the cluster's precision."""
        if self.peak_tflops is not None:
            return self.peak_tflops
        peak = acc.peak_tflops(self.device, self.precision)
        assert peak is not None, "validated in problems()"
        return peak

    @property
    def hbm_bytes_per_s(self) -> float | None:
        """GPU memory bandwidth, bytes/s; None for a device we know no figure for (memory-bound terms are
        then left out)."""
        if self.memory_gbytes_per_s is not None:
            return self.memory_gbytes_per_s * 1e9
        dev = acc.match_device_name(self.device)
        gbps = HBM_GBYTES_PER_S.get(dev.key) if dev is not None else None
        return None if gbps is None else gbps * 1e9

    @property
    def gpu_memory_bytes(self) -> float | None:
        """Memory per GPU, bytes; None when unknown (no fits/doesn't-fit verdict)."""
        if self.gpu_memory_gib is not None:
            return self.gpu_memory_gib * 2**30
        dev = acc.match_device_name(self.device)
        return None if dev is None or dev.memory_gb is None else dev.memory_gb * 2**30

    @property
    def nvlink_bytes_per_s(self) -> float:
        return self.nvlink_gbytes_per_s * 1e9

    @property
    def node_bytes_per_s(self) -> float:
        return self.internode_gbits_per_s_per_node * 1e9 / 8


def cluster_presets() -> list[str]:
    """Names of the shipped cluster presets (configs/clusters/*.yaml)."""
    return sorted(p.stem for p in CLUSTER_DIR.glob("*.yaml"))


def cluster_from_dict(data: object, source: str = "cluster") -> ClusterSpec:
    """Validate a parsed cluster YAML: unknown keys, wrong types and bad values in one ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError([f"expected a mapping at the top level, got {type(data).__name__}"], source)
    spec, problems = build_lenient(ClusterSpec, data)
    if spec is not None and not problems:
        problems = spec.problems()
    if problems or spec is None:
        raise ConfigError(problems or ["could not build the cluster"], source)
    return spec


def load_cluster(name_or_path: str | Path) -> ClusterSpec:
    """A preset by name ('v100-dgx1') or a YAML file by path."""
    path = Path(name_or_path)
    if not path.suffix and str(name_or_path) in cluster_presets():
        path = CLUSTER_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ConfigError(
            [f"no cluster file {str(path)!r}; presets: {', '.join(cluster_presets())}"], "cluster"
        )
    try:
        raw = read_yaml(path)
    except InputFileError as e:
        raise ConfigError([str(e)], str(path)) from None
    return cluster_from_dict(raw, str(path))
