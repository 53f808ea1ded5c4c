#!/usr/bin/env bash
# The main job: set up (idempotent), then the whole pipeline on the embedded default, offline.
#   bash scripts/run.sh                       # experiment=default (the main job)
#   bash scripts/run.sh experiment=smoke      # a few minutes; any Hydra override works
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
[ $# -gt 0 ] || set -- experiment=default
exec .venv/bin/python -m distill.pipeline "$@"
