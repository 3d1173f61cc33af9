#!/usr/bin/env bash
# Build the CPU and CUDA images with podman on a Debian bookworm root made here with mmdebstrap (for hosts that
# reach Debian's archive and PyPI but no image registry). Needs: apt-get install podman buildah mmdebstrap.
#   deploy/containers/build.sh [cpu] [cuda] [kamailio]      (default: cpu)
# pip in the build trusts this host's CA bundle ($CA_BUNDLE, default /etc/ssl/certs/ca-certificates.crt), lent as a
# build secret and not kept in the image.
# Images: localhost/cosyvoice-gateway:cpu, localhost/cosyvoice-gateway:cuda, localhost/kamailio:bookworm.
# PODMAN_OPTS / BUILD_OPTS add options, e.g. where the host forbids raising rlimits and runs cgroups v1 hybrid
# (this project's CI machines):
#   PODMAN_OPTS="--runtime runc" BUILD_OPTS="--ulimit nofile=4096:4096 --ulimit nproc=4096:4096"
set -euo pipefail
cd "$(dirname "$0")/../.."
flavors=("$@")
[ "${#flavors[@]}" -gt 0 ] || flavors=(cpu)
base=localhost/debian-bookworm-python:12
read -r -a podman_opts <<< "${PODMAN_OPTS:-}"
read -r -a build_opts <<< "${BUILD_OPTS:-}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
if ! podman "${podman_opts[@]}" image exists "$base"; then
    echo ">> making $base with mmdebstrap"
    mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$work/root.tar" \
        http://deb.debian.org/debian
    podman "${podman_opts[@]}" import "$work/root.tar" "$base"
fi
# The build context: what the image installs, not the checkout's venv, caches or benchmark outputs
mkdir "$work/context"
cp -r pyproject.toml README.md requirements.lock gateway engines engine_service tts_core connection_caps \
    "$work/context/"
mkdir -p "$work/context/deploy" && cp -r deploy/containers "$work/context/deploy/"
find "$work/context" -name __pycache__ -prune -exec rm -rf {} +
for flavor in "${flavors[@]}"; do
    if [ "$flavor" = kamailio ]; then
        recipe=deploy/containers/Containerfile.kamailio; tag=localhost/kamailio:bookworm
    else
        recipe=deploy/containers/Containerfile; tag="localhost/cosyvoice-gateway:$flavor"
    fi
    echo ">> building $tag"
    # --network host: the build's pip and apt reach the archive as this host does; --format docker keeps HEALTHCHECK
    podman "${podman_opts[@]}" build --network host --format docker "${build_opts[@]}" \
        --secret id=ca_bundle,src="${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}" \
        --build-arg BASE="$base" --build-arg FLAVOR="$flavor" -f "$recipe" -t "$tag" "$work/context"
done
