# call 2 (34c1d80): decode kernels at the small points (stream now issued from C++), stream/swap pairs at ShareGPT 20 (both orders), 5 (swap first), Alpaca 10
set -u
L=$OUT/log.txt; H=experiments/device/h200.sh
export DIRECTKV_DATA_DIR=$PWD/.data
date > $L
bash $H build >> $L 2>&1
KERNEL_ARGS='ops=[decode] contexts=[4096,32768] decode_batches=[1,16]' bash $H kernels >> $L 2>&1
date >> $L
for order in "directkv,swap" "swap,directkv"; do STEP_TIMEOUT=130 RATE_ARGS="datasets=[sharegpt] rates=[20] num_requests=100 system.names=[$order] system.directkv_variant=stream" bash $H rate >> $L 2>&1; date >> $L; done
STEP_TIMEOUT=130 RATE_ARGS="datasets=[sharegpt] rates=[5] num_requests=100 system.names=[swap,directkv] system.directkv_variant=stream" bash $H rate >> $L 2>&1
date >> $L
STEP_TIMEOUT=100 RATE_ARGS="datasets=[alpaca] rates=[10] num_requests=100 system.names=[directkv,swap] system.directkv_variant=stream" bash $H rate >> $L 2>&1
date >> $L
