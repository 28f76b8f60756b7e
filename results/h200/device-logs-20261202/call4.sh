# call 4 (9a95bf6): ShareGPT pairs with the warm-up pass at 20 (swap first) and 30 req/s (stream first)
set -u
L=$OUT/log.txt; H=experiments/device/h200.sh
export DIRECTKV_DATA_DIR=$PWD/.data
date > $L
bash $H build >> $L 2>&1
S="system.directkv_variant=stream"
STEP_TIMEOUT=125 RATE_ARGS="datasets=[sharegpt] rates=[20] num_requests=100 system.names=[swap,directkv] $S" bash $H rate >> $L 2>&1; date >> $L
STEP_TIMEOUT=125 RATE_ARGS="datasets=[sharegpt] rates=[30] num_requests=100 system.names=[directkv,swap] $S" bash $H rate >> $L 2>&1; date >> $L
