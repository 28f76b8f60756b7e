# call 4 (twenty-fifth session, 2c1bb69): Llama batch 4 16K / 8K / 2K in the other order (swap first); ShareGPT
# 30 req/s; the decode ring's slot size 32 / 64 / 96 MiB on ShareGPT 10 req/s (one multirun)
set -u
L=$OUT/log.txt; H=experiments/device/h200.sh
mkdir -p .data && tar xzf .ab/data.tar.gz -C .data; export DIRECTKV_DATA_DIR=$PWD/.data
date > $L
bash $H build >> $L 2>&1
S="system.directkv_variant=stream executor.hbm_prefill=sdpa"
STEP_TIMEOUT=100 CONTEXT_ARGS="contexts=[16384,8192,2048] batch_size=4 output_len=16 system.names=[swap,directkv] $S" bash $H context >> $L 2>&1; date >> $L
STEP_TIMEOUT=160 RATE_ARGS="datasets=[sharegpt] rates=[30] num_requests=100 system.names=[swap,directkv] $S" bash $H rate >> $L 2>&1; date >> $L
STEP_TIMEOUT=300 RATE_ARGS="datasets=[sharegpt] rates=[10] num_requests=100 system.names=[swap,directkv] $S executor.directkv_stream_chunk_mib=32,64,96 -m" bash $H rate >> $L 2>&1; date >> $L
