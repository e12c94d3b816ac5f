#!/usr/bin/env bash
# One SLURM task per node: start this node's ranks with launcher.launch --no-ssh (see slurm_demix.sbatch).
# Reads SLURM's environment: SLURM_JOB_ID, SLURM_JOB_NODELIST (expanded with `scontrol show hostnames`),
# SLURM_NODEID; GPUS_PER_NODE (default 8), RUN_DIR, MASTER_PORT (default 29500 + SLURM_JOB_ID % 1000) and
# MASTER_ADDR (default: the first host of the allocation) may be set by the caller. Extra arguments go to
# launcher.launch (--config, --set ...).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${SLURM_JOB_ID:?not inside a SLURM job (SLURM_JOB_ID unset)}"
: "${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST unset}"
: "${SLURM_NODEID:?SLURM_NODEID unset}"
gpus=${GPUS_PER_NODE:-8}
run_dir=${RUN_DIR:-runs/slurm-$SLURM_JOB_ID}
mkdir -p "$run_dir"
# Every node writes the same hostfile (same allocation); node-local name, so no node reads a half-written one.
hostfile="$run_dir/hostfile.node$SLURM_NODEID"
scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/\$/ slots=$gpus/" > "$hostfile"
master_addr=${MASTER_ADDR:-$(head -n 1 "$hostfile" | cut -d' ' -f1)}
master_port=${MASTER_PORT:-$((29500 + SLURM_JOB_ID % 1000))}
exec .venv/bin/python -m launcher.launch --hostfile "$hostfile" --no-ssh --node-rank "$SLURM_NODEID" \
    --master-addr "$master_addr" --master-port "$master_port" --run-dir "$run_dir" "$@"
