#!/usr/bin/env bash
# Run one GPU benchmark command on a lent GPU machine that has PyTorch but none of our other
# dependencies, and keep its compiler cache between machines.
#
#   bash scripts/gpu_bench.sh timeout 450 python3 bench/bench_load.py --golden .golden --out "$OUT/load.json"
#
# It reads, from the repository root (ignored folders that the caller carries along):
#   .whl/   wheels of the pure dependencies (structlog, soxr, kaldi-native-fbank, ...): scripts/gpu_wheels.sh
#   .golden a copy of ../shared/golden
#   .ind/   the torch.compile/Triton cache as xz-compressed tar pieces ind.txz.part* (xz: a third of
#           gzip's size, and the carried files share 64 MiB with the tree)
# With SAVE_CACHE=1 and $OUT set it writes the cache back to $OUT as ind.txz.part* pieces of at most
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
parts=(.ind/ind.txz.part*)
if [ ${#parts[@]} -gt 0 ]; then
    cat "${parts[@]}" | xz -dc | tar x -C /tmp || echo "gpu_bench: the carried cache pieces did not unpack" >&2
fi
"$@"
status=$?
if [ "${SAVE_CACHE:-0}" = 1 ] && [ -n "${OUT:-}" ]; then
    tar c -C /tmp ind | xz -T0 -6 | split -b 15M - "$OUT/ind.txz.part"
    echo "gpu_bench: cache saved as $(ls "$OUT"/ind.txz.part* | wc -l) piece(s), $(du -ch "$OUT"/ind.txz.part* | tail -1 | cut -f1)"
fi
exit "$status"
