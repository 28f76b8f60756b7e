# call 1 (twenty-fifth session, 2c1bb69): GPU suite at HEAD (973 expected: incl. the no-past-prefill GPU tests);
# directkv's first prompt chunks by SDPA against the kernel (first GPU run), one Hydra multirun (one process, jobs
# kernel then sdpa, swap beside stream in each) at OPT-13B 3 x 16K; then the decode ring's slot size 32/64/96 MiB
# at Llama batch 4 32K, one multirun
set -u
L=$OUT/log.txt; H=experiments/device/h200.sh
mkdir -p .data && tar xzf .ab/data.tar.gz -C .data; export DIRECTKV_DATA_DIR=$PWD/.data
date > $L
bash $H build test >> $L 2>&1
tail -2 $OUT/gpu_tests.log >> $L; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log >> $L; tail -1 $OUT/cpu_kernel_tests.log >> $L; rm -f $OUT/cpu_kernel_tests.log; date >> $L
S="system.directkv_variant=stream executor.hbm_prefill=sdpa"
O="model=opt-13b contexts=[16384] batch_size=3 output_len=8 scheduler.max_batched_tokens=8192"
STEP_TIMEOUT=210 CONTEXT_ARGS="$O system.names=[swap,directkv] $S executor.directkv_no_past_prefill=kernel,sdpa -m" bash $H context >> $L 2>&1; date >> $L
STEP_TIMEOUT=190 CONTEXT_ARGS="contexts=[32768] batch_size=4 output_len=16 system.names=[swap,directkv] $S executor.directkv_stream_chunk_mib=32,64,96 -m" bash $H context >> $L 2>&1; date >> $L
