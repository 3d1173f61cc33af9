"""Fast paths for the CosyVoice2 model code on CUDA: captured graphs, batched sampling, dtype choice.

Nothing here changes what the model computes; each runner replays the same module calls with static
shapes so a scheduler can drive many requests per GPU step. Runners are built once per process
(capture costs seconds) and owned by the one thread that owns the GPU; none is thread-safe.
"""

from tts_core.accel.buckets import select_bucket
from tts_core.accel.dtypes import resolve_dtype

__all__ = ["resolve_dtype", "select_bucket"]
