#!/usr/bin/env bash
# session 35, call 1. main0 = 00a19a4 (HEAD), cand = the working tree: decode math on tensor cores for 2-8 heads in
# 64-row tiles (DecodeMma), naive one row at a time, the launcher's split-plan check. Every GPU test on cand; if they
# pass: every page in HBM (the SM-bound case) main0 / cand alternated twice, then, only on a link at its usual pace,
# the decode benchmark main0 / cand alternated twice at 4K / 8K x 1 / 4
set -u
ROOT=$PWD L=$OUT/log.txt H=experiments/device/h200.sh
SHA=$(cat .ab/sha) TAG=decode-mma-candidate
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
(cd .ab/main0 && PYTHONPATH=$PWD:/tmp/site DIRECTKV_CACHE=/tmp/cmain0 python3 -c "from directkv.kernels.cuda import build; build.build_all()" > /tmp/bmain0.log 2>&1) &
DIRECTKV_GIT_SHA="$SHA+$TAG" bash $H build probe >> $L 2>&1
wait; tail -n 2 /tmp/bmain0.log >> $L
echo "=== gpu tests cand $(date +%T)" >> $L
PYTHONPATH=$PWD:/tmp/site DIRECTKV_CACHE=/tmp/dkvcache timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests -x 2>&1 | tee $OUT/gpu_tests.log | tail -4 >> $L
if ! grep -q " passed" $OUT/gpu_tests.log || grep -qE "[0-9]+ (failed|error)" $OUT/gpu_tests.log; then
  echo "=== tests failed: decode tests without -x" >> $L
  PYTHONPATH=$PWD:/tmp/site DIRECTKV_CACHE=/tmp/dkvcache timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_decode.py 2>&1 | tail -40 > $OUT/decode_tests.log
  exit 0
fi
for r in 1 2; do for t in main0 cand; do
  echo "=== hbm $t $r $(date +%T)" >> $L
  if [ $t = cand ]; then d=$ROOT; c=/tmp/dkvcache; else d=$ROOT/.ab/main0; c=/tmp/cmain0; fi
  (cd $d && PYTHONPATH=$d:/tmp/site DIRECTKV_CACHE=$c timeout 60 python3 $ROOT/.ab/hbm_bench.py $t 2>&1 | tail -12) >> $L
done; done
sm=$(grep -o "'sm_read_gbps': [0-9.]*" $L | tail -1 | awk '{print $2}')
echo "=== sm_read_gbps $sm" >> $L
if awk "BEGIN{exit !($sm < 48)}"; then echo "=== link disturbed: benchmarks skipped" >> $L; exit 0; fi
export PYTHONUNBUFFERED=1 DIRECTKV_TOKENIZER=approx
for r in 1 2; do for t in main0 cand; do
  echo "=== bench $t $r $(date +%T)" >> $L
  if [ $t = cand ]; then d=$ROOT; c=/tmp/dkvcache; s="$SHA+$TAG"; else d=$ROOT/.ab/main0; c=/tmp/cmain0; s=$SHA; fi
  (cd $d && DIRECTKV_GIT_SHA=$s PYTHONPATH=$d:/tmp/site DIRECTKV_CACHE=$c timeout 100 python3 -m experiments.run +exp=kernel_ablation device=cuda results_root=/tmp/res-$t progress=false ops=[decode] contexts=[4096,8192] decode_batches=[1,4] 2>&1 | tail -1) >> $L
done; done
tar czf $OUT/results.tar.gz -C /tmp res-main0 res-cand
echo "=== done $(date +%T)" >> $L
