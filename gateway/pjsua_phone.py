"""The operator's test phone: place one SIP call with a text to speak, record what comes back.

It is a real SIP user agent (PJSIP through its `pjsua2` binding, from the `pjsua2-python` wheel),
independent of the gateway's own SIP code, so it checks the gateway the way a PBX would. One call:
INVITE `uri` with an `X-TTS-Text` header (UTF-8, percent-encoded so any proxy passes it as ASCII),
offer G.711 (PCMU, PCMA) or the codecs asked for (`--codec g722` offers G.722 only, `--codec g722,pcmu` both,
in that order), record the far end's audio to a WAV file, and end when the far end hangs up or the timeout
passes (then we send BYE, or CANCEL while it is still ringing). The result names the codec the call used.

Recording format: pjsua's WAV writer at the conference bridge rate, mono 16-bit PCM at
`RECORD_RATE` (16 kHz), whatever the codec; G.711 audio is upsampled by PJSIP, G.722 is 16 kHz already.

pjsua2 keeps process-global state (one library per process, created once), so `place_call` and
`place_call_async` run each call in a fresh `python -m gateway.pjsua_phone` subprocess and read its
JSON result; `call_in_this_process` is what that subprocess (and the CLI's `call`) runs. PJSIP is
driven without worker threads (`threadCnt = 0`): `libHandleEvents` waits for SIP events on our
thread, so callbacks never race with the code that reads their results.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import quote

RECORD_RATE = 16_000
DEFAULT_CODECS = ("PCMU", "PCMA")
KNOWN_CODECS = ("PCMU", "PCMA", "G722")  # what the gateway answers with; the wheel's PJSIP has all three
# After we hang up, how long we keep handling events so the BYE/CANCEL transaction completes.
_HANGUP_GRACE_S = 2.0


@dataclass(frozen=True)
class CallResult:
    answered: bool
    status_code: int  # the final response to our INVITE (200 when answered); 0 if none came
    reason: str
    duration_s: float  # from answer (200 OK) to the end of the call; 0.0 if never answered
    ended_by: str  # "remote" (far end sent BYE or rejected), "timeout" (we hung up), "error"
    wav_path: str | None  # None when nothing was recorded (no answer or no audio stream)
    peer: str = ""  # HOST:PORT the INVITE went to
    waited_s: float = 0.0  # from the INVITE to the final response (or to our hang-up)
    provisional: str = ""  # the last 1xx before the end, e.g. "180 Ringing"; "" if none came
    codec: str = ""  # the audio codec of the answered call, e.g. "PCMU" or "G722"; "" if none

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> CallResult:
        return cls(**json.loads(text))


def call_in_this_process(uri: str, text: str | None, record_path: str | None = None, timeout_s: float = 30.0,
                         voice: str | None = None, codecs: Sequence[str] = DEFAULT_CODECS,
                         local_host: str | None = None, verbose: bool = False) -> CallResult:
    """Place the call with pjsua2 in this process; call at most once per process."""
    import pjsua2 as pj

    headers = {}
    if text is not None:
        headers["X-TTS-Text"] = quote(text, safe=" ,.?!'-:;")
    if voice is not None:
        headers["X-TTS-Voice"] = quote(voice)
    if local_host is None:
        local_host = "127.0.0.1" if _uri_host(uri) in ("127.0.0.1", "localhost", "[::1]") else None

    class Phone(pj.Call):
        def __init__(self, account: pj.Account) -> None:
            super().__init__(account)
            self.answered_at: float | None = None
            self.ended_at: float | None = None
            self.status_code = 0
            self.reason = ""
            self.provisional = ""
            self.recorder: pj.AudioMediaRecorder | None = None
            self.codec = ""

        def onCallState(self, prm) -> None:
            info = self.getInfo()
            if info.state == pj.PJSIP_INV_STATE_CONFIRMED and self.answered_at is None:
                self.answered_at = time.monotonic()
                self.status_code = 200
                self.reason = "OK"
            elif info.state == pj.PJSIP_INV_STATE_DISCONNECTED:
                self.ended_at = time.monotonic()
                if self.answered_at is None:
                    self.status_code = info.lastStatusCode
                    self.reason = info.lastReason
            elif 100 < info.lastStatusCode < 200 and self.answered_at is None:
                self.provisional = f"{info.lastStatusCode} {info.lastReason}"

        def onCallMediaState(self, prm) -> None:
            info = self.getInfo()
            for index, media in enumerate(info.media):
                if media.type == pj.PJMEDIA_TYPE_AUDIO and media.status == pj.PJSUA_CALL_MEDIA_ACTIVE:
                    self.codec = self.getStreamInfo(index).codecName.upper()
                    if record_path is None or self.recorder is not None:
                        return
                    self.recorder = pj.AudioMediaRecorder()
                    self.recorder.createRecorder(record_path)
                    self.getAudioMedia(index).startTransmit(self.recorder)
                    return

    endpoint = pj.Endpoint()
    with _stdout_silenced(not verbose):  # pjlib logs its start-up before any log config can apply
        endpoint.libCreate()
    account = phone = None
    try:
        config = pj.EpConfig()
        config.uaConfig.threadCnt = 0
        config.uaConfig.mainThreadOnly = False
        config.uaConfig.userAgent = "cosyvoice-gateway-test-phone"
        config.logConfig.level = 5 if verbose else 1
        config.logConfig.consoleLevel = 5 if verbose else 1
        config.medConfig.clockRate = RECORD_RATE
        config.medConfig.sndClockRate = RECORD_RATE
        endpoint.libInit(config)
        endpoint.audDevManager().setNullDev()  # no sound card: the bridge runs on a null clock

        transport = pj.TransportConfig()
        transport.port = 0  # ephemeral: several test phones may run at once
        if local_host:
            transport.boundAddress = local_host
            transport.publicAddress = local_host
        endpoint.transportCreate(pj.PJSIP_TRANSPORT_UDP, transport)
        endpoint.libStart()
        _prefer_codecs(endpoint, codecs)

        account_config = pj.AccountConfig()
        account_config.idUri = f"sip:test-phone@{local_host or '127.0.0.1'}"
        account_config.regConfig.registerOnAdd = False
        if local_host:
            account_config.mediaConfig.transportConfig.boundAddress = local_host
            account_config.mediaConfig.transportConfig.publicAddress = local_host
        account = pj.Account()
        account.create(account_config)

        phone = Phone(account)
        call_param = pj.CallOpParam(True)
        for name, value in headers.items():
            header = pj.SipHeader()
            header.hName = name
            header.hValue = value
            call_param.txOption.headers.append(header)
        peer = _uri_peer(uri)
        started = time.monotonic()
        try:
            phone.makeCall(uri, call_param)
        except pj.Error as exc:
            return CallResult(False, 0, exc.reason or exc.info(), 0.0, "error", None, peer)
        ended_by = _wait_for_end(endpoint, phone, timeout_s, lambda: phone.hangup(pj.CallOpParam(True)))

        recorded = phone.recorder is not None
        phone.recorder = None  # destroying the writer finalises the WAV header
        ended_at = phone.ended_at or time.monotonic()
        duration = ended_at - phone.answered_at if phone.answered_at is not None else 0.0
        final_at = phone.answered_at or (started + timeout_s if ended_by == "timeout" else ended_at)
        return CallResult(answered=phone.answered_at is not None, status_code=phone.status_code,
                          reason=phone.reason, duration_s=round(duration, 3), ended_by=ended_by,
                          wav_path=record_path if recorded else None, peer=peer,
                          waited_s=round(final_at - started, 3), provisional=phone.provisional, codec=phone.codec)
    finally:
        # The Call and Account wrappers must die before the library: their destructors call into it.
        del phone, account
        endpoint.libDestroy()


def _wait_for_end(endpoint, phone, timeout_s: float, hangup: Callable[[], None]) -> str:
    """Handle SIP events until the call ends; on timeout hang up and allow the BYE/CANCEL to finish."""
    deadline = time.monotonic() + timeout_s
    ended_by = "remote"
    while phone.ended_at is None:
        now = time.monotonic()
        if now >= deadline:
            if ended_by == "timeout":  # we hung up and the far end never confirmed: give up
                break
            ended_by = "timeout"
            hangup()
            deadline = now + _HANGUP_GRACE_S
            continue
        # Blocks until a SIP event or the timeout: an event wait, not a sleep.
        endpoint.libHandleEvents(int(min(0.05, deadline - now) * 1000) + 1)
    return ended_by


@contextlib.contextmanager
def _stdout_silenced(silence: bool) -> Iterator[None]:
    if not silence:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    with open(os.devnull, "wb") as devnull:
        os.dup2(devnull.fileno(), 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _uri_host(uri: str) -> str:
    rest = uri.split(":", 1)[1] if ":" in uri else uri
    rest = rest.split("@", 1)[-1]
    if rest.startswith("["):
        return rest[: rest.index("]") + 1]
    return rest.split(":", 1)[0].split(";", 1)[0]


def _uri_peer(uri: str) -> str:
    """HOST:PORT a SIP URI is sent to (5060 when it names no port; RFC 3263 SRV look-ups aside)."""
    host = _uri_host(uri)
    rest = uri.split("@", 1)[-1] if "@" in uri else uri.split(":", 1)[-1]
    rest = rest[len(host):] if rest.startswith(host) else ""
    port = rest[1:].split(";", 1)[0].split(">", 1)[0] if rest.startswith(":") else ""
    return f"{host}:{port or 5060}"


def _prefer_codecs(endpoint, codecs: Sequence[str]) -> None:
    """Offer only `codecs`, in that order (priority 255 downwards); disable the rest."""
    wanted = [name.upper() for name in codecs]
    for codec in endpoint.codecEnum2():
        name = codec.codecId.split("/", 1)[0].upper()
        priority = 255 - wanted.index(name) if name in wanted else 0
        endpoint.codecSetPriority(codec.codecId, priority)


def parse_codecs(value: str) -> tuple[str, ...]:
    """`--codec g722,pcmu` -> ("G722", "PCMU"); ValueError names a codec the gateway does not speak."""
    names = tuple(name.strip().upper() for name in value.split(",") if name.strip())
    unknown = [name for name in names if name not in KNOWN_CODECS]
    if unknown or not names:
        raise ValueError(f"--codec {value!r}: choose from {', '.join(c.lower() for c in KNOWN_CODECS)}")
    return names


def _command(uri: str, text: str | None, record_path: str | None, timeout_s: float,
             voice: str | None, codecs: Sequence[str] = DEFAULT_CODECS) -> list[str]:
    command = [sys.executable, "-m", "gateway.pjsua_phone", uri, "--timeout", str(timeout_s), "--json",
               "--codec", ",".join(codecs)]
    if text is not None:
        command += ["--text", text]
    if record_path is not None:
        command += ["--record", str(record_path)]
    if voice is not None:
        command += ["--voice", voice]
    return command


def _parse_result(stdout: str, stderr: str, returncode: int) -> CallResult:
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            return CallResult.from_json(line)
    raise RuntimeError(f"test phone exited {returncode} without a result: {stderr.strip()[-2000:]}")


def place_call(uri: str, text: str | None, record_path: str | Path | None = None, timeout_s: float = 30.0,
               voice: str | None = None, codecs: Sequence[str] = DEFAULT_CODECS) -> CallResult:
    """Place one call from a fresh subprocess (pjsua2 state stays out of this process). Blocks."""
    done = subprocess.run(_command(uri, text, str(record_path) if record_path else None, timeout_s, voice, codecs),
                          capture_output=True, text=True, timeout=timeout_s + 30)
    return _parse_result(done.stdout, done.stderr, done.returncode)


async def place_call_async(uri: str, text: str | None, record_path: str | Path | None = None,
                           timeout_s: float = 30.0, voice: str | None = None,
                           codecs: Sequence[str] = DEFAULT_CODECS) -> CallResult:
    """`place_call` for code running on an event loop (e.g. a test that also runs the gateway)."""
    process = await asyncio.create_subprocess_exec(
        *_command(uri, text, str(record_path) if record_path else None, timeout_s, voice, codecs),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout_s + 30)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        process.kill()
        await process.wait()
        raise
    return _parse_result(stdout.decode(), stderr.decode(), process.returncode or 0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.pjsua_phone", description=__doc__.splitlines()[0])
    parser.add_argument("uri")
    parser.add_argument("--text")
    parser.add_argument("--voice")
    parser.add_argument("--record")
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--codec", type=parse_codecs, default=DEFAULT_CODECS, help="codecs to offer, in order")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    parser.add_argument("--verbose", action="store_true", help="show PJSIP's log")
    args = parser.parse_args(argv)
    result = call_in_this_process(args.uri, args.text, args.record, args.timeout, args.voice, args.codec,
                                  verbose=args.verbose)
    print(result.to_json() if args.json else describe(result), flush=True)
    return 0 if result.answered else 1


def describe(result: CallResult) -> str:
    """One line for the operator: answered, nobody answered in time, or who refused and how."""
    if not result.answered:
        if result.ended_by == "error":
            return f"not answered: could not call {result.peer}: {result.reason}"
        if result.ended_by == "timeout" or result.status_code in (0, 408):
            # Our hang-up shows up as 487 Request Terminated, and 408 is the INVITE's own timer
            # (RFC 3261 §17.1.1.2 Timer B): either way nobody answered, which is what to say.
            rang = f" (it rang: {result.provisional})" if result.provisional else ""
            return f"not answered: no answer from {result.peer} within {result.waited_s:.0f} s{rang}"
        return f"not answered: {result.peer} refused the call with {result.status_code} {result.reason}".rstrip()
    recorded = f", recorded to {result.wav_path}" if result.wav_path else ""
    codec = f" ({result.codec})" if result.codec else ""
    return f"answered{codec}, {result.duration_s:.1f} s, ended by {result.ended_by}{recorded}"


if __name__ == "__main__":
    sys.exit(main())
