"""The operator's pjsua2 test phone (gateway/pjsua_phone.py) against SIPp acting as the far end: it places
calls, records, and reports outcomes."""

from __future__ import annotations

import shutil
import socket
import subprocess
import wave
from pathlib import Path

import numpy as np
import pytest

from gateway.pjsua_phone import RECORD_RATE, describe, place_call

pytest.importorskip("pjsua2")
pytestmark = [pytest.mark.sipp, pytest.mark.skipif(shutil.which("sipp") is None, reason="sipp not installed")]

TONE_HZ = 440.0

# Answer with PCMU, stream a tone file after the ACK, then hang up with our own BYE.
ANSWER_PLAY_BYE = """<?xml version="1.0" encoding="ISO-8859-1" ?>
<scenario name="answer, play, hang up">
  <recv request="INVITE" crlf="true">
    <action>
      <ereg regexp="sip:[^>;]*" search_in="hdr" header="Contact:" assign_to="peer" />
      <ereg regexp=".*" search_in="hdr" header="X-TTS-Text:" assign_to="tts_text" />
      <log message="X-TTS-Text=[$tts_text]" />
    </action>
  </recv>
  <send>
    <![CDATA[
      SIP/2.0 200 OK
      [last_Via:]
      [last_From:]
      [last_To:];tag=[pid]SIPpTag01[call_number]
      [last_Call-ID:]
      [last_CSeq:]
      Contact: <sip:[local_ip]:[local_port];transport=[transport]>
      Content-Type: application/sdp
      Content-Length: [len]

      v=0
      o=- 1 1 IN IP[local_ip_type] [local_ip]
      s=-
      c=IN IP[media_ip_type] [media_ip]
      t=0 0
      m=audio [rtpstream_audio_port] RTP/AVP 0
      a=rtpmap:0 PCMU/8000
    ]]>
  </send>
  <recv request="ACK" crlf="true">
    <action>
      <ereg regexp=".*" search_in="hdr" header="From:" assign_to="caller" />
      <ereg regexp=".*" search_in="hdr" header="To:" assign_to="callee" />
    </action>
  </recv>
  <nop><action><exec rtp_stream="tone.wav,1,0" /></action></nop>
  <pause milliseconds="2500" />
  <send retrans="500">
    <![CDATA[
      BYE [$peer] SIP/2.0
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
      From: [$callee]
      To: [$caller]
      Call-ID: [call_id]
      CSeq: 2 BYE
      Contact: <sip:[local_ip]:[local_port];transport=[transport]>
      Max-Forwards: 70
      Content-Length: 0

    ]]>
  </send>
  <recv response="200" crlf="true" />
</scenario>
"""

def reply(status: str, cseq: str = "[last_CSeq:]") -> str:
    """A SIPp <send> of a body-less response to the last request, To-tagged as ours."""
    return f"""  <send>
    <![CDATA[
      SIP/2.0 {status}
      [last_Via:]
      [last_From:]
      [last_To:];tag=[pid]SIPpTag01[call_number]
      [last_Call-ID:]
      {cseq}
      Content-Length: 0

    ]]>
  </send>
"""


BUSY = f"""<?xml version="1.0" encoding="ISO-8859-1" ?>
<scenario name="busy">
  <recv request="INVITE" />
{reply("486 Busy Here")}  <recv request="ACK" />
</scenario>
"""

# Ring, never answer; take the CANCEL the phone sends at its timeout and end the INVITE with 487.
RING_NO_ANSWER = f"""<?xml version="1.0" encoding="ISO-8859-1" ?>
<scenario name="ring, no answer">
  <recv request="INVITE" />
{reply("180 Ringing")}  <recv request="CANCEL" />
{reply("200 OK")}{reply("487 Request Terminated", "CSeq: [cseq] INVITE")}  <recv request="ACK" />
</scenario>
"""


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ulaw(samples: np.ndarray) -> bytes:
    """G.711 mu-law encode 16-bit PCM (ITU-T G.711 segment encoding)."""
    pcm = samples.astype(np.int32)
    sign = (pcm < 0).astype(np.int32) << 7
    magnitude = np.minimum(np.abs(pcm), 32635) + 0x84
    exponent = np.floor(np.log2(magnitude)).astype(np.int32) - 7
    mantissa = (magnitude >> (exponent + 3)) & 0x0F
    return (~(sign | (exponent << 4) | mantissa) & 0xFF).astype(np.uint8).tobytes()


def start_sipp(workdir: Path, scenario: str, port: int, *extra: str) -> subprocess.Popen:
    (workdir / "scenario.xml").write_text(scenario)
    command = ["sipp", "-sf", "scenario.xml", "-i", "127.0.0.1", "-p", str(port), "-m", "1", "-nostdin",
               "-timeout", "20", "-trace_logs", "-trace_err", *extra]
    return subprocess.Popen(command, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_call_is_answered_recorded_and_ended_by_the_far_end(tmp_path: Path):
    t = np.arange(2 * 8000) / 8000
    (tmp_path / "tone.wav").write_bytes(ulaw(12000 * np.sin(2 * np.pi * TONE_HZ * t)))
    port = free_udp_port()
    sipp = start_sipp(tmp_path, ANSWER_PLAY_BYE, port)
    record = tmp_path / "heard.wav"
    result = place_call(f"sip:tts@127.0.0.1:{port}", "你好, hello", record, timeout_s=10)
    assert sipp.wait(timeout=20) == 0, sipp.stderr.read().decode()

    assert result.answered and result.status_code == 200
    assert result.ended_by == "remote"
    assert 2.0 < result.duration_s < 4.0
    with wave.open(str(record)) as wav:
        assert (wav.getframerate(), wav.getsampwidth(), wav.getnchannels()) == (RECORD_RATE, 2, 1)
        audio = np.frombuffer(wav.readframes(wav.getnframes()), dtype=np.int16).astype(np.float64)
    spectrum = np.abs(np.fft.rfft(audio))
    assert abs(np.argmax(spectrum) * RECORD_RATE / audio.size - TONE_HZ) < 10, "recorded the tone SIPp played"
    # The header reached the far end as UTF-8 percent-encoded text.
    logged = "".join(p.read_text(errors="replace") for p in tmp_path.glob("scenario_*_logs.log"))
    assert "X-TTS-Text= %E4%BD%A0%E5%A5%BD, hello\n" in logged


def test_rejected_call_reports_the_status(tmp_path: Path):
    port = free_udp_port()
    sipp = start_sipp(tmp_path, BUSY, port)
    result = place_call(f"sip:tts@127.0.0.1:{port}", "hello", tmp_path / "none.wav", timeout_s=10)
    sipp.wait(timeout=20)
    assert not result.answered
    assert result.status_code == 486
    assert result.wav_path is None
    assert describe(result) == f"not answered: 127.0.0.1:{port} refused the call with 486 Busy Here"


def test_a_ringing_call_nobody_answers_says_so_not_487(tmp_path: Path):
    port = free_udp_port()
    sipp = start_sipp(tmp_path, RING_NO_ANSWER, port)
    result = place_call(f"sip:tts@127.0.0.1:{port}", "hello", None, timeout_s=2)
    assert sipp.wait(timeout=20) == 0, sipp.stderr.read().decode()  # it saw our CANCEL
    assert not result.answered and result.ended_by == "timeout"
    assert describe(result) == f"not answered: no answer from 127.0.0.1:{port} within 2 s (it rang: 180 Ringing)"


def test_phone_hangs_up_at_the_timeout(tmp_path: Path):
    port = free_udp_port()
    sipp = subprocess.Popen(["sipp", "-sn", "uas", "-i", "127.0.0.1", "-p", str(port), "-m", "1", "-nostdin",
                             "-timeout", "20", "-rtp_echo", "-mp", str(free_udp_port())],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    result = place_call(f"sip:tts@127.0.0.1:{port}", "hello", tmp_path / "echo.wav", timeout_s=2)
    assert sipp.wait(timeout=20) == 0  # SIPp saw our BYE and answered it: its one call succeeded
    assert result.answered and result.ended_by == "timeout"
    assert 1.5 < result.duration_s < 3.0
    assert Path(result.wav_path).stat().st_size > 44
