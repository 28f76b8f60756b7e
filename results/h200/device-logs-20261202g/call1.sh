# call 1 (twenty-fourth session, 0ac2bed): GPU suite at HEAD; ncu prefill 16K past x 2048 new with the read probe
# (counter overhead vs re-reads); Llama b4 32K stream / swap (sdpa) swap-first; then the stream decode ring as
# 3 slots x 64 MiB (same 384 MiB as 12 x 16 MiB; fewer, larger ring chunks per layer; device_copy_modified) both orders
set -u
L=$OUT/log.txt; H=experiments/device/h200.sh
mkdir -p .data && tar xzf .ab/data.tar.gz -C .data; export DIRECTKV_DATA_DIR=$PWD/.data
date > $L
bash $H build test >> $L 2>&1
tail -2 $OUT/gpu_tests.log >> $L; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log >> $L; tail -1 $OUT/cpu_kernel_tests.log >> $L; rm -f $OUT/cpu_kernel_tests.log; date >> $L
STEP_TIMEOUT=150 KERNEL_ARGS='counters=ncu ops=[prefill] prefill_contexts=[16384] prefill_q_lens=[2048]' bash $H kernels >> $L 2>&1; date >> $L
S="system.directkv_variant=stream executor.hbm_prefill=sdpa"
STEP_TIMEOUT=120 CONTEXT_ARGS="contexts=[32768] batch_size=4 output_len=16 system.names=[swap,directkv] $S" bash $H context >> $L 2>&1; date >> $L
sed -i -e '118s/num_slots=self.stream_slots,/num_slots=3, chunk_bytes=64 << 20,/' -e '119s/ring_bytes=stream_ring_bytes(self.stream_slots)/ring_bytes=3 * 2 * (64 << 20)/' directkv/engine/gpu/paths.py
sed -n 117,119p directkv/engine/gpu/paths.py >> $L
for order in "directkv,swap" "swap,directkv"; do
  STEP_TIMEOUT=120 CONTEXT_ARGS="contexts=[32768] batch_size=4 output_len=16 system.names=[$order] $S" bash $H context >> $L 2>&1; date >> $L
done
