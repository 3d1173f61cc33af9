"""Chunk-causal attention masks: the one rule that makes the flow streamable.

With a static chunk size C, frame i may attend to every frame of its own chunk and of all chunks
before it (`num_left_chunks < 0`), or only to the `num_left_chunks` chunks before it. Chunks are
counted from the first frame of the sequence (the prompt's first frame), so a frame's context does
not depend on frames in later chunks: that is what lets a chunk-wise path reuse earlier results.
"""

from __future__ import annotations

import torch


def chunk_attention_mask(size: int, chunk_size: int, num_left_chunks: int = -1,
                         device: torch.device | str = "cpu") -> torch.Tensor:
    """(size, size) bool, True where query row may attend to key column."""
    pos = torch.arange(size, device=device)
    chunk = torch.div(pos, chunk_size, rounding_mode="floor")
    end = (chunk + 1) * chunk_size
    mask = pos.unsqueeze(0) < end.unsqueeze(1)
    if num_left_chunks >= 0:
        start = (chunk - num_left_chunks).clamp(min=0) * chunk_size
        mask &= pos.unsqueeze(0) >= start.unsqueeze(1)
    return mask
