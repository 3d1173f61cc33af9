#!/usr/bin/env bash
# Install the gateway on a fresh machine and start it on its embedded default config
# (CPU eSpeak NG engine, SIP on 127.0.0.1:5060 UDP+TCP, HTTP on 127.0.0.1:8080).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh phone
exec cosyvoice-gateway serve "$@"
