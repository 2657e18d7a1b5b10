#!/usr/bin/env bash
# One call on a lent GPU machine (no network): install the carried wheels
# (.whl, from ../shared/tools/device-wheels.sh), build the CUDA variant with
# all cores, then run the requested steps, logging under $OUT (or ./gpu-logs).
#   bash scripts/gpu_session.sh build test bench sanitize cold
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-logs}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 MAX_JOBS=${MAX_JOBS:-16}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || exit 1
fi
export CUTLASS_INCLUDE=${CUTLASS_INCLUDE:-/tmp/site/cutlass_library/source/include}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)" | tee -a "$OUT/gpu.txt"
rc=0
for step in "$@"; do
  echo "=== $step ($(date +%T))"
  case $step in
    build) time python3 tools/build.py --backend cuda 2>&1 | tee "$OUT/build.log" | tail -5; rc=$((rc | PIPESTATUS[0])) ;;
    test) python3 -m pytest tests -q -rfE -p no:cacheprovider --maxfail=20 -W ignore::UserWarning ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/test.log" | tail -25; rc=$((rc | PIPESTATUS[0])) ;;
    testk=*) python3 -m pytest tests -q -p no:cacheprovider -k "${step#testk=}" 2>&1 | tee "$OUT/test-k.log" | tail -25; rc=$((rc | PIPESTATUS[0])) ;;
    bench) python3 benchmarks/bench_gpu.py --train --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"; rc=$((rc | PIPESTATUS[0])) ;;
    cold) python3 benchmarks/bench_gpu.py --only none --cold-start --out "$OUT/cold.json" 2>&1 | tee "$OUT/cold.log" ;;
    sanitize) compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest tests/test_forward.py -q -p no:cacheprovider -x -k "cuda" 2>&1 | tee "$OUT/memcheck.log" | tail -8; rc=$((rc | PIPESTATUS[0])) ;;
    *) echo "unknown step $step"; rc=1 ;;
  esac
done
exit $rc
