# call 2 (twenty-fourth session, 0ac2bed): the stream decode ring as 3 slots x 64 MiB (same 384 MiB as the default
# 12 x 16 MiB; device_copy_modified, sed on paths.py before the first run) against swap (sdpa prompt chunks):
# OPT-13B 3 x 16K both orders, Llama batch 4 16K both orders, ShareGPT 10 req/s swap first
set -u
L=$OUT/log.txt; H=experiments/device/h200.sh
mkdir -p .data && tar xzf .ab/data.tar.gz -C .data; export DIRECTKV_DATA_DIR=$PWD/.data
date > $L
sed -i -e '118s/num_slots=self.stream_slots,/num_slots=3, chunk_bytes=64 << 20,/' -e '119s/ring_bytes=stream_ring_bytes(self.stream_slots)/ring_bytes=3 * 2 * (64 << 20)/' directkv/engine/gpu/paths.py
sed -n 117,119p directkv/engine/gpu/paths.py >> $L
bash $H build >> $L 2>&1
S="system.directkv_variant=stream executor.hbm_prefill=sdpa"
O="model=opt-13b contexts=[16384] batch_size=3 output_len=8 scheduler.max_batched_tokens=8192"
for order in "swap,directkv" "directkv,swap"; do
  STEP_TIMEOUT=110 CONTEXT_ARGS="$O system.names=[$order] $S" bash $H context >> $L 2>&1; date >> $L
done
for order in "directkv,swap" "swap,directkv"; do
  STEP_TIMEOUT=100 CONTEXT_ARGS="contexts=[16384] batch_size=4 output_len=16 system.names=[$order] $S" bash $H context >> $L 2>&1; date >> $L
done
STEP_TIMEOUT=200 RATE_ARGS="datasets=[sharegpt] rates=[10] num_requests=100 system.names=[swap,directkv] $S" bash $H rate >> $L 2>&1; date >> $L
