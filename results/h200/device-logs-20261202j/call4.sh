# call 4 (twenty-seventh session, 1190585's code): Llama 5 x 128K, directkv stream then cpu_attn in one process, no
# warm-up pass (it would serve the 5 x 128K point twice); directkv first, so it bears the cold process's first seconds
set -u
cp .ab/h200-pcie5.head.json directkv/specs/calibration/h200-pcie5.json
L=$OUT/log.txt; H=experiments/device/h200.sh
date > $L
bash $H build >> $L 2>&1
S="system.directkv_variant=stream executor.hbm_prefill=sdpa"
STEP_TIMEOUT=560 CONTEXT_ARGS="contexts=[131068] batch_size=5 output_len=4 scheduler.max_batched_tokens=8192 system.names=[directkv,cpu_attn] executor.warmup_pass=false $S" bash $H context >> $L 2>&1; date >> $L
