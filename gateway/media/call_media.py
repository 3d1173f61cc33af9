"""The media facade the call layer uses: `MediaEngine` (one per process) and `CallMedia` (one per call).

`MediaEngine` owns the shared `PacketClock` and the RTP port pool. `CallMedia` joins one call's pieces:
the SDP answerer, the RTP session and the playout buffer. It plays line audio (16-bit PCM at the codec's rate,
`plan.audio_rate`: 8 kHz for G.711, 16 kHz for G.722; already at the line's level: gateway/speech.py and
speech_audio/line_audio.py make it), so a cached prompt and a streamed one take the same path.
While a prompt plays, the call is subscribed to the clock and each tick sends one packet; otherwise it
sends nothing, but its socket stays open to receive DTMF. A prompt's first packet does not wait for the
call's next tick: it goes out as soon as its audio is buffered, as the packet of the tick just passed
(`_start_talkspurt`).

`pause()` takes a playing prompt off the clock and `resume()` puts it back, its buffered audio kept (MRCP
PAUSE/RESUME, and STOP before its play task is cancelled).

On hold (the peer's offer says we may not send), a playing prompt keeps running in time and its
frames are dropped unsent: `play()` still ends when the prompt's last sample is due, and the engine
stream never backs up behind a caller who pressed hold.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import structlog

from gateway import metrics
from gateway.config_errors import ConfigError
from gateway.media.packet_clock import PacketClock
from gateway.media.playout import PlayoutBuffer, PlayoutSettings
from gateway.media.port_pool import PortsExhausted, RtpPortPool
from gateway.media.rtp_peer import Latching, RtpPeer
from gateway.media.rtp_session import RtpSession
from gateway.media.sdp import CodecOrder, MediaPlan, NoCommonCodec, SdpAnswerer

log = structlog.get_logger(__name__)

__all__ = ["CallMedia", "MediaClosed", "MediaEngine", "MediaSettings", "NoCommonCodec", "PortsExhausted"]


@dataclass(frozen=True)
class MediaSettings:
    bind_host: str = "127.0.0.1"  # where RTP/RTCP sockets bind: an address of this host, or a wildcard
    bind_key: str = "media.bind_address"  # the config key bind_host came from, for the start's error
    advertised_host: str = "127.0.0.1"  # what the SDP answer names (c=, o=): may be a public/NAT address
    rtp_port_min: int = 20000
    rtp_port_max: int = 30000
    codecs: tuple[str, ...] = ("PCMU", "PCMA", "G722")
    codec_order: CodecOrder = "offer"  # see sdp.py: the offer's order or ours
    initial_playout_delay_ms: int = 60
    max_playout_delay_ms: int = 400
    rtcp_interval_s: float = 5.0
    rtp_latching: Latching = "off"  # see rtp_peer: whether a NAT'd phone's RTP source may replace its SDP address
    dtmf_max_per_second: float = 10.0  # per call; key presses beyond it are dropped
    inactivity_timeout_s: float = 60.0  # no RTP/RTCP from the caller this long (off hold): end the call; 0: never
    hold_timeout_s: float = 300.0  # the same while on hold (media/inactivity.py says why it is longer); 0: never


class MediaClosed(RuntimeError):
    """`play()` was called on call media that has been closed."""


class MediaEngine:
    """Process-wide media: the one packet clock and the RTP port pool."""

    def __init__(self, settings: MediaSettings) -> None:
        self.settings = settings
        self.clock = PacketClock()
        self._pool = RtpPortPool(settings.rtp_port_min, settings.rtp_port_max)
        self._calls: set[CallMedia] = set()
        metrics.rtp_port_pairs_free.set(self._pool.free)

    async def start(self) -> None:
        """Raises ConfigError when RTP cannot bind its address (not one of this host's): otherwise every call
        would fail at its first bind, long after the start looked fine."""
        host = self.settings.bind_host
        try:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.bind((host, 0))
        except OSError as exc:
            raise ConfigError([f"{self.settings.bind_key}: cannot bind RTP on {host} ({exc.strerror or exc}); "
                               "bind an address of this host and put a public or NAT address in "
                               "sip.advertised_host / media.advertised_address"]) from None
        self.clock.start()

    async def stop(self) -> None:
        for media in list(self._calls):
            await media.close()
        self.clock.stop()

    @property
    def active_calls(self) -> int:
        return len(self._calls)

    @property
    def port_pairs_free(self) -> int:
        """RTP/RTCP pairs of the range no call holds; at 0 a new call cannot be answered (503)."""
        return self._pool.free

    @property
    def port_pairs_total(self) -> int:
        return self._pool.total

    def refusal(self) -> str | None:
        """Media's part of why a new call is turned away now ("kind: detail", the kind a bounded label of
        gateway_calls_refused_total), or None: no free RTP/RTCP port pair."""
        if self._pool.free == 0:
            return "no_rtp_ports: every RTP/RTCP port pair of media.rtp_port_range is held by a call"
        return None

    async def open_call(self, call_id: str, offer_sdp: str, signalling_source: str | None = None) -> CallMedia:
        """Bind the call's ports and answer its offer; raises PortsExhausted, or NoCommonCodec / SdpError
        (ports released again).

        `signalling_source` is the IP the INVITE came from: with `rtp_latching: signalling_source` RTP
        from that host may replace the SDP's address.
        """
        if not self.clock.running:
            raise RuntimeError("MediaEngine.start() must run before open_call()")
        settings = self.settings
        session = RtpSession(call_id, self.clock, settings.rtcp_interval_s,
                             RtpPeer(settings.rtp_latching, signalling_source), settings.dtmf_max_per_second)
        try:
            await session.bind(self.settings.bind_host, self._pool)
        finally:
            metrics.rtp_port_pairs_free.set(self._pool.free)
        try:
            answerer = SdpAnswerer(self.settings.advertised_host, session.local_port, self.settings.codecs,
                                   self.settings.codec_order)
            answer_sdp, plan = answerer.answer(offer_sdp)
            plan = await _resolved(plan)
            session.apply_plan(plan)
        except BaseException:
            await self._release(None, session)
            raise
        media = CallMedia(call_id, session, answerer, answer_sdp, plan, self)
        self._calls.add(media)
        log.info("media_opened", call_id=call_id, port=session.local_port, codec=plan.codec,
                 remote=f"{plan.remote_host}:{plan.remote_port}", can_send=plan.can_send)
        return media

    async def _release(self, media: CallMedia | None, session: RtpSession) -> None:
        self._calls.discard(media)
        try:
            await session.close(self._pool)
        finally:
            metrics.rtp_port_pairs_free.set(self._pool.free)


async def _resolved(plan: MediaPlan) -> MediaPlan:
    """The plan with its remote host as an IP literal (SDP may carry a DNS name, RFC 4566 §5.7)."""
    try:
        ipaddress.ip_address(plan.remote_host)
        return plan
    except ValueError:
        pass
    infos = await asyncio.get_running_loop().getaddrinfo(plan.remote_host, plan.remote_port,
                                                         type=socket.SOCK_DGRAM)
    return dataclasses.replace(plan, remote_host=infos[0][4][0])


class CallMedia:
    def __init__(self, call_id: str, session: RtpSession, answerer: SdpAnswerer, answer_sdp: str,
                 plan: MediaPlan, engine: MediaEngine) -> None:
        self.call_id = call_id
        self.answer_sdp = answer_sdp
        self.plan = plan
        self.dtmf: asyncio.Queue[str] = session.dtmf
        self.first_speech_sent_at: float | None = None
        self._session = session
        self._answerer = answerer
        self._engine = engine
        self._clock = engine.clock
        self._buffer = PlayoutBuffer(PlayoutSettings(
            initial_delay_ms=engine.settings.initial_playout_delay_ms,
            max_delay_ms=engine.settings.max_playout_delay_ms), plan.audio_rate)  # a re-offer keeps the rate
        self._done: asyncio.Future[None] | None = None
        self._closed = False
        self._listening_since = time.monotonic()  # answer or last hold/resume: silence before it does not count
        self._log = log.bind(call_id=call_id)

    @property
    def underruns(self) -> int:
        return self._buffer.underruns

    @property
    def packets_sent(self) -> int:
        return self._session.packets_sent

    @property
    def local_port(self) -> int:
        return self._session.local_port

    @property
    def on_hold(self) -> bool:
        """The peer may send us nothing: our answer is not sendrecv, or its address is 0.0.0.0 (RFC 3264 §8.4)."""
        return self.plan.direction != "sendrecv" or self.plan.remote_host in ("0.0.0.0", "::")

    def silence(self) -> tuple[float, bool]:
        """(monotonic time since which no RTP/RTCP arrived from the peer, whether on hold): what
        gateway/media/inactivity.py measures against the inactivity and hold timeouts."""
        return max(self._session.last_received_at, self._listening_since), self.on_hold

    def update_offer(self, offer_sdp: str) -> str:
        """Answer a re-INVITE/UPDATE offer (hold, resume, new address); raises NoCommonCodec, changing nothing."""
        answer_sdp, plan = self._answerer.answer(offer_sdp)
        self._session.apply_plan(plan)
        was_on_hold = self.on_hold
        if plan.can_send != self.plan.can_send:
            self._log.info("media_direction", direction=plan.direction, can_send=plan.can_send)
        self.plan, self.answer_sdp = plan, answer_sdp
        if was_on_hold != self.on_hold:  # the peer's hold or resume is a sign of life: the count restarts
            self._listening_since = time.monotonic()
        return answer_sdp

    async def play(self, chunks: AsyncIterator[np.ndarray]) -> None:
        """Speak a stream of line audio chunks (int16 at `plan.audio_rate`); returns once the last sample has
        been sent. A prompt that arrives whole (a cache hit) starts at once: a stream that has ended needs no
        pre-roll.

        If the iterator raises, buffered audio is discarded and the error propagates; cancelling the task
        does the same. Returns early, without error, if `close()` is called meanwhile.
        """
        if self._closed:
            raise MediaClosed(f"call {self.call_id}: media already closed")
        if self._done is not None:
            raise RuntimeError(f"call {self.call_id}: a prompt is already playing")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._done = done
        buffer = self._buffer
        buffer.begin_prompt()
        self._clock.subscribe(self._on_tick)
        try:
            async for chunk in chunks:
                if self._closed:
                    return
                buffer.push(chunk, loop.time())
                self._start_talkspurt()
                self._clock.run_if_due()  # many calls taking in chunks at once must not hold a tick back
            if self._closed:
                return
            buffer.end_of_stream()
            self._start_talkspurt()
            if not buffer.finished:
                await done
        finally:
            self._clock.unsubscribe(self._on_tick)
            self._done = None
            if not buffer.finished:
                buffer.flush()

    def pause(self) -> None:
        """Send nothing from the next tick on, keeping the prompt's buffered audio (MRCP PAUSE, and STOP
        before its task is cancelled, so no packet leaves after the response)."""
        self._clock.unsubscribe(self._on_tick)

    def resume(self) -> None:
        """Carry on with the paused prompt from where it stopped (MRCP RESUME); nothing when none plays."""
        if self._done is not None and not self._closed:
            self._clock.subscribe(self._on_tick)

    def _start_talkspurt(self) -> None:
        """The prompt's first audio is buffered: send its first frame now, not at the call's next tick.

        It goes out as the packet of the call's tick that has just passed (its slot sent nothing: the
        buffer was still filling), so it is late by less than 20 ms against the clock, never early, and the
        RTP timestamps stay base + 160 * tick (RFC 3550 §5.1) with the marker on it (RFC 3551 §4.1). The
        next packet follows at the call's next tick, on time: a receiver's jitter buffer sees the rest of
        the talkspurt arrive no later than the first packet promised. Waiting for the slot instead cost the
        caller 0-20 ms (10 on average) of first-speech latency for nothing."""
        if not self._buffer.starting:
            return
        tick = self._clock.last_tick(self._on_tick)
        if tick is None or tick <= self._session.last_sent_tick:  # a previous prompt used that tick
            return
        self._send(self._buffer.pop_frame(), tick)

    def _on_tick(self, tick: int, deadline: float) -> None:
        self._send(self._buffer.pop_frame(), tick)

    def _send(self, frame: np.ndarray | None, tick: int) -> None:
        # The per-call hot path: one frame, one packet. Frames popped while on hold are dropped.
        if frame is not None and self._session.send_frame(frame, tick) and self.first_speech_sent_at is None:
            self.first_speech_sent_at = time.monotonic()
        if self._buffer.finished and self._done is not None and not self._done.done():
            self._done.set_result(None)

    async def close(self) -> None:
        """Stop sending, discard buffered audio, release the ports; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._clock.unsubscribe(self._on_tick)
        self._buffer.flush()
        if self._done is not None and not self._done.done():
            self._done.set_result(None)
        await self._engine._release(self, self._session)
        self._log.info("media_closed", packets_sent=self.packets_sent, underruns=self.underruns,
                       underrun_events=self._buffer.underrun_events, first_underrun_s=self._buffer.first_underrun_s,
                       foreign_packets_dropped=self._session.foreign_packets_dropped,
                       dtmf_dropped=self._session.dtmf_dropped, send_failures=self._session.send_failures)
