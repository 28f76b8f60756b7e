# call 5 (twenty-fifth session, 2c1bb69; sent as one command line): swap's two prompt-chunk paths in one process
L=$OUT/log.txt; H=experiments/device/h200.sh; mkdir -p .data && tar xzf .ab/data.tar.gz -C .data; export DIRECTKV_DATA_DIR=$PWD/.data
date > $L; STEP_TIMEOUT=270 RATE_ARGS="datasets=[sharegpt] rates=[10] num_requests=100 system.names=[swap] executor.hbm_prefill=kernel,sdpa -m" bash $H rate >> $L 2>&1; date >> $L
