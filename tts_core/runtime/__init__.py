"""The streaming runtime: one scheduler owns the device and serves many requests at once.

`pipeline.CosyVoice2Pipeline` loads a model directory and starts the scheduler. The roles, as in
nano-vllm: `scheduler` decides what runs next (admission into KV slots, the decode loop, retiring);
`step_rows` which jobs a decode step takes (deadline-aware); `lm_runner` runs the LM's prefills and
decode steps on the decode thread; `render_loop` is a render lane (tokens -> audio chunks through
`chunk_render`); `request` is one request's state; `settings` what the runtime trades. Importing this package loads no model and needs no GPU.
"""

from tts_core.runtime.collecting_sink import CollectingSink
from tts_core.runtime.pipeline import CosyVoice2Pipeline
from tts_core.runtime.request import AudioSink, JobOptions, NothingToSpeak, SynthesisError, SynthesisJob
from tts_core.runtime.scheduler import SynthesisScheduler
from tts_core.runtime.settings import SchedulerSettings

__all__ = ["AudioSink", "CollectingSink", "CosyVoice2Pipeline", "JobOptions", "NothingToSpeak", "SchedulerSettings",
           "SynthesisError", "SynthesisJob", "SynthesisScheduler"]
