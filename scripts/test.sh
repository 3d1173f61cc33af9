#!/usr/bin/env bash
# Install everything the tests need on a fresh Debian/Ubuntu machine, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh test
export COSYVOICE_GOLDEN_DIR="${COSYVOICE_GOLDEN_DIR:-$(pwd)/../shared/golden}"
export COSYVOICE3_GOLDEN_DIR="${COSYVOICE3_GOLDEN_DIR:-$(pwd)/../shared/golden_cv3}"
set +e
python -m pytest -ra "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "FAIL: pytest collected no tests" >&2
    exit 1
fi
exit "$rc"
