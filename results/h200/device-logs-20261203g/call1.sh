#!/usr/bin/env bash
# session 34, call 1: every GPU test at HEAD (the cluster-merge tests never run on a GPU: GQA 2, the empty
# sequence), then the decode benchmark twice at 4K / 8K x 1 / 4 (tiled beside tiled:global_merge) and once at 128K x 1
set -u
export DIRECTKV_GIT_SHA=$(cat .ab/sha) L=$OUT/log.txt H=experiments/device/h200.sh
bash $H env build test >> $L 2>&1
for r in 1 2; do
  KERNEL_ARGS='ops=[decode] contexts=[4096,8192] decode_batches=[1,4]' STEP_TIMEOUT=110 bash $H kernels >> $L 2>&1
done
KERNEL_ARGS='ops=[decode] contexts=[131072] decode_batches=[1]' STEP_TIMEOUT=100 bash $H kernels >> $L 2>&1
echo "=== done $(date +%T)" >> $L
