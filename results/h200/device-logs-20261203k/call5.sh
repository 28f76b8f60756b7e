#!/usr/bin/env bash
# session 38, call 5: ncu of the wgmma tiled kernel (k loop inner, A by TMA), 10240^3, 20 splits, B in HBM:
# full set with details, and the per-instruction SASS stall samples.
set -u
L=$OUT/log.txt
cd .ab/wg
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
echo "=== ncu $(date +%T)" >> $L
timeout 200 $NCU --set full --print-details all -k regex:gemm_tiled --launch-count 1 -o /tmp/rep ./harness_m0 one 1 20 0 10240 10240 10240 >> $L 2>&1
$NCU -i /tmp/rep.ncu-rep --print-details all > $OUT/ncu_tiled_details.txt 2>&1
$NCU -i /tmp/rep.ncu-rep --page source --csv --print-source sass > /tmp/src.csv 2>&1
gzip -c /tmp/src.csv > $OUT/src.csv.gz
echo "=== done $(date +%T)" >> $L
