#!/usr/bin/env bash
# session 36, call 2: HEAD (.ab/sha). The whole suite as a user runs it (README's test command) on the GPU machine, then,
# on a link at its usual pace, the decode benchmark over the grid and at batch 1-8 over 4K / 8K
set -u
L=$OUT/log.txt H=experiments/device/h200.sh
export DIRECTKV_GIT_SHA=$(cat .ab/sha)
bash $H build probe >> $L 2>&1
echo "=== all tests $(date +%T)" >> $L
STEP_TIMEOUT=380 bash $H all >> $L 2>&1
sm=$(grep -o "'sm_read_gbps': [0-9.]*" $L | tail -1 | awk '{print $2}')
echo "=== sm_read_gbps $sm" >> $L
if awk "BEGIN{exit !($sm < 48)}"; then echo "=== link disturbed: benchmarks skipped" >> $L; exit 0; fi
KERNEL_ARGS="ops=[decode] contexts=[4096,8192] decode_batches=[1,2,4,8]" STEP_TIMEOUT=60 bash $H kernels >> $L 2>&1
echo "=== done $(date +%T)" >> $L
