#!/usr/bin/env bash
# Every check that needs a GPU, in one command: the `gpu`-marked tests (NCCL, CUDA RNG on resume, fp16 loss scaling,
# bf16 support, ...) and the GPU throughput sweep, with the results recorded for the repo:
#     bash scripts/gpu_checks.sh        # writes benchmarks/results/gpu_checks.md and benchmarks/results/gpu_throughput.md
#
# The venv: an existing .venv is used as it is. Without one, on a node with wheelhouse/ (`make wheels PY=...` on a
# connected machine) it is built offline on the node's own torch (`make venv OFFLINE=1 SYSTEM_TORCH=1`), else from the
# package index (`make venv`). Fails (exit 2, saying why, writing no result) when no CUDA device is visible: a CPU
# machine would skip every GPU test and record nothing proven. GPU_CHECKS_BENCH=0 skips the sweep; extra arguments
# go to `python -m benchmarks.gpu_throughput`.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${GPU_CHECKS_OUT:-benchmarks/results/gpu_checks.md}
py=.venv/bin/python
if [ ! -x "$py" ]; then
  if [ -d wheelhouse/core ]; then
    make venv OFFLINE=1 SYSTEM_TORCH=1 >&2 || { echo "gpu_checks: the offline venv could not be built (above)" >&2; exit 2; }
  else
    make venv >&2 || { echo "gpu_checks: make venv failed; on a node without network use 'make wheels PY=<its python>' elsewhere, copy wheelhouse/ here" >&2; exit 2; }
  fi
fi
if ! cuda=$("$py" -c "import torch; n = torch.cuda.device_count() if torch.cuda.is_available() else 0; print(n); raise SystemExit(0 if n else 1)" 2>&1); then
  echo "gpu_checks: no CUDA device is visible (torch $("$py" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -1); CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}; $(echo "$cuda" | tail -1)): nothing to check, nothing recorded" >&2
  exit 2
fi
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}
log=$(mktemp)
start=$(date -u +%FT%TZ)
"$py" -m pytest -m gpu -v -rs -p no:cacheprovider tests/ 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
passed=$(grep -Eo "[0-9]+ passed" "$log" | tail -1 | cut -d' ' -f1)
if [ "$rc" = 0 ] && [ -z "$passed" ]; then
  echo "gpu_checks: no GPU test passed (all skipped?): counted as a failure" >&2
  rc=1
fi
{
  echo "# GPU checks"
  echo
  echo "Command: \`bash scripts/gpu_checks.sh\` (= \`.venv/bin/python -m pytest -m gpu -v -rs tests/\`), started $start,"
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' with local changes'), exit code $rc."
  echo
  echo '```'
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv 2>&1 || echo "nvidia-smi not found"
  "$py" -m benchmarks.machine --versions 2>&1
  echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo '```'
  echo
  echo '```'
  grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" "$log" | sed -e 's/\x1b\[[0-9;]*m//g'
  echo '```'
  gpus=$(echo "$cuda" | tail -1)
  if [ "$gpus" -lt 2 ]; then
    echo
    echo "Not checked with $gpus GPU (NCCL runs one rank per device; tests/gpu/test_gpu.py ONE_GPU_CANNOT_CHECK):"
    "$py" -c "from tests.gpu.test_gpu import ONE_GPU_CANNOT_CHECK as c; print(chr(10).join('- ' + x for x in c))" 2>&1
  fi
} > "$out"
echo "wrote $out"
rm -f "$log"
if [ "${GPU_CHECKS_BENCH:-1}" = 1 ]; then
  "$py" -m benchmarks.gpu_throughput "$@" || rc=${rc/#0/1}
fi
exit "$rc"
