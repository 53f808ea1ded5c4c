#!/usr/bin/env bash
# The test suite: set up (idempotent), then pytest. Extra args go to pytest (e.g. -k losses).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
