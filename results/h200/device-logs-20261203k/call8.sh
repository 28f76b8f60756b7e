#!/usr/bin/env bash
# session 38, call 8 (HEAD = .ab/sha: wgmma GEMM). Build, GEMM GPU tests + the build test, gemm_case_study at
# 10240 and 4096 (every variant and anchor), then the same with counters=ncu at 10240 (L2 hit, PCIe bytes).
set -u
L=$OUT/log.txt H=experiments/device/h200.sh
export DIRECTKV_GIT_SHA=$(cat .ab/sha)
bash $H build >> $L 2>&1
export PYTHONPATH=$PWD:/tmp/site DIRECTKV_CACHE=/tmp/dkvcache
echo "=== gemm tests $(date +%T)" >> $L
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_gemm.py tests/test_cuda_gemm_graph.py 2>&1 > $OUT/gpu_gemm_tests.log
tail -3 $OUT/gpu_gemm_tests.log >> $L; grep -E "^(FAILED|ERROR)" $OUT/gpu_gemm_tests.log | head -20 >> $L
STEP_TIMEOUT=170 GEMM_ARGS="sizes=[10240,4096]" bash $H gemm >> $L 2>&1
echo "=== ncu gemm $(date +%T)" >> $L
STEP_TIMEOUT=150 GEMM_ARGS="sizes=[10240] counters=ncu" bash $H gemm >> $L 2>&1
echo "=== done $(date +%T)" >> $L
