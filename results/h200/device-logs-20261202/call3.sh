# call 3: pairs with the warm-up pass (executor.warmup_pass, default on): ShareGPT 10 both orders, ShareGPT 5 swap first, Llama batch 4 2K/1K both orders
set -u
L=$OUT/log.txt; H=experiments/device/h200.sh
export DIRECTKV_DATA_DIR=$PWD/.data
date > $L
bash $H build >> $L 2>&1
S="system.directkv_variant=stream"
for names in "swap,directkv" "directkv,swap"; do
  STEP_TIMEOUT=140 RATE_ARGS="datasets=[sharegpt] rates=[10] num_requests=100 system.names=[$names] $S" bash $H rate >> $L 2>&1; date >> $L
done
for names in "directkv,swap" "swap,directkv"; do
  STEP_TIMEOUT=60 CONTEXT_ARGS="contexts=[2048,1024] batch_size=4 output_len=16 system.names=[$names] $S" bash $H context >> $L 2>&1; date >> $L
done
STEP_TIMEOUT=130 RATE_ARGS="datasets=[sharegpt] rates=[5] num_requests=100 system.names=[swap,directkv] $S" bash $H rate >> $L 2>&1; date >> $L
