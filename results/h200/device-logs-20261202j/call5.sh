# call 5 (twenty-seventh session, 1190585's code): Llama 2 x 64K, directkv stream first then cpu_attn (call 3 had
# cpu_attn first: 1.007), warm-up pass on
set -u
cp .ab/h200-pcie5.head.json directkv/specs/calibration/h200-pcie5.json
L=$OUT/log.txt; H=experiments/device/h200.sh
date > $L
bash $H build >> $L 2>&1
S="system.directkv_variant=stream executor.hbm_prefill=sdpa"
STEP_TIMEOUT=150 CONTEXT_ARGS="contexts=[65536] batch_size=2 output_len=8 scheduler.max_batched_tokens=8192 system.names=[directkv,cpu_attn] $S" bash $H context >> $L 2>&1; date >> $L
