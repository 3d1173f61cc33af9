"""A request's streaming vocoder that replays a captured HiFT graph when one fits the chunk.

Same glue as `HiftStream` (8-frame mel cache, 3840-sample source cache, Hamming cross-fade, held-back
tail); only the F0 + source + decode call is swapped for a `GraphedHift` of the chunk's frame count
(the steady chunk shapes of a schedule are few: first chunk, later chunks; finals vary and run
eagerly). A graph draws its excitation noise from the device's default generator, not the job's
seeded one: graphed chunks are not reproducible by seed (the eager path is).
"""

from __future__ import annotations

import torch

from tts_core.hift import HiftGenerator, HiftStream


class ChunkVocoder(HiftStream):
    def __init__(self, vocoder: HiftGenerator, generator: torch.Generator | None,
                 graphs: dict[tuple[int, int], object]) -> None:
        super().__init__(vocoder, generator)
        # (mel frames incl. cache, cached source samples) -> GraphedHift of the lane rendering now
        self.graphs = graphs

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Mark the caches as used on `stream` (another rendering lane takes this vocoder over)."""
        for cached in (self._mel, self._source, self._speech):
            if cached is not None:
                cached.record_stream(stream)

    @torch.inference_mode()
    def push(self, mel_chunk: torch.Tensor, finalize: bool = False, source: torch.Tensor | None = None) -> torch.Tensor:
        cached = 0 if self._source is None else self._source.shape[-1]
        graph = self.graphs.get((mel_chunk.shape[-1] + (0 if self._mel is None else self._mel.shape[-1]), cached))
        if graph is None or source is not None:
            return super().push(mel_chunk, finalize, source)
        mel = mel_chunk if self._mel is None else torch.cat([self._mel, mel_chunk], dim=2)
        wav, source = graph.inference(mel, self._source)
        if self._speech is not None:
            wav = self._cross_fade(wav, self._speech)
        if finalize:
            self.finished = True
            self._mel = self._source = self._speech = None
            return wav.clone()
        # Copies: the graph's outputs are overwritten by its next replay (another stream's chunk).
        self._mel = mel[..., -self.mel_cache_frames:].clone()
        self._source = source[..., -self.source_cache_samples:].clone()
        self._speech = wav[..., -self.source_cache_samples:].clone()
        return wav[..., :-self.source_cache_samples].clone()
