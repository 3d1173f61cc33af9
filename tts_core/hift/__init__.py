"""CosyVoice2's HiFT vocoder: mel -> 24 kHz waveform, with per-request streaming state.

`load_hift(model_dir)` builds and strictly loads the shared `HiftGenerator`; each request wraps it
in a `HiftStream` (its own caches and its own `torch.Generator` for the source noise).
"""

from tts_core.hift.config import HiftConfig, hift_config_from
from tts_core.hift.generator import HiftGenerator, load_hift, load_hift_checkpoint
from tts_core.hift.streaming import MEL_CACHE_FRAMES, HiftStream, speech_window

__all__ = ["MEL_CACHE_FRAMES", "HiftConfig", "HiftGenerator", "HiftStream", "hift_config_from", "load_hift",
           "load_hift_checkpoint", "speech_window"]
