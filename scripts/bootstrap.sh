# Sourced by quickstart.sh and test.sh: system packages + a project venv, idempotent.
# Usage: source scripts/bootstrap.sh [extras]   (default extras: test)
set -euo pipefail
extras="${1:-test}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${COSYVOICE_GATEWAY_VENV:-$root/.venv}"

need_apt=()
command -v sipp >/dev/null || need_apt+=(sip-tester)
command -v espeak-ng >/dev/null || need_apt+=(espeak-ng)
dpkg -s libsofia-sip-ua0 libapr1 libaprutil1 >/dev/null 2>&1 || need_apt+=(libapr1 libaprutil1 libsofia-sip-ua0)  # UniMRCP umc, the MRCP tests' client
# the failover test runs Kamailio's dispatcher in front of several gateways (sip_config/kamailio/)
command -v kamailio >/dev/null || [ -x /usr/sbin/kamailio ] || need_apt+=(kamailio)
# the TTS API's try-a-voice page is tested in a real headless browser
command -v chromium >/dev/null || need_apt+=(chromium)
command -v chromedriver >/dev/null || need_apt+=(chromium-driver)
if [ "${#need_apt[@]}" -gt 0 ] && [ "$extras" = "test" ]; then
    sudo_cmd=""; [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
    echo ">> installing system packages: ${need_apt[*]}"
    $sudo_cmd apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if [ ! -x "$venv/bin/python" ]; then
    echo ">> creating virtual environment $venv"
    python3 -m venv "$venv"
fi
# shellcheck disable=SC1091
source "$venv/bin/activate"
python -m pip install -q --upgrade pip
# The CPU build of torch, so pip never pulls a multi-GB CUDA build on a CPU host (GPU hosts: see README).
if [ "$extras" = "test" ] && ! python -c "import torch" 2>/dev/null; then
    echo ">> installing torch (CPU build)"
    python -m pip install -q "torch==2.13.0"
fi
echo ">> installing cosyvoice-gateway[$extras]"
python -m pip install -q -e "$root[$extras]"
