# call 2 (b7dcb99, executor.directkv_stream_slots=8): Llama batch-4 context pair 16K/4K/1K both orders; ShareGPT 30 pair swap first; ShareGPT 20 stream first
set -u
L=$OUT/log.txt; H=experiments/device/h200.sh
export DIRECTKV_DATA_DIR=$PWD/.data
date > $L
bash $H build >> $L 2>&1
S="system.directkv_variant=stream executor.directkv_stream_slots=8"
for order in "directkv,swap" "swap,directkv"; do STEP_TIMEOUT=170 CONTEXT_ARGS="contexts=[16384,4096,1024] batch_size=4 output_len=16 system.names=[$order] $S" bash $H context >> $L 2>&1; date >> $L; done
STEP_TIMEOUT=95 RATE_ARGS="datasets=[sharegpt] rates=[30] num_requests=100 system.names=[swap,directkv] $S" bash $H rate >> $L 2>&1; date >> $L
STEP_TIMEOUT=95 RATE_ARGS="datasets=[sharegpt] rates=[20] num_requests=100 system.names=[directkv,swap] $S" bash $H rate >> $L 2>&1; date >> $L
