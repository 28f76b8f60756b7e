# call 3 (6b6c1c9): suite (bench_decode's cut stream rows + its tests), decode kernels twice, context pair swap first, ShareGPT 5 and 30 pairs stream first
set -u
L=$OUT/log.txt; H=experiments/device/h200.sh
export DIRECTKV_DATA_DIR=$PWD/.data
date > $L
bash $H build test >> $L 2>&1; tail -2 $OUT/gpu_tests.log >> $L; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log >> $L; rm -f $OUT/cpu_kernel_tests.log
if grep -qE "^(FAILED|ERROR)" $OUT/gpu_tests.log; then exit 0; fi
date >> $L
for i in 1 2; do KERNEL_ARGS='ops=[decode] contexts=[4096,32768] decode_batches=[1,16]' bash $H kernels >> $L 2>&1; done
date >> $L
STEP_TIMEOUT=200 CONTEXT_ARGS='contexts=[16384,4096,1024] batch_size=4 output_len=16 system.names=[swap,directkv] system.directkv_variant=stream' bash $H context >> $L 2>&1
date >> $L
STEP_TIMEOUT=130 RATE_ARGS="datasets=[sharegpt] rates=[5] num_requests=100 system.names=[directkv,swap] system.directkv_variant=stream" bash $H rate >> $L 2>&1
date >> $L
STEP_TIMEOUT=130 RATE_ARGS="datasets=[sharegpt] rates=[30] num_requests=100 system.names=[directkv,swap] system.directkv_variant=stream" bash $H rate >> $L 2>&1
date >> $L
