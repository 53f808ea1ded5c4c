#!/usr/bin/env bash
# specdec's own tests with the distill package absent: specdec stands alone (it never imports distill).
#   bash scripts/test_specdec_alone.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/tests"
cp -r specdec "$tmp/"
cp tests/test_specdec_*.py tests/test_heads.py "$tmp/tests/"
# the suite's conftest, plus a guard: any import of distill fails
{ cat tests/conftest.py; printf '\nimport sys\nsys.modules["distill"] = None  # absent\n'; } > "$tmp/tests/conftest.py"
cd "$tmp"
"$OLDPWD/.venv/bin/python" -m pytest -q -p no:cacheprovider tests "$@"
