# call 1 (b7dcb99): suite; 16K batch-4 per-step times with 2/4/8 decode ring slots + swap; A/A: swap twice at ShareGPT 10 (separate processes)
set -u
L=$OUT/log.txt; H=experiments/device/h200.sh
export DIRECTKV_DATA_DIR=$PWD/.data
date > $L
bash $H build test >> $L 2>&1; tail -2 $OUT/gpu_tests.log >> $L; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log >> $L; rm -f $OUT/cpu_kernel_tests.log
if grep -qE "^(FAILED|ERROR)" $OUT/gpu_tests.log; then exit 0; fi
date >> $L
for n in 2 4 8; do PROFILE_TAG=s${n}_ PROFILE_SYSTEMS=directkv PROFILE_ARGS="--variant stream --context 16384 --batch 4 --output 16 --graphs --count 0 --stream-slots $n" bash $H profile >> $L 2>&1; done
PROFILE_TAG=s_ PROFILE_SYSTEMS=swap PROFILE_ARGS="--context 16384 --batch 4 --output 16 --graphs --count 0" bash $H profile >> $L 2>&1
date >> $L
for i in 1 2; do STEP_TIMEOUT=100 RATE_ARGS="datasets=[sharegpt] rates=[10] num_requests=100 system.names=[swap]" bash $H rate >> $L 2>&1; date >> $L; done
