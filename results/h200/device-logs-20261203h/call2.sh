#!/usr/bin/env bash
# session 35, call 2. main0 = 3316c3a (tensor-core decode for 2-8 heads a CTA), cand = HEAD (235ca8f: one head a CTA on tensor
# cores too: naive, and tiled over MHA). Every GPU test on HEAD; every page in HBM, main0 / cand alternated twice; then,
# only on a link at its usual pace, the decode benchmark over the grid (4K / 16K / 32K / 128K x 1 / 16 / 64) and
# tiled decode against forced split counts beside the plain read (sweep_splits.py: is the host-only plan still the best
# now the math is cheap?)
set -u
ROOT=$PWD L=$OUT/log.txt H=experiments/device/h200.sh D=results/h200/device-logs-20261203h
export DIRECTKV_GIT_SHA=$(cat .ab/sha)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
(cd .ab/main0 && PYTHONPATH=$PWD:/tmp/site DIRECTKV_CACHE=/tmp/cmain0 python3 -c "from directkv.kernels.cuda import build; build.build_all(['decode_attention','host_memory'])" > /tmp/bmain0.log 2>&1) &
bash $H build probe >> $L 2>&1
wait; tail -n 1 /tmp/bmain0.log >> $L
echo "=== gpu tests $(date +%T)" >> $L
PYTHONPATH=$PWD:/tmp/site DIRECTKV_CACHE=/tmp/dkvcache timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests -x 2>&1 | tee $OUT/gpu_tests.log | tail -4 >> $L
if ! grep -q " passed" $OUT/gpu_tests.log || grep -qE "[0-9]+ (failed|error)" $OUT/gpu_tests.log; then echo "=== tests failed" >> $L; exit 0; fi
for r in 1 2; do for t in main0 cand; do
  echo "=== hbm $t $r $(date +%T)" >> $L
  if [ $t = cand ]; then d=$ROOT; c=/tmp/dkvcache; else d=$ROOT/.ab/main0; c=/tmp/cmain0; fi
  (cd $d && PYTHONPATH=$d:/tmp/site DIRECTKV_CACHE=$c timeout 60 python3 $ROOT/.ab/hbm_bench.py $t 2>&1 | tail -12) >> $L
done; done
sm=$(grep -o "'sm_read_gbps': [0-9.]*" $L | tail -1 | awk '{print $2}')
echo "=== sm_read_gbps $sm" >> $L
if awk "BEGIN{exit !($sm < 48)}"; then echo "=== link disturbed: benchmarks skipped" >> $L; exit 0; fi
KERNEL_ARGS="ops=[decode] contexts=[4096,16384,32768,131072] decode_batches=[1,16,64]" STEP_TIMEOUT=120 bash $H kernels >> $L 2>&1
echo "=== sweep $(date +%T)" >> $L
PYTHONPATH=$ROOT:/tmp/site DIRECTKV_CACHE=/tmp/dkvcache TAG=head timeout 150 python3 $D/sweep_splits.py >> $L 2>&1
echo "=== done $(date +%T)" >> $L
