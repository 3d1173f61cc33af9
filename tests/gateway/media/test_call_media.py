"""End to end over loopback: a plain UDP socket plays the phone, CallMedia plays the prompt."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import statistics
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest
from structlog.testing import capture_logs

from gateway import metrics
from gateway.media import rtcp
from speech_audio import g711
from gateway.media.call_media import CallMedia, MediaEngine, MediaSettings
from gateway.media.dtmf import TelephoneEvent
from speech_audio.line_audio import LineAudio
from gateway.media.rtp import RtpPacket
from gateway.media.sdp import NoCommonCodec, parse_sdp

pytestmark = pytest.mark.timeout(30)

# A port range of our own, so parallel test runs on the box do not collide.
PORT_BASE = 40000 + (os.getpid() % 500) * 20


class Phone(asyncio.DatagramProtocol):
    """The remote party: records every datagram with its arrival time."""

    def __init__(self) -> None:
        self.received: asyncio.Queue[tuple[bytes, tuple, float]] = asyncio.Queue()
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        self.received.put_nowait((data, addr, asyncio.get_running_loop().time()))

    @property
    def port(self) -> int:
        return self.transport.get_extra_info("sockname")[1]

    async def packets(self, count: int, timeout: float = 5.0) -> list[tuple[RtpPacket, float]]:
        out = []
        for _ in range(count):
            data, _, at = await asyncio.wait_for(self.received.get(), timeout)
            out.append((RtpPacket.parse(data), at))
        return out

    async def nothing_more(self, wait: float = 0.2) -> bool:
        await asyncio.sleep(wait)  # a negative check: give stray packets time to show up
        return self.received.empty()


async def open_phone(host: str = "127.0.0.1") -> Phone:
    _, phone = await asyncio.get_running_loop().create_datagram_endpoint(Phone, local_addr=(host, 0))
    return phone


_stamps = itertools.count(8000, 8000)


def press(phone: Phone, digit: str, media: CallMedia) -> None:
    """One key press as the start packet of a new RFC 4733 event (its own timestamp)."""
    event = TelephoneEvent("0123456789*#".index(digit), False, 10, 160).serialize()
    phone.transport.sendto(RtpPacket(101, 1, next(_stamps), 0x1234, event, marker=True).serialize(),
                           ("127.0.0.1", media.local_port))


def dropped() -> float:
    return metrics.registry.get_sample_value("gateway_rtp_packets_dropped_total", {"reason": "foreign_source"}) or 0.0


def dtmf_dropped() -> float:
    return metrics.registry.get_sample_value("gateway_dtmf_events_dropped_total") or 0.0


def offer(port: int, *lines: str, formats: str = "0 8 101") -> str:
    return "\r\n".join(["v=0", "o=phone 1 1 IN IP4 127.0.0.1", "s=-", "c=IN IP4 127.0.0.1", "t=0 0",
                        f"m=audio {port} RTP/AVP {formats}", "a=rtpmap:101 telephone-event/8000", *lines]) + "\r\n"


async def tone(seconds: float, hz: float = 440.0, rate: int = 24000, chunk_s: float = 0.2) -> AsyncIterator[np.ndarray]:
    """Line audio (int16, 8 kHz) of a tone made at the engine's rate, in chunks as an engine would send them."""
    t = np.arange(int(seconds * rate)) / rate
    audio = (0.4 * np.sin(2 * np.pi * hz * t)).astype(np.float32)
    step = int(chunk_s * rate)
    line = LineAudio(rate, 8000, None)
    for start in range(0, audio.size, step):
        yield line.push(audio[start : start + step])
        await asyncio.sleep(0)
    yield line.flush()


@pytest.fixture
async def engine(request) -> AsyncIterator[MediaEngine]:
    """A media engine on our port range; `@pytest.mark.media(rtp_latching=...)` changes its settings."""
    marker = request.node.get_closest_marker("media")
    media_engine = MediaEngine(MediaSettings(rtp_port_min=PORT_BASE, rtp_port_max=PORT_BASE + 19,
                                             rtcp_interval_s=0.2, **(marker.kwargs if marker else {})))
    await media_engine.start()
    yield media_engine
    await media_engine.stop()


async def test_one_second_tone_arrives_as_50_paced_packets(engine: MediaEngine) -> None:
    phone = await open_phone()
    media = await engine.open_call("c1", offer(phone.port))
    assert media.plan.codec == "PCMU" and parse_sdp(media.answer_sdp).media[0].port == media.local_port
    assert media.local_port % 2 == 0
    await media.play(tone(1.0))
    received = await phone.packets(50)
    assert await phone.nothing_more()
    packets = [p for p, _ in received]
    assert all(len(p.serialize()) == 172 and len(p.payload) == 160 for p in packets)
    assert all(p.payload_type == 0 for p in packets)
    assert len({p.ssrc for p in packets}) == 1
    assert [p.marker for p in packets] == [True] + [False] * 49
    assert all((b.sequence_number - a.sequence_number) % 65536 == 1 for a, b in zip(packets, packets[1:]))
    assert all((b.timestamp - a.timestamp) % 2**32 == 160 for a, b in zip(packets, packets[1:]))
    # Timing-sensitive (shared 2-core box): pacing checked on the median and the total span only.
    gaps = np.diff([at for _, at in received])
    assert 0.015 < statistics.median(gaps) < 0.025
    assert 0.85 < sum(gaps) < 1.15
    audio = g711.decode(b"".join(p.payload for p in packets), "PCMU").astype(np.float64)
    assert abs(np.argmax(np.abs(np.fft.rfft(audio))) * 8000 / audio.size - 440) <= 2
    assert media.packets_sent == 50 and media.underruns == 0 and media.first_speech_sent_at is not None
    await media.close()


async def test_rtp_and_keys_from_anywhere_but_the_sdp_address_are_dropped(engine: MediaEngine) -> None:
    phone = await open_phone()
    intruders = [await open_phone(), await open_phone("127.0.0.2")]  # same host other port; other host
    media = await engine.open_call("c2", offer(phone.port))
    before = dropped()
    for intruder in intruders:  # sent first: the old latch-to-anyone would have handed them the call
        intruder.transport.sendto(RtpPacket(0, 1, 160, 0x666, bytes(160)).serialize(),
                                  ("127.0.0.1", media.local_port))
        press(intruder, "1", media)
    press(phone, "5", media)
    assert await asyncio.wait_for(media.dtmf.get(), 5) == "5"  # datagrams queue in order: the rest were seen
    assert media.dtmf.empty() and dropped() == before + 4
    await media.play(tone(0.2))
    assert len(await phone.packets(10)) == 10
    assert all(intruder.received.empty() for intruder in intruders)
    await media.close()


@pytest.mark.media(rtp_latching="sdp_host")
async def test_sdp_host_latching_takes_a_natd_port_once_but_never_another_host(engine: MediaEngine) -> None:
    advertised, natd, other_host, late = (await open_phone(), await open_phone(), await open_phone("127.0.0.2"),
                                          await open_phone())
    media = await engine.open_call("c2b", offer(advertised.port))
    before = dropped()
    press(other_host, "1", media)  # another host never latches, even first
    press(natd, "5", media)  # the SDP's host from another port: NAT rewrote it; latched
    press(late, "9", media)  # after the first valid packet nobody else latches,
    press(advertised, "7", media)  # not even the SDP's own port
    press(natd, "3", media)
    assert [await asyncio.wait_for(media.dtmf.get(), 5) for _ in range(2)] == ["5", "3"]
    assert media.dtmf.empty() and dropped() == before + 3
    await media.play(tone(0.2))
    assert len(await natd.packets(10)) == 10
    assert all(p.received.empty() for p in (advertised, other_host, late))
    await media.close()


@pytest.mark.media(rtp_latching="signalling_source")
async def test_signalling_source_latching_takes_the_invites_host(engine: MediaEngine) -> None:
    advertised, public, stranger = await open_phone(), await open_phone("127.0.0.2"), await open_phone("127.0.0.3")
    media = await engine.open_call("c2c", offer(advertised.port), signalling_source="127.0.0.2")
    press(stranger, "1", media)
    press(public, "5", media)
    assert await asyncio.wait_for(media.dtmf.get(), 5) == "5" and media.dtmf.empty()
    await media.play(tone(0.2))
    assert len(await public.packets(10)) == 10
    assert advertised.received.empty() and stranger.received.empty()
    await media.close()


@pytest.mark.media(dtmf_max_per_second=5)
async def test_a_dtmf_flood_beyond_the_limit_is_dropped_and_counted(engine: MediaEngine) -> None:
    phone = await open_phone()
    media = await engine.open_call("c2d", offer(phone.port))
    before, started, sent = dtmf_dropped(), time.monotonic(), 40
    for _ in range(sent):
        press(phone, "1", media)
    digits = []
    while True:  # then '#' after a pause, pressed again until a refilled token lets it through
        press(phone, "#", media)
        sent += 1
        try:
            while (digit := await asyncio.wait_for(media.dtmf.get(), 0.5)) != "#":
                digits.append(digit)
            break
        except TimeoutError:
            continue
    elapsed = time.monotonic() - started
    assert 5 <= len(digits) <= 5 + 5 * elapsed  # the burst, plus what refilled while the flood came in
    assert dtmf_dropped() == before + sent - len(digits) - 1
    await media.close()


async def test_hold_stops_packets_and_resume_continues_the_stream(engine: MediaEngine) -> None:
    phone = await open_phone()
    media = await engine.open_call("c3", offer(phone.port))
    await media.play(tone(0.2))
    before = await phone.packets(10)

    answer = media.update_offer(offer(phone.port, "a=sendonly"))
    assert parse_sdp(answer).media[0].has_attribute("recvonly") and not media.plan.can_send
    await media.play(tone(0.2))
    assert await phone.nothing_more()

    media.update_offer(offer(phone.port, "a=sendrecv"))
    await media.play(tone(0.2))
    after = await phone.packets(10)
    last, (first, first_at) = before[-1][0], after[0]
    assert first.sequence_number == (last.sequence_number + 1) % 65536 and first.marker
    elapsed_ticks = ((first.timestamp - last.timestamp) % 2**32) / 160
    assert abs(elapsed_ticks - (first_at - before[-1][1]) / 0.020) < 5  # advanced by real time
    assert int(parse_sdp(answer).origin.split()[2]) == 1
    await media.close()


async def test_dtmf_key_presses_arrive_once_each(engine: MediaEngine) -> None:
    phone = await open_phone()
    media = await engine.open_call("c4", offer(phone.port))
    seq = 100
    for timestamp, event in [(8000, 1), (16000, 11), (24000, 1)]:
        durations = [160, 320, 480]
        payloads = [TelephoneEvent(event, False, 10, d).serialize() for d in durations]
        payloads += [TelephoneEvent(event, True, 10, 640).serialize()] * 3
        for i, payload in enumerate(payloads):
            phone.transport.sendto(RtpPacket(101, seq, timestamp, 0x77, payload, marker=i == 0).serialize(),
                                   ("127.0.0.1", media.local_port))
            seq += 1
    digits = [await asyncio.wait_for(media.dtmf.get(), 5) for _ in range(3)]
    assert digits == ["1", "#", "1"]
    assert await phone.nothing_more(0.1) and media.dtmf.empty()
    await media.close()


async def test_sender_reports_go_to_the_rtcp_port(engine: MediaEngine) -> None:
    phone, phone_rtcp = await open_phone(), await open_phone()
    media = await engine.open_call("c5", offer(phone.port, f"a=rtcp:{phone_rtcp.port}"))
    await media.play(tone(0.2))
    rtp_ssrc = (await phone.packets(10))[0][0].ssrc
    while True:
        data, source, _ = await asyncio.wait_for(phone_rtcp.received.get(), 5)
        assert source[1] == media.local_port + 1  # RTCP on the odd port above RTP's (RFC 3550 §11)
        report = rtcp.parse_compound(data)[0]
        if isinstance(report, rtcp.SenderReport) and report.packet_count == 10:  # reports go on mid-prompt too
            break
    assert report.ssrc == rtp_ssrc and report.octet_count == 1600
    await media.close()


async def test_cancel_stops_sending_and_the_call_can_play_again(engine: MediaEngine) -> None:
    phone = await open_phone()
    media = await engine.open_call("c6", offer(phone.port))
    task = asyncio.create_task(media.play(tone(10.0)))
    await phone.packets(3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.05)  # packets sent before the cancel may still be on their way: let them land
    while not phone.received.empty():
        phone.received.get_nowait()
    assert await phone.nothing_more()
    await media.play(tone(0.1))
    assert len(await phone.packets(5)) == 5
    await media.close()


async def test_engine_failure_propagates_after_flushing(engine: MediaEngine) -> None:
    phone = await open_phone()
    media = await engine.open_call("c7", offer(phone.port))

    async def failing() -> AsyncIterator[np.ndarray]:
        yield np.zeros(800, np.int16)
        raise RuntimeError("engine died")

    with pytest.raises(RuntimeError, match="engine died"):
        await media.play(failing())
    assert await phone.nothing_more()
    await media.close()


async def test_no_common_codec_releases_the_ports_and_close_is_idempotent(engine: MediaEngine) -> None:
    with pytest.raises(NoCommonCodec):
        await engine.open_call("c8", offer(5000, "a=rtpmap:18 G729/8000", formats="18"))
    assert engine.active_calls == 0
    phone = await open_phone()
    media = await engine.open_call("c9", offer(phone.port))
    port = media.local_port
    await media.close()
    await media.close()
    assert engine.active_calls == 0
    transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
        asyncio.DatagramProtocol, local_addr=("127.0.0.1", port))  # the port is free again
    transport.close()


async def test_the_first_packet_goes_out_with_the_first_chunk_not_at_the_next_tick(engine: MediaEngine) -> None:
    """A prompt's first audio is sent the moment it is buffered, as the packet of the call's tick that has just
    passed; the talkspurt then goes on at the call's ticks with consecutive timestamps and sequence numbers."""
    phone = await open_phone()
    media = await engine.open_call("c9", offer(phone.port))
    loop = asyncio.get_running_loop()
    gate = loop.create_future()

    def open_gate(index: int, deadline: float) -> None:
        if index >= 1 and not gate.done():  # the call's slot has run a tick before this one
            gate.set_result(index)

    engine.clock.subscribe(open_gate)  # slot 0 of each period; the call's prompt takes slot 1, 5 ms later
    sent_with_first_chunk: list[int] = []

    async def chunks() -> AsyncIterator[np.ndarray]:
        async for chunk in tone(0.4):
            if not sent_with_first_chunk:
                tick = await gate  # right after slot 0 ran: the call's own slot is not due for ~5 ms
                engine.clock.unsubscribe(open_gate)
                yield chunk
                sent_with_first_chunk.append(media.packets_sent)  # play() asks for the next chunk at once
                continue
            yield chunk

    await media.play(chunks())
    assert sent_with_first_chunk == [1]  # before the call's slot came round
    received = await phone.packets(20)
    packets = [p for p, _ in received]
    assert [p.marker for p in packets] == [True] + [False] * 19
    assert all((b.sequence_number - a.sequence_number) % 65536 == 1 for a, b in zip(packets, packets[1:]))
    assert all((b.timestamp - a.timestamp) % 2**32 == 160 for a, b in zip(packets, packets[1:]))
    first_chunk = await anext(tone(0.4))
    expected = g711.encode(first_chunk[:160], "PCMU")
    assert packets[0].payload == bytes(expected)  # the first chunk's first 20 ms: no leading silence
    await media.close()


def send_failures(stream: str) -> float:
    return metrics.registry.get_sample_value("gateway_rtp_send_failures_total",
                                             {"stream": stream, "reason": "error"}) or 0.0


async def test_an_rtcp_send_that_fails_is_counted_and_the_call_still_frees_its_sockets_and_ports(
        engine: MediaEngine) -> None:
    """A plan whose RTCP port no socket can send to (the SDP check refuses such offers; this is the defence
    behind it): each report fails, is counted, RTP goes on, and close() still closes both sockets (after
    an RTCP BYE that fails too) and returns the port pair."""
    fds_before, free_before = len(os.listdir("/proc/self/fd")), engine.port_pairs_free
    failures_before = send_failures("rtcp")
    phone = await open_phone()
    media = await engine.open_call("c-rtcp", offer(phone.port))
    media._session.apply_plan(dataclasses.replace(media.plan, remote_rtcp_port=70000))
    assert engine.port_pairs_free == free_before - 1
    await media.play(tone(0.6))  # 0.6 s: two or more RTCP reports at 0.2 s +-50 %
    assert len(await phone.packets(30)) == 30  # RTP unaffected by the failing RTCP
    assert send_failures("rtcp") >= failures_before + 1
    port = media.local_port
    await media.close()
    assert send_failures("rtcp") >= failures_before + 2  # the BYE at hang-up failed as well
    # the phone's socket is the only new one (at most: descriptors of earlier tests may close meanwhile, and
    # the ports bound again below prove the call's two sockets are gone)
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 1
    assert engine.port_pairs_free == free_before and engine.active_calls == 0
    for reuse in (port, port + 1):  # both ports can be bound again
        transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            asyncio.DatagramProtocol, local_addr=("127.0.0.1", reuse))
        transport.close()


async def test_the_callers_rtcp_bye_is_logged_once_however_often_it_comes(engine: MediaEngine) -> None:
    """pjsua sends its RTCP BYE twice, and a peer may send it at will: one log line per call."""
    phone, phone_rtcp = await open_phone(), await open_phone()
    media = await engine.open_call("c-bye", offer(phone.port, f"a=rtcp:{phone_rtcp.port}"))
    bye = bytes.fromhex("80 c9 0001 aabbccdd") + rtcp.serialize_bye(rtcp.Bye((0xAABBCCDD,), "hangup"))  # RR + BYE
    with capture_logs() as logs:
        for _ in range(20):
            phone_rtcp.transport.sendto(bye, ("127.0.0.1", media.local_port + 1))
        await asyncio.sleep(0.3)
    assert [(e["event"], e["reason"]) for e in logs if e["event"] == "rtcp_bye"] == [("rtcp_bye", "hangup")]
    await media.close()


async def test_a_late_second_chunk_is_logged_as_one_dry_spell_after_the_first_chunks_audio(engine: MediaEngine) -> None:
    # A first chunk of 0.2 s, the next 0.5 s later: the caller hears 0.2 s, then silence until the second chunk is
    # buffered. media_closed says so: one dry spell, after 0.2 s, of several silent 20-ms slots.
    phone = await open_phone()
    media = await engine.open_call("c-late", offer(phone.port))

    chunks = [c async for c in tone(0.4, chunk_s=0.2)]  # the first a little short of 0.2 s: the resampler's delay

    async def late_second_chunk() -> AsyncIterator[np.ndarray]:
        yield chunks[0]
        await asyncio.sleep(0.5)
        for chunk in chunks[1:]:
            yield chunk

    with capture_logs() as logs:
        await media.play(late_second_chunk())
        await media.close()
    (closed,) = [e for e in logs if e["event"] == "media_closed"]
    assert closed["underrun_events"] == 1 and closed["underruns"] >= 5  # 0.3 s late: most of it silent slots
    assert closed["first_underrun_s"] == chunks[0].size // 160 * 160 / 8000  # its whole frames: the rest waited
