"""Prompt-audio features for CosyVoice2 voice enrolment, equal to the official frontend's.

    prompt_mel(wav_24k, PromptMelConfig.from_yaml(cfg))  -> (frames, 80)   flow prompt features
    campplus_fbank(wav_16k)                              -> (frames, 80)   campplus.onnx input
    whisper_logmel(wav_16k, n_mels=128)                  -> (1, 128, frames) speech tokenizer input
    load_wav(path, sample_rate)                          -> (N,) mono float32

No model runs here: the ONNX sessions belong to the frontend that calls these.
"""

from tts_core.features.campplus_fbank import campplus_fbank, kaldi_fbank
from tts_core.features.mel_filters import mel_filterbank
from tts_core.features.prompt_mel import PromptMelConfig, prompt_mel
from tts_core.features.wav_file import WavAudio, WavFormatError, load_wav, read_wav, resample
from tts_core.features.whisper_logmel import whisper_logmel

__all__ = ["PromptMelConfig", "WavAudio", "WavFormatError", "campplus_fbank", "kaldi_fbank", "load_wav",
           "mel_filterbank", "prompt_mel", "read_wav", "resample", "whisper_logmel"]
