# call 7 (twenty-fifth session, 2c1bb69; one command line): ncu of the decode variants at 4K x 1 with the read probe
L=$OUT/log.txt; date > $L; STEP_TIMEOUT=160 KERNEL_ARGS='counters=ncu ops=[decode] contexts=[4096] decode_batches=[1]' bash experiments/device/h200.sh kernels >> $L 2>&1; date >> $L
