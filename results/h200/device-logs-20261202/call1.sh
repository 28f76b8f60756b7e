# call 1 (23f5202): suite; GEMM with the graph rows; order effect at ShareGPT 10: stream alone, swap alone, both pairs
set -u
L=$OUT/log.txt; H=experiments/device/h200.sh
export DIRECTKV_DATA_DIR=$PWD/.data
date > $L
bash $H build test >> $L 2>&1
tail -2 $OUT/gpu_tests.log >> $L; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log >> $L
rm -f $OUT/cpu_kernel_tests.log
if grep -qE "^(FAILED|ERROR)" $OUT/gpu_tests.log; then grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log | grep -qv gemm_graph && exit 0; fi
date >> $L
GEMM_ARGS="sizes=[4096,10240]" bash $H gemm >> $L 2>&1; date >> $L
S="system.directkv_variant=stream"
for names in "directkv" "swap" "swap,directkv" "directkv,swap"; do
  STEP_TIMEOUT=95 RATE_ARGS="datasets=[sharegpt] rates=[10] num_requests=100 system.names=[$names] $S" bash $H rate >> $L 2>&1; date >> $L
done
