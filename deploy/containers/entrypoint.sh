#!/bin/bash
# The image's entry point: `serve` (default) or `doctor`, with the config from, first found:
#   a file mounted at /etc/cosyvoice-gateway/gateway.yaml (a Kubernetes ConfigMap, podman -v);
#   $COSYVOICE_GATEWAY_CONFIG: the whole YAML text;
#   the image's /opt/cosyvoice-gateway/container.yaml (gateway-cpu.yaml or gateway-cuda.yaml in deploy/containers).
# Then overrides: $COSYVOICE_GATEWAY_ADVERTISED_HOST (sip.advertised_host: the address PBXs reach, required by
# the image's config) and $COSYVOICE_GATEWAY_SET, KEY=VALUE lines (one per line) passed as --set; further
# arguments go to the command (e.g. serve --log-level debug).
set -euo pipefail
command="${1:-serve}"
[ "$#" -gt 0 ] && shift
config=/etc/cosyvoice-gateway/gateway.yaml
if [ ! -f "$config" ]; then
    if [ -n "${COSYVOICE_GATEWAY_CONFIG:-}" ]; then
        config="$(mktemp /tmp/gateway-XXXXXX.yaml)"
        printf '%s\n' "$COSYVOICE_GATEWAY_CONFIG" > "$config"
    else
        config=/opt/cosyvoice-gateway/container.yaml
    fi
fi
overrides=()
if [ -n "${COSYVOICE_GATEWAY_ADVERTISED_HOST:-}" ]; then
    overrides+=(--set "sip.advertised_host=$COSYVOICE_GATEWAY_ADVERTISED_HOST")
fi
while IFS= read -r setting; do
    if [ -n "$setting" ]; then overrides+=(--set "$setting"); fi
done <<< "${COSYVOICE_GATEWAY_SET:-}"
case "$command" in
    serve|doctor)
        exec cosyvoice-gateway "$command" --config "$config" "${overrides[@]}" "$@" ;;
    *)
        exec "$command" "$@" ;;
esac
