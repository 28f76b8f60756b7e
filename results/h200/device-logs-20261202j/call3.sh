# call 3 (twenty-seventh session, ca564f4 = 1190585's code): directkv stream against cpu_attn where cpu_attn was ahead
# of the old tiled variant (Llama 2 x 64K; OPT-13B 3 x 32K and 3 x 16K), one process per point, warm-up pass on.
# The local tree holds a helper's uncommitted calibration file; the committed one is put back first (simulated rows).
set -u
cp .ab/h200-pcie5.head.json directkv/specs/calibration/h200-pcie5.json
L=$OUT/log.txt; H=experiments/device/h200.sh
date > $L
bash $H build >> $L 2>&1
S="system.directkv_variant=stream executor.hbm_prefill=sdpa"
STEP_TIMEOUT=150 CONTEXT_ARGS="contexts=[65536] batch_size=2 output_len=8 scheduler.max_batched_tokens=8192 system.names=[cpu_attn,directkv] $S" bash $H context >> $L 2>&1; date >> $L
STEP_TIMEOUT=230 CONTEXT_ARGS="model=opt-13b contexts=[32760] batch_size=3 output_len=8 scheduler.max_batched_tokens=8192 system.names=[directkv,cpu_attn] $S" bash $H context >> $L 2>&1; date >> $L
STEP_TIMEOUT=130 CONTEXT_ARGS="model=opt-13b contexts=[16384] batch_size=3 output_len=8 scheduler.max_batched_tokens=8192 system.names=[cpu_attn,directkv] $S" bash $H context >> $L 2>&1; date >> $L
