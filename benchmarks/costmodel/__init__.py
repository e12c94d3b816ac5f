"""A cluster cost model for Dense, DEMix and GShard training, checked against DEMix Tables 2 and 9.

    python -m benchmarks.costmodel --paper [--cluster v100-dgx1 | --cluster-file my.yaml]
    python -m benchmarks.costmodel --preset gpt3-xl --arch demix --gpus 128 --cluster a100-dgx

t_step = t_compute + t_allreduce_exposed + t_alltoall + t_gshard, with t_compute = F / (n · P · e(h)) and e(h)
fitted on the paper's four Dense rows only. One concern per module: options (CostOptions, Efficiency), cluster
(ClusterSpec, presets), collectives (alpha-beta), layout (bytes per GPU and collective), gshard (t_gshard terms),
memory, predict, fit, paper (Tables 2/9 comparisons), report (tables, the --paper Markdown), cli. The formulas,
their sources and the known omissions: docs/costmodel.md.
"""

from benchmarks.costmodel.cli import build_parser, main
from benchmarks.costmodel.cluster import (
    CLUSTER_DIR,
    HBM_GBYTES_PER_S,
    ROOT,
    ClusterSpec,
    cluster_from_dict,
    cluster_presets,
    load_cluster,
)
from benchmarks.costmodel.collectives import (
    allreduce_internode_bytes,
    allreduce_seconds,
    alltoall_internode_bytes,
    alltoall_seconds,
    ring_allreduce_seconds,
)
from benchmarks.costmodel.fit import PaperPoint, cluster_efficiency, fit_efficiency, paper_points
from benchmarks.costmodel.gshard import (
    GSHARD_TERM_KEYS,
    OPTIMIZER_STEP_BYTES,
    SAVED_SEC_BYTES,
    SE_BYTES_BACKWARD,
    SE_BYTES_PER_GATE_CALL,
    SEC_BYTES_BACKWARD,
    SEC_BYTES_PER_FORWARD,
    SEC_BYTES_PER_GATE_CALL,
    STATE_BYTES,
    GShardTerms,
    dispatch_combine_flops,
    gating_bytes,
    gshard_capacity,
    gshard_terms,
)
from benchmarks.costmodel.layout import (
    NORM_BYTES,
    allreduce_plan,
    alltoall_volume,
    comm_bytes_per_update,
    demix_groups,
    params_per_gpu,
    plan_from_measured,
)
from benchmarks.costmodel.memory import memory_bytes
from benchmarks.costmodel.options import (
    ARCHS,
    DTYPE_BYTES,
    EFFICIENCY_FORMS,
    GRAD_REDUCE,
    GSHARD_OVERHEADS,
    ON_OOM,
    OPTIMIZERS,
    RECOMPUTE,
    CostOptions,
    Efficiency,
)
from benchmarks.costmodel.paper import (
    REFERENCE_HOURS,
    REFERENCE_MAX_UPDATES,
    before_options,
    gshard_comparison,
    gshard_what_ifs,
    paper_report,
    sensitivity,
)
from benchmarks.costmodel.predict import (
    Prediction,
    exposed_allreduce_seconds,
    predict,
    trainer_bucket_bytes,
    trainer_cost_options,
)
from benchmarks.costmodel.report import REPORT_NOTES, RESULTS_DIR, format_table, write_paper_report

__all__ = [
    "build_parser",
    "main",
    "CLUSTER_DIR",
    "HBM_GBYTES_PER_S",
    "ROOT",
    "ClusterSpec",
    "cluster_from_dict",
    "cluster_presets",
    "load_cluster",
    "allreduce_internode_bytes",
    "allreduce_seconds",
    "alltoall_internode_bytes",
    "alltoall_seconds",
    "ring_allreduce_seconds",
    "PaperPoint",
    "cluster_efficiency",
    "fit_efficiency",
    "paper_points",
    "GSHARD_TERM_KEYS",
    "OPTIMIZER_STEP_BYTES",
    "SAVED_SEC_BYTES",
    "SE_BYTES_BACKWARD",
    "SE_BYTES_PER_GATE_CALL",
    "SEC_BYTES_BACKWARD",
    "SEC_BYTES_PER_FORWARD",
    "SEC_BYTES_PER_GATE_CALL",
    "STATE_BYTES",
    "GShardTerms",
    "dispatch_combine_flops",
    "gating_bytes",
    "gshard_capacity",
    "gshard_terms",
    "NORM_BYTES",
    "allreduce_plan",
    "alltoall_volume",
    "comm_bytes_per_update",
    "demix_groups",
    "params_per_gpu",
    "plan_from_measured",
    "memory_bytes",
    "ARCHS",
    "DTYPE_BYTES",
    "EFFICIENCY_FORMS",
    "GRAD_REDUCE",
    "GSHARD_OVERHEADS",
    "ON_OOM",
    "OPTIMIZERS",
    "RECOMPUTE",
    "CostOptions",
    "Efficiency",
    "REFERENCE_HOURS",
    "REFERENCE_MAX_UPDATES",
    "before_options",
    "gshard_comparison",
    "gshard_what_ifs",
    "paper_report",
    "sensitivity",
    "Prediction",
    "exposed_allreduce_seconds",
    "predict",
    "trainer_bucket_bytes",
    "trainer_cost_options",
    "REPORT_NOTES",
    "RESULTS_DIR",
    "format_table",
    "write_paper_report",
]
