#!/usr/bin/env bash
# Creates .venv (reusing a preinstalled torch when there is one), installs the
# test/runtime dependencies and builds the kernels-hub variant for this machine
# (CUDA when nvcc and a CUDA torch are present, else CPU). Idempotent and
# quick when nothing changed: each step checks before it acts, and the build
# is incremental (tools/build.py).
#
# Prints one line per step; pip's and the compiler's output go to
# .cache/setup.log, shown only when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .cache
LOG=.cache/setup.log
: >"$LOG"
PY=${PYTHON:-python3}
VPY=.venv/bin/python

# step NAME COMMAND...: runs COMMAND with its output in the log, then prints
# one line with the elapsed time (and the log's tail on failure).
step() {
  local name=$1 t0=$SECONDS
  shift
  printf 'setup: %-13s' "$name"
  if "$@" >>"$LOG" 2>&1; then
    echo " ok ($((SECONDS - t0)) s)"
  else
    echo " FAILED ($((SECONDS - t0)) s); the last lines of $LOG:"
    tail -n 40 "$LOG" >&2
    exit 1
  fi
}

pipi() {
  if [ -d .whl ] && "$VPY" -m pip install --no-index --find-links .whl "$@"; then return; fi
  "$VPY" -m pip install "$@"
}

# One interpreter start answers every question the steps below ask.
probe() {
  local gpu=""  # a CUDA build needs nvcc and a GPU device node
  if command -v nvcc >/dev/null && compgen -G "/dev/nvidia[0-9]*" >/dev/null; then gpu=1; fi
  MAXSIM_GPU=$gpu "$VPY" - <<'EOF' 2>/dev/null || echo "torch"
import importlib.metadata as m, importlib.util as u
missing = [n for n in ("torch", "kernels", "pytest", "hypothesis", "numpy", "matplotlib", "ninja") if u.find_spec(n) is None]
for dist in ("pylate", "colpali-engine"):
    try:
        m.version(dist)
    except m.PackageNotFoundError:
        missing.append("integrations")
        break
print(" ".join(missing))
if "torch" not in missing:
    import os
    if os.environ["MAXSIM_GPU"]:  # torch is imported only where a CUDA build is possible
        import torch
        print("cuda" if torch.cuda.is_available() else "cpu")
    else:
        print("cpu")
EOF
}

venv() { [ -x "$VPY" ] || "$PY" -m venv --system-site-packages .venv; }

torch_install() {
  # A CPU build keeps the download small; a GPU machine normally has torch already.
  pipi "torch==2.13.0" || pipi torch
}

# matplotlib: the examples and benchmarks/render.py draw PNG charts (Agg backend).
test_deps() { pipi "kernels==0.17.2" pytest hypothesis numpy ninja matplotlib; }

# Integration tests run against the real PyLate and colpali-engine. Both go in
# with --no-deps: PyLate pins fast-plaid (wheels built for torch <= 2.11; only
# its PLAID index needs it) and colpali-engine pulls torchvision (a CUDA build
# from PyPI that fails to load next to a CPU torch; transformers treats it as
# optional). Their remaining requirements go in first, with torch pinned to the
# installed version so pip never swaps torch.
integration_deps() {
  local tv
  tv=$("$VPY" -c 'import torch; print(torch.__version__.split("+")[0])')
  pipi "torch==$tv" "sentence-transformers==5.3.0" "transformers==5.3.0" "datasets>=2.20.0" \
    "accelerate>=0.31.0" "pandas>=2.2.1" "ujson==5.12.0" "peft>=0.18.0,<0.21.0" pillow scipy requests
  pipi --no-deps "pylate==1.6.0" "colpali-engine==0.3.18"
}

build() { "$VPY" tools/build.py --backend "$1"; }

step venv venv
state=$(probe)
missing=$(sed -n 1p <<<"$state")
if [[ " $missing " == *" torch "* ]]; then
  step torch torch_install
  state=$(probe)
  missing=$(sed -n 1p <<<"$state")
fi
if [ -n "${missing// /}" ]; then
  [[ "$missing" =~ (kernels|pytest|hypothesis|numpy|matplotlib|ninja) ]] && step dependencies test_deps
  [[ " $missing " == *" integrations "* ]] && step integrations integration_deps
else
  echo "setup: dependencies  ok (installed)"
fi
backend=${MAXSIM_BACKEND:-$(sed -n 2p <<<"$state")}
step "build $backend" build "${backend:-cpu}"
