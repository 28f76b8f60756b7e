#!/usr/bin/env bash
# session 38, call 2: ncu --set full of one wgmma tiled and one pipelined call at 10240^3 (B in HBM, then tiled on host)
set -u
L=$OUT/log.txt
cd .ab/wg
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
for cfg in "1 7 0" "2 7 0" "1 7 1"; do set -- $cfg
  echo "=== ncu v=$1 splits=$2 host=$3 $(date +%T)" >> $L
  timeout 150 $NCU --set full -k regex:gemm_tiled\|gemm_pipelined --launch-count 1 ./harness_new one $1 $2 $3 10240 10240 10240 > $OUT/ncu_v$1_h$3.txt 2>&1
  echo "rc=$?" >> $L
done
echo "=== done $(date +%T)" >> $L
