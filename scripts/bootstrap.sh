# shellcheck shell=bash
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
command -v soxi >/dev/null || need_apt+=(sox)  # the play URL tests open its WAVs in sox
# streamed WAVs are read from a pipe by ffmpeg too; G.722 is checked byte for byte against its encoder
command -v ffmpeg >/dev/null || need_apt+=(ffmpeg)
# deploy/: a real Prometheus scrapes a gateway to check the dashboard and alert rules (promtool comes with it);
# the GPU-host install script is linted with shellcheck
command -v prometheus >/dev/null || need_apt+=(prometheus)
command -v shellcheck >/dev/null || need_apt+=(shellcheck)
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
# The CPU build of torch: PyPI's torch for Linux is the CUDA build (GBs of CUDA libraries a CPU host never
# uses), so a plain `pip install torch` is not it. A +cpu wheel pip already offers (find-links or a local
# index, as on CI here) is installed from there; otherwise it comes from PyTorch's CPU index. GPU hosts: README.
if [ "$extras" = "test" ] && ! python -c "import torch" 2>/dev/null; then
    echo ">> installing torch (CPU build)"
    python -m pip install -q "torch==2.13.0+cpu" 2>/dev/null \
        || python -m pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
fi
echo ">> installing cosyvoice-gateway[$extras] (versions pinned by requirements.lock)"
# The lock pins every dependency but torch (installed above, or the host's CUDA build): as constraints, it
# fixes the versions of whatever these extras need and installs nothing they do not.
python -m pip install -q -c "$root/requirements.lock" -e "${root}[$extras]"
