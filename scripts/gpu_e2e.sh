#!/usr/bin/env bash
# The end-to-end GPU benchmark of the product: real SIP calls into `cosyvoice-gateway serve` with the
# CosyVoice2 engine on full-size random weights, RTP received and timed per call (bench/bench_e2e_calls.py).
# Run through scripts/gpu_bench.sh on a GPU host (it brings the wheels, golden files and compiler cache):
#
#   bash scripts/gpu_bench.sh bash scripts/gpu_e2e.sh workers "$OUT" 1 50 100 150 200
#   bash scripts/gpu_bench.sh bash scripts/gpu_e2e.sh in_process "$OUT" 1 50 100
#   bash scripts/gpu_bench.sh bash scripts/gpu_e2e.sh instant "$OUT" 100 200 500
#   RATES="10 10 20 10" GPU1_STEPS=3 KILL_WORKER_AT=15 KILL_STEPS=4 \
#       bash scripts/gpu_bench.sh bash scripts/gpu_e2e.sh workers2 "$OUT" 1 200 400 200
#   WINDOW=60 SEEDS="1 2" MODES=sip bash scripts/gpu_bench.sh bash scripts/gpu_e2e.sh openloop "$OUT" 10 20
#   MAX_LEN=1024 bash scripts/gpu_bench.sh bash scripts/gpu_e2e.sh lone "$OUT" 8
#
# workers: the engine in a worker process the gateway supervises (the product's shape); its worker also
# serves the speech API, which bench/bench_tts_api.py measures after the calls (1, 10 and 50 clients, jambonz
# at 10) beside the engine's own first chunk of the same requests, from the serve log ($OUT/tts_api.json);
# in_process: the same engine inside the gateway's process (engine.workers: 0, the arrangement before the
# split); instant: no GPU work at all, the media path alone; workers2: a 2-GPU host, the same steps first on
# one GPU (engine.cosyvoice2.devices [0], e2e_gpu1.json; its first GPU1_STEPS steps) then one worker per GPU
# (devices [0, 1], e2e_gpu2.json), 30-s prompts at RATES new calls/s per step (default RATE, 10, for every
# step); with KILL_WORKER_AT=SECONDS the two-GPU run kill -9s the worker on GPU 1 that long into each of
# KILL_STEPS (default every step) and reports the killed worker's calls apart from GPU 0's. PART=gpu1 or gpu2
# runs only that half (two calls on one warm machine fit the command limit); FP16_CALLS="1 100" runs those
# steps in fp16 on GPU 1 beside the one-GPU run (e2e_fp16.json).
# openloop: the workers arrangement under bench/bench_open_loop.py at the rates given (new requests/s, Poisson):
# SIP calls with the issue's 30-s prompts, then the worker's speech API with a 3/10/30-s mix, each run a 30-s
# warm-up, a WINDOW-second window (default 300, as tts-bench) and a 35-s tail, for each of SEEDS (default
# "1 2 3"), MODES "sip api" by default ($OUT/open_loop_cosyvoice2.json); API_RATES="15 20" gives the speech API other
# rates than SIP's in the same start-up. One run lasts WINDOW + 65 s: split
# rates, seeds or modes over calls to fit a command's time limit. The engine settings match bench_load's, so the
# carried compiler cache serves both; MAX_BATCH (slots, default 128) and FLOW_CONTEXT_S (default 13) change them
# for every arrangement (300 calls of 30 s need ~300 slots: docs/PERF_NOTES.md "What a slot costs"; another
# context length compiles other flow graphs, so the carried cache misses).
# lone: the workers arrangement, one call at a time, N times (a short prompt, LONE_PROMPT_S, default 5 s): each lone
# call's first speech and where its first chunk went (the render's flow call on the host and on its stream), the
# first use of each render lane's compiled graphs after start included ($OUT/e2e_lone.json).
# Prompts last as long as the random model speaks them (bench/spoken_prompt.py): a 30-s prompt is a text of 52-59
# characters (38-39 tokens) that it speaks for 30.4-31.2 s, and the benches raise max_len from 768 to 1024 to hold
# it (other decode graphs: the carried compiler cache misses them). PROMPT_LENGTH=chars sizes texts at 60 ms a
# character as before (500 characters for 30 s in max_len 768: the KV room ended every call at 11.5 s).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091  # scripts/gpu_engine.sh, from the repository root (the cd above)
source scripts/gpu_engine.sh
arrangement="$1"; out="$2"; shift 2
prompt_length="${PROMPT_LENGTH:-spoken}"
# FAMILY=3 (e.g. FAMILY=3 bash scripts/gpu_bench.sh bash scripts/gpu_e2e.sh workers "$OUT" 1 100): full-size random
# CosyVoice3 weights instead (bench/full_model.py --family 3 from $COSYVOICE3_GOLDEN_DIR, default
# ../shared/golden_cv3); the workers and in_process files are then named *_cv3, so a CosyVoice2 run keeps its own.
family="${FAMILY:-2}"
if [ "$family" = 3 ]; then
    model=/tmp/cosyvoice3_full_bench; tag=_cv3
    # A CosyVoice3 slot keeps 1.8 MiB a frame of DiT keys/values (README): 128 slots x 13 s would be ~150 GiB, so
    # fewer slots and a shorter kept context unless given (64 x 5 s: ~28 GiB, the voices' ~7 GiB beside it).
    export MAX_BATCH="${MAX_BATCH:-64}" FLOW_CONTEXT_S="${FLOW_CONTEXT_S:-5}"
    if [ "$arrangement" != instant ] && [ ! -f "$model/spk2info.pt" ]; then
        python3 bench/full_model.py --family 3 --out "$model" --golden "${COSYVOICE3_GOLDEN_DIR:-../shared/golden_cv3}"
    fi
else
    model=/tmp/cosyvoice2_full_bench; tag=""
    if [ "$arrangement" != instant ] && [ ! -f "$model/llm.pt" ]; then
        python3 bench/full_model.py --out "$model" --golden "${COSYVOICE_GOLDEN_DIR:-../shared/golden}"
    fi
fi
config="$out/e2e_$arrangement$tag.yaml"
key=$(python3 -c 'import secrets; print(secrets.token_hex(16))')
then=()
api_lines=""
case "$arrangement" in
    workers)
        workers_line="  worker: {port: 8090}"
        api_lines="tts_api: {api_keys: [{name: bench, key: \"$key\", max_streams: 200}]}"
        # The OpenAI route names its voice: the config's default (gpu_engine.sh), not the bench's "en".
        then=(--then "python3 bench/bench_tts_api.py --url http://127.0.0.1:8090 --key $key --voice bench_voice \
--clients 1 10 50 --jambonz-clients 10 --samples 20 --engine-log $out/serve_workers$tag.log --out $out/tts_api$tag.json") ;;
    in_process) workers_line="  workers: 0" ;;
    workers2|openloop|lone) workers_line="  worker: {port: 8090}" ;;
    instant)
        exec python3 bench/bench_e2e_calls.py --engine instant --calls "$@" --prompt-seconds 20 \
            --prompt-length "$prompt_length" --out "$out/e2e_instant.json" ;;
    *) echo "unknown arrangement $arrangement (workers, in_process, instant, workers2, openloop, lone)" >&2; exit 2 ;;
esac
cat > "$config" <<YAML
engine:
  name: cosyvoice2
$workers_line
$(cosyvoice2_settings "$model")
sip:
  max_calls: 1000
$api_lines
YAML
if [ "$arrangement" = openloop ]; then
    # shellcheck disable=SC2086  # SEEDS and MODES are word lists
    exec python3 bench/bench_open_loop.py --config "$config" --rates "$@" ${API_RATES:+--api-rates $API_RATES} \
        --seeds ${SEEDS:-1 2 3} \
        --modes ${MODES:-sip api} --window "${WINDOW:-300}" --prompt-seconds 30 --api-prompt-seconds 3 10 30 \
        --prompt-length "$prompt_length" \
        --out "$out/open_loop_cosyvoice2.json" --serve-log "$out/serve_openloop.log"
fi
if [ "$arrangement" = lone ]; then
    steps=()
    for _ in $(seq "${1:-8}"); do steps+=(1); done
    exec python3 bench/bench_e2e_calls.py --config "$config" --calls "${steps[@]}" --prompt-seconds "${LONE_PROMPT_S:-5}" \
        --prompt-length "$prompt_length" --out "$out/e2e_lone$tag.json" --serve-log "$out/serve_lone$tag.log"
fi
if [ "$arrangement" = workers2 ]; then
    # RATES: new calls/s for each step (default RATE, 10, for all); GPU1_STEPS: how many of the steps the one-GPU
    # run takes first (default all); KILL_STEPS: the two-GPU run's steps with the kill (default every one).
    read -r -a rates <<< "${RATES:-}"
    [ ${#rates[@]} -eq 0 ] && for _ in "$@"; do rates+=("${RATE:-10}"); done
    n1="${GPU1_STEPS:-$#}"
    part="${PART:-both}"
    if [ "$part" != gpu2 ]; then
        fp16_pid=""
        if [ -n "${FP16_CALLS:-}" ]; then  # fp16 on GPU 1 meanwhile (its own worker port), 10 new calls/s
            sed -e 's/dtype: bf16/dtype: fp16/' -e 's/port: 8090/port: 8091/' "$config" > "$out/e2e_fp16.yaml"
            # shellcheck disable=SC2086  # FP16_CALLS is a word list
            timeout "${FP16_TIMEOUT_S:-420}" python3 bench/bench_e2e_calls.py --config "$out/e2e_fp16.yaml" --devices 1 \
                --calls $FP16_CALLS --rate 10 \
                --prompt-seconds 30 --prompt-length "$prompt_length" \
                --out "$out/e2e_fp16.json" --serve-log "$out/serve_fp16.log" &
            fp16_pid=$!
        fi
        python3 bench/bench_e2e_calls.py --config "$config" --devices 0 --calls "${@:1:$n1}" --rates "${rates[@]:0:$n1}" \
            --prompt-seconds 30 --prompt-length "$prompt_length" \
            --out "$out/e2e_gpu1.json" --serve-log "$out/serve_gpu1.log"
        [ -z "$fp16_pid" ] || wait "$fp16_pid" || echo "gpu_e2e: the fp16 run failed or ran out of time" >&2
    fi
    [ "$part" != gpu1 ] || exit 0
    kill=()
    [ -n "${KILL_WORKER_AT:-}" ] && kill=(--kill-worker-at "$KILL_WORKER_AT" --kill-worker 1)
    # shellcheck disable=SC2206  # KILL_STEPS is a word list
    [ -n "${KILL_WORKER_AT:-}" ] && [ -n "${KILL_STEPS:-}" ] && kill+=(--kill-steps $KILL_STEPS)
    exec python3 bench/bench_e2e_calls.py --config "$config" --devices 0 1 --calls "$@" --rates "${rates[@]}" \
        --prompt-seconds 30 --prompt-length "$prompt_length" \
        --out "$out/e2e_gpu2.json" --serve-log "$out/serve_gpu2.log" "${kill[@]}"
fi
exec python3 bench/bench_e2e_calls.py --config "$config" --calls "$@" --prompt-seconds 20 --rate 10 \
    --prompt-length "$prompt_length" \
    --out "$out/e2e_$arrangement$tag.json" --serve-log "$out/serve_$arrangement$tag.log" "${then[@]}"
