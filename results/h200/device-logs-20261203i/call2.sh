#!/usr/bin/env bash
# session 36, call 2. cand = HEAD (.ab/sha: the push merge reverted; 32-row tiles on tensor cores, SoftmaxMerge, the
# length cut at the table's end), main0 = 8e1437c, candT = cand with the split's planned page-table entries requested
# beside the length (before it), candP = 6907c19 (the push merge, call 1's candidate). Every GPU test on cand; every
# page in HBM, the four alternated twice (round 1 also 32-row tiles for main0 / cand); then, on a link at its usual
# pace, the decode benchmark at 4K / 8K x 1 / 4 for main0 / cand / candT alternated twice (the grid was dropped: too
# little device time was left)
set -u
ROOT=$PWD L=$OUT/log.txt H=experiments/device/h200.sh
export DIRECTKV_GIT_SHA=$(cat .ab/sha)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
for t in main0 candT candP; do (cd .ab/$t && PYTHONPATH=$PWD:/tmp/site DIRECTKV_CACHE=/tmp/c$t python3 -c "from directkv.kernels.cuda import build; build.build_all(['decode_attention','host_memory','probe'])" > /tmp/b$t.log 2>&1) & done
bash $H build probe >> $L 2>&1
wait; for f in /tmp/b*.log; do tail -n 1 $f; done >> $L
echo "=== gpu tests $(date +%T)" >> $L
PYTHONPATH=$PWD:/tmp/site DIRECTKV_CACHE=/tmp/dkvcache timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee $OUT/gpu_tests.log | tail -4 >> $L
if ! grep -q " passed" $OUT/gpu_tests.log || grep -qE "[0-9]+ (failed|error)" $OUT/gpu_tests.log; then echo "=== tests failed" >> $L; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log | head -30 >> $L; exit 0; fi
tree() { if [ $1 = cand ]; then d=$ROOT; c=/tmp/dkvcache; else d=$ROOT/.ab/$1; c=/tmp/c$1; fi
  case $1 in main0) sha=8e1437c32920de7fca229801239db81f5a33582a ;; candP) sha=6907c19b643726d6b281d397497e6224c3f96d17 ;; *) sha=$(cat .ab/sha) ;; esac; }
for r in 1 2; do for t in main0 cand candT candP; do
  echo "=== hbm $t $r $(date +%T)" >> $L
  tree $t
  if [ $r = 1 ] && { [ $t = main0 ] || [ $t = cand ]; }; then tl=64,32; else tl=64; fi
  (cd $d && DIRECTKV_GIT_SHA=$sha TILES=$tl PYTHONPATH=$d:/tmp/site DIRECTKV_CACHE=$c timeout 70 python3 $ROOT/.ab/hbm_bench2.py $t 2>&1 | tail -20) >> $L
done; done
sm=$(grep -o "'sm_read_gbps': [0-9.]*" $L | tail -1 | awk '{print $2}')
echo "=== sm_read_gbps $sm" >> $L
if awk "BEGIN{exit !($sm < 48)}"; then echo "=== link disturbed: benchmarks skipped" >> $L; exit 0; fi
for r in 1 2; do for t in main0 cand candT; do
  echo "=== bench $t $r $(date +%T)" >> $L
  tree $t
  (cd $d && DIRECTKV_GIT_SHA=$sha PYTHONPATH=$d:/tmp/site DIRECTKV_CACHE=$c timeout 60 python3 -m experiments.run +exp=kernel_ablation device=cuda results_root=/tmp/res-$t progress=false ops=[decode] contexts=[4096,8192] decode_batches=[1,4] 2>&1 | tail -1) >> $L
done; done
tar czf $OUT/ab.tar.gz -C /tmp res-main0 res-cand res-candT 2>/dev/null
echo "=== done $(date +%T)" >> $L
