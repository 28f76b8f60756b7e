# call 5 (twenty-sixth session, ae766d1): the new default executor.directkv_stream_slots=auto (no slots override):
# OPT-13B 3 x 16K (auto -> 24) stream first, Llama batch 4 32K (auto -> 12) stream first; the slot and new-pass GPU tests
set -u
L=$OUT/log.txt; H=experiments/device/h200.sh
date > $L
bash $H build >> $L 2>&1
PYTHONPATH=$PWD:/tmp/site DIRECTKV_CACHE=/tmp/dkvcache python3 -m pytest -q -m gpu tests/test_prefill_new_pass.py tests/test_stream_slots.py > $OUT/gpu_tests.log 2>&1; tail -2 $OUT/gpu_tests.log >> $L; date >> $L
S="system.directkv_variant=stream executor.hbm_prefill=sdpa"
STEP_TIMEOUT=120 CONTEXT_ARGS="model=opt-13b contexts=[16384] batch_size=3 output_len=8 scheduler.max_batched_tokens=8192 system.names=[directkv,swap] $S" bash $H context >> $L 2>&1; date >> $L
STEP_TIMEOUT=110 CONTEXT_ARGS="contexts=[32768] batch_size=4 output_len=16 system.names=[directkv,swap] $S" bash $H context >> $L 2>&1; date >> $L
