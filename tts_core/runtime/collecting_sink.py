"""CollectingSink: keeps a job's chunks in memory and lets a thread wait for the end of the stream.

For warm-up, benchmarks and tests; the gateway uses engines.channel.ChunkChannel instead.
"""

from __future__ import annotations

import threading

import numpy as np


class CollectingSink:
    """A sink that keeps every chunk and lets a thread wait for the end (warm-up, benchmarks, tests)."""

    def __init__(self) -> None:
        self.chunks: list[np.ndarray] = []
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._cancel = threading.Event()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        self._cancel.set()

    def put(self, chunk: np.ndarray) -> None:
        self.chunks.append(chunk)

    def finish(self) -> None:
        self._done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._done.set()

    def wait(self, timeout: float | None = None) -> list[np.ndarray]:
        """Block until the stream ends; raises the stream's error, or TimeoutError."""
        if not self._done.wait(timeout):
            raise TimeoutError("synthesis did not finish in time")
        if self.error is not None:
            raise self.error
        return self.chunks

    def samples(self) -> int:
        return sum(len(c) for c in self.chunks)
