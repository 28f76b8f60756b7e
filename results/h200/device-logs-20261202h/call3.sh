# call 3 (twenty-fifth session, 2c1bb69): the 64 MiB decode-slot default at the points not re-measured with it:
# ShareGPT 20 and 5 req/s (swap and stream in one process, the order alternating), Llama batch 4 16K / 8K / 2K
set -u
L=$OUT/log.txt; H=experiments/device/h200.sh
mkdir -p .data && tar xzf .ab/data.tar.gz -C .data; export DIRECTKV_DATA_DIR=$PWD/.data
date > $L
bash $H build >> $L 2>&1
S="system.directkv_variant=stream executor.hbm_prefill=sdpa"
STEP_TIMEOUT=160 RATE_ARGS="datasets=[sharegpt] rates=[20] num_requests=100 system.names=[directkv,swap] $S" bash $H rate >> $L 2>&1; date >> $L
STEP_TIMEOUT=170 RATE_ARGS="datasets=[sharegpt] rates=[5] num_requests=100 system.names=[swap,directkv] $S" bash $H rate >> $L 2>&1; date >> $L
STEP_TIMEOUT=200 CONTEXT_ARGS="contexts=[16384,8192,2048] batch_size=4 output_len=16 system.names=[directkv,swap] $S" bash $H context >> $L 2>&1; date >> $L
