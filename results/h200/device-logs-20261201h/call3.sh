# call 3 (serving default directkv_stream_slots=8): suite; stream/swap pairs at ShareGPT 10 (both orders), 30 (stream first), 20 (swap first), 5 (swap first)
set -u
L=$OUT/log.txt; H=experiments/device/h200.sh
export DIRECTKV_DATA_DIR=$PWD/.data
date > $L
bash $H build test >> $L 2>&1; tail -2 $OUT/gpu_tests.log >> $L; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log >> $L; rm -f $OUT/cpu_kernel_tests.log
if grep -qE "^(FAILED|ERROR)" $OUT/gpu_tests.log; then exit 0; fi
date >> $L
S="system.directkv_variant=stream"
for spec in "10 swap,directkv" "10 directkv,swap" "30 directkv,swap" "20 swap,directkv" "5 swap,directkv"; do set -- $spec
STEP_TIMEOUT=95 RATE_ARGS="datasets=[sharegpt] rates=[$1] num_requests=100 system.names=[$2] $S" bash $H rate >> $L 2>&1; date >> $L; done
