"""Where rendered prompts are kept: a memory LRU bounded in bytes, and files in a directory that survives restarts.

An entry is one prompt's line audio: 16-bit mono PCM at the line's rate, named by a `PromptKey` (text, voice, the
engine's model identity for that voice, rate, level). PCM rather than G.711 bytes: every codec the gateway speaks
encodes from it per packet (2.5 us a frame), and the speech API encodes its own formats from it, so one entry
serves PCMU and PCMA callers alike; the rate is in the key because a wideband line needs other samples.

A file is `<dir>/<digest[:2]>/<digest>.pcm`: a 76-byte header (magic, version, rate, sample count, the key's
digest, the SHA-256 of the samples) then the samples, little-endian. A file whose header, length or checksum does
not match is deleted and reported as corrupt, never returned: a torn write, a full disk or a flipped bit costs one
re-render, not a call full of noise. Files are written to a temporary name and renamed, so a reader never sees a
half-written one; no fsync (losing an entry in a crash costs a render, nothing more).

Thread-safe (one lock); the disk methods block and belong on a worker thread, never on an event loop.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT_VERSION = 1
_MAGIC = b"CVPC"
_HEADER = struct.Struct("<4sBxxxII32s32s")  # magic, version, rate, samples, key digest, payload sha256


@dataclass(frozen=True)
class PromptKey:
    """What makes two renderings the same audio. `model` is the engine's identity for the voice (its checkpoint and
    the voice's prompt data and text frontend version): a new model, voice or frontend is a new key, so old
    entries are never played for it. `level` is the line level the audio was made at ("-19.0", or "engine")."""

    text: str
    voice: str
    model: str
    rate: int
    level: str

    @property
    def digest(self) -> str:
        fields = [FORMAT_VERSION, self.text, self.voice, self.model, self.rate, self.level]
        return hashlib.sha256(json.dumps(fields, ensure_ascii=False).encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class StoreStats:
    corrupt: int
    memory_evictions: int
    disk_evictions: int
    memory_bytes: int
    memory_entries: int
    disk_bytes: int
    disk_entries: int


class PromptStore:
    """Memory LRU up to `max_memory_bytes`; files under `directory` (None: memory only) up to `max_disk_bytes`
    (None: unbounded), the least recently used removed first."""

    def __init__(self, directory: Path | None, max_memory_bytes: int, max_disk_bytes: int | None = None) -> None:
        self.directory = directory
        self.max_memory_bytes = max_memory_bytes
        self.max_disk_bytes = max_disk_bytes
        self._lock = threading.Lock()
        self._memory: OrderedDict[str, np.ndarray] = OrderedDict()
        self._memory_bytes = 0
        self._disk: OrderedDict[str, int] = OrderedDict()  # digest -> file size, least recently used first
        self._counts = dict.fromkeys(("corrupt", "memory_evictions", "disk_evictions"), 0)
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            self._scan()

    # -- memory (cheap, any thread) ----------------------------------------------------------------
    def memory_get(self, key: PromptKey) -> np.ndarray | None:
        with self._lock:
            pcm = self._memory.get(key.digest)
            if pcm is not None:
                self._memory.move_to_end(key.digest)
            return pcm

    def remember(self, key: PromptKey, pcm: np.ndarray) -> None:
        """Keep `pcm` (int16, contiguous) in memory (read-only from now on); an entry larger than the whole budget is not kept."""
        pcm.flags.writeable = False  # shared by every call that plays it
        with self._lock:
            self._forget(key.digest)
            if pcm.nbytes > self.max_memory_bytes:
                return
            self._memory[key.digest] = pcm
            self._memory_bytes += pcm.nbytes
            while self._memory_bytes > self.max_memory_bytes:
                _, old = self._memory.popitem(last=False)
                self._memory_bytes -= old.nbytes
                self._counts["memory_evictions"] += 1

    def _forget(self, digest: str) -> None:
        old = self._memory.pop(digest, None)
        if old is not None:
            self._memory_bytes -= old.nbytes

    # -- disk (blocking: call on a worker thread) -------------------------------------------------
    def path_of(self, key: PromptKey) -> Path:
        assert self.directory is not None
        digest = key.digest
        return self.directory / digest[:2] / f"{digest}.pcm"

    def disk_get(self, key: PromptKey) -> np.ndarray | None:
        """The entry's samples from its file (then kept in memory too), or None if absent or corrupt (deleted)."""
        if self.directory is None:
            return None
        path = self.path_of(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        pcm = _decode(data, key)
        with self._lock:
            if pcm is None:
                self._counts["corrupt"] += 1
                self._disk.pop(key.digest, None)
            elif key.digest in self._disk:
                self._disk.move_to_end(key.digest)
        if pcm is None:
            path.unlink(missing_ok=True)
            return None
        os.utime(path)  # the file's mtime is its last use: the LRU order after a restart
        self.remember(key, pcm)
        return pcm

    def write(self, key: PromptKey, pcm: np.ndarray, rate: int) -> None:
        """Write the entry's file (replacing any), then remove least recently used files over the budget."""
        if self.directory is None:
            return
        path = self.path_of(key)
        path.parent.mkdir(exist_ok=True)
        payload = np.ascontiguousarray(pcm, dtype="<i2").tobytes()
        header = _HEADER.pack(_MAGIC, FORMAT_VERSION, rate, len(payload) // 2, bytes.fromhex(key.digest),
                              hashlib.sha256(payload).digest())
        temporary = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
        temporary.write_bytes(header + payload)
        os.replace(temporary, path)
        with self._lock:
            self._disk[key.digest] = len(header) + len(payload)
            self._disk.move_to_end(key.digest)
            victims = []
            while self.max_disk_bytes is not None and sum(self._disk.values()) > self.max_disk_bytes \
                    and len(self._disk) > 1:
                digest, _ = self._disk.popitem(last=False)
                victims.append(digest)
                self._counts["disk_evictions"] += 1
        for digest in victims:
            (self.directory / digest[:2] / f"{digest}.pcm").unlink(missing_ok=True)

    def _scan(self) -> None:
        assert self.directory is not None
        found = []
        for path in self.directory.glob("??/*.pcm"):
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            found.append((stat.st_mtime, path.stem, stat.st_size))
        for _, digest, size in sorted(found):
            self._disk[digest] = size

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(**self._counts, memory_bytes=self._memory_bytes, memory_entries=len(self._memory),
                              disk_bytes=sum(self._disk.values()), disk_entries=len(self._disk))


def _decode(data: bytes, key: PromptKey) -> np.ndarray | None:
    """The samples of a file's bytes, or None when anything about them is wrong."""
    if len(data) < _HEADER.size:
        return None
    magic, version, rate, samples, digest, checksum = _HEADER.unpack_from(data)
    payload = data[_HEADER.size:]
    if (magic != _MAGIC or version != FORMAT_VERSION or rate != key.rate or digest.hex() != key.digest
            or len(payload) != 2 * samples or hashlib.sha256(payload).digest() != checksum):
        return None
    return np.frombuffer(payload, dtype="<i2").astype(np.int16)
