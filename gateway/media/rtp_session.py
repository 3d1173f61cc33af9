"""One call's RTP/RTCP endpoint: the sockets, the source check, packet numbering, RTCP reports.

- Binds RTP on an even port of the configured range on the advertised host, RTCP on port + 1
  (RFC 3550 §11), and sends from those same ports (symmetric RTP, RFC 4961).
- Source check: `RtpPeer` says where media goes and whose packets count (the SDP address, or with
  latching enabled the first valid sender from an allowed host). RTP, RFC 4733 and RTCP from any
  other source are dropped and counted (`gateway_rtp_packets_dropped_total{reason="foreign_source"}`)
  with one log line per call, so a flood costs a header parse, a comparison and a counter per packet.
- Numbering: random SSRC, sequence number and timestamp base (RFC 3550 §5.1). The timestamp is tied to
  the shared packet clock (base + 160 * tick), so across pauses, hold and clock skips it advances by the
  real elapsed time; the sequence number only counts packets actually sent, so it stays continuous.
  The marker bit goes on the first packet after any tick that sent nothing (a new talkspurt, RFC 3551
  §4.1), which covers the first packet, prompts after silence, and resume after hold.
- Receive: RTP is counted and telephone-events (RFC 4733) become digits on `dtmf`, at most
  `dtmf_max_per_second` per call (a token bucket; the excess is dropped and counted); RTCP is parsed
  enough to log a BYE. RTCP SR + SDES go out every `rtcp_interval_s`, randomised to 0.5-1.5x
  (RFC 3550 §6.3.5).

`send_frame` is on the per-tick hot path: header pack, G.711 table lookup, one sendto. It writes to the
RTP socket directly rather than through the asyncio transport: a packet the kernel cannot take now is
dropped (and shows as a sequence gap at the receiver) instead of being queued and sent late, which is
what real-time audio wants, and it saves the transport's per-call overhead (bench/bench_media_tick.py).
RTCP is written to its socket directly too. A send that fails, for any reason, drops that one packet:
it is counted (`gateway_rtp_send_failures_total`) and logged once per call and stream, and never
closes a socket: an asyncio transport closes itself on a non-OSError send failure (a port out of
range raises OverflowError), and its RTCP BYE at hang-up then raised before the sockets were closed
and the ports returned. `close` closes the sockets and returns the ports whatever failed before it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import random
import socket
import time

import numpy as np
import structlog

from gateway import metrics
from gateway.media import rtcp
from speech_audio import g711
from gateway.media.dtmf import DtmfDetector, DtmfParseError
from gateway.media.packet_clock import PacketClock
from gateway.media.port_pool import PortsExhausted, RtpPortPool
from gateway.media.rtp import RtpPacket, RtpParseError, is_rtcp, pack_header
from gateway.media.rtp_peer import RtpPeer
from gateway.media.sdp import MediaPlan
from gateway.media.token_bucket import TokenBucket

log = structlog.get_logger(__name__)

SAMPLES_PER_TICK = 160
_DROPPED_FOREIGN = metrics.rtp_packets_dropped_total.labels(reason="foreign_source")
_DROPPED_MALFORMED = metrics.rtp_packets_dropped_total.labels(reason="malformed")
_SEND_FAILED = {(stream, reason): metrics.rtp_send_failures_total.labels(stream=stream, reason=reason)
                for stream in ("rtp", "rtcp") for reason in ("would_block", "error")}
# What a sendto may raise for one packet: OSError (no route, EACCES, a full buffer), OverflowError (a port
# beyond 65535), ValueError / TypeError (an address the socket's family cannot take).
_SEND_ERRORS = (OSError, OverflowError, ValueError, TypeError)


class _Endpoint(asyncio.DatagramProtocol):
    def __init__(self, on_datagram) -> None:
        self._on_datagram = on_datagram
        self.closed = asyncio.get_running_loop().create_future()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def datagram_received(self, data: bytes, addr) -> None:
        self._on_datagram(data, addr)

    def error_received(self, exc: Exception) -> None:
        # ICMP port unreachable from an earlier sendto (peer not listening yet): not our failure.
        log.debug("rtp_socket_error", error=repr(exc))


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class RtpSession:
    def __init__(self, call_id: str, clock: PacketClock, rtcp_interval_s: float, peer: RtpPeer,
                 dtmf_max_per_second: float) -> None:
        self.call_id = call_id
        self.dtmf: asyncio.Queue[str] = asyncio.Queue()
        self.packets_sent = 0
        self.octets_sent = 0
        self.packets_received = 0
        # When the peer last sent us RTP or RTCP (monotonic): the inactivity watcher's evidence of life.
        self.last_received_at = time.monotonic()
        self.local_port = 0
        self.ssrc = random.getrandbits(32)
        self._clock = clock
        self._plan: MediaPlan | None = None  # None until the first offer is answered: send nothing
        self._peer = peer
        self.foreign_packets_dropped = 0
        self.dtmf_dropped = 0
        self._seq = random.getrandbits(16)
        self._ts_base = random.getrandbits(32)
        self._last_sent_tick = -2
        self._detector = DtmfDetector()
        # A burst of one second's worth: fast dialers send ~10 keys/s, a flood of events is cut there.
        self._dtmf_limit = TokenBucket(dtmf_max_per_second, max(1.0, dtmf_max_per_second), time.monotonic())
        self._rtp: asyncio.DatagramTransport | None = None
        self._rtcp: asyncio.DatagramTransport | None = None
        self._endpoints: list[_Endpoint] = []
        self._rtp_socket: socket.socket | None = None  # the RTP transport's socket, for direct sends
        self._rtcp_socket: socket.socket | None = None  # the RTCP transport's socket, likewise
        self.packets_dropped = 0
        self.send_failures = {"rtp": 0, "rtcp": 0}
        self._rtcp_interval_s = rtcp_interval_s
        self._rtcp_timer: asyncio.TimerHandle | None = None
        self._cname = f"{os.getpid()}-{self.ssrc:08x}@cosyvoice-gateway"
        self._log = log.bind(call_id=call_id)

    # -- lifecycle ---------------------------------------------------------------------------------
    async def bind(self, host: str, pool: RtpPortPool) -> int:
        """Bind RTP/RTCP on the first free pair of the pool; returns the RTP port."""
        for port in pool.candidates():
            pool.acquire(port)
            try:
                self._rtp, self._rtp_socket = await self._endpoint(host, port, self._on_rtp)
                self._rtcp, self._rtcp_socket = await self._endpoint(host, port + 1, self._on_rtcp)
            except OSError:  # taken by another process: try the next pair
                await self._close_transports()
                pool.release(port)
                continue
            self.local_port = port
            self._schedule_rtcp()
            return port
        raise PortsExhausted(f"no free RTP/RTCP port pair on {host}")

    async def _endpoint(self, host: str, port: int, on_datagram) -> tuple[asyncio.DatagramTransport, socket.socket]:
        """A datagram transport on (host, port) and its socket, which we send on directly."""
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            sock.bind((host, port))
            transport, endpoint = await asyncio.get_running_loop().create_datagram_endpoint(
                lambda: _Endpoint(on_datagram), sock=sock)
        except BaseException:
            sock.close()
            raise
        self._endpoints.append(endpoint)
        return transport, sock

    async def close(self, pool: RtpPortPool) -> None:
        """Send RTCP BYE (if we sent media), close both sockets and wait until they are closed, then return
        the port pair to the pool: the last two happen whatever failed before (a call's teardown must never
        leak its sockets or ports)."""
        try:
            if self._rtcp_timer is not None:
                self._rtcp_timer.cancel()
                self._rtcp_timer = None
            if self.packets_sent:
                self._send_rtcp(bye=True)
        finally:
            try:
                await self._close_transports()
            finally:
                if self.local_port:
                    pool.release(self.local_port)
                    self.local_port = 0

    async def _close_transports(self) -> None:
        for transport in (self._rtp, self._rtcp):
            if transport is not None:
                transport.close()
        self._rtp = self._rtcp = None
        self._rtp_socket = self._rtcp_socket = None
        # The sockets close on a later loop iteration; the ports are only free once they have.
        await asyncio.gather(*(endpoint.closed for endpoint in self._endpoints))
        self._endpoints.clear()

    # -- plan --------------------------------------------------------------------------------------
    def apply_plan(self, plan: MediaPlan) -> None:
        """Adopt a (re)negotiated plan; a changed remote address is the new partner (and restarts latching).

        The plan's host must be an IP literal (the caller resolves names off the loop); a re-offer naming
        a host we cannot use keeps media flowing where it already goes.
        """
        old, self._plan = self._plan, plan
        if old is not None and ((plan.remote_host, plan.remote_port, plan.remote_rtcp_port)
                                == (old.remote_host, old.remote_port, old.remote_rtcp_port)):
            return
        if not _is_ip(plan.remote_host):
            self._log.warning("remote_hostname_ignored", host=plan.remote_host)
            return
        self._peer.expect(plan.remote_host, plan.remote_port, plan.remote_rtcp_port)

    # -- send (hot path) ---------------------------------------------------------------------------
    @property
    def last_sent_tick(self) -> int:
        """The packet tick of the newest packet sent (-2 before the first): a later packet needs a later tick."""
        return self._last_sent_tick

    def send_frame(self, samples: np.ndarray, tick: int) -> bool:
        """Send 160 samples as the packet of `tick`; False (nothing sent) when the plan forbids sending."""
        plan = self._plan
        if plan is None or not plan.can_send or self._rtp_socket is None:
            return False
        marker = tick != self._last_sent_tick + 1
        self._last_sent_tick = tick
        header = pack_header(plan.payload_type, self._seq, (self._ts_base + SAMPLES_PER_TICK * tick) & 0xFFFFFFFF,
                             self.ssrc, marker)
        payload = g711.encode(samples, plan.codec)
        self._seq = (self._seq + 1) & 0xFFFF  # a dropped packet is a loss the receiver should see
        try:
            self._rtp_socket.sendto(header + payload, self._peer.remote)
        except _SEND_ERRORS as exc:  # e.g. no route: the call goes on, RTCP/SIP will tell if the peer is gone
            self.packets_dropped += 1
            self._send_failed("rtp", exc, self._peer.remote)
            return False
        self.packets_sent += 1
        self.octets_sent += len(payload)
        metrics.rtp_packets_sent_total.inc()
        return True

    def _send_failed(self, stream: str, exc: Exception, address) -> None:
        """One packet not sent: counted, and logged once per call and stream (the metric counts the rest)."""
        reason = "would_block" if isinstance(exc, (BlockingIOError, InterruptedError)) else "error"
        _SEND_FAILED[stream, reason].inc()
        self.send_failures[stream] += 1
        if self.send_failures[stream] == 1:
            self._log.warning("rtp_send_failed", stream=stream, reason=reason, remote=f"{address[0]}:{address[1]}",
                              error=repr(exc)[:160])

    # -- receive -----------------------------------------------------------------------------------
    def _on_rtp(self, data: bytes, addr) -> None:
        if is_rtcp(data):  # rtcp-mux peers (RFC 5761)
            self._on_rtcp(data, addr)
            return
        try:
            packet = RtpPacket.parse(data)
        except RtpParseError:
            _DROPPED_MALFORMED.inc()
            return
        peer, before = self._peer, self._peer.remote
        if not peer.admit(addr[:2]):
            self._drop_foreign(addr)
            return
        if peer.remote is not before:
            self._log.info("rtp_latched", sdp_addr=f"{before[0]}:{before[1]}", source=f"{addr[0]}:{addr[1]}",
                           latching=peer.latching)
        self.packets_received += 1
        self.last_received_at = time.monotonic()
        metrics.rtp_packets_received_total.inc()
        if self._plan is not None and packet.payload_type == self._plan.telephone_event_pt:
            try:
                digit = self._detector.feed(packet.ssrc, packet.timestamp, packet.payload)
            except DtmfParseError:
                return
            if digit is not None:
                self._on_key_press(digit)

    def _on_key_press(self, digit: str) -> None:
        if self._dtmf_limit.take(time.monotonic()):
            self.dtmf.put_nowait(digit)
            return
        self.dtmf_dropped += 1
        metrics.dtmf_events_dropped_total.inc()
        if self.dtmf_dropped == 1:  # one line per call; the metric counts the rest
            self._log.warning("dtmf_rate_limited", digit=digit)

    def _drop_foreign(self, addr) -> None:
        self.foreign_packets_dropped += 1
        _DROPPED_FOREIGN.inc()
        if self.foreign_packets_dropped == 1:  # one line per call, not one per packet of a flood
            remote = self._peer.remote
            self._log.warning("rtp_foreign_source_dropped", source=f"{addr[0]}:{addr[1]}",
                              partner=f"{remote[0]}:{remote[1]}", latching=self._peer.latching)

    def _on_rtcp(self, data: bytes, addr) -> None:
        if not self._peer.admit_rtcp(addr[:2]):
            self._drop_foreign(addr)
            return
        try:
            packets = rtcp.parse_compound(data)
        except rtcp.RtcpParseError as exc:
            self._log.debug("rtcp_malformed", error=str(exc))
            return
        self.last_received_at = time.monotonic()
        for packet in packets:
            if isinstance(packet, rtcp.Bye):
                self._log.info("rtcp_bye", reason=packet.reason)

    # -- RTCP reports ------------------------------------------------------------------------------
    def _schedule_rtcp(self) -> None:
        delay = self._rtcp_interval_s * random.uniform(0.5, 1.5)  # RFC 3550 §6.3.5
        self._rtcp_timer = asyncio.get_running_loop().call_later(delay, self._on_rtcp_timer)

    def _on_rtcp_timer(self) -> None:
        self._schedule_rtcp()
        self._send_rtcp()

    def _send_rtcp(self, bye: bool = False) -> None:
        # RTCP flows whatever the direction (RFC 3264 §5.1), except to a c=0.0.0.0 hold address.
        remote_rtcp = self._peer.remote_rtcp
        if self._rtcp_socket is None or remote_rtcp[0] in ("0.0.0.0", "::") or not remote_rtcp[1]:
            return
        if self.packets_sent:
            # The RTP timestamp of this wallclock instant, extrapolated from the packet clock (§6.4.1).
            ticks = self._clock.tick_at(asyncio.get_running_loop().time()) if self._clock.running else 0.0
            report = rtcp.serialize_sender_report(rtcp.SenderReport(
                ssrc=self.ssrc, ntp_timestamp=rtcp.ntp_timestamp(time.time()),
                rtp_timestamp=int(self._ts_base + SAMPLES_PER_TICK * ticks) & 0xFFFFFFFF,
                packet_count=self.packets_sent & 0xFFFFFFFF, octet_count=self.octets_sent & 0xFFFFFFFF))
        else:
            report = rtcp.serialize_receiver_report(rtcp.ReceiverReport(ssrc=self.ssrc))
        datagram = report + rtcp.serialize_sdes_cname(self.ssrc, self._cname)
        if bye:
            datagram += rtcp.serialize_bye(rtcp.Bye((self.ssrc,)))
        try:
            self._rtcp_socket.sendto(datagram, remote_rtcp)
        except _SEND_ERRORS as exc:
            self._send_failed("rtcp", exc, remote_rtcp)
