# The GPU benchmarks' engine settings, sourced by scripts/gpu_e2e.sh and scripts/gpu_product.sh: one place, because
# the carried compiler cache (.ind) serves only the shapes these settings capture (full-size random weights from
# bench/full_model.py, bf16, max_batch 128, max_len 768, flow_context_s 13).
# shellcheck shell=bash

# The engine.cosyvoice2 block (YAML, indented under engine:) for the model directory $1.
cosyvoice2_settings() {
    cat <<YAML
  cosyvoice2:
    model_dir: $1
    device: cuda
    dtype: bf16
    default_voice: bench_voice
    max_batch: 128
    max_len: 768
    flow_context_s: 13.0
YAML
}
