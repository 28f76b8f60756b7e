# call 4 (twenty-sixth session, 9a4c723): the fixed new-pass GPU test; the decode ring's slot count 24 / 36 at OPT-13B
# 3 x 32K (12 slots measured 1.134x swap in call 3; the cost model gives 1.17 / 1.055 / 1.037 for 12 / 24 / 36), one
# multirun; Llama batch 4 32K with 24 then 12 slots (the reverse of call 1's order)
set -u
L=$OUT/log.txt; H=experiments/device/h200.sh
mkdir -p .data && tar xzf .ab/data.tar.gz -C .data; export DIRECTKV_DATA_DIR=$PWD/.data
date > $L
bash $H build >> $L 2>&1
PYTHONPATH=$PWD:/tmp/site DIRECTKV_CACHE=/tmp/dkvcache python3 -m pytest -q -m gpu tests/test_prefill_new_pass.py > $OUT/gpu_tests.log 2>&1; tail -2 $OUT/gpu_tests.log >> $L; date >> $L
S="system.directkv_variant=stream executor.hbm_prefill=sdpa"
STEP_TIMEOUT=300 CONTEXT_ARGS="model=opt-13b contexts=[32760] batch_size=3 output_len=8 scheduler.max_batched_tokens=8192 system.names=[swap,directkv] $S executor.directkv_stream_slots=24,36 -m" bash $H context >> $L 2>&1; date >> $L
STEP_TIMEOUT=150 CONTEXT_ARGS="contexts=[32768] batch_size=4 output_len=16 system.names=[directkv,swap] $S executor.directkv_stream_slots=24,12 -m" bash $H context >> $L 2>&1; date >> $L
