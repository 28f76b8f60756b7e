# call 2 (twenty-seventh session, 1190585): cpu_attn, FlexGen and hbm at ShareGPT 10 req/s, 100 requests (their
# step series, for their own host-time fit); then a stream / swap pair at 10 req/s, swap first (auto = 12 slots)
set -u
L=$OUT/log.txt; H=experiments/device/h200.sh
mkdir -p .data && tar xzf .ab/data.tar.gz -C .data; export DIRECTKV_DATA_DIR=$PWD/.data
date > $L
bash $H build >> $L 2>&1
S="system.directkv_variant=stream executor.hbm_prefill=sdpa"
STEP_TIMEOUT=250 RATE_ARGS='datasets=[sharegpt] rates=[10] num_requests=100 system.names=[cpu_attn,flexgen,hbm]' bash $H rate >> $L 2>&1; date >> $L
STEP_TIMEOUT=160 RATE_ARGS="datasets=[sharegpt] rates=[10] num_requests=100 system.names=[swap,directkv] $S" bash $H rate >> $L 2>&1; date >> $L
