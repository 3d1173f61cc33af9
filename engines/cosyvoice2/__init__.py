"""The `cosyvoice2` engine: CosyVoice2 and CosyVoice3 zero-shot voices (the family read from the model directory)
streamed by tts_core's runtime.

The only place in the gateway that imports tts_core. Importing this package needs no GPU and loads
no model; `start()` loads and warms up in a worker thread.
"""

from engines.cosyvoice2.engine import CosyVoice2Engine

__all__ = ["CosyVoice2Engine"]
