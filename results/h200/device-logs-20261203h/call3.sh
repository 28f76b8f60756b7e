#!/usr/bin/env bash
# session 35, call 3, HEAD (see .ab/sha): host-only decode plans capped at CLUSTER_MAX splits. Every GPU test; then, only
# on a link at its usual pace, forced split counts beside the plan and the plain read at 16K / 32K / 64K x 1
# (sweep_splits.py), and the decode benchmark at batch 1 over 4K-128K
set -u
ROOT=$PWD L=$OUT/log.txt H=experiments/device/h200.sh D=results/h200/device-logs-20261203h
export DIRECTKV_GIT_SHA=$(cat .ab/sha)
bash $H build probe >> $L 2>&1
echo "=== gpu tests $(date +%T)" >> $L
PYTHONPATH=$PWD:/tmp/site DIRECTKV_CACHE=/tmp/dkvcache timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee $OUT/gpu_tests.log | tail -3 >> $L
sm=$(grep -o "'sm_read_gbps': [0-9.]*" $L | tail -1 | awk '{print $2}')
echo "=== sm_read_gbps $sm" >> $L
if awk "BEGIN{exit !($sm < 48)}"; then echo "=== link disturbed: benchmarks skipped" >> $L; exit 0; fi
echo "=== sweep $(date +%T)" >> $L
PYTHONPATH=$ROOT:/tmp/site DIRECTKV_CACHE=/tmp/dkvcache TAG=capped POINTS=16384x1,32768x1,65536x1,4096x1 SPLITS=4,8,16 timeout 120 python3 $D/sweep_splits.py >> $L 2>&1
KERNEL_ARGS="ops=[decode] contexts=[4096,8192,16384,32768,131072] decode_batches=[1]" STEP_TIMEOUT=100 bash $H kernels >> $L 2>&1
echo "=== done $(date +%T)" >> $L
