# call 2 (twenty-fifth session, 2c1bb69): directkv's first prompt chunks by SDPA against the kernel on ShareGPT
# 10 req/s (one multirun, jobs sdpa then kernel: the reverse of call 1's order), then OPT-13B 3 x 16K again in
# that order
set -u
L=$OUT/log.txt; H=experiments/device/h200.sh
mkdir -p .data && tar xzf .ab/data.tar.gz -C .data; export DIRECTKV_DATA_DIR=$PWD/.data
date > $L
bash $H build >> $L 2>&1
S="system.directkv_variant=stream executor.hbm_prefill=sdpa"
STEP_TIMEOUT=300 RATE_ARGS="datasets=[sharegpt] rates=[10] num_requests=100 system.names=[swap,directkv] $S executor.directkv_no_past_prefill=sdpa,kernel -m" bash $H rate >> $L 2>&1; date >> $L
O="model=opt-13b contexts=[16384] batch_size=3 output_len=8 scheduler.max_batched_tokens=8192"
STEP_TIMEOUT=200 CONTEXT_ARGS="$O system.names=[directkv,swap] $S executor.directkv_no_past_prefill=sdpa,kernel -m" bash $H context >> $L 2>&1; date >> $L
