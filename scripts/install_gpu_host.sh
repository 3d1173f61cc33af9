#!/usr/bin/env bash
# Install cosyvoice-gateway on a fresh Debian/Ubuntu GPU host, in one command, from this checkout:
#
#   sudo scripts/install_gpu_host.sh --model-dir /opt/models/CosyVoice2-0.5B [--allow 10.0.0.0/8] [--advertised-host IP]
#
# 1. reads the driver's CUDA version (nvidia-smi) and picks the PyTorch wheel index of the newest CUDA build of
#    torch $TORCH_VERSION that driver runs (TORCH_CUDA_BUILDS below);
# 2. apt: python3, python3-venv; the system user cosyvoice;
# 3. a venv in /opt/cosyvoice-gateway/venv: torch's CUDA build, then this project with its tts extra, every other
#    version from requirements.lock;
# 4. /etc/cosyvoice-gateway/gateway.yaml (kept if present): cosyvoice2 on every GPU, the model directory given;
# 5. the compiler-cache directory /var/cache/cosyvoice-gateway and the systemd unit (plus a drop-in letting
#    `voice add` write the model's voices/ directory);
# 6. `cosyvoice-gateway doctor` as the service user, then starts the service (--no-start: not).
#
# --dry-run prints every step (commands and files) and changes nothing; with --cuda-version it needs no GPU.
# --print-index-url prints the torch index this host's driver gets and exits.
set -euo pipefail

TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
# CUDA builds of torch $TORCH_VERSION, newest first, as "minimum driver CUDA version:wheel tag". A driver runs a
# build of its CUDA version or older (CUDA minor-version compatibility), so the first entry not newer wins.
TORCH_CUDA_BUILDS=("13.0:cu130" "12.8:cu128" "12.6:cu126")
TORCH_INDEX_BASE="https://download.pytorch.org/whl"

PREFIX=/opt/cosyvoice-gateway
CONFIG_DIR=/etc/cosyvoice-gateway
CACHE_DIR=/var/cache/cosyvoice-gateway
UNIT=/etc/systemd/system/cosyvoice-gateway.service
checkout="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

dry_run=0; start=1; print_index=0
model_dir=""; allow="127.0.0.0/8"; advertised_host=""; cuda_version=""; gpus=""; torch_index=""

usage() { sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
die() { echo "install_gpu_host: $*" >&2; exit 1; }

while [ "$#" -gt 0 ]; do
    case "$1" in
        --model-dir) model_dir="$2"; shift 2 ;;
        --allow) allow="$2"; shift 2 ;;
        --advertised-host) advertised_host="$2"; shift 2 ;;
        --cuda-version) cuda_version="$2"; shift 2 ;;   # what nvidia-smi would say (tests, or to choose)
        --gpus) gpus="$2"; shift 2 ;;                   # how many GPUs (default: nvidia-smi -L)
        --torch-index-url) torch_index="$2"; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        --no-start) start=0; shift ;;
        --print-index-url) print_index=1; shift ;;
        -h|--help) usage 0 ;;
        *) echo "install_gpu_host: unknown option $1" >&2; usage 2 ;;
    esac
done

# One step: printed, and run unless --dry-run.
run() {
    printf '+'; printf ' %q' "$@"; printf '\n'
    if [ "$dry_run" -eq 0 ]; then "$@"; fi
}

# A file written: its content printed under --dry-run, else installed with this mode.
write_file() {
    local path="$1" mode="$2" content
    content="$(cat)"
    if [ "$dry_run" -eq 1 ]; then
        printf '+ write %s (mode %s):\n%s\n+ end of %s\n' "$path" "$mode" "$content" "$path"
    else
        install -D -m "$mode" /dev/stdin "$path" <<< "$content"
    fi
}

# "12.8" -> 12008, so versions compare as integers
version_number() { local major="${1%%.*}" minor="${1#*.}"; echo $((major * 1000 + ${minor%%.*})); }

index_url_for() {
    local driver="$1" build
    for build in "${TORCH_CUDA_BUILDS[@]}"; do
        if [ "$(version_number "${build%%:*}")" -le "$(version_number "$driver")" ]; then
            echo "$TORCH_INDEX_BASE/${build#*:}"
            return 0
        fi
    done
    return 1
}

# -- 1. the driver -> torch's CUDA build --------------------------------------------------------
if [ -z "$cuda_version" ]; then
    command -v nvidia-smi >/dev/null || die "no NVIDIA driver (nvidia-smi not found): install it first \
(Debian: apt install nvidia-driver; Ubuntu: ubuntu-drivers install), reboot, run this again"
    cuda_version="$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9][0-9.]*\).*/\1/p' | head -n1)"
    [ -n "$cuda_version" ] || die "nvidia-smi names no CUDA version: is the driver loaded? (nvidia-smi alone shows)"
fi
if [ -z "$torch_index" ]; then
    torch_index="$(index_url_for "$cuda_version")" || die "the driver runs CUDA $cuda_version, older than every \
CUDA build of torch $TORCH_VERSION (${TORCH_CUDA_BUILDS[*]}): upgrade the NVIDIA driver"
fi
if [ "$print_index" -eq 1 ]; then echo "$torch_index"; exit 0; fi
if [ -z "$gpus" ]; then
    if command -v nvidia-smi >/dev/null; then gpus="$(nvidia-smi -L | grep -c '^GPU ')"; else gpus=1; fi
fi
[ "$gpus" -ge 1 ] || die "no GPU listed by nvidia-smi -L"
[ -n "$model_dir" ] || die "--model-dir is required: the CosyVoice2 model directory (official layout)"
if [ -z "$advertised_host" ]; then
    advertised_host="$(hostname -I 2>/dev/null | awk '{print $1}')"
    [ -n "$advertised_host" ] || die "cannot tell this host's address: pass --advertised-host"
fi
if [ "$dry_run" -eq 0 ] && [ "$(id -u)" -ne 0 ]; then die "run as root (sudo), or with --dry-run to see the steps"; fi
echo ">> driver CUDA $cuda_version: torch $TORCH_VERSION from $torch_index; $gpus GPU(s); model $model_dir"

# -- 2. system packages and the service user ---------------------------------------------------
run apt-get update -qq
run env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv ca-certificates
if [ "$dry_run" -eq 1 ] || ! id cosyvoice >/dev/null 2>&1; then
    run useradd --system --home-dir /var/lib/cosyvoice-gateway --create-home --shell /usr/sbin/nologin cosyvoice
fi
if [ "$dry_run" -eq 0 ]; then
    python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' || die "python3 is $(python3 --version): \
3.11 or newer is needed (Debian 12, Ubuntu 24.04)"
fi

# -- 3. the venv: torch's CUDA build first, then the project pinned by the lock ------------------
run python3 -m venv "$PREFIX/venv"
run "$PREFIX/venv/bin/pip" install -q --upgrade pip
run "$PREFIX/venv/bin/pip" install -q "torch==$TORCH_VERSION" --index-url "$torch_index"
run "$PREFIX/venv/bin/pip" install -q -c "$checkout/requirements.lock" "${checkout}[tts]"

# -- 4. the config, kept if the operator already has one ----------------------------------------
devices="$(seq -s ', ' 0 $((gpus - 1)))"
if [ "$dry_run" -eq 1 ] || [ ! -f "$CONFIG_DIR/gateway.yaml" ]; then
    write_file "$CONFIG_DIR/gateway.yaml" 0644 <<EOF
# Written by scripts/install_gpu_host.sh. Every key: sip_config/gateway-cosyvoice2.yaml and the README's
# Configuration section. Check after a change: cosyvoice-gateway doctor --config $CONFIG_DIR/gateway.yaml
sip:
  listen: "0.0.0.0:5060"
  advertised_host: "$advertised_host"
trunks:
  - name: pbx
    allow: ["$allow"]
engine:
  name: cosyvoice2
  cosyvoice2:
    model_dir: $model_dir
    device: cuda
    devices: [$devices]
    max_batch: 64
  worker:
    port: 9100                  # worker i on 9100 + i: /metrics and /healthz for Prometheus
http:
  listen: "127.0.0.1:8080"
EOF
else
    echo ">> keeping $CONFIG_DIR/gateway.yaml"
fi

# -- 5. the compiler cache and the systemd unit ---------------------------------------------------
run install -d -o cosyvoice -g cosyvoice -m 0750 "$CACHE_DIR"
run install -m 0644 "$checkout/systemd/cosyvoice-gateway.service" "$UNIT"
write_file "$UNIT.d/model-dir.conf" 0644 <<EOF
# Written by scripts/install_gpu_host.sh: \`cosyvoice-gateway voice add\` writes the model's voices directory.
[Service]
ReadWritePaths=-$model_dir/voices
EOF
run systemctl daemon-reload

# -- 6. check, then start -----------------------------------------------------------------------
# The same cache directory the unit gives torch, so the check is of the directory the service will use
run runuser -u cosyvoice -- "$PREFIX/venv/bin/cosyvoice-gateway" doctor --config "$CONFIG_DIR/gateway.yaml" \
    --cache-dir "$CACHE_DIR" || die "doctor found a problem (above, with what to do); after fixing it: \
systemctl enable --now cosyvoice-gateway"
if [ "$start" -eq 1 ]; then
    run systemctl enable --now cosyvoice-gateway
    echo ">> started: journalctl -u cosyvoice-gateway -f; the first start compiles for 6-7 minutes (/healthz 503)"
fi
