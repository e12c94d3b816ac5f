#!/usr/bin/env bash
# Every check that needs a GPU, in one call that fits a short loan of an offline node:
#     bash scripts/gpu_checks.sh --out DIR [--quick] [--budget-s S] [--wheels DIR] [--python PY] [--no-bench]
#                                [-- ARGS for python -m benchmarks.gpu_throughput]
# Carry the repository and gpu-wheels/ (`make gpu-wheels` on a machine with network: what a stock GPU image lacks,
# under 10 MiB). docs/gpu.md has the recipe. In order, each step writing into DIR (default runs/gpu_checks) at once,
# so a call cut short still brings back what it reached:
#   1. node.txt, node-freeze.txt: nvidia-smi, driver, CPU, memory, the Python and its `pip list` (before anything can
#      fail);
#   2. the interpreter: an existing .venv that imports torch and deepspeed, else the node's own Python (PY, default
#      python3) with gpu-wheels/ installed by `pip install --no-deps --no-index --target .gpu-site` (no venv, no
#      resolver, no network) and the repository on PYTHONPATH; imports.txt: every project module imported (exit 3
#      when one fails: the rest could not run);
#   3. no CUDA device: exit 2, no check result written (a CPU machine would skip every GPU test: nothing proven);
#   4. the `gpu`-marked tests (`gpu and quick` with --quick) in parallel (pytest-xdist where the node has it), each
#      under a time limit: pytest.log (streamed), pytest.xml, gpu_checks.md;
#   5. the throughput sweep (`--quick`: its quick cells), each cell's line written as it finishes, stopped at the
#      call's deadline: gpu_throughput.md, .json, .jsonl.
# The whole call stays within --budget-s (default 420 s; 180 s with --quick). Exit 0 when every check passed, 1 when
# one failed, 2 without CUDA, 3 when the setup failed (the facts of step 1 are written all the same). A copy without
# .git records GPU_CHECKS_COMMIT as its commit.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
out=runs/gpu_checks quick=0 budget= wheels=gpu-wheels py=${PYTHON:-python3} bench=1 sweep_args=()
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=$2; shift 2 ;;
    --quick) quick=1; shift ;;
    --budget-s) budget=$2; shift 2 ;;
    --wheels) wheels=$2; shift 2 ;;
    --python) py=$2; shift 2 ;;
    --no-bench) bench=0; shift ;;
    --) shift; sweep_args=("$@"); break ;;
    -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_checks: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -n "$budget" ] || budget=$([ "$quick" = 1 ] && echo 180 || echo 420)
case $budget in ''|*[!0-9]*) echo "gpu_checks: --budget-s $budget: expected whole seconds" >&2; exit 2 ;; esac
mkdir -p "$out" || { echo "gpu_checks: cannot create $out" >&2; exit 2; }
out=$(cd "$out" && pwd)
t0=$SECONDS
say() { echo "[gpu_checks +$((SECONDS - t0))s] $*" | tee -a "$out/progress.log" >&2; }
left() { echo $((budget - (SECONDS - t0))); }

# 1. What the node has, first.
{
  echo "date: $(date -u +%FT%TZ)"
  if [ -n "${GPU_CHECKS_COMMIT:-}" ]; then echo "commit: $GPU_CHECKS_COMMIT (GPU_CHECKS_COMMIT)"
  elif git rev-parse --short HEAD > /dev/null 2>&1; then
    echo "commit: $(git rev-parse --short HEAD)$(git diff --quiet 2>/dev/null || echo ' with local changes')"
  else echo "commit: unknown (no git here: set GPU_CHECKS_COMMIT)"; fi
  echo "host: $(uname -srm); cores: $(nproc); $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null)"
  echo "memory: $(free -g 2>/dev/null | awk '/Mem:/ {print $2 " GiB"}')"
  echo "python: $(command -v "$py") ($("$py" -c 'import sys; print(sys.version.split()[0], "prefix", sys.prefix)' 2>&1))"
  echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi 2>&1; nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv 2>&1
  else echo "nvidia-smi: not found"; fi
} > "$out/node.txt"
"$py" -m pip list --format=freeze > "$out/node-freeze.txt" 2>&1 || true
say "node facts in $out/node.txt, node-freeze.txt"

# 2. The interpreter: a usable .venv, else the node's own Python with the carried wheels.
if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch, deepspeed" 2>/dev/null; then
  py=.venv/bin/python
  export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$repo/.venv/torch_extensions}
  say "using .venv ($py)"
else
  [ -e .venv ] && say ".venv exists but cannot import torch and deepspeed: not used"
  site=$repo/.gpu-site
  if ls "$wheels"/*.whl > /dev/null 2>&1; then
    stamp=$(cd "$wheels" && ls -l -- *.whl | awk '{print $5, $NF}' | sha256sum | cut -c1-16)
    if [ "$(cat "$site/.stamp" 2>/dev/null)" != "$stamp" ]; then
      rm -rf "$site"
      if ! "$py" -m pip install --quiet --no-deps --no-index --no-compile --target "$site" "$wheels"/*.whl \
          > "$out/install.log" 2>&1; then
        say "the carried wheels did not install (install.log)"; cat "$out/install.log" >&2; exit 3
      fi
      echo "$stamp" > "$site/.stamp"
    fi
    say "installed $(ls "$wheels"/*.whl | wc -l) carried wheels into $site (no venv, no network)"
  else
    say "no wheels in $wheels/: using $py as it is (make gpu-wheels on a machine with network)"
  fi
  export PYTHONPATH=$site:$repo${PYTHONPATH:+:$PYTHONPATH}
  export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$site/torch_extensions}
  say "using $py with PYTHONPATH=$PYTHONPATH"
fi
export TOKENIZERS_PARALLELISM=false
"$py" scripts/check_imports.py --out "$out/imports.txt" > /dev/null 2>&1
imports_rc=$?
say "$(sed -n 2p "$out/imports.txt" 2>/dev/null || echo 'import check did not run')"
if [ "$imports_rc" != 0 ]; then
  grep FAILED "$out/imports.txt" >&2
  say "setup failed: project modules do not import (imports.txt)"; exit 3
fi

# 3. A CUDA device, or nothing to check. GPU_CHECKS_CPU_DRY_RUN=1 (tests/scripts/test_gpu_node.py) walks steps 4
# and 5 on CPU to check this script's own plumbing: every GPU test skips, the sweep is --tiny, the exit is 1 and the
# results say "CPU dry run: nothing checked".
dry=${GPU_CHECKS_CPU_DRY_RUN:-0}
if ! cuda=$("$py" -c "import torch; n = torch.cuda.device_count() if torch.cuda.is_available() else 0; print(n); raise SystemExit(0 if n else 1)" 2>&1); then
  if [ "$dry" != 1 ]; then
    echo "gpu_checks: no CUDA device is visible (torch $("$py" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -1); CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}; $(echo "$cuda" | tail -1)): nothing to check, nothing recorded" >&2
    exit 2
  fi
  say "CPU dry run (GPU_CHECKS_CPU_DRY_RUN=1): the steps run, nothing is checked"
elif [ "$dry" = 1 ]; then
  echo "gpu_checks: GPU_CHECKS_CPU_DRY_RUN=1 on a machine with CUDA: unset it to run the checks" >&2; exit 2
fi
ngpu=$(echo "$cuda" | tail -1)
say "$ngpu CUDA device(s)"

# 4. The GPU tests, in parallel where the node has pytest-xdist, each under a time limit.
reserve=$([ "$bench" = 1 ] && { [ "$quick" = 1 ] && echo 80 || echo 200; } || echo 10)
test_s=$(( $(left) - reserve ))
marker=$([ "$quick" = 1 ] && echo "gpu and quick" || echo "gpu")
xdist=()
"$py" -c "import xdist" 2>/dev/null && xdist=(-n "$(( $(nproc) / 3 > 6 ? 6 : ($(nproc) / 3 > 1 ? $(nproc) / 3 : 1) ))")
per_test=$(( test_s < 240 ? test_s : 240 ))
say "pytest -m '$marker' ${xdist[*]} (each test <= ${per_test}s, all <= ${test_s}s)"
start=$(date -u +%FT%TZ)
# only the files that hold gpu-marked tests: collecting all of tests/ costs ~20 s of a short call
mapfile -t gpu_files < <(grep -rlE "pytest\.mark\.gpu\b" tests --include='test_*.py' | sort)
timeout --signal=TERM --kill-after=10 "$test_s" "$py" -m pytest -m "$marker" "${xdist[@]}" -v -rs \
  -p no:cacheprovider --timeout "$per_test" --junitxml "$out/pytest.xml" "${gpu_files[@]}" 2>&1 | tee "$out/pytest.log"
rc=${PIPESTATUS[0]}
[ "$rc" = 124 ] && say "pytest stopped at the call's deadline (${test_s}s): the log has what finished"
[ "$rc" = 0 ] || rc=1
passed=$(grep -Eo "[0-9]+ passed" "$out/pytest.log" | tail -1 | cut -d' ' -f1)
if [ "$rc" = 0 ] && [ -z "$passed" ]; then
  say "no GPU test passed (all skipped?): counted as a failure"; rc=1
fi
{
  [ "$dry" = 1 ] && echo "# GPU checks: CPU DRY RUN, NOTHING CHECKED (GPU_CHECKS_CPU_DRY_RUN=1)" || echo "# GPU checks"
  echo
  echo "Command: \`bash scripts/gpu_checks.sh$([ "$quick" = 1 ] && echo ' --quick') --out DIR\` (= \`python -m pytest -m '$marker' ${xdist[*]} --timeout $per_test -v -rs ${gpu_files[*]}\`), started $start,"
  echo "$(sed -n 2p "$out/node.txt"), exit code $rc."
  echo
  echo '```'
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap \
    --format=csv 2>&1 || echo "nvidia-smi not found"
  "$py" -m benchmarks.machine --versions 2>&1
  echo "python: $("$py" -c 'import sys; print(sys.version.split()[0], sys.executable)')"
  echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo '```'
  echo
  if [ "$ngpu" -lt 2 ]; then
    echo "Not checked with $ngpu GPU (NCCL runs one rank per device; tests/gpu/test_gpu.py ONE_GPU_CANNOT_CHECK):"
    "$py" -c "from tests.gpu.test_gpu import ONE_GPU_CANNOT_CHECK as c; print(chr(10).join('- ' + x for x in c))" 2>&1
    echo
  fi
  echo '```'
  grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|Timeout" "$out/pytest.log" | sed -e 's/\x1b\[[0-9;]*m//g'
  echo '```'
} > "$out/gpu_checks.md"
say "wrote $out/gpu_checks.md (pytest exit $rc)"

# 5. The throughput sweep, each cell written as it finishes, stopped at the deadline.
if [ "$bench" = 1 ]; then
  deadline=$(( $(left) - 30 ))  # the sweep's own start-up, and a phase under way is not interrupted
  if [ "$deadline" -lt 30 ]; then
    say "no time left for the sweep (${deadline}s)"; rc=${rc/#0/1}
  else
    say "sweep: python -m benchmarks.gpu_throughput $([ "$quick" = 1 ] && echo --quick) --deadline-s $deadline ${sweep_args[*]}"
    timeout --signal=TERM --kill-after=10 $((deadline + 20)) "$py" -m benchmarks.gpu_throughput \
      $([ "$quick" = 1 ] && echo --quick) $([ "$dry" = 1 ] && echo --tiny) --deadline-s "$deadline" \
      --record "$out/gpu_throughput.md" \
      "${sweep_args[@]}" 2>&1 | tee "$out/gpu_throughput.log" || rc=${rc/#0/1}
  fi
fi
say "done in $((SECONDS - t0))s, exit $rc; results in $out"
exit "$rc"
