#!/usr/bin/env bash
# session 38, call 1: wgmma tiled / pipelined GEMM (harness_new, working tree) against the mma.sync kernels of HEAD
# (harness_old): correctness first, then flushed timing at 4096^3 and 10240^3, B on host and in HBM.
set -u
L=$OUT/log.txt
cd .ab/wg
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current --format=csv > $L 2>&1
echo "=== new check $(date +%T)" >> $L
timeout 120 ./harness_new check >> $L 2>&1; rc=$?; echo "rc=$rc" >> $L
if [ $rc -eq 0 ]; then
  echo "=== new time $(date +%T)" >> $L; timeout 150 ./harness_new time >> $L 2>&1; echo "rc=$?" >> $L
  echo "=== old time $(date +%T)" >> $L; timeout 150 ./harness_old time >> $L 2>&1; echo "rc=$?" >> $L
else
  echo "=== old check (harness sanity) $(date +%T)" >> $L; timeout 60 ./harness_old check >> $L 2>&1; echo "rc=$?" >> $L
fi
echo "=== done $(date +%T)" >> $L
