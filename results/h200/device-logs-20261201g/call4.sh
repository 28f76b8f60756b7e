# call 4 (6b6c1c9): Llama batch 4 at 16K: per-step times and a traced decode-only step, swap then stream; 4K step times
set -u
L=$OUT/log.txt; H=experiments/device/h200.sh
export DIRECTKV_DATA_DIR=$PWD/.data
date > $L
bash $H build >> $L 2>&1
P="--variant stream --context 16384 --batch 4 --output 16 --graphs --min-decodes 4 --count 1 --rows 12"
PROFILE_TAG=c16k_ PROFILE_SYSTEMS="swap directkv" PROFILE_ARGS="$P" bash $H profile >> $L 2>&1
date >> $L
PROFILE_TAG=c4k_ PROFILE_SYSTEMS="directkv swap" PROFILE_ARGS="--variant stream --context 4096 --batch 4 --output 16 --graphs --count 0" bash $H profile >> $L 2>&1
date >> $L
