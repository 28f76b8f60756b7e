#!/usr/bin/env bash
# session 38, call 7: partial C prefetched into L2 (registers freed); pipelined as ping-pong warpgroups over 64-row
# blocks with their own A rings and a turn for the tensor cores. Checks, timing (new vs HEAD's kernels).
set -u
L=$OUT/log.txt
cd .ab/wg
echo "=== check $(date +%T)" >> $L; timeout 100 ./harness_new check > $OUT/check.txt 2>&1; echo "rc=$?" >> $L; grep -v " ok$" $OUT/check.txt | tail -12 >> $L
if grep -q "CHECKS failed: 0" $OUT/check.txt; then
  echo "=== time new $(date +%T)" >> $L; timeout 100 ./harness_new time >> $L 2>&1; echo "rc=$?" >> $L
fi
echo "=== done $(date +%T)" >> $L
