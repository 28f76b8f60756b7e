#!/usr/bin/env bash
# NOT RUN: the session had too little device time left to start a machine. Prepared for the next session.
# session 38, call 10 (HEAD = .ab/sha: the k-split plan of one chunk a CTA within 1/8 of GPU memory). Build, GEMM
# GPU tests + the plan tests, gemm_case_study at 10240 and 4096.
set -u
L=$OUT/log.txt H=experiments/device/h200.sh
export DIRECTKV_GIT_SHA=$(cat .ab/sha)
bash $H build >> $L 2>&1
export PYTHONPATH=$PWD:/tmp/site DIRECTKV_CACHE=/tmp/dkvcache
echo "=== gemm tests $(date +%T)" >> $L
timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_gemm.py -k "not stream" 2>&1 > $OUT/gpu_gemm_tests.log
tail -2 $OUT/gpu_gemm_tests.log >> $L; grep -E "^(FAILED|ERROR)" $OUT/gpu_gemm_tests.log | head -20 >> $L
STEP_TIMEOUT=100 GEMM_ARGS="sizes=[10240,4096]" bash $H gemm >> $L 2>&1
echo "=== done $(date +%T)" >> $L
