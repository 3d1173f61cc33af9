#!/usr/bin/env bash
# The product's GPU figures in one lease: ONE `cosyvoice-gateway serve` in the product's shape (a supervised
# cosyvoice2 worker on the full-size random model, bf16, max_batch 128, max_len 768, flow_context_s 13: the
# engine settings of scripts/gpu_e2e.sh, so the carried compiler cache serves it) with the speech API, the play
# URL, MRCP and the prompt cache on, and these steps against it (each writes one bench/results-shaped JSON):
#
#   install  issue #37, run first (doctor needs the ports and the GPU's memory free, so before serve starts):
#            install_gpu_host.sh --print-index-url, its --dry-run for the bench model, and `gateway.cli doctor`
#            on this script's config (driver, CUDA, torch, GPU memory against max_batch, model dir loaded
#            strictly, voices, ports, cache dir): $OUT/product_install.json
#   calls    issue #32: CACHED_STEPS (default "1000") calls to a prerendered (cached) prompt, each step
#            beside UNCACHED (100) calls of a text the engine renders (route cache: false), both spread over
#            RAMP_S (15) seconds, every caller hanging up HEAR_S (30) s after its first speech
#            (bench_e2e_calls.py --cached-calls --hear-s): per kind first speech, gaps, RTP p99, engine jobs of
#            the cached calls (must be 0), prompt cache hits; the serve's CPU, its packet clock's lateness and
#            its full GC pauses (its /metrics): $OUT/product_calls.json. One gateway process.
#   curve    where one gateway process breaks: CURVE_STEPS ("250 500 750 1100") cached calls alone on the
#            serve, the same figures per step: $OUT/product_curve.json. The step where RTP p99 passes 22 ms
#            or gaps appear, beside the serve's share of a core and its clock lateness, is the breaking point.
#   calls_multi  the calls step's last row over GATEWAYS (4) gateway processes of the host, the arrangement the
#            README gives an operator: the serve owns the engine worker (engine.worker.port + .token), the
#            GATEWAYS-1 others speak through it (engine.remote, the same engine block and prompt cache
#            directory: their prerender is a disk hit). In front: the shipped Kamailio
#            (sip_config/kamailio/kamailio.cfg) when `kamailio` is installed (KAMAILIO=off: not), else the
#            caller's round robin; the JSON's `front` says which ran. Figures per gateway (`by_gateway`, by
#            the 200's Contact; the serve is `serve_sip`): $OUT/product_calls_multi.json.
#   latency  issue #34: MRCP SPEAK -> first RTP beside the engine's first chunk of the same SPEAKs
#            (bench_mrcp.py --sip-port, MRCP_ROUNDS 10: $OUT/product_mrcp.json); then the worker's API at
#            API_CLIENTS ("1 50") clients: OpenAI /v1/audio/speech first byte beside each request's engine first
#            chunk, play URL miss and hit first byte (bench_tts_api.py --url, API_SAMPLES 10 per row:
#            $OUT/product_api.json)
# Also $OUT/serve.log.xz and $OUT/product_summary.txt (printed at the end); the config is in product_install.json.
#
# On the GPU host (the lead), about 450 s all told, estimated from earlier leases: wheels and model ~35 s, install
# and doctor ~30, serve start-up ~70-120 (warm compiler cache), calls ~100 (its prompt prerendered first, real time),
# calls_multi ~60, MRCP ~15, API ~80 (a play-URL miss is a whole render); each step has its own timeout. The curve
# (~4 x 55 s) does not fit one 600-s command beside the rest: run it alone (serve start-up and prerender + ~240 s):
#   bash scripts/gpu_bench.sh bash scripts/gpu_product.sh "$OUT" install calls calls_multi latency
#   bash scripts/gpu_bench.sh bash scripts/gpu_product.sh "$OUT" curve
# Dry run here on CPU (instant engine in a supervised worker, first chunk 70 ms; no model build, the
# install script told the CUDA version; figures are the CPU box's, not the product's):
#   ENGINE=instant CACHED_STEPS=40 UNCACHED=10 RAMP_S=4 HEAR_S=10 CURVE_STEPS="20 60" MRCP_ROUNDS=3 \
#       API_CLIENTS="1 5" API_SAMPLES=5 GATEWAYS=2 bash scripts/gpu_product.sh /tmp/product_out install calls \
#       curve calls_multi latency
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
# shellcheck disable=SC1091  # scripts/gpu_engine.sh, from the repository root (the cd above)
source scripts/gpu_engine.sh
out="$1"; shift
steps=("$@"); [ ${#steps[@]} -gt 0 ] || steps=(install calls calls_multi latency)
mkdir -p "$out"
ENGINE="${ENGINE:-cosyvoice2}"
model=/tmp/cosyvoice2_full_bench
py=python3
started_at=$(date +%s)
say() { echo "gpu_product [$(( $(date +%s) - started_at )) s]: $*"; }
has_step() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

if [ "$ENGINE" = cosyvoice2 ] && [ ! -f "$model/llm.pt" ]; then
    $py bench/full_model.py --out "$model" --golden "${COSYVOICE_GOLDEN_DIR:-.golden}" || { say "model build failed"; exit 1; }
fi
# Free loopback ports, one per argument (udp or tcp), printed on one line.
free_ports() {
    $py - "$@" <<'PY'
import socket, sys
socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM if kind == "udp" else socket.SOCK_STREAM)
         for kind in sys.argv[1:]]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in socks])
PY
}
# A gateway config's sip and trunks sections: UDP on loopback port $1, room and flood budgets for the calls.
sip_sections() {
    cat <<YAML
sip:
  listen: "127.0.0.1:$1"
  transports: [udp]
  max_calls: 1400
  flood: {max_requests_per_s_per_source: 100000, max_requests_per_s: 100000}
trunks:
  - {name: bench, allow: ["127.0.0.0/8"]}
YAML
}
read -r sip_port http_port worker_port mrcp_port < <(free_ports udp tcp tcp tcp)
key=$($py -c 'import secrets; print(secrets.token_hex(16))')
engine_token=$($py -c 'import secrets; print(secrets.token_hex(16))')
text30=$($py -c 'print(("Thank you for calling, every line is busy, please hold. " * 20)[:500])')  # 30 s at 60 ms a char (bench_e2e_calls)
bench30=$($py -c 'print(("bench prompt " * 200)[:500])')
config=/tmp/product.yaml
cache_dir=/tmp/product_cache
rm -rf "$cache_dir"; mkdir -p "$cache_dir"
if [ "$ENGINE" = cosyvoice2 ]; then
    engine_block="  name: cosyvoice2
  worker: {port: $worker_port, token: \"$engine_token\"}
$(cosyvoice2_settings "$model")"
    # calls_multi's other gateways: the same engine block (so the same prompt cache keys) on the serve's worker
    shared_block="  name: cosyvoice2
  workers: 0
  remote: {urls: [\"ws://127.0.0.1:$worker_port/v1/engine/stream\"], token: \"$engine_token\"}
$(cosyvoice2_settings "$model")"
    voice=bench_voice
else
    engine_block="  name: instant
  workers: 1
  worker: {port: $worker_port, slots: 256, token: \"$engine_token\"}
  instant: {realtime: true, first_chunk_delay_ms: 70}"
    shared_block="  name: instant
  workers: 0
  remote: {urls: [\"ws://127.0.0.1:$worker_port/v1/engine/stream\"], token: \"$engine_token\"}
  instant: {realtime: true, first_chunk_delay_ms: 70}"
    voice=en
fi
cat > "$config" <<YAML
engine:
$engine_block
$(sip_sections "$sip_port")
http:
  listen: "127.0.0.1:$http_port"
mrcp:
  enabled: true
  listen: "127.0.0.1:$mrcp_port"
prompt_cache:
  directory: $cache_dir/prompts
routes:
  - {match: cached, text: "$text30", prerender: true}
  - {match: uncached, text: "$bench30", cache: false}
tts_api:
  api_keys: [{name: bench, key: "$key", max_streams: 400}]
logging:
  level: info
YAML

if has_step install; then
    say "install: install_gpu_host.sh --print-index-url / --dry-run, doctor"
    timeout 240 $py - "$config" "$out/product_install.json" "$ENGINE" <<'PY'
import json, os, shutil, subprocess, sys, time
config, out, engine = sys.argv[1:]
# Without a driver (the CPU dry run) the install script must be told the CUDA version and GPU count.
told = [] if shutil.which("nvidia-smi") else ["--cuda-version", "13.0", "--gpus", "1"]
commands = [["bash", "scripts/install_gpu_host.sh", "--print-index-url", *told],
            ["bash", "scripts/install_gpu_host.sh", "--dry-run", "--model-dir", "/tmp/cosyvoice2_full_bench",
             "--advertised-host", "127.0.0.1", *told],
            [sys.executable, "-m", "gateway.cli", "doctor", "--config", config, "--cache-dir", "/tmp"]]
if shutil.which("nvidia-smi"):
    commands.insert(0, ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used", "--format=csv"])
runs = []
for command in commands:
    began = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=200)
        code, output = done.returncode, done.stdout + done.stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        code, output = None, repr(exc)
    runs.append({"command": " ".join(command), "exit_code": code, "seconds": round(time.monotonic() - began, 1),
                 "output": output.splitlines()})
doctor = runs[-1]["output"]
report = {"what": "issue #37 on this host: the GPU install script as far as a host with no package index allows "
                  "(--print-index-url, --dry-run), and doctor on the product config before serve starts",
          "engine": engine, "date": time.strftime("%Y-%m-%d %H:%M"), "cpu_count": os.cpu_count(),
          # doctor's GPU host checks (driver, torch's CUDA, GPU memory against max_batch, model dir, voices)
          "doctor_gpu_checks": [line for line in doctor if line.split()[1:2] and line.split()[1].lower().startswith(
              ("gpu", "nvidia", "torch", "model", "voices"))], "runs": runs,
          "config": open(config).read().splitlines()}
with open(out, "w") as f:
    json.dump(report, f, indent=1)
for run in runs:
    print(f"  exit {run['exit_code']}: {run['command']}")
print("  doctor:", *doctor, sep="\n    ")
PY
fi

serve_pid=""
stop_serve() {
    [ -n "$serve_pid" ] || return 0
    kill -TERM "$serve_pid" 2>/dev/null && wait "$serve_pid" 2>/dev/null
    serve_pid=""
}
trap 'stop_extras; stop_serve' EXIT
if has_step calls || has_step curve || has_step calls_multi || has_step latency; then
    say "serve: starting ($ENGINE)"
    $py -m gateway.cli serve --config "$config" 2> "$out/serve.log" > /dev/null &
    serve_pid=$!
    # Ready, then (cosyvoice2) the compiled graphs in: the worker is ready on graphs of the eager modules and
    # swaps the compiled ones in while serving; these figures are the engine's at full speed.
    compiled=0; [ "$ENGINE" = cosyvoice2 ] && compiled=1
    if ! $py - "$http_port" "$serve_pid" "$out/serve.log" "$compiled" <<'PY'
import os, sys, time, urllib.request
port, pid, log, compiled = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
started = time.monotonic()
end = started + 400
ready = None
while time.monotonic() < end and os.path.exists(f"/proc/{pid}"):
    try:
        if ready is None:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2)
            ready = time.monotonic() - started
            print(f"gpu_product: ready after {ready:.1f} s", flush=True)
        if not compiled or "compiled_graphs_" in open(log, errors="replace").read():
            print(f"gpu_product: compiled graphs in after {time.monotonic() - started:.1f} s", flush=True)
            sys.exit(0)
    except OSError:
        pass
    time.sleep(1)  # waiting for a start-up, not pacing media
sys.exit(1)
PY
    then
        say "serve did not become ready; its log ends:"; tail -30 "$out/serve.log"
        steps=()
    else
        say "serve: ready"
    fi
fi

# Every cached step's callers hang up HEAR_S (30) seconds after their first speech: the calls last as long
# whatever length the engine made the prompt (the random model renders the 30-s text in ~108 s) and are never
# ended by the gateway's media.inactivity_timeout_s (60 s) first, since these callers send no RTP.
calls_bench() {  # calls_bench OUT_JSON ARGS...: bench_e2e_calls.py against the serve
    local json="$1"; shift
    timeout 420 $py bench/bench_e2e_calls.py --http-port "$http_port" --serve-pid "$serve_pid" \
        --serve-log "$out/serve.log" --start-timeout 240 --calls --user uncached --prompt-seconds 30 \
        --hear-s "${HEAR_S:-30}" --ramp-s "${RAMP_S:-15}" --out "$out/$json" "$@" > "$out/bench.stdout" 2>&1
    local code=$?; say "$json: exit $code"; [ "$code" = 0 ] || tail -20 "$out/bench.stdout"; rm -f "$out/bench.stdout"
}
if has_step calls; then
    say "calls: ${CACHED_STEPS:-1000} cached beside ${UNCACHED:-100} uncached, over ${RAMP_S:-15} s"
    # shellcheck disable=SC2086  # CACHED_STEPS is a word list
    calls_bench product_calls.json --sip "127.0.0.1:$sip_port" --cached-calls ${CACHED_STEPS:-1000} \
        --uncached-calls "${UNCACHED:-100}" --watch "127.0.0.1:$sip_port,$http_port,$serve_pid"
fi
if has_step curve; then
    say "curve: ${CURVE_STEPS:-250 500 750 1100} cached calls alone on the one serve"
    # shellcheck disable=SC2086  # CURVE_STEPS is a word list
    calls_bench product_curve.json --sip "127.0.0.1:$sip_port" --cached-calls ${CURVE_STEPS:-250 500 750 1100} \
        --uncached-calls 0 --watch "127.0.0.1:$sip_port,$http_port,$serve_pid"
fi

extra_pids=()
kamailio_pid=""
stop_extras() {
    local pid
    [ -n "$kamailio_pid" ] && kill -TERM "$kamailio_pid" 2>/dev/null && wait "$kamailio_pid" 2>/dev/null
    kamailio_pid=""
    for pid in "${extra_pids[@]}"; do kill -TERM "$pid" 2>/dev/null; done
    for pid in "${extra_pids[@]}"; do wait "$pid" 2>/dev/null; done
    extra_pids=()
}
if has_step calls_multi; then
    # The host's arrangement (README, "Several gateway processes on one host"): the serve owns the engine
    # worker (engine.worker.port + token); GATEWAYS-1 more `serve`s use it through engine.remote with the same
    # engine block and prompt cache directory, so their prerender finds the serve's file (no second render).
    gateways="${GATEWAYS:-4}"
    front=round_robin; kamailio_bin=$(command -v kamailio || echo /usr/sbin/kamailio)
    [ "${KAMAILIO:-auto}" != off ] && [ -x "$kamailio_bin" ] && front=kamailio
    say "calls_multi: $gateways gateway processes sharing the serve's engine worker, in front: $front"
    watch=("127.0.0.1:$sip_port,$http_port,$serve_pid"); also=("127.0.0.1:$sip_port"); extra_logs=()
    # the serve's prompt on disk first, so the others' prerender is a hit, not a second render on the GPU
    # shellcheck disable=SC2016  # $1 expands in the inner bash
    timeout 300 bash -c 'until grep -qs "\"prerendered\"" "$1"; do sleep 0.5; done' _ "$out/serve.log"
    for ((i = 1; i < gateways; i++)); do
        read -r esip ehttp < <(free_ports udp tcp)
        low=$((10000 + (i - 1) * 3000))  # below the serve's 20000-30000 and the callers' ephemeral ports
        cat > "/tmp/product_extra_$i.yaml" <<YAML
engine:
$shared_block
$(sip_sections "$esip")
media: {rtp_port_range: "$low-$((low + 2999))"}
http: {listen: "127.0.0.1:$ehttp"}
prompt_cache:
  directory: $cache_dir/prompts
routes:
  - {match: cached, text: "$text30", prerender: true}
  - {match: uncached, text: "$bench30", cache: false}
logging: {level: info}
YAML
        $py -m gateway.cli serve --config "/tmp/product_extra_$i.yaml" 2> "/tmp/product_extra_$i.log" > /dev/null &
        extra_pids+=($!)
        extra_logs+=("/tmp/product_extra_$i.log")
        also+=("127.0.0.1:$esip")
        watch+=("127.0.0.1:$esip,$ehttp,$!")
    done
    target=(--sip "127.0.0.1:$sip_port" --also-sip "${also[@]:1}")
    if [ "$front" = kamailio ]; then
        read -r kport < <(free_ports udp)
        kdir=$(mktemp -d)
        printf '1 sip:%s\n' "${also[@]}" > "$kdir/dispatcher.list"
        "$kamailio_bin" -f sip_config/kamailio/kamailio.cfg -DD -E -m 256 -M 16 -Y "$kdir" \
            -A "LISTEN=udp:127.0.0.1:$kport" -A "DISPATCHER_LIST=\"$kdir/dispatcher.list\"" -A PROBE_INTERVAL=1 \
            > "$out/kamailio.log" 2>&1 &
        kamailio_pid=$!
        target=(--sip "127.0.0.1:$kport")
    fi
    # each extra gateway up and its prompt found in the shared cache; $log expands in the inner bash
    # shellcheck disable=SC2016
    if timeout 120 bash -c 'for log in "$@"; do until grep -qs "\"prerendered\"" "$log"; do sleep 0.5; done; done' _ \
            "${extra_logs[@]}"; then
        sleep 2  # Kamailio's first OPTIONS probes mark the gateways up (PROBE_INTERVAL 1)
        calls_bench product_calls_multi.json "${target[@]}" --watch "${watch[@]}" \
            --cached-calls "$(echo "${CACHED_STEPS:-1000}" | awk '{print $NF}')" --uncached-calls "${UNCACHED:-100}"
        $py - "$out/product_calls_multi.json" "$front" "127.0.0.1:$sip_port" <<'PY'
import json, sys
path, front, serve = sys.argv[1:]
report = json.load(open(path))
report.update(front=front, serve_sip=serve)  # which spread the calls; which gateway owns the engine worker
json.dump(report, open(path, "w"), indent=2)
PY
        grep -h '"prerendered"' "${extra_logs[@]}" | cut -c1-200
    else
        say "calls_multi: the extra gateways did not come up"; tail -5 "${extra_logs[@]}"
    fi
    stop_extras
fi

if has_step latency; then
    say "latency: MRCP SPEAK -> first RTP"
    timeout 90 $py bench/bench_mrcp.py --sip-port "$sip_port" --engine-log "$out/serve.log" \
        --rounds "${MRCP_ROUNDS:-10}" --out "$out/product_mrcp.json" > /dev/null 2> "$out/mrcp.stderr"
    say "mrcp: exit $?"; tail -5 "$out/mrcp.stderr"; rm -f "$out/mrcp.stderr"
    say "latency: OpenAI API and play URL at ${API_CLIENTS:-1 50} clients"
    # shellcheck disable=SC2086  # API_CLIENTS is a word list
    timeout 200 $py bench/bench_tts_api.py --url "http://127.0.0.1:$worker_port" --key "$key" --voice "$voice" \
        --clients ${API_CLIENTS:-1 50} --samples "${API_SAMPLES:-10}" --scenarios openai play \
        --engine-log "$out/serve.log" --out "$out/product_api.json" 2>&1 | tail -4
    say "api: exit ${PIPESTATUS[0]}"
fi
stop_serve
[ -f "$out/serve.log" ] && xz -T0 -f "$out/serve.log"

$py - "$out" <<'PY' | tee "$out/product_summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def load(name):
    path = out / name
    return json.loads(path.read_text()) if path.exists() else None
if (install := load("product_install.json")):
    for r in install["runs"]:
        print(f"install: exit {r['exit_code']}: {r['command'].replace(sys.executable, 'python3')}")
    print("  doctor:", *install["runs"][-1]["output"], sep="\n    ")
def clock(row):
    return (f"clock late >2/10/20 ms {row.get('clock_late_over_2ms_pct')}/{row.get('clock_late_over_10ms_pct')}/"
            f"{row.get('clock_late_over_20ms_pct')} %, skipped {row.get('clock_skipped_ticks')}, full GCs "
            f"{row.get('gc_full_collections')} (>10 ms {row.get('gc_full_over_10ms')}, >50 ms {row.get('gc_full_over_50ms')})")
for name in ("product_calls.json", "product_curve.json", "product_calls_multi.json"):
    report = load(name) or {}
    front = f" (front: {report['front']}, engine worker owned by {report['serve_sip']})" if "front" in report else ""
    for step in report.get("steps", []):
        print(f"{name.removeprefix('product_').removesuffix('.json')}{front} {step['calls']} at {step['rate_per_s']}/s, "
              f"all gateways: answered {step['answered']}, 503 {step['refused_503']}, RTP p99 {step['rtp_interval_p99_ms']}"
              f" ms (max {step['rtp_interval_max_ms']}), gaps>60ms {step['calls_with_gap_over_60ms']}, lost "
              f"{step['lost_packets']}, heard p50 {step['heard_s_p50']} s, serve CPU {step['gateway_cpu_s']} s, "
              f"prompt cache of the serve {step.get('prompt_cache')}")
        for user, row in step.get("by_user", {}).items():
            print(f"  {user}: {row['answered']}/{row['calls']} answered, engine jobs {row['engine_jobs']}, first "
                  f"speech p50 {row['first_speech_p50_ms']} p95 {row['first_speech_p95_ms']} ms, engine first chunk "
                  f"p50 {row['engine_first_chunk_p50_ms']} ms, RTP p99 {row['rtp_interval_p99_ms']} ms, gaps "
                  f"{row['calls_with_gap_over_60ms']}, heard {row['heard_s_p50']} s")
        for gateway, row in step.get("by_gateway", {}).items():
            print(f"  gateway {gateway}{' (serve)' if gateway == report.get('serve_sip') else ''}: {row['answered']} "
                  f"answered, RTP p99 {row['rtp_interval_p99_ms']} ms (max {row['rtp_interval_max_ms']}), gaps "
                  f"{row['calls_with_gap_over_60ms']}, lost {row['lost_packets']}, first speech max "
                  f"{row['first_speech_max_ms']} ms, heard {row['heard_s_p50']} s, CPU {row.get('cpu_core_share')} of "
                  f"a core ({row.get('cpu_ms_per_call')} ms a call), {clock(row)}")
if (mrcp := load("product_mrcp.json")):
    print(f"mrcp: SPEAK -> first RTP {mrcp['speak_to_first_rtp_ms']}, engine first chunk "
          f"{mrcp.get('engine_first_chunk_ms')}, STOP -> last RTP {mrcp['stop_to_last_rtp_ms']}")
for clients, row in ((load("product_api.json") or {}).get("scenarios") or {}).items():
    print(f"api {clients} clients: " + ", ".join(f"{name} p50 {s['p50_ms']} p95 {s['p95_ms']} ms"
                                                  for name, s in row.items() if isinstance(s, dict))
          + f", engine jobs of play hits {row.get('engine_jobs_of_play_hits')}")
PY
say "done; files: $(find "$out" -maxdepth 1 -type f -printf '%f ')"
