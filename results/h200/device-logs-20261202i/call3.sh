# call 3 (twenty-sixth session, 57eac26): ShareGPT 30 req/s swap first; OPT-13B 3 x 16K profile of both systems
# (stream with the slot count call 1 favoured: SLOTS), the per-step kernels and copies of its losing step
set -u
L=$OUT/log.txt; H=experiments/device/h200.sh
mkdir -p .data && tar xzf .ab/data.tar.gz -C .data; export DIRECTKV_DATA_DIR=$PWD/.data
date > $L
bash $H build >> $L 2>&1
S="system.directkv_variant=stream executor.hbm_prefill=sdpa"
STEP_TIMEOUT=160 RATE_ARGS="datasets=[sharegpt] rates=[30] num_requests=100 system.names=[swap,directkv] $S" bash $H rate >> $L 2>&1; date >> $L
STEP_TIMEOUT=300 CONTEXT_ARGS="model=opt-13b contexts=[32760] batch_size=3 output_len=8 scheduler.max_batched_tokens=8192 system.names=[directkv,swap] $S" bash $H context >> $L 2>&1; date >> $L
