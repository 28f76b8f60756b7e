# call 1 (twenty-seventh session, 1190585): the whole GPU suite at HEAD (last whole run at 57eac26); the auto slot
# default on OPT-6.7B (3 x 16K) and OPT-30B (2 x 16K: 44 GB of pinned K/V per system), 12 against auto (24), swap first
set -u
L=$OUT/log.txt; H=experiments/device/h200.sh
mkdir -p .data && tar xzf .ab/data.tar.gz -C .data; export DIRECTKV_DATA_DIR=$PWD/.data
date > $L
bash $H build test >> $L 2>&1
tail -2 $OUT/gpu_tests.log >> $L; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log >> $L; tail -1 $OUT/cpu_kernel_tests.log >> $L; rm -f $OUT/cpu_kernel_tests.log; date >> $L
S="system.directkv_variant=stream executor.hbm_prefill=sdpa"
STEP_TIMEOUT=150 CONTEXT_ARGS="model=opt-6.7b contexts=[16384] batch_size=3 output_len=8 scheduler.max_batched_tokens=8192 system.names=[swap,directkv] $S executor.directkv_stream_slots=12,auto -m" bash $H context >> $L 2>&1; date >> $L
STEP_TIMEOUT=200 CONTEXT_ARGS="model=opt-30b contexts=[16384] batch_size=2 output_len=8 scheduler.max_batched_tokens=8192 system.names=[swap,directkv] $S executor.directkv_stream_slots=12,auto -m" bash $H context >> $L 2>&1; date >> $L
