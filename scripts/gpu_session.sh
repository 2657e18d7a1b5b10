#!/usr/bin/env bash
# One call on a GPU machine, also one without network access: install the
# wheels carried in .whl/ (downloaded beforehand where there is a network),
# build the CUDA variant with all cores, then run the requested steps,
# logging under $OUT (or ./gpu-logs).
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
# step LOG CMD...: run CMD, keep its whole output in $OUT/LOG, show the tail.
step() {
  local log=$1; shift
  "$@" > "$OUT/$log" 2>&1; local r=$?
  tail -n 40 "$OUT/$log"
  [ $r -eq 0 ] || echo "!!! $log exited $r"
  rc=$((rc | r))
}
for s in "$@"; do
  echo "=== $s ($(date +%T))"
  case $s in
    build) step build.log python3 tools/build.py --backend cuda ;;
    test) step test.log python3 -m pytest tests -q -rfE -p no:cacheprovider --maxfail=20 -W ignore::UserWarning ${PYTEST_ARGS:-} ;;
    bench) step bench.log python3 benchmarks/bench_gpu.py --train --out "$OUT/bench.json" ;;
    cold) step cold.log python3 benchmarks/bench_gpu.py --only none --cold-start --out "$OUT/cold.json" ;;
    sanitize) step memcheck.log timeout ${SAN_TIMEOUT:-300} compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest tests/test_forward.py tests/test_train.py -q -p no:cacheprovider -x -k "cuda and not large" ;;
    racecheck) step racecheck.log timeout ${SAN_TIMEOUT:-300} compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest tests/test_train.py tests/test_forward.py -q -p no:cacheprovider -x -k "cuda and (deterministic or contrastive or candidates) and not large" ;;
    *) echo "unknown step $s"; rc=1 ;;
  esac
done
exit $rc
