"""The speech-token LM: Qwen2 decoder, static KV cache, repetition-aware sampling."""
