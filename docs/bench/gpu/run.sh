#!/bin/bash
# The GPU check of issue 43, end to end in at most 8 minutes on an H100 or H200: the CUDA tests, then the benchmarks
# (`titans bench gpu`: the memory layer against causal SDPA and titans-pytorch, a 125M model's training step per
# variant, decoding at 32K context, the kernels' precision against float64), every JSON into $OUT with the GPU,
# driver, torch and triton named, and the summary table last. NOTES.md beside it holds the floors and predictions.
#
# Prepare here (registries reachable): bash docs/bench/gpu/wheels.sh. Then, through the device tool, from the
# repository root: run(command="OUT=$OUT bash docs/bench/gpu/run.sh", carry=[".whl"], timeout_s=540).
#
# DRY=1 dry-runs it on a CPU (the local .venv, Triton's interpreter, toy sizes: `titans bench gpu --quick`).
set -u
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
ROOT=$PWD
OUT=${OUT:-/tmp/titans-gpu}
PY=python3; QUICK=""; TESTS="tests/test_cuda.py tests/memory/test_triton.py tests/memory/test_triton_channels.py"; WORKERS=8
if [ "${DRY:-0}" = 1 ]; then
  PY=$ROOT/.venv/bin/python; QUICK="--quick --device cpu"; WORKERS=2; export TRITON_INTERPRET=1
  TESTS="tests/test_cuda.py tests/memory/test_triton.py::test_no_grad_forward_matches_the_recorded_one"
fi
mkdir -p "$OUT" /tmp/site
START=$(date +%s)
stamp() { echo "== $1 ($(( $(date +%s) - START )) s)"; }

stamp "packages"
WHEELS=$([ "${DRY:-0}" = 1 ] || python3 docs/bench/gpu/missing.py 2>/dev/null)
if [ -n "$WHEELS" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $WHEELS \
    > "$OUT/install.log" 2>&1 || echo "wheel install failed (see install.log)"
fi
export PYTHONPATH=/tmp/site:$ROOT/src
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no GPU: dry run"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"

stamp "compiling the benchmarks' kernels in the background"
if [ "${DRY:-0}" = 1 ]; then true & else $PY docs/bench/gpu/warm.py > "$OUT/warm.log" 2>&1 & fi
WARM=$!

stamp "CUDA tests"
timeout 150 $PY -m pytest -o addopts= -q -p no:cacheprovider --import-mode=importlib -rfs --durations=15 \
  -n $WORKERS --dist load $TESTS -m "not slow" > "$OUT/gpu_tests.log" 2>&1
echo "tests rc $?"; grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -3; grep -E "^FAILED|^ERROR" "$OUT/gpu_tests.log" | cut -c1-250

wait $WARM; echo "warm rc $?"; tail -4 "$OUT/warm.log" 2>/dev/null
stamp "benchmarks"
bench() { timeout "$1" $PY -m titans.cli bench gpu --out "$OUT" --only "$2" $QUICK >> "$OUT/bench.log" 2>&1 \
  || echo "bench $2: rc $? (see bench.log)"; }
bench 30 matmul
bench 90 layer
bench 90 model
bench 50 decode
bench 45 precision
stamp "summary"
$PY -c "from pathlib import Path; from titans.bench.gpu import summary; print(summary(Path('$OUT')))" \
  | tee "$OUT/summary.txt"
stamp "done"
