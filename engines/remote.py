"""RemoteEngine: the gateway's client for engine workers (engine_service), local supervised ones or other hosts'.

It is a `SpeechEngine` like any other, so the call path does not change: `open_stream` picks a worker, sends
`open` and returns a channel made with `admitted=False`; the worker's `opened` or `refused` settles it before
the call is answered. No worker with a slot -> `NoCapacity` (the INVITE gets 503), so an answered call always
has a slot and starts speaking within the bound.

Placement: among workers whose expected first audio is within `max_first_audio_ms` and that have a free slot,
a worker whose status is late (none for `LATE_FACTOR` times its usual status interval, worker_link.py: hung,
or its loop stalled) is chosen only when no fresh one can take the stream; among those left, the most free slots
wins, then the earlier first audio. An open that does not become a stream there is placed again on a worker it has not
tried, before the call is answered: refused for capacity or unavailability (not for its voice or text), its
worker lost before it said `opened`, or not yet seen by a late worker after one late interval. With no other
worker to try, the refusal stands (503). Each open tries each worker at most once, and the call's own
admission timeout bounds the whole.

Each worker is one `WorkerLink` (engines/worker_link.py: its socket, reconnection, frames and free slots);
a link that dies ends every stream on it at once: admitted ones fail, waiting ones are placed again here or
refused (503).

health(): ready while any worker is ready (slots summed; free only where the first-audio bound holds);
warming while none is connected yet or all are reconnecting (the supervisor or the remote host restarts
them, so the gateway's watchdog has nothing to restart); down once closed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Sequence

import aiohttp
import structlog

from engine_service import protocol
from engines.base import (EngineHealth, EngineUnavailable, FirstAudioTooLate, NoCapacity, SpeechEngine,
                          SynthesisRefused, SynthesisRequest)
from engines.channel import ChunkChannel
from engines.worker_link import RemoteChannel, WorkerLink

log = structlog.get_logger(__name__)

FIRST_AUDIO_REASON = "expected first audio"  # how health() says "full because too slow", not "no slot"


class RemoteEngine(SpeechEngine):
    """Speech from engine workers over the streaming protocol; see the module docstring."""

    # The workers' model decides (a CosyVoice3 model takes instruct / dialect, others refuse with bad_text: 400).
    takes_instructs = True

    def __init__(self, urls: Sequence[str] = (), token: str = "", engine_name: str = "remote",
                 default_voice: str = "", max_first_audio_ms: float | None = None, dead_after_s: float = 1.0,
                 sample_format: protocol.Format = "f32le",
                 on_streams_lost: Callable[[str, int], None] | None = None, identity: str | None = None) -> None:
        self.name = engine_name
        self._identity = identity or engine_name  # the workers' model identity (gateway/app.py derives it)
        self._fallback_voice = default_voice
        self._token = token
        self._bound_ms = max_first_audio_ms
        self._dead_after_s = dead_after_s
        self._format = sample_format
        self._on_streams_lost = on_streams_lost or (lambda _name, _count: None)
        self._session: aiohttp.ClientSession | None = None
        self._links: dict[str, WorkerLink] = {}
        self._started = False
        self._closed = False
        for index, url in enumerate(urls):
            self.add_worker(f"remote-{index}", url)

    def model_identity(self, voice: str) -> str:
        return f"{self._identity}:{voice}"

    def add_worker(self, name: str, url: str | None = None, token: str | None = None) -> WorkerLink:
        """A worker to use; `url` None: not listening yet (a supervised worker starting), see `worker_at`."""
        link = WorkerLink(name, url, self._token if token is None else token, self._dead_after_s,
                          self._session_of, self._lost, self._place_again, self._place_unseen)
        self._links[name] = link
        if self._started:
            link.start()
        return link

    def worker_at(self, name: str, url: str) -> None:
        self._links[name].retarget(url)

    @property
    def links(self) -> Sequence[WorkerLink]:
        return tuple(self._links.values())

    def _session_of(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    def _lost(self, name: str, count: int) -> None:
        log.error("engine_worker_streams_lost", worker=name, streams=count)
        self._on_streams_lost(name, count)

    async def start(self) -> None:
        self._started, self._closed = True, False
        for link in self._links.values():
            link.start()

    async def close(self) -> None:
        self._closed = True
        await asyncio.gather(*(link.stop() for link in self._links.values()))
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def restart(self) -> None:
        """Nothing to do here: links reconnect by themselves and the supervisor restarts dead workers."""

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        """Until a worker is ready (its voices known), for the gateway's start-up checks."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not any(link.usable for link in self._links.values()):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("no engine worker became ready")
            await asyncio.sleep(0.05)  # start-up wait, not media pacing

    # -- the SpeechEngine interface --------------------------------------------------------------
    def _hello(self) -> protocol.Hello | None:
        return next((link.hello for link in self._links.values() if link.hello is not None), None)

    def voices(self) -> Sequence[str]:
        hello = self._hello()
        return hello.voices if hello else ()

    @property
    def default_voice(self) -> str:
        hello = self._hello()
        return hello.default_voice if hello else self._fallback_voice

    @property
    def max_text_chars(self) -> int:  # type: ignore[override]
        hello = self._hello()
        return hello.max_text_chars if hello else SpeechEngine.max_text_chars

    def _within_bound(self, link: WorkerLink) -> bool:
        return self._bound_ms is None or link.first_audio_ms <= self._bound_ms

    def health(self) -> EngineHealth:
        if self._closed or not self._started:
            return EngineHealth("down", reason="closed" if self._closed else "not started")
        usable = [link for link in self._links.values() if link.usable]
        if not usable:
            return EngineHealth("warming", reason=f"no engine worker ready (0 of {len(self._links)})")
        eligible = [link for link in usable if self._within_bound(link)]
        free = sum(link.slots_free for link in eligible)
        reason = ""
        if not eligible:
            reason = (f"{FIRST_AUDIO_REASON} {min(link.first_audio_ms for link in usable):.0f} ms is over the "
                      f"bound {self._bound_ms:.0f} ms on every worker")
        elif free == 0:  # a worker behind real time reports no free slot either (CosyVoice2's shed_late_s)
            reason = "no worker slot is free (taken, or its streams behind real time)"
        return EngineHealth("ready", slots_total=sum(link.status.slots_total for link in usable), slots_free=free,
                            queue_depth=sum(link.status.queue_depth for link in usable), reason=reason)

    def validate(self, request: SynthesisRequest) -> None:
        # With no worker connected there is no voice list to check against: that is the engine being
        # unavailable (503, try elsewhere), not the caller's voice being unknown (404).
        if not any(link.usable for link in self._links.values()):
            raise EngineUnavailable(f"no engine worker ready (0 of {len(self._links)})")
        super().validate(request)

    def open_stream(self, request: SynthesisRequest) -> ChunkChannel:
        self.validate(request)
        link = self._choose()
        if link is None:
            if not any(self._within_bound(link) for link in self._links.values() if link.usable):
                raise FirstAudioTooLate(f"expected first audio is over the bound of {self._bound_ms:.0f} ms "
                                        f"on every worker")
            raise NoCapacity("no engine worker slot is free (taken, or its streams behind real time)")
        channel = RemoteChannel(request)
        link.open(channel, self._format)
        return channel

    # -- placement (the module docstring's rule) -------------------------------------------------
    def _choose(self, tried: Collection[str] = ()) -> WorkerLink | None:
        fit = [link for link in self._links.values() if link.usable and link.name not in tried
               and self._within_bound(link) and link.slots_free > 0]
        fresh = [link for link in fit if not link.late]
        return max(fresh or fit, key=lambda link: (link.slots_free, -link.first_audio_ms), default=None)

    def _place_again(self, channel: RemoteChannel, refusal: SynthesisRefused) -> None:
        """Refused or lost before it was admitted: a worker it has not tried, or the refusal stands."""
        link = None if self._closed or channel.cancelled else self._choose(channel.tried)
        if link is None:
            channel.refuse(refusal)
            return
        log.info("engine_open_placed_again", call_id=channel.request.call_id, worker=link.name,
                 tried=sorted(channel.tried), why=str(refusal))
        link.open(channel, self._format)

    def _place_unseen(self, channel: RemoteChannel) -> None:
        """Not yet read by its late worker: moved where another worker can take it, else left to come or die."""
        link = None if self._closed or channel.cancelled else self._choose(channel.tried)
        if link is None or channel.link is None:
            return
        late = channel.link
        late.cancel(channel.stream)  # if the worker wakes, it reads the open, then this, and frees the slot
        log.info("engine_open_placed_again", call_id=channel.request.call_id, worker=link.name,
                 tried=sorted(channel.tried), why=f"worker {late.name} late")
        link.open(channel, self._format)
