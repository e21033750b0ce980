#!/bin/bash
set -u
export PYTHONUNBUFFERED=1
ROOT=$PWD
mkdir -p /tmp/site
for w in $(python3 .whl/missing.py 2>/dev/null); do python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/$w-*.whl || echo "install $w failed"; done
export PYTHONPATH=/tmp/site:$ROOT/src
nvidia-smi --query-gpu=name --format=csv,noheader; date
for shape in "64 4 2" "128 4 2" "256 4 2"; do (timeout 280 python3 .whl/gpu_compile_time.py $shape >> $OUT/compile_times.jsonl 2>>$OUT/compile_err.log || echo "{\"shape\": \"$shape\", \"timeout_or_rc\": $?}" >> $OUT/compile_times.jsonl) & done
echo "== gpu tests"
timeout 170 python3 -m pytest -o addopts= -q -p no:cacheprovider --import-mode=importlib -rfs --durations=10 -n 10 --dist load tests/test_cuda.py tests/memory/test_triton.py > $OUT/gpu_tests.log 2>&1
echo "tests rc $?"; grep -E "passed|failed" $OUT/gpu_tests.log | tail -3; grep -E "^FAILED" $OUT/gpu_tests.log | cut -c1-250
date; echo "== bench"
timeout 90 python3 -m titans.cli bench memory --device cuda --implementation triton,fused,autograd --dim 64 --heads 4 --expansion 2 --lengths 2048,8192 --batch 8 --repeats 3 --rounds 1 --warmup 1 --timeout-s 80 --no-reference --out $OUT/bench_d64.json > $OUT/bench.log 2>&1
tail -8 $OUT/bench.log
date; wait; cat $OUT/compile_times.jsonl; tail -5 $OUT/compile_err.log 2>/dev/null; date
