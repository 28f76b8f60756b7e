#!/usr/bin/env bash
# session 38, call 6: partial-C addresses as immediate offsets from one row pointer; checks + timing (m0, m2); ncu
# source samples of the pipelined kernel (20 splits, B in HBM).
set -u
L=$OUT/log.txt
cd .ab/wg
for m in 0 2; do echo "=== check m$m $(date +%T)" >> $L; timeout 100 ./harness_m$m check > /tmp/chk$m.txt 2>&1; echo "rc=$?" >> $L; grep -v " ok$" /tmp/chk$m.txt | tail -8 >> $L; done
for m in 0 2; do echo "=== time m$m $(date +%T)" >> $L; timeout 100 ./harness_m$m time >> $L 2>&1; echo "rc=$?" >> $L; done
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
echo "=== ncu $(date +%T)" >> $L
timeout 200 $NCU --set full -k regex:gemm_pipelined --launch-count 1 -o /tmp/rep ./harness_m0 one 2 20 0 10240 10240 10240 >> /tmp/ncu.log 2>&1
$NCU -i /tmp/rep.ncu-rep --print-details all > /tmp/det.txt 2>&1; grep -E "Duration|Stall |Eligible Warps|L2 Hit Rate  " /tmp/det.txt >> $L
$NCU -i /tmp/rep.ncu-rep --page source --csv --print-source sass > /tmp/src.csv 2>&1
gzip -c /tmp/src.csv > $OUT/src_pipe.csv.gz
echo "=== done $(date +%T)" >> $L
