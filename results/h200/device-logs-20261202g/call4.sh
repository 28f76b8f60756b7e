# call 4 (twenty-fourth session, HEAD: executor.directkv_stream_chunk_mib, default 64, and the prefetch test's fix):
# the fixed GPU test; then, each as one Hydra multirun (-m last: python 3.12's argparse refused it before the
# overrides in call 3), one process, jobs chunk 16 then 64, swap beside stream in each job, sdpa prompt chunks:
# ShareGPT 10 req/s, then Llama b4 32K (device budget: 518 s left)
set -u
L=$OUT/log.txt; H=experiments/device/h200.sh
mkdir -p .data && tar xzf .ab/data.tar.gz -C .data; export DIRECTKV_DATA_DIR=$PWD/.data
date > $L
bash $H build >> $L 2>&1
PYTHONPATH=$PWD:/tmp/site DIRECTKV_CACHE=/tmp/dkvcache python3 -m pytest -q -m gpu tests/test_gpu_executor.py -k prefetch_reads_what_tiled_reads > $OUT/gpu_tests.log 2>&1; tail -1 $OUT/gpu_tests.log >> $L; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log >> $L; date >> $L
S="system.directkv_variant=stream executor.hbm_prefill=sdpa executor.directkv_stream_chunk_mib=16,64 -m"
STEP_TIMEOUT=250 RATE_ARGS="datasets=[sharegpt] rates=[10] num_requests=100 system.names=[swap,directkv] $S" bash $H rate >> $L 2>&1; date >> $L
STEP_TIMEOUT=100 CONTEXT_ARGS="contexts=[32768] batch_size=4 output_len=16 system.names=[swap,directkv] $S" bash $H context >> $L 2>&1; date >> $L
