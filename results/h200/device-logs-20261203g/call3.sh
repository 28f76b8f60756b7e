#!/usr/bin/env bash
# session 34, call 3. main0 = 9c9001f (HEAD), cand = the working tree (decode math: a batch of rows' scores, then one
# softmax rescale). Every GPU test on cand; then, only on a link at its usual pace (calls 1-2 got 29.5-36.9 GB/s of
# SM reads against 51.4), the decode benchmark main0 / cand alternated twice at 4K / 8K x 1 / 4, cand at 128K x 1, and
# the Llama batch 4 context sweep (tiled beside swap) on main0
set -u
ROOT=$PWD L=$OUT/log.txt H=experiments/device/h200.sh
SHA=$(cat .ab/sha)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
(cd .ab/main0 && PYTHONPATH=$PWD:/tmp/site DIRECTKV_CACHE=/tmp/cmain0 python3 -c "from directkv.kernels.cuda import build; build.build_all()" > /tmp/bmain0.log 2>&1) &
DIRECTKV_GIT_SHA="$SHA+decode-math-candidate" bash $H build probe >> $L 2>&1
wait; tail -n 2 /tmp/bmain0.log >> $L
echo "=== gpu tests cand $(date +%T)" >> $L
PYTHONPATH=$PWD:/tmp/site DIRECTKV_CACHE=/tmp/dkvcache timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee $OUT/gpu_tests.log | tail -4 >> $L
sm=$(grep -o "'sm_read_gbps': [0-9.]*" $L | tail -1 | awk '{print $2}')
echo "=== sm_read_gbps $sm" >> $L
if awk "BEGIN{exit !($sm < 48)}"; then echo "=== link disturbed: benchmarks skipped" >> $L; exit 0; fi
export PYTHONUNBUFFERED=1 DIRECTKV_TOKENIZER=approx
for r in 1 2; do for t in main0 cand; do
  echo "=== bench $t $r $(date +%T)" >> $L
  if [ $t = cand ]; then d=$ROOT; c=/tmp/dkvcache; s="$SHA+decode-math-candidate"; else d=$ROOT/.ab/main0; c=/tmp/cmain0; s=$SHA; fi
  (cd $d && DIRECTKV_GIT_SHA=$s PYTHONPATH=$d:/tmp/site DIRECTKV_CACHE=$c timeout 100 python3 -m experiments.run +exp=kernel_ablation device=cuda results_root=/tmp/res-$t progress=false ops=[decode] contexts=[4096,8192] decode_batches=[1,4] 2>&1 | tail -1) >> $L
done; done
echo "=== bench cand 128K $(date +%T)" >> $L
DIRECTKV_GIT_SHA="$SHA+decode-math-candidate" PYTHONPATH=$ROOT:/tmp/site DIRECTKV_CACHE=/tmp/dkvcache timeout 100 python3 -m experiments.run +exp=kernel_ablation device=cuda results_root=/tmp/res-cand progress=false ops=[decode] contexts=[131072] decode_batches=[1] 2>&1 | tail -1 >> $L
tar czf $OUT/results.tar.gz -C /tmp res-main0 res-cand
echo "=== context main0 $(date +%T)" >> $L
(cd .ab/main0 && DIRECTKV_GIT_SHA=$SHA PYTHONPATH=$PWD:/tmp/site DIRECTKV_CACHE=/tmp/cmain0 timeout -s INT -k 20 300 python3 -m experiments.run +exp=context_sweep device=cuda results_root=/tmp/res-main0 progress=false contexts=[4096,32768] batch_size=4 system.names=[swap,directkv] system.directkv_variant=tiled 2>&1 | tail -12) >> $L
tar czf $OUT/results.tar.gz -C /tmp res-main0 res-cand
echo "=== done $(date +%T)" >> $L
