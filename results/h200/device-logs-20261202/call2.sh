# call 2 (23f5202): order effect: a sacrificial first system (hbm) before the pair; the pair after a 20 s pause
# following setup (.ab/settle.py); GEMM again (graph rows, second run)
set -u
L=$OUT/log.txt; H=experiments/device/h200.sh
export DIRECTKV_DATA_DIR=$PWD/.data
date > $L
bash $H build >> $L 2>&1
S="system.directkv_variant=stream"
STEP_TIMEOUT=150 RATE_ARGS="datasets=[sharegpt] rates=[10] num_requests=100 system.names=[hbm,swap,directkv] $S" bash $H rate >> $L 2>&1; date >> $L
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site DIRECTKV_CACHE=/tmp/dkvcache DIRECTKV_TOKENIZER=approx
SETTLE_S=20 timeout -s INT -k 20 150 python3 .ab/settle.py +exp=rate_sweep device=cuda results_root=/tmp/dkv-results progress=false datasets=[sharegpt] rates=[10] num_requests=100 "system.names=[swap,directkv]" $S >> $L 2>&1; date >> $L
GEMM_ARGS="sizes=[4096,10240]" bash $H gemm >> $L 2>&1; date >> $L
tar czf "$OUT/results.tar.gz" -C /tmp/dkv-results . 2>/dev/null
