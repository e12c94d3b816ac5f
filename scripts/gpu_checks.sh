#!/usr/bin/env bash
# Every check that needs a GPU (tests marked `gpu`: NCCL, CUDA RNG on resume, fp16 loss scaling, bf16 support),
# in one command, with the result recorded for the repo:
#     bash scripts/gpu_checks.sh            # writes benchmarks/results/gpu_checks.md
# Needs a CUDA machine with network access to PyPI for the first `make venv` (or an existing .venv).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${GPU_CHECKS_OUT:-benchmarks/results/gpu_checks.md}
make venv >/dev/null || exit 1
log=$(mktemp)
start=$(date -u +%FT%TZ)
.venv/bin/python -m pytest -m gpu -v -rs -p no:cacheprovider tests/ 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
{
  echo "# GPU checks"
  echo
  echo "Command: \`bash scripts/gpu_checks.sh\` (= \`.venv/bin/python -m pytest -m gpu -v -rs tests/\`), started $start,"
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), exit code $rc."
  echo
  echo '```'
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "nvidia-smi not found"
  .venv/bin/python -c "import torch, deepspeed; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'deepspeed', deepspeed.__version__, 'gpus', torch.cuda.device_count())"
  echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo '```'
  echo
  echo '```'
  grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" "$log" | sed -e 's/\x1b\[[0-9;]*m//g'
  echo '```'
} > "$out"
echo "wrote $out"
rm -f "$log"
exit "$rc"
