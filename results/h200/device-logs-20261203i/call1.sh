#!/usr/bin/env bash
# session 36, call 1. cand = HEAD (.ab/sha: the cluster merge by push, 32-row tiles on tensor cores, table entries beside
# the length), main0 = 8e1437c. Every GPU test on cand; every page in HBM, main0 / cand alternated (tiles 64 and 32,
# then 64); then, on a link at its usual pace: per-CTA traces of main0 (trA, device-logs-20261203f/patch_trace.py) and
# cand (trB, patch_trace_push.py); the decode benchmark at 4K / 8K x 1 / 4, main0 / cand alternated twice; the issue's
# grid for cand
set -u
ROOT=$PWD L=$OUT/log.txt H=experiments/device/h200.sh
export DIRECTKV_GIT_SHA=$(cat .ab/sha)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
(cd .ab/main0 && PYTHONPATH=$PWD:/tmp/site DIRECTKV_CACHE=/tmp/cmain0 python3 -c "from directkv.kernels.cuda import build; build.build_all(['decode_attention','host_memory','probe'])" > /tmp/bmain0.log 2>&1) &
for t in trA trB; do (cd .ab/$t && PYTHONPATH=$PWD:/tmp/site DIRECTKV_CACHE=/tmp/c$t python3 -c "from directkv.kernels.cuda import build; build.build_all(['decode_attention','host_memory','probe'])" > /tmp/b$t.log 2>&1) & done
bash $H build probe >> $L 2>&1
wait; for f in /tmp/b*.log; do tail -n 1 $f; done >> $L
echo "=== gpu tests $(date +%T)" >> $L
PYTHONPATH=$PWD:/tmp/site DIRECTKV_CACHE=/tmp/dkvcache timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee $OUT/gpu_tests.log | tail -4 >> $L
if ! grep -q " passed" $OUT/gpu_tests.log || grep -qE "[0-9]+ (failed|error)" $OUT/gpu_tests.log; then echo "=== tests failed" >> $L; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log | head -30 >> $L; exit 0; fi
for r in 1 2; do for t in main0 cand; do
  echo "=== hbm $t $r $(date +%T)" >> $L
  if [ $t = cand ]; then d=$ROOT; c=/tmp/dkvcache; else d=$ROOT/.ab/main0; c=/tmp/cmain0; fi
  if [ $r = 1 ]; then tl=64,32; else tl=64; fi
  (cd $d && TILES=$tl PYTHONPATH=$d:/tmp/site DIRECTKV_CACHE=$c timeout 70 python3 $ROOT/.ab/hbm_bench2.py $t 2>&1 | tail -20) >> $L
done; done
sm=$(grep -o "'sm_read_gbps': [0-9.]*" $L | tail -1 | awk '{print $2}')
echo "=== sm_read_gbps $sm" >> $L
if awk "BEGIN{exit !($sm < 48)}"; then echo "=== link disturbed: benchmarks skipped" >> $L; exit 0; fi
for t in trA trB; do
  echo "=== trace $t $(date +%T)" >> $L
  (cd .ab/$t && TAG=$t PYTHONPATH=$PWD:/tmp/site DIRECTKV_CACHE=/tmp/c$t POINTS=4096x1,8192x1,4096x4 timeout 60 python3 $ROOT/.ab/trace_diag.py 2>&1 | grep -v isolated | tail -8) >> $L
done
for r in 1 2; do for t in main0 cand; do
  echo "=== bench $t $r $(date +%T)" >> $L
  if [ $t = cand ]; then d=$ROOT; c=/tmp/dkvcache; else d=$ROOT/.ab/main0; c=/tmp/cmain0; fi
  (cd $d && PYTHONPATH=$d:/tmp/site DIRECTKV_CACHE=$c timeout 60 python3 -m experiments.run +exp=kernel_ablation device=cuda results_root=/tmp/res-$t progress=false ops=[decode] contexts=[4096,8192] decode_batches=[1,4] 2>&1 | tail -1) >> $L
done; done
tar czf $OUT/ab.tar.gz -C /tmp res-main0 res-cand 2>/dev/null
KERNEL_ARGS="ops=[decode] contexts=[4096,16384,32768,131072] decode_batches=[1,16,64]" STEP_TIMEOUT=100 bash $H kernels >> $L 2>&1
echo "=== done $(date +%T)" >> $L
