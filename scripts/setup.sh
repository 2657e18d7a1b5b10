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
# matplotlib: the examples and benchmarks/render.py draw PNG charts (Agg backend).
"$VPY" -c "import kernels, pytest, hypothesis, numpy, matplotlib" 2>/dev/null \
  || pipi "kernels==0.17.2" pytest hypothesis numpy ninja matplotlib
# Integration tests run against the real PyLate and colpali-engine. Both go in
# with --no-deps: PyLate pins fast-plaid (wheels built for torch <= 2.11; only
# its PLAID index needs it) and colpali-engine pulls torchvision (a CUDA build
# from PyPI that fails to load next to a CPU torch; transformers treats it as
# optional). Their remaining requirements are listed with torch pinned to the
# installed version so pip never swaps torch.
# (Checked by metadata: importing colpali_engine next to kernels needs the
# workaround in torch-ext/maxsim/integrations/_patch.py.)
if ! "$VPY" -c "import importlib.metadata as m; m.version('pylate'); m.version('colpali-engine')" 2>/dev/null; then
  tv=$("$VPY" -c 'import torch; print(torch.__version__.split("+")[0])')
  pipi --no-deps "pylate==1.6.0" "colpali-engine==0.3.18"
  pipi "torch==$tv" "sentence-transformers==5.3.0" "transformers==5.3.0" "datasets>=2.20.0" \
    "accelerate>=0.31.0" "pandas>=2.2.1" "ujson==5.12.0" "peft>=0.18.0,<0.21.0" pillow scipy requests
fi
backend=${MAXSIM_BACKEND:-}
if [ -z "$backend" ]; then
  if "$VPY" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
     && command -v nvcc >/dev/null; then backend=cuda; else backend=cpu; fi
fi
"$VPY" tools/build.py --backend "$backend"
