#!/usr/bin/env bash
# Sets up (venv, deps, build) and runs the quickstart demo on the GPU when
# there is one, else on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/01_quickstart.py "$@"
