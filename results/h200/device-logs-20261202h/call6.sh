# call 6 (twenty-fifth session, 2c1bb69; one command line): our decode kernel over HBM pages against SDPA
L=$OUT/log.txt; date > $L; export PYTHONPATH=$PWD:/tmp/site DIRECTKV_CACHE=/tmp/dkvcache
timeout -s INT 150 python3 results/h200/device-logs-20261202e/hbm_decode.py >> $L 2>&1; echo rc=$? >> $L; date >> $L
