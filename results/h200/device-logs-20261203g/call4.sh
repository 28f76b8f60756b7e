#!/usr/bin/env bash
# session 34, call 4: the decode math candidate against main0 (9c9001f) with every page in HBM, alternated twice
set -u
ROOT=$PWD L=$OUT/log.txt
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
(cd .ab/main0 && PYTHONPATH=$PWD:/tmp/site DIRECTKV_CACHE=/tmp/cmain0 python3 -c "from directkv.kernels.cuda import build; build.build_all(['decode_attention','host_memory'])" > /tmp/bmain0.log 2>&1) &
PYTHONPATH=$PWD:/tmp/site DIRECTKV_CACHE=/tmp/dkvcache python3 -c "from directkv.kernels.cuda import build; build.build_all(['decode_attention','host_memory'])" > /tmp/bcand.log 2>&1
wait; tail -n 1 /tmp/bmain0.log /tmp/bcand.log >> $L
for r in 1 2; do for t in main0 cand; do
  echo "=== hbm $t $r $(date +%T)" >> $L
  if [ $t = cand ]; then d=$ROOT; c=/tmp/dkvcache; else d=$ROOT/.ab/main0; c=/tmp/cmain0; fi
  (cd $d && PYTHONPATH=$d:/tmp/site DIRECTKV_CACHE=$c timeout 60 python3 $ROOT/.ab/hbm_bench.py $t 2>&1 | tail -12) >> $L
done; done
echo "=== done $(date +%T)" >> $L
