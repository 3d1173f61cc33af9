"""Streaming synthesis: when each chunk is rendered (chunk_schedule) and the per-request state that renders it."""
