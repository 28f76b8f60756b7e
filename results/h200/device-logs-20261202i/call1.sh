# call 1 (twenty-sixth session, 57eac26): GPU suite at HEAD (first since the no-past-prefill default switch and palette
# PNGs); the decode ring's slot count 12 / 24 at OPT-13B 3 x 16K (one multirun, swap beside stream in each job), then
# at Llama batch 4 32K
set -u
L=$OUT/log.txt; H=experiments/device/h200.sh
mkdir -p .data && tar xzf .ab/data.tar.gz -C .data; export DIRECTKV_DATA_DIR=$PWD/.data
date > $L
bash $H build test >> $L 2>&1
tail -2 $OUT/gpu_tests.log >> $L; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log >> $L; tail -1 $OUT/cpu_kernel_tests.log >> $L; rm -f $OUT/cpu_kernel_tests.log; date >> $L
S="system.directkv_variant=stream executor.hbm_prefill=sdpa"
O="model=opt-13b contexts=[16384] batch_size=3 output_len=8 scheduler.max_batched_tokens=8192"
STEP_TIMEOUT=200 CONTEXT_ARGS="$O system.names=[swap,directkv] $S executor.directkv_stream_slots=12,24 -m" bash $H context >> $L 2>&1; date >> $L
STEP_TIMEOUT=170 CONTEXT_ARGS="contexts=[32768] batch_size=4 output_len=16 system.names=[swap,directkv] $S executor.directkv_stream_slots=12,24 -m" bash $H context >> $L 2>&1; date >> $L
