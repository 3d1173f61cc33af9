#!/usr/bin/env bash
# Regenerate requirements.lock: every Python dependency of the project and its extras (tts, phone, test) pinned,
# for every Python >= 3.11 (--universal: markers where versions differ), torch and what torch pulls left out.
# torch is installed on its own before the lock is used (CPU hosts and CI: torch==2.13.0, CPU build; GPU hosts:
# the CUDA build matching the driver, scripts/install_gpu_host.sh), so the lock never pins a CUDA build.
# Installs use it as constraints: pip install -c requirements.lock -e '.[EXTRAS]'.
# Needs uv (pip install uv). Commit the result with the pyproject change that needed it.
set -euo pipefail
cd "$(dirname "$0")/.."
overrides="$(mktemp)"
trap 'rm -f "$overrides"' EXIT
# An override whose marker never holds removes the requirement (torch) with everything only it needs.
echo "torch ; sys_platform == 'never'" > "$overrides"
uv pip compile pyproject.toml --universal --python-version 3.11 --extra tts --extra phone --extra test \
    --override "$overrides" --no-header --quiet -o requirements.lock.tmp
{
    echo "# Pinned Python dependencies of cosyvoice-gateway[tts,phone,test], torch excluded (installed first,"
    echo "# separately: the CPU or CUDA build). Used as constraints: pip install -c requirements.lock -e '.[test]'."
    echo "# Regenerate with scripts/lock.sh (uv); tests/deploy/test_lock.py checks it covers pyproject.toml."
    # drop what only torch needed (marked never by the override): a constraint that can never apply
    awk '/^[^ #]/ { skip = index($0, "sys_platform == '"'"'never'"'"'") > 0 } !skip' requirements.lock.tmp
} > requirements.lock
rm requirements.lock.tmp
