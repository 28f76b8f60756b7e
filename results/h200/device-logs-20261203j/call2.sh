#!/usr/bin/env bash
# session 37, call 2. main = HEAD (.ab/sha), g4 = HEAD with a 4-stage A ring in the tiled GEMM (kTiledStages 3 -> 4).
# The GEMM k_splits sweep at 10240 and 4096 for both (B on host / in HBM); then the whole suite at HEAD.
set -u
ROOT=$PWD L=$OUT/log.txt H=experiments/device/h200.sh
export DIRECTKV_GIT_SHA=$(cat .ab/sha)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
(cd .ab/g4 && PYTHONPATH=$PWD:/tmp/site DIRECTKV_CACHE=/tmp/cg4 python3 -c "from directkv.kernels.cuda import build; build.build_all(['gemm_case_study','host_memory'])" > /tmp/bg4.log 2>&1) &
bash $H env build >> $L 2>&1
wait; tail -n 2 /tmp/bg4.log >> $L
for n in 10240 4096; do for t in main g4; do
  if [ $t = main ]; then d=$ROOT; c=/tmp/dkvcache; else d=$ROOT/.ab/g4; c=/tmp/cg4; fi
  echo "=== gemm $t $n $(date +%T)" >> $L
  (cd $d && N=$n TAG=$t PYTHONPATH=$d:/tmp/site DIRECTKV_CACHE=$c timeout 90 python3 $ROOT/.ab/gemm_diag.py >> $OUT/gemm_sweep.jsonl 2>> $L)
done; done
echo "=== all $(date +%T)" >> $L
bash $H all >> $L 2>&1
echo "=== done $(date +%T)" >> $L
