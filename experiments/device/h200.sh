#!/usr/bin/env bash
# One device session on a lent GPU machine: environment, build, GPU tests, then the named experiments.
# Usage: bash experiments/device/h200.sh [STEP ...]   (steps: env build test all probe kernels gemm ncu context rate cpu profile)
# STEP_TIMEOUT=S stops an experiment step after S seconds (SIGINT; finished points are already on disk) so the
# device call's own limit never cuts the packing of results.
# The device image has no Hydra: carry its wheels in .whl/ (pip download hydra-core omegaconf; pip wheel
# antlr4-python3-runtime==4.9.3), which this script installs into /tmp/site.
# Pass the commit: DIRECTKV_GIT_SHA=$(git rev-parse HEAD) (the device copy has no git history).
# The ShareGPT / Alpaca samples live outside the checkout (../shared/data): copy them into an ignored .data/,
# carry it, and export DIRECTKV_DATA_DIR=$PWD/.data for the rate step.
# Results are packed into $OUT/results.tar.gz (the device tool returns at most 2 folder levels), logs into $OUT.
# The tool also returns at most 8 files: the test step writes two logs and the profile step one per system,
# so send other output to one log file (a call that left 10 files in $OUT lost its results.tar.gz). PROFILE_TAG=x
# names the profile step's files profile_x<system>.txt, so a second profile step does not overwrite the first's.
# A Hydra multirun in one process: put -m LAST in *_ARGS (CONTEXT_ARGS="... key=a,b -m"); before the overrides the
# device's Python 3.12 argparse refused them (2026-12-02).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site DIRECTKV_CACHE=${DIRECTKV_CACHE:-/tmp/dkvcache} DIRECTKV_TOKENIZER=${DIRECTKV_TOKENIZER:-approx}
RES=/tmp/dkv-results
mkdir -p $RES
run() { echo "=== $* ($(date +%T))"; if [ -n "${STEP_TIMEOUT:-}" ]; then timeout -s INT -k 20 "$STEP_TIMEOUT" "$@"; else "$@"; fi
        echo "=== rc=$? ($(date +%T))"; }
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(env build test)
# Every experiment step needs the ops built; on a cold machine that is ~45 s, which a step's timeout would
# otherwise count (two runs were lost to it on 2026-11-29). Built once here, outside any timeout; a warm
# cache makes this a hash check.
built=
ensure_built() { [ -n "$built" ] && return; built=1
  python3 -c "from directkv.kernels.cuda import build;import time;t=time.time();build.build_all();print('ops built or cached in %.0f s'%(time.time()-t))" 2>&1 | tail -3; }
for step in "${steps[@]}"; do
  case $step in probe|kernels|gemm|context|rate|cpu|ncu|profile) ensure_built ;; esac
  case $step in
    env) run nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
         run python3 -c "import torch,sys;print(sys.version.split()[0],torch.__version__,torch.version.cuda,torch.cuda.get_device_name(0))" ;;
    build) built=1; run python3 -c "from directkv.kernels.cuda import build;import time;t=time.time();print(build.build_all());print('build s',time.time()-t)" ;;
    test) python3 -m pytest -q -m gpu tests 2>&1 | tee $OUT/gpu_tests.log | tail -25
          # the CPU kernel is built with -march=native: check it (and each item it can compile) on this CPU too
          python3 -m pytest -q tests/test_cpu_decode_attention.py tests/test_cpu_decode_paths.py 2>&1 | tee $OUT/cpu_kernel_tests.log | tail -3 ;;
    # the whole suite as a user here runs it (README's test command): CPU tests must pass beside a GPU too
    all) python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tee $OUT/all_tests.log | tail -25 ;;
    probe) run python3 -c "from directkv.kernels.cuda.probe import measure_ceilings as m;print(m())" ;;
    kernels) run python3 -m experiments.run +exp=kernel_ablation device=cuda results_root=$RES progress=false ${KERNEL_ARGS:-} ;;
    gemm) run python3 -m experiments.run +exp=gemm_case_study device=cuda results_root=$RES progress=false ${GEMM_ARGS:-} ;;
    context) run python3 -m experiments.run +exp=context_sweep device=cuda results_root=$RES progress=false ${CONTEXT_ARGS:-} ;;
    rate) run python3 -m experiments.run +exp=rate_sweep device=cuda results_root=$RES progress=false ${RATE_ARGS:-} ;;
    cpu) run python3 -m experiments.run +exp=cpu_attention results_root=$RES progress=false ${CPU_ARGS:-} ;;
    ncu) run python3 -m experiments.run +exp=kernel_ablation device=cuda results_root=$RES progress=false counters=ncu ${NCU_ARGS:-}
         run python3 -m experiments.run +exp=gemm_case_study device=cuda results_root=$RES progress=false counters=ncu sizes=[10240] ;;
    profile) for sys in ${PROFILE_SYSTEMS:-swap directkv}; do
               # to the file first, then its head: `tee | head` cut the file short once head had its lines
               run python3 -m directkv.engine.gpu.profile --system $sys ${PROFILE_ARGS:-} > $OUT/profile_${PROFILE_TAG:-}$sys.txt 2>&1
               head -60 $OUT/profile_${PROFILE_TAG:-}$sys.txt
             done ;;
    *) echo "unknown step $step" ;;
  esac
  tar czf "$OUT/results.tar.gz" -C $RES . 2>/dev/null  # after every step: a later timeout keeps what is done
done
ls -la "$OUT"
