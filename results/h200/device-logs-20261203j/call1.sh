#!/usr/bin/env bash
# session 37, call 1. cand = HEAD (.ab/sha: SplitMerge), main0 = dc4076f (csrc = 8e1437c). GPU tests on cand; decode
# with every page in HBM, main0 / cand alternated twice; on a steady link the decode benchmark at 4K / 8K x 1 / 4, once
# each; then the GEMM tiled diagnosis (k_splits sweep with B on host / in HBM beside pipelined, naive with B in HBM and
# cuBLAS; ncu --set full of one tiled call each).
set -u
ROOT=$PWD L=$OUT/log.txt H=experiments/device/h200.sh
export DIRECTKV_GIT_SHA=$(cat .ab/sha)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
(cd .ab/main0 && PYTHONPATH=$PWD:/tmp/site DIRECTKV_CACHE=/tmp/cmain0 python3 -c "from directkv.kernels.cuda import build; build.build_all(['decode_attention','host_memory','probe'])" > /tmp/bmain0.log 2>&1) &
bash $H env build probe >> $L 2>&1
wait; tail -n 1 /tmp/bmain0.log >> $L
export PYTHONPATH=$PWD:/tmp/site DIRECTKV_CACHE=/tmp/dkvcache
echo "=== gpu tests $(date +%T)" >> $L
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee $OUT/gpu_tests.log | tail -4 >> $L
if grep -qE "[0-9]+ (failed|error)" $OUT/gpu_tests.log; then grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log | head -30 >> $L; fi
tree() { if [ $1 = cand ]; then d=$ROOT; c=/tmp/dkvcache; sha=$(cat .ab/sha); else d=$ROOT/.ab/$1; c=/tmp/c$1; sha=dc4076fcba1498547a6da9a150276688c8755a32; fi; }
for r in 1 2; do for t in main0 cand; do
  echo "=== hbm $t $r $(date +%T)" >> $L; tree $t
  (cd $d && DIRECTKV_GIT_SHA=$sha TILES=64 PYTHONPATH=$d:/tmp/site DIRECTKV_CACHE=$c timeout 50 python3 $ROOT/.ab/hbm_bench2.py $t 2>&1 | tail -12) >> $L
done; done
sm=$(grep -o "'sm_read_gbps': [0-9.]*" $L | tail -1 | awk '{print $2}')
echo "=== sm_read_gbps $sm" >> $L
if awk "BEGIN{exit !($sm >= 48)}"; then for t in main0 cand; do
  echo "=== bench $t $(date +%T)" >> $L; tree $t
  (cd $d && DIRECTKV_GIT_SHA=$sha PYTHONPATH=$d:/tmp/site DIRECTKV_CACHE=$c timeout 45 python3 -m experiments.run +exp=kernel_ablation device=cuda results_root=/tmp/res-$t progress=false ops=[decode] contexts=[4096,8192] decode_batches=[1,4] 2>&1 | tail -1) >> $L
done; tar czf $OUT/ab.tar.gz -C /tmp res-main0 res-cand 2>/dev/null; else echo "=== link disturbed: benchmarks skipped" >> $L; fi
echo "=== gemm sweep $(date +%T)" >> $L
timeout 80 python3 .ab/gemm_diag.py > $OUT/gemm_sweep.jsonl 2>> $L
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
for t in hbm host; do echo "=== ncu $t $(date +%T)" >> $L
  PROFILE=$t timeout 75 $NCU --set full --nvtx --nvtx-include measure/ -k regex:gemm_tiled --launch-count 1 python3 .ab/gemm_diag.py > $OUT/ncu_tiled_$t.txt 2>&1
  echo "rc=$?" >> $L; done
echo "=== done $(date +%T)" >> $L
