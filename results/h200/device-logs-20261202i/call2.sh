# call 2 (twenty-sixth session, 57eac26): ShareGPT 20 req/s in both orders, then 30 req/s stream first (one pair
# each so far put stream 7-11% behind swap)
set -u
L=$OUT/log.txt; H=experiments/device/h200.sh
mkdir -p .data && tar xzf .ab/data.tar.gz -C .data; export DIRECTKV_DATA_DIR=$PWD/.data
date > $L
bash $H build >> $L 2>&1
S="system.directkv_variant=stream executor.hbm_prefill=sdpa"
STEP_TIMEOUT=160 RATE_ARGS="datasets=[sharegpt] rates=[20] num_requests=100 system.names=[directkv,swap] $S" bash $H rate >> $L 2>&1; date >> $L
STEP_TIMEOUT=160 RATE_ARGS="datasets=[sharegpt] rates=[20] num_requests=100 system.names=[swap,directkv] $S" bash $H rate >> $L 2>&1; date >> $L
STEP_TIMEOUT=160 RATE_ARGS="datasets=[sharegpt] rates=[30] num_requests=100 system.names=[directkv,swap] $S" bash $H rate >> $L 2>&1; date >> $L
