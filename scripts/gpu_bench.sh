#!/usr/bin/env bash
# Run one GPU benchmark command on a lent GPU machine that has PyTorch but none of our other
# dependencies, and keep its compiler cache between machines.
#
#   bash scripts/gpu_bench.sh timeout 450 python3 bench/bench_load.py --golden .golden --out "$OUT/load.json"
#
# It reads, from the repository root (ignored folders that the caller carries along):
#   .whl/   wheels of the pure dependencies (structlog, soxr, kaldi-native-fbank, pytest, ...)
#   .golden a copy of ../shared/golden
#   .ind/   the torch.compile/Triton cache, as ind.tgz or as ind.tgz.part* pieces
# With SAVE_CACHE=1 and $OUT set it writes the cache back to $OUT as ind.tgz.part* pieces of at most
# 15 MiB (what such a machine hands back per file), also when the command failed or timed out:
# a cold start-up compiles for minutes, a warm one reads the cache.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 COSYVOICE_GOLDEN_DIR="$PWD/.golden"
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/ind/triton
mkdir -p /tmp/ind
shopt -s nullglob
parts=(.ind/ind.tgz.part*)
if [ ${#parts[@]} -gt 0 ]; then
    cat "${parts[@]}" | tar xz -C /tmp || echo "gpu_bench: the carried cache pieces did not unpack" >&2
elif [ -f .ind/ind.tgz ]; then
    tar xzf .ind/ind.tgz -C /tmp || echo "gpu_bench: the carried cache did not unpack" >&2
fi
"$@"
status=$?
if [ "${SAVE_CACHE:-0}" = 1 ] && [ -n "${OUT:-}" ]; then
    tar cz -C /tmp ind | split -b 15M - "$OUT/ind.tgz.part"
    echo "gpu_bench: cache saved as $(ls "$OUT"/ind.tgz.part* | wc -l) piece(s), $(du -ch "$OUT"/ind.tgz.part* | tail -1 | cut -f1)"
fi
exit "$status"
