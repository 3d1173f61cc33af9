#!/usr/bin/env bash
# Fetch, here, the wheels a lent GPU host needs besides its own PyTorch (it reaches no package index), into
# .whl/ (ignored: name it in the device call's carry), for Python 3.12 on x86-64; scripts/gpu_bench.sh
# installs them there. The host's image already has numpy, aiohttp, pyyaml, prometheus-client, tokenizers,
# onnxruntime and pytest.
#
#   bash scripts/gpu_wheels.sh && cp -r ../shared/golden .golden
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || printf '/.whl/\n/.golden/\n/.ind/\n' >> .git/info/exclude
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 any; do
    platforms+=(--platform "$p")
done
# Ours (pyproject) and what they need that the image lacks: pydantic's core and helpers, wetext's FST
# runtime and contractions, inflect's helpers; pytest-asyncio for the CUDA tests.
fetch() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "$@"; }
fetch structlog soxr kaldi-native-fbank espeakng-loader pydantic annotated-types typing-inspection typing-extensions \
    wetext kaldifst contractions textsearch anyascii pyahocorasick inflect more-itertools typeguard jaraco.functools \
    pytest-asyncio lameenc defusedxml G722==1.2.8
# pydantic pins its core exactly: fetch the version the fetched pydantic names
fetch "$(unzip -p .whl/pydantic-2*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core *\(==[^ ;]*\).*/pydantic-core\1/p')"
du -sh .whl
