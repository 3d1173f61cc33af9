"""A voice prompt recording checked against what enrolment needs, before any model runs.

The official frontend reads the prompt at 16 kHz and refuses a file recorded below that rate
(`load_wav`'s `min_sr`: upsampling adds no speaker detail), and its speech tokenizer refuses more
than 30 s. Our limits are narrower where our runtime is (the bounds come from tts_core/voices.py).
Level is checked on the file's own samples: a silent or clipped prompt enrols without an error
and then speaks badly on every call, so it is refused here with the figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tts_core.features.wav_file import read_wav, resample

MIN_SOURCE_RATE = 16_000  # the official load_wav's min_sr
SILENT_RMS_DBFS = -50.0  # speech prompts sit near -30..-15 dBFS; below this there is nothing to enrol
FULL_SCALE = 0.999  # a sample this close to full scale is taken as clipped
CLIPPED_FRACTION = 0.001  # more than 0.1 % of samples at full scale: audibly clipped


@dataclass(frozen=True)
class PromptAudio:
    wav: torch.Tensor  # (N,) mono float32 at the requested rate
    seconds: float
    source_rate: int


def check_prompt_audio(path: Path, sample_rate: int, min_seconds: float, max_seconds: float) -> PromptAudio:
    """The prompt at `sample_rate`, or ValueError naming the file and what is wrong with it."""
    if not path.is_file():
        raise FileNotFoundError(f"prompt wav not found: {path}")
    audio = read_wav(path)
    if audio.sample_rate < MIN_SOURCE_RATE:
        raise ValueError(f"{path}: recorded at {audio.sample_rate} Hz; the model needs at least "
                         f"{MIN_SOURCE_RATE} Hz (a phone recording at 8 kHz is too narrow)")
    mono = audio.samples.mean(axis=1, dtype=np.float32) if audio.samples.shape[1] > 1 else audio.samples[:, 0]
    seconds = mono.shape[0] / audio.sample_rate
    if not min_seconds <= seconds <= max_seconds:
        raise ValueError(f"{path}: prompt is {seconds:.1f} s; give {min_seconds:g}-{max_seconds:g} s of the "
                         f"speaker (3-10 s of clean speech works best)")
    rms = float(np.sqrt(np.mean(np.square(mono, dtype=np.float64))))
    rms_dbfs = 20 * np.log10(max(rms, 1e-10))
    if rms_dbfs < SILENT_RMS_DBFS:
        raise ValueError(f"{path}: prompt is nearly silent ({rms_dbfs:.0f} dBFS RMS, needs above "
                         f"{SILENT_RMS_DBFS:.0f})")
    clipped = float(np.mean(np.abs(mono) >= FULL_SCALE))
    if clipped > CLIPPED_FRACTION:
        raise ValueError(f"{path}: prompt is clipped ({clipped:.1%} of samples at full scale); record it "
                         f"at a lower level")
    wav = resample(mono, audio.sample_rate, sample_rate)
    return PromptAudio(torch.from_numpy(np.ascontiguousarray(wav)), seconds, audio.sample_rate)
