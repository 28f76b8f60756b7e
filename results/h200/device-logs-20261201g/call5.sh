# call 5 (6b6c1c9): Llama batch 4 at 16K, traced decode-only step with >= 1 decode (1d+0p: stream 43.1 vs swap 40.9 ms in call 4), swap then stream
set -u
L=$OUT/log.txt; H=experiments/device/h200.sh
export DIRECTKV_DATA_DIR=$PWD/.data
date > $L
bash $H build >> $L 2>&1
P="--variant stream --context 16384 --batch 4 --output 16 --graphs --skip 44 --min-decodes 1 --count 1 --rows 30"
PROFILE_TAG=t16k_ PROFILE_SYSTEMS="swap directkv" PROFILE_ARGS="$P" bash $H profile >> $L 2>&1
date >> $L
