# call 3 (twenty-fourth session, HEAD with executor.directkv_stream_chunk_mib, default 64): GPU suite (the new
# decode test at 64 MiB slots, the chunk knob's serving test); then, each as one Hydra multirun (one process, jobs
# 16 then 64, swap beside stream in each job, sdpa prompt chunks): Llama b4 32K, ShareGPT 10 req/s, OPT-13B 3 x 16K
set -u
L=$OUT/log.txt; H=experiments/device/h200.sh
mkdir -p .data && tar xzf .ab/data.tar.gz -C .data; export DIRECTKV_DATA_DIR=$PWD/.data
date > $L
bash $H build test >> $L 2>&1
tail -2 $OUT/gpu_tests.log >> $L; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log >> $L; tail -1 $OUT/cpu_kernel_tests.log >> $L; rm -f $OUT/cpu_kernel_tests.log; date >> $L
S="system.directkv_variant=stream executor.hbm_prefill=sdpa executor.directkv_stream_chunk_mib=16,64"
STEP_TIMEOUT=150 CONTEXT_ARGS="-m contexts=[32768] batch_size=4 output_len=16 system.names=[swap,directkv] $S" bash $H context >> $L 2>&1; date >> $L
STEP_TIMEOUT=260 RATE_ARGS="-m datasets=[sharegpt] rates=[10] num_requests=100 system.names=[swap,directkv] $S" bash $H rate >> $L 2>&1; date >> $L
O="model=opt-13b contexts=[16384] batch_size=3 output_len=8 scheduler.max_batched_tokens=8192"
STEP_TIMEOUT=120 CONTEXT_ARGS="-m $O system.names=[swap,directkv] $S" bash $H context >> $L 2>&1; date >> $L
