"""One call from INVITE to hang-up: choose what to say, admit or refuse, speak, end.

The call session is the only place that joins the three halves: the SIP dialog (`InboundCall`), the
media (`CallMedia`) and the engine stream (`ChunkChannel`). Data flows one way (engine -> media); the
only things that travel back are explicit events: the dialog ending, DTMF digits.

Refusals happen before the call is answered (RFC 3261 §21.4 codes): no text and no route -> 404,
text that is not UTF-8, holds control characters or nothing speakable -> 400, unknown voice / empty text
-> the engine's refusal code, no free engine slot or engine down -> 503, no common codec -> 488, no free
RTP port pair -> 503 (each 503 with Retry-After). All of them come before any 183: a route with
`early_media` is admitted like any other, then speaks in 183 Session Progress (`_speak_early`). The
speech is settled before the 200 OK (gateway/speech.py): a prompt cache hit has all its audio, and its first
packet leaves with the 200 (or the 183); otherwise the engine stream is opened and admitted (its slot taken)
first, so an answered call always has synthesis running behind it. The line audio is made at the codec's
rate (8 kHz G.711, 16 kHz G.722: `media.plan.audio_rate`), and an SSML prompt (segments) is never cached.
A caller that sends no RTP/RTCP for `media.inactivity_timeout_s` (off hold) is taken for gone: the call
ends with our BYE and the outcome `media_timeout`; on hold the bound is `media.hold_timeout_s` and the
outcome `hold_timeout` (gateway/media/inactivity.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import MappingProxyType

import structlog

from engines.base import SpeechEngine, SynthesisFailed, SynthesisRefused, SynthesisRequest
from engines.ssml import SsmlError
from gateway import metrics
from gateway.media.call_media import CallMedia, MediaEngine, PortsExhausted
from gateway.media.inactivity import peer_silent_for
from gateway.media.sdp import NoCommonCodec, SdpError
from gateway.routing import BadHeader, NoPrompt, Prompt, PromptResolver
from gateway.sip.uas import Ended, InboundCall
from gateway.speech import CallSpeech, Speech

log = structlog.get_logger(__name__)


# Refusal class name -> the bounded `reason` label of gateway_calls_refused_total.
_REFUSAL_KINDS = {"BadText": "bad_text", "EmptyText": "bad_text", "TextTooLong": "bad_text",
                  "UnknownVoice": "unknown_voice", "NoCapacity": "no_capacity",
                  "FirstAudioTooLate": "first_audio_bound",
                  "EngineUnavailable": "engine_unavailable"}


# The reason phrases of the final responses an early-media route may end with (RFC 3261 §21).
_REJECT_REASONS = {404: "Not Found", 410: "Gone", 480: "Temporarily Unavailable", 484: "Address Incomplete",
                   486: "Busy Here", 503: "Service Unavailable", 600: "Busy Everywhere", 603: "Decline",
                   604: "Does Not Exist Anywhere"}


def dialog_outcome(ended: Ended) -> str:
    """The outcome (gateway_calls_total's label) of a call or MRCP session whose dialog ended this way."""
    return {"remote_bye": "caller_hangup", "local_bye": "completed", "bye_timeout": "completed"}.get(
        ended.reason, ended.reason)


def _warning_text(detail: str) -> str:
    """A Warning header's quoted text (RFC 3261 §20.43): printable, no quotes, bounded."""
    return "".join(c if c.isprintable() and c not in '"\\' else "?" for c in detail[:200])


class CallSession:
    def __init__(self, call: InboundCall, resolve_prompt: PromptResolver, speech: CallSpeech,
                 media_engine: MediaEngine) -> None:
        self.call = call
        self._resolve_prompt = resolve_prompt
        self._speech = speech
        self._engine: SpeechEngine = speech.engine
        self._media_engine = media_engine
        self._log = log.bind(call_id=call.call_id)
        self.outcome: str | None = None

    async def run(self) -> str:
        """Drive the call to its end; returns and counts the outcome. Never raises for one bad call."""
        metrics.calls_active.inc()
        try:
            self.outcome = await self._run()
        except Exception:  # one broken call must never take the gateway (or other calls) down
            self._log.exception("call_failed_unexpectedly")
            self.call.hangup()
            self.outcome = "failed"
        finally:
            metrics.calls_active.dec()
        metrics.calls_total.labels(outcome=self.outcome).inc()
        # one line per call's end: the session's outcome and how its dialog ended (InboundCall.end_reason)
        self._log.info("call_ended", outcome=self.outcome, sip_end=self.call.end_reason)
        return self.outcome

    async def _run(self) -> str:
        call = self.call  # its INVITE was logged by the SIP server (sip_invite)
        try:
            prompt = self._resolve_prompt(call)
            request = SynthesisRequest(text=prompt.text, voice=prompt.voice, call_id=call.call_id,
                                       segments=prompt.segments, options=MappingProxyType(dict(prompt.options)))
            self._engine.validate(request)
        except NoPrompt as exc:
            return self._reject(404, "No Prompt For Number", str(exc), "no_prompt")
        except SsmlError as exc:
            return self._reject(400, "Bad SSML", str(exc), "bad_text")
        except UnicodeDecodeError:
            return self._reject(400, "Bad X-TTS-Text Encoding", "X-TTS-Text is not valid UTF-8", "bad_text")
        except BadHeader as exc:
            return self._reject(400, "Bad X-TTS Header", str(exc), "bad_header")
        except SynthesisRefused as exc:
            return self._refuse(exc)
        if not call.remote_sdp:
            return self._reject(488, "SDP Offer Required", "INVITE without SDP (late offer) is not supported",
                                "no_codec")
        try:
            media = await self._media_engine.open_call(call.call_id, call.remote_sdp,
                                                       signalling_source=call.source[0])
        except (NoCommonCodec, SdpError) as exc:
            return self._reject(488, "Not Acceptable Here", str(exc), "no_codec")
        except PortsExhausted as exc:  # capacity, like a full engine: the PBX retries or routes elsewhere
            return self._reject(503, "Service Unavailable", str(exc), "no_rtp_ports")

        try:
            # SSML is not cached: its key would have to hold the segments (breaks, prosody, <audio>), not the words
            speech = await self._speech.open(request, prompt.cache and not prompt.segments, media.plan.audio_rate)
        except SynthesisRefused as exc:
            await media.close()
            return self._refuse(exc)
        except BaseException:
            await media.close()
            raise
        if call.ended:  # the caller cancelled while the engine admitted the stream
            speech.close()
            await media.close()
            return "cancelled"
        call.offer_handler = self._offer_handler(media)
        try:
            if prompt.early_media is not None:
                return await self._speak_early(prompt, speech, media)
            call.accept(media.answer_sdp)
            self._log.info("answered", codec=media.plan.codec, voice=prompt.voice, chars=len(prompt.text),
                           cached=speech.hit)
            return await self._speak_until_end(prompt, speech, media)
        finally:
            speech.close()
            await media.close()

    def _refuse(self, refusal: SynthesisRefused) -> str:
        kind = _REFUSAL_KINDS.get(type(refusal).__name__, "other")
        return self._reject(refusal.sip_status, refusal.sip_reason, str(refusal), kind)

    def _reject(self, status: int, reason: str, detail: str, kind: str) -> str:
        self._log.info("rejected", status=status, reason=reason, detail=detail)
        metrics.calls_refused_total.labels(reason=kind).inc()
        headers = {"Warning": f'399 cosyvoice-gateway "{_warning_text(detail)}"'}
        if status == 503:
            headers["Retry-After"] = str(self.call.retry_after_s)
        self.call.reject(status, reason, headers)
        return "rejected"

    def _offer_handler(self, media: CallMedia) -> Callable[[str], str | None]:
        def answer(offer: str) -> str | None:
            try:
                sdp = media.update_offer(offer)
            except NoCommonCodec as exc:
                self._log.info("reoffer_refused", detail=str(exc))
                return None
            self._log.info("reoffer", can_send=media.plan.can_send)
            return sdp

        return answer

    async def _speak_until_end(self, prompt: Prompt, speech: Speech, media: CallMedia) -> str:
        stream = speech.stream
        play = asyncio.create_task(media.play(speech.chunks), name=f"play-{self.call.call_id}")
        ended = asyncio.create_task(self._next_end(), name=f"dialog-{self.call.call_id}")
        dtmf = asyncio.create_task(self._watch_dtmf(media, prompt, play), name=f"dtmf-{self.call.call_id}")
        silent = asyncio.create_task(self._caller_gone(media), name=f"inactivity-{self.call.call_id}")
        try:
            done, _ = await asyncio.wait({play, ended, silent}, return_when=asyncio.FIRST_COMPLETED)
            if play not in done:  # the dialog ended, or the caller vanished, while we were still speaking
                play.cancel()
                await asyncio.gather(play, return_exceptions=True)
                self._observe_first_packet(media, stream)
                return self._end_without_caller(silent.result()[1]) if silent in done else ended.result()
            self._observe_first_packet(media, stream)
            error = None if play.cancelled() else play.exception()  # cancelled: a barge-in stopped it
            if error is not None:  # SynthesisFailed from the engine, or anything the media path raised
                metrics.synthesis_failures_total.inc()
                self._log.error("synthesis_failed", error=repr(error), engine_error=isinstance(error, SynthesisFailed))
                self.call.hangup()
                await ended
                return "failed"
            self._log.info("prompt_played", underruns=media.underruns, packets=media.packets_sent)
            if prompt.hangup_after:
                self.call.hangup()
                await ended
                return "completed"
            done, _ = await asyncio.wait({ended, silent}, return_when=asyncio.FIRST_COMPLETED)
            return ended.result() if ended in done else self._end_without_caller(silent.result()[1])
        finally:
            for task in (play, ended, dtmf, silent):
                task.cancel()
            await asyncio.gather(play, ended, dtmf, silent, return_exceptions=True)

    async def _speak_early(self, prompt: Prompt, speech: Speech, media: CallMedia) -> str:
        """The prompt as early media: 183 with our SDP answer, RTP before any 200, then what the prompt says:
        answer (the 200 carries the same SDP and the same RTP session goes on, so sequence numbers and
        timestamps continue), reject with `reject_code`, or ring on in 183 until the caller cancels."""
        call = self.call
        call.progress(media.answer_sdp)
        self._log.info("early_media", then=prompt.early_media, codec=media.plan.codec, voice=prompt.voice,
                       chars=len(prompt.text), reliable=call.reliable_provisionals, cached=speech.hit)
        stream = speech.stream
        play = asyncio.create_task(media.play(speech.chunks), name=f"play-{call.call_id}")
        ended = asyncio.create_task(self._next_end(), name=f"dialog-{call.call_id}")
        dtmf = asyncio.create_task(self._watch_dtmf(media, prompt, play), name=f"dtmf-{call.call_id}")
        try:
            done, _ = await asyncio.wait({play, ended}, return_when=asyncio.FIRST_COMPLETED)
            if play not in done:  # cancelled (487) or the PRACK never came while we spoke
                play.cancel()
                await asyncio.gather(play, return_exceptions=True)
                self._observe_first_packet(media, stream)
                return ended.result()
            self._observe_first_packet(media, stream)
            error = None if play.cancelled() else play.exception()
            if error is not None:
                metrics.synthesis_failures_total.inc()
                self._log.error("synthesis_failed", error=repr(error), engine_error=isinstance(error, SynthesisFailed))
                call.reject(500, "Server Internal Error")
                return "failed"
            self._log.info("prompt_played", early_media=True, underruns=media.underruns, packets=media.packets_sent)
            if prompt.early_media == "reject":
                reason = _REJECT_REASONS.get(prompt.reject_code, "Call Rejected")
                call.reject(prompt.reject_code, reason)
                self._log.info("rejected", status=prompt.reject_code, reason=reason, after_early_media=True)
                return "announced_reject"
            if prompt.early_media == "ring":
                return await ended
            call.accept(media.answer_sdp)  # held back by the call until the 183's PRACK, if it was reliable
            self._log.info("answered", codec=media.plan.codec, after_early_media=True)
            confirmed = asyncio.create_task(call.confirmed.wait())
            await asyncio.wait({confirmed, ended}, return_when=asyncio.FIRST_COMPLETED)
            confirmed.cancel()
            if ended.done():
                return ended.result()
            if prompt.hangup_after:
                call.hangup()
                return await ended
            silent = asyncio.create_task(self._caller_gone(media), name=f"inactivity-{call.call_id}")
            try:
                done, _ = await asyncio.wait({ended, silent}, return_when=asyncio.FIRST_COMPLETED)
                return ended.result() if ended in done else self._end_without_caller(silent.result()[1])
            finally:
                silent.cancel()
                await asyncio.gather(silent, return_exceptions=True)
        finally:
            for task in (play, ended, dtmf):
                task.cancel()
            await asyncio.gather(play, ended, dtmf, return_exceptions=True)

    async def _caller_gone(self, media: CallMedia) -> tuple[float, bool]:
        """Returns (silence, on hold) when the caller has sent no RTP/RTCP for media.inactivity_timeout_s off
        hold or media.hold_timeout_s on hold; never when both are 0."""
        settings = self._media_engine.settings
        if settings.inactivity_timeout_s <= 0 and settings.hold_timeout_s <= 0:
            await asyncio.Event().wait()
        return await peer_silent_for(media, settings.inactivity_timeout_s, settings.hold_timeout_s)

    def _end_without_caller(self, on_hold: bool) -> str:
        """The caller vanished without BYE: send ours and free the engine slot and ports now, without waiting
        for the BYE's transaction, which a vanished caller lets run to its 64*T1 timeout (RFC 3261 §17.1.2.2)."""
        settings = self._media_engine.settings
        outcome = "hold_timeout" if on_hold else "media_timeout"
        self._log.warning(outcome, timeout_s=settings.hold_timeout_s if on_hold else settings.inactivity_timeout_s)
        self.call.hangup()
        return outcome

    async def _next_end(self) -> str:
        while True:
            event = await self.call.events.get()
            if isinstance(event, Ended):
                return dialog_outcome(event)

    async def _watch_dtmf(self, media: CallMedia, prompt: Prompt, play: asyncio.Task) -> None:
        while True:
            digit = await media.dtmf.get()
            metrics.dtmf_events_total.inc()
            self._log.info("dtmf", digit=digit, barge_in=prompt.barge_in and not play.done())
            if prompt.barge_in and not play.done():
                play.cancel()  # barge-in: the caller pressed a key, stop speaking

    def _observe_first_packet(self, media: CallMedia, stream) -> None:
        if stream is not None and stream.first_chunk_at is not None:
            metrics.engine_first_chunk_seconds.labels(engine=self._engine.name).observe(
                stream.first_chunk_at - stream.opened_at)
        if media.first_speech_sent_at is not None:
            latency = media.first_speech_sent_at - self.call.received_at
            metrics.first_packet_latency_seconds.observe(latency)
            self._log.info("first_speech_packet", latency_ms=round(latency * 1000, 1))
