#!/usr/bin/env bash
# Sets up (venv, deps, build) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest tests -q -p no:cacheprovider "$@"
