#!/usr/bin/env bash
# Creates .venv (reusing a preinstalled torch when there is one), installs the
# test/runtime dependencies and builds the kernels-hub variant for this machine
# (CUDA when nvcc and a CUDA torch are present, else CPU). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv
fi
VPY=.venv/bin/python
pipi() {
  if [ -d .whl ]; then "$VPY" -m pip install -q --no-index --find-links .whl "$@" 2>/dev/null && return; fi
  "$VPY" -m pip install -q "$@"
}
if ! "$VPY" -c "import torch" 2>/dev/null; then
  # A CPU build keeps the download small; a GPU machine normally has torch already.
  pipi "torch==2.13.0" || pipi torch
fi
"$VPY" -c "import kernels, pytest, hypothesis, numpy" 2>/dev/null || pipi "kernels==0.17.2" pytest hypothesis numpy ninja
backend=${MAXSIM_BACKEND:-}
if [ -z "$backend" ]; then
  if "$VPY" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
     && command -v nvcc >/dev/null; then backend=cuda; else backend=cpu; fi
fi
"$VPY" tools/build.py --backend "$backend"
