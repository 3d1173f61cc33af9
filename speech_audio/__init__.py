"""Audio code both processes need (the gateway and the engine workers): a package below both.

`resample` (engine rate -> line rate), `level` (dBm0, active speech level, the per-stream gain and peak limiter),
`line_audio` (an engine stream made line audio: resampled, levelled, 16-bit), `prompt_store` (the prompt cache's
memory LRU and disk files) and `prompt_cache` (one fill per key, shared by everyone who asks meanwhile).
Never imports the gateway, the engines, the engine service or tts_core.
"""
