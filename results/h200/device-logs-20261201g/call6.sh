# call 6 (59f29a2, balanced stream chunks): suite; 16K batch-4 step times (stream, swap); 16K traced 1d step of stream; context pair stream first
set -u
L=$OUT/log.txt; H=experiments/device/h200.sh
export DIRECTKV_DATA_DIR=$PWD/.data
date > $L
bash $H build test >> $L 2>&1; tail -2 $OUT/gpu_tests.log >> $L; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log >> $L; rm -f $OUT/cpu_kernel_tests.log
if grep -qE "^(FAILED|ERROR)" $OUT/gpu_tests.log; then exit 0; fi
date >> $L
PROFILE_TAG=b16k_ PROFILE_SYSTEMS="directkv swap" PROFILE_ARGS="--variant stream --context 16384 --batch 4 --output 16 --graphs --skip 44 --min-decodes 1 --count 1 --rows 20" bash $H profile >> $L 2>&1
date >> $L
STEP_TIMEOUT=200 CONTEXT_ARGS='contexts=[16384,4096,1024] batch_size=4 output_len=16 system.names=[directkv,swap] system.directkv_variant=stream' bash $H context >> $L 2>&1
date >> $L
