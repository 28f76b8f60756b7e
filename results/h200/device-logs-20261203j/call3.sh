#!/usr/bin/env bash
# session 37, call 3 (HEAD = .ab/sha: the k-split plan for four waves). GEMM GPU tests, then gemm_case_study at
# 10240 and 4096 (every variant and anchor), the run kept under results/.
set -u
L=$OUT/log.txt H=experiments/device/h200.sh
export DIRECTKV_GIT_SHA=$(cat .ab/sha)
bash $H build >> $L 2>&1
export PYTHONPATH=$PWD:/tmp/site DIRECTKV_CACHE=/tmp/dkvcache
echo "=== gemm tests $(date +%T)" >> $L
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_gemm.py tests/test_cuda_gemm_graph.py 2>&1 | tail -3 > $OUT/gpu_gemm_tests.log
cat $OUT/gpu_gemm_tests.log >> $L
STEP_TIMEOUT=170 GEMM_ARGS="sizes=[10240,4096]" bash $H gemm >> $L 2>&1
echo "=== done $(date +%T)" >> $L
