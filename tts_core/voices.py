"""Speaker prompts ("voices"): what a zero-shot request needs about its speaker, and where they live.

A `Voice` carries exactly what the official zero-shot frontend hands the model for a prompt:
prompt text tokens, the prompt's speech tokens (for the LM and the flow), its 24 kHz mel (2 frames
per speech token) and its CAM++ speaker embedding. Voices are stored in the official `spk2info`
format (`{name: {prompt_text: (1, N) int32, ..., flow_embedding: (1, 192)}}`), so a file written
here loads in the official code and the official `spk2info.pt` loads here.

`VoiceBank` holds `<model_dir>/spk2info.pt` plus every `<voices_dir>/*.pt` (default
`<model_dir>/voices`); `register_voice` enrols a new voice from a wav and its transcript by running
the two frontend ONNX models once (tts_core/voice_files.py, with the operator's `list_voices` and
`remove_voice`), so synthesis never runs ONNX. Voice files are validated when loaded: a bad file is
refused with a message naming the file, the voice and the field, not at the first call.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

log = structlog.get_logger(__name__)

MEL_BINS = 80
EMBEDDING_DIM = 192
PROMPT_RATE = 16_000  # speech tokens and the speaker embedding are computed at 16 kHz
MEL_RATE = 24_000  # the prompt mel at the output rate
FRAMES_PER_TOKEN = 2  # 50 Hz mel frames per 25 Hz speech token
TOKEN_RATE = 25  # speech tokens per second of prompt
# Prompt bounds. The official tokenizer takes up to 30 s, but the flow pool holds 600 prompt frames
# per voice (runtime/chunk_render.FlowPoolSettings.voice_frames 500 + two 50-frame chunks): 12 s.
# A longer voice would fail every start, so it is refused when added and, naming it, when loaded.
MIN_PROMPT_SECONDS = 1.0
MAX_PROMPT_SECONDS = 12.0
MAX_PROMPT_TOKENS = int(MAX_PROMPT_SECONDS * TOKEN_RATE)


@dataclass(frozen=True, eq=False)
class Voice:
    name: str
    prompt_text: tuple[int, ...]
    llm_prompt_speech_token: tuple[int, ...]
    flow_prompt_speech_token: tuple[int, ...]
    prompt_speech_feat: torch.Tensor  # (frames, 80) float32, frames = 2 x flow prompt tokens
    llm_embedding: torch.Tensor  # (192,) float32
    flow_embedding: torch.Tensor  # (192,) float32

    @classmethod
    def from_spk2info(cls, name: str, entry: Mapping[str, Any], source: str = "") -> Voice:
        """From one official spk2info entry; errors name `source` and the field."""
        where = f"{source}: voice {name!r}" if source else f"voice {name!r}"

        def field(key: str) -> torch.Tensor:
            if key not in entry:
                raise ValueError(f"{where}: field {key!r} is missing")
            value = entry[key]
            return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)

        def tokens(key: str) -> tuple[int, ...]:
            return tuple(int(t) for t in field(key).reshape(-1).tolist())

        feat = field("prompt_speech_feat").float()
        feat = feat[0] if feat.dim() == 3 else feat
        if feat.dim() != 2 or feat.shape[1] != MEL_BINS:
            raise ValueError(f"{where}: prompt_speech_feat has shape {tuple(feat.shape)}, expected (frames, 80)")
        embeddings = {}
        for key in ("llm_embedding", "flow_embedding"):
            emb = field(key).float().reshape(-1)
            if emb.numel() != EMBEDDING_DIM:
                raise ValueError(f"{where}: {key} has {emb.numel()} values, expected {EMBEDDING_DIM}")
            embeddings[key] = emb
        flow_tokens = tokens("flow_prompt_speech_token")
        if len(flow_tokens) > MAX_PROMPT_TOKENS:
            raise ValueError(f"{where}: its prompt is {len(flow_tokens) / TOKEN_RATE:.1f} s; at most "
                             f"{MAX_PROMPT_SECONDS:g} s fits (remove it, or add it again from a shorter recording)")
        if feat.shape[0] != FRAMES_PER_TOKEN * len(flow_tokens):
            raise ValueError(f"{where}: prompt_speech_feat has {feat.shape[0]} frames for {len(flow_tokens)} "
                             f"prompt tokens; expected {FRAMES_PER_TOKEN} per token")
        return cls(name=name, prompt_text=tokens("prompt_text"),
                   llm_prompt_speech_token=tokens("llm_prompt_speech_token"),
                   flow_prompt_speech_token=flow_tokens, prompt_speech_feat=feat.contiguous(),
                   llm_embedding=embeddings["llm_embedding"], flow_embedding=embeddings["flow_embedding"])

    def to_spk2info(self) -> dict[str, torch.Tensor]:
        """The official entry: batch-1 tensors and their `_len` companions."""
        def ids(values: tuple[int, ...]) -> torch.Tensor:
            return torch.tensor([values], dtype=torch.int32).reshape(1, -1)

        def length(n: int) -> torch.Tensor:
            return torch.tensor([n], dtype=torch.int32)

        return {
            "prompt_text": ids(self.prompt_text), "prompt_text_len": length(len(self.prompt_text)),
            "llm_prompt_speech_token": ids(self.llm_prompt_speech_token),
            "llm_prompt_speech_token_len": length(len(self.llm_prompt_speech_token)),
            "flow_prompt_speech_token": ids(self.flow_prompt_speech_token),
            "flow_prompt_speech_token_len": length(len(self.flow_prompt_speech_token)),
            "prompt_speech_feat": self.prompt_speech_feat[None].clone(),
            "prompt_speech_feat_len": length(self.prompt_speech_feat.shape[0]),
            "llm_embedding": self.llm_embedding[None].clone(),
            "flow_embedding": self.flow_embedding[None].clone(),
        }


def read_spk2info(path: Path) -> list[Voice]:
    """Every voice in one spk2info file, validated; ValueError names the file (and the voice and field)."""
    ((_, entries),) = raw_voice_files_of([path])
    if isinstance(entries, str):
        raise ValueError(entries)
    return [Voice.from_spk2info(str(name), entry, str(path)) for name, entry in entries.items()]


def write_spk2info(path: Path, voices: list[Voice]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_raw(path, {v.name: v.to_spk2info() for v in voices})


class VoiceBank:
    """Name -> Voice; thread-safe reads, `add` for voices built in process (tests, enrolment)."""

    def __init__(self, voices: list[Voice] = ()) -> None:
        self._lock = threading.Lock()
        self._voices: dict[str, Voice] = {v.name: v for v in voices}

    @classmethod
    def load(cls, model_dir: str | Path, voices_dir: str | Path | None = None) -> VoiceBank:
        """`<model_dir>/spk2info.pt` (if any), then `<voices_dir>/*.pt`; a later file wins a name clash."""
        model_dir = Path(model_dir)
        voices_dir = voices_dir_of(model_dir, voices_dir)
        files = raw_voice_files(model_dir, voices_dir)
        bank = cls()
        for path, entries in files:
            if isinstance(entries, str):
                raise ValueError(entries)
            for name, entry in entries.items():
                bank.add(Voice.from_spk2info(str(name), entry, str(path)))
        log.info("tts_voices_loaded", count=len(bank), files=len(files), voices_dir=str(voices_dir))
        return bank

    def add(self, voice: Voice) -> None:
        with self._lock:
            self._voices[voice.name] = voice

    def get(self, name: str) -> Voice:
        with self._lock:
            voice = self._voices.get(name)
        if voice is None:
            raise KeyError(f"unknown voice {name!r}")
        return voice

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._voices)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._voices

    def __len__(self) -> int:
        with self._lock:
            return len(self._voices)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


def voices_dir_of(model_dir: Path, voices_dir: str | Path | None) -> Path:
    return Path(voices_dir) if voices_dir is not None else model_dir / "voices"


def raw_voice_files(model_dir: Path, voices_dir: Path) -> list[tuple[Path, Mapping[str, Any] | str]]:
    """The files VoiceBank.load reads, in its order, each with its unvalidated entries (or, for a
    file that does not unpickle to a mapping, the reason)."""
    files = [model_dir / "spk2info.pt"] if (model_dir / "spk2info.pt").is_file() else []
    return raw_voice_files_of(files + (sorted(voices_dir.glob("*.pt")) if voices_dir.is_dir() else []))


def raw_voice_files_of(files: list[Path]) -> list[tuple[Path, Mapping[str, Any] | str]]:
    loaded: list[tuple[Path, Mapping[str, Any] | str]] = []
    for path in files:
        try:
            raw = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as exc:  # a truncated or foreign file: unpickling raises anything
            loaded.append((path, f"{path}: not a readable speaker file ({type(exc).__name__}: {exc})"))
            continue
        loaded.append((path, raw if isinstance(raw, Mapping) else
                       f"{path}: not a speaker file (expected a mapping name -> speaker entry)"))
    return loaded


def write_raw(path: Path, entries: Mapping[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(dict(entries), tmp)
    tmp.replace(path)  # a reader never sees a half-written file
