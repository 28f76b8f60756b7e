# call 1 (34c1d80): suite (85e43d4..34c1d80 first GPU run), replays (plan ms after numpy; prefill_new_pass kernel vs flash), ShareGPT-30 pairs flash then kernel
set -u
L=$OUT/log.txt; H=experiments/device/h200.sh
export DIRECTKV_DATA_DIR=$PWD/.data
date > $L
bash $H build test >> $L 2>&1; tail -2 $OUT/gpu_tests.log >> $L; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log >> $L; rm -f $OUT/cpu_kernel_tests.log
if grep -qE "^(FAILED|ERROR)" $OUT/gpu_tests.log; then exit 0; fi
date >> $L
R="--variant stream --schedule .ab/sharegpt-rate10.parquet --graphs --count 0"
PROFILE_TAG=r_ PROFILE_SYSTEMS=directkv PROFILE_ARGS="$R" bash $H profile >> $L 2>&1
PROFILE_TAG=rflash_ PROFILE_SYSTEMS=directkv PROFILE_ARGS="$R --prefill-new-pass flash" bash $H profile >> $L 2>&1
PROFILE_TAG=r_ PROFILE_SYSTEMS=swap PROFILE_ARGS="$R" bash $H profile >> $L 2>&1
date >> $L
STEP_TIMEOUT=120 RATE_ARGS="datasets=[sharegpt] rates=[30] num_requests=100 system.names=[directkv,swap] system.directkv_variant=stream executor.prefill_new_pass=flash" bash $H rate >> $L 2>&1
date >> $L
STEP_TIMEOUT=120 RATE_ARGS="datasets=[sharegpt] rates=[30] num_requests=100 system.names=[swap,directkv] system.directkv_variant=stream" bash $H rate >> $L 2>&1
date >> $L
