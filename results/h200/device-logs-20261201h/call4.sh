# call 4 (9c92caa): Llama batch-4 context pair 32K/8K/2K both orders; ShareGPT 10 pair swap first after a 30 s pause (is the slow first run the previous process's teardown?)
set -u
L=$OUT/log.txt; H=experiments/device/h200.sh
export DIRECTKV_DATA_DIR=$PWD/.data
date > $L
bash $H build >> $L 2>&1
S="system.directkv_variant=stream"
for order in "directkv,swap" "swap,directkv"; do vmstat 1 2 >> $L; STEP_TIMEOUT=120 CONTEXT_ARGS="contexts=[32768,8192,2048] batch_size=4 output_len=16 system.names=[$order] $S" bash $H context >> $L 2>&1; date >> $L; done
vmstat 1 2 >> $L; sleep 30; vmstat 1 2 >> $L
STEP_TIMEOUT=95 RATE_ARGS="datasets=[sharegpt] rates=[10] num_requests=100 system.names=[swap,directkv] $S" bash $H rate >> $L 2>&1; date >> $L
