"""One key block of a flash-attention loop (Triton), shared by the attention kernels of the pooled flows
(`dit_attention.py`, CosyVoice3; `flow_attention.py`, CosyVoice2).

The running maximum, sum and output accumulate in fp32 over key blocks, as SDPA's flash kernels do, in base 2:
`scale` carries log2(e) / sqrt(head_dim), so the exponentials are exp2 of the scaled scores (one multiply fewer
an element than exp). A key a query must not see is masked to -inf; callers start `best` at a finite -1e30 so
a query that has seen nothing yet never makes exp2(-inf - -inf).
"""

from __future__ import annotations

import math

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the host: CPU torch comes without Triton
    triton = None


def scale_for(head_dim: int) -> float:
    """The `scale` of `softmax_step` for heads of `head_dim` channels."""
    return math.log2(math.e) / math.sqrt(head_dim)


if triton is not None:

    @triton.jit
    def softmax_step(q, keys, values, seen, best, total, acc, scale, PRECISION: tl.constexpr):
        scores = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale
        scores = tl.where(seen, scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, 1))
        weights = tl.exp2(scores - new_best[:, None])
        rescale = tl.exp2(best - new_best)
        total = total * rescale + tl.sum(weights, 1)
        acc = acc * rescale[:, None] + tl.dot(weights.to(values.dtype), values, input_precision=PRECISION)
        return new_best, total, acc
