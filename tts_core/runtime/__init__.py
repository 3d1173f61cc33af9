"""The streaming runtime: one scheduler owns the device and serves many requests at once.

`pipeline.CosyVoice2Pipeline` loads a model directory and starts the scheduler; `request` holds one
request's state; `scheduler` decides what runs next and runs the LM on its decode thread;
`render_loop` turns tokens into audio chunks on the scheduler's render thread. Importing this
package loads no model and needs no GPU.
"""

from tts_core.runtime.collecting_sink import CollectingSink
from tts_core.runtime.pipeline import CosyVoice2Pipeline
from tts_core.runtime.request import AudioSink, JobOptions, SynthesisError, SynthesisJob
from tts_core.runtime.scheduler import SchedulerSettings, SynthesisScheduler

__all__ = ["AudioSink", "CollectingSink", "CosyVoice2Pipeline", "JobOptions", "SchedulerSettings",
           "SynthesisError", "SynthesisJob", "SynthesisScheduler"]
