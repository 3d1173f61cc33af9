# The GPU benchmarks' engine settings, sourced by scripts/gpu_e2e.sh and scripts/gpu_product.sh: one place, because
# the carried compiler cache (.ind) serves only the shapes these settings capture (full-size random weights from
# bench/full_model.py, bf16, max_batch 128, max_len 768, flow_context_s 13).
# shellcheck shell=bash

# The engine.cosyvoice2 block (YAML, indented under engine:) for the model directory $1. DTYPE (bf16), MAX_BATCH
# (slots, 128) and FLOW_CONTEXT_S (13) change it; other values compile other graphs, so the carried cache misses.
# FLOW_CONTEXT_INT8=true keeps that context as int8 codes (half the pool: 336 slots of 13 s in 59.9 GiB);
# MAX_HOP_TOKENS sets engine.cosyvoice2.max_hop_tokens (unset: the family's default, CosyVoice2's 50); SHED_LATE_S
# sets shed_late_s (unset: the engine's default, 0.5; null: off); FIRST_HOP sets first_hop_tokens (unset: the
# official first hop; another value captures other first-chunk graphs, so the carried cache misses them). MAX_LEN
# (768): the 30-s prompts' benches raise it to 1024, so a run of short prompts that should find their compiled
# decode graphs in the same cache sets MAX_LEN=1024.
cosyvoice2_settings() {
    cat <<YAML
  cosyvoice2:
    model_dir: $1
    device: cuda
    dtype: ${DTYPE:-bf16}
    default_voice: bench_voice
    max_batch: ${MAX_BATCH:-128}
    max_len: ${MAX_LEN:-768}
    flow_context_s: ${FLOW_CONTEXT_S:-13.0}
    flow_context_int8: ${FLOW_CONTEXT_INT8:-false}
${MAX_HOP_TOKENS:+    max_hop_tokens: $MAX_HOP_TOKENS}
${SHED_LATE_S:+    shed_late_s: $SHED_LATE_S}
${FIRST_HOP:+    first_hop_tokens: $FIRST_HOP}
YAML
}
