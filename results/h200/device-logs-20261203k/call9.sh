#!/usr/bin/env bash
# session 38, call 9: ncu of the final kernels (harness_new = f9e2fff's GEMM code), 10240^3, 7 splits (the plan),
# B on the host: tiled and pipelined, summary + per-instruction stall samples.
set -u
L=$OUT/log.txt
cd .ab/wg
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
for v in 1 2; do
  echo "=== ncu v=$v $(date +%T)" >> $L
  timeout 120 $NCU --set full -k regex:gemm_tiled\|gemm_pipelined --launch-count 1 -o /tmp/rep$v ./harness_new one $v 7 1 10240 10240 10240 >> /tmp/ncu.log 2>&1
  $NCU -i /tmp/rep$v.ncu-rep --print-details all > $OUT/ncu_v$v.txt 2>&1
  grep -E "Duration|Stall |Eligible Warps Per|L2 Hit Rate  |DRAM Throughput|Compute \(SM\) Throughput|Registers Per" $OUT/ncu_v$v.txt | head -30 >> $L
  $NCU -i /tmp/rep$v.ncu-rep --page source --csv --print-source sass 2>&1 | gzip -c > $OUT/src_v$v.csv.gz
done
echo "=== done $(date +%T)" >> $L
