#!/usr/bin/env bash
# The speech API's first audio on a GPU host: an engine worker (python -m engine_service) serving the API with
# CosyVoice2 on full-size random weights, driven by bench/bench_tts_api.py at N concurrent clients; beside it,
# the engine's own first chunk of the same requests, read from the worker's tts_job_done log lines.
#
#   bash scripts/gpu_bench.sh bash scripts/gpu_tts_api.sh "$OUT" 1 10 50
set -euo pipefail
cd "$(dirname "$0")/.."
out="$1"; shift
model=/tmp/cosyvoice2_full_bench
[ -f "$model/llm.pt" ] || python3 bench/full_model.py --out "$model" --golden "${COSYVOICE_GOLDEN_DIR:-../shared/golden}"
key=$(python3 -c 'import secrets; print(secrets.token_hex(16))')
settings='{"model_dir": "'$model'", "device": "cuda", "dtype": "bf16", "default_voice": "bench_voice",
           "max_batch": 128, "max_len": 768, "flow_context_s": 13.0}'
api='{"api_keys": [{"name": "bench", "key": "'$key'", "max_streams": 200}]}'
log="$out/worker_tts_api.log"
python3 -m engine_service --engine cosyvoice2 --settings "$settings" --tts-api "$api" --listen 127.0.0.1:8090 \
    >"$out/worker_stdout.txt" 2>"$log" &
worker=$!
trap 'kill $worker 2>/dev/null; wait $worker 2>/dev/null || true' EXIT
until grep -q engine_worker_listening "$out/worker_stdout.txt" 2>/dev/null; do
    kill -0 $worker 2>/dev/null || { tail -20 "$log"; exit 1; }
    sleep 1  # waiting for a GPU start-up (minutes), not pacing anything
done
for clients in "$@"; do
    mark=$(wc -l <"$log")
    python3 bench/bench_tts_api.py --url http://127.0.0.1:8090 --key "$key" --clients "$clients" \
        --jambonz-clients 10 --samples 20 --out "$out/tts_api_$clients.json"
    tail -n +"$((mark + 1))" "$log" | python3 -c '
import json, sys, numpy as np
first = [json.loads(l)["first_chunk_s"] * 1000 for l in sys.stdin if "tts_job_done" in l]
print(f"engine first chunk of those requests: n {len(first)} p50 {np.percentile(first, 50):.1f} ms "
      f"p95 {np.percentile(first, 95):.1f} ms" if first else "no tts_job_done lines")'
done
