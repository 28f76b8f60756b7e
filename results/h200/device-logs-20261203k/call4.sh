#!/usr/bin/env bash
# session 38, call 4 (k loop inner: no injected wait): A tiles by TMA in tiled / pipelined; the partial-C fetch placed three ways (harness_m0/1/2).
# Checks on m0 and m2, timing of all three; SASS of the tiled / pipelined kernels for the injected waits.
set -u
L=$OUT/log.txt
cd .ab/wg
for m in 0 1 2; do echo "=== check m$m $(date +%T)" >> $L; timeout 100 ./harness_m$m check > /tmp/chk$m.txt 2>&1; echo "rc=$?" >> $L; grep -v " ok$" /tmp/chk$m.txt | tail -8 >> $L; done
for m in 0 1 2; do echo "=== time m$m $(date +%T)" >> $L; timeout 100 ./harness_m$m time >> $L 2>&1; echo "rc=$?" >> $L; done
CUOBJ=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
$CUOBJ -sass harness_m0 > /tmp/sass.txt 2>&1
awk '/Function : .*gemm_tiled_kernelILb1ELb1/,/\.\.\.\.\.\.\.\.\.\./' /tmp/sass.txt | grep -n "WARPGROUP\|HGMMA\|WARPSYNC\|BAR\|SYNCS\|UTMALDG\|EXIT\|BRA" > $OUT/sass_tiled.txt
awk '/Function : .*gemm_pipelined_kernelILb1ELb1/,/\.\.\.\.\.\.\.\.\.\./' /tmp/sass.txt | grep -n "WARPGROUP\|HGMMA\|WARPSYNC\|BAR\|SYNCS\|UTMALDG\|EXIT\|BRA\|SETMAXREG" > $OUT/sass_pipe.txt
echo "=== done $(date +%T)" >> $L
