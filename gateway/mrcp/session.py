"""One MRCPv2 session from INVITE to BYE (RFC 6787 §4.2): answer the offer with a synthesizer channel and
its audio stream, serve the channel until the dialog ends.

The SIP server has already admitted the INVITE by the same decision as a call (`SipServer.why_refused`:
draining, sip.max_calls, the engine down or without a free slot, no RTP port pair: 503 + Retry-After); a
session counts against sip.max_calls like a call. Here the offer is refused before anything is answered:
no speechsynth control stream, or a setup we cannot serve -> 488; no common codec -> 488; no RTP ports -> 503.
Each SPEAK then opens its own speech stream, at the line level a call gets (gateway/mrcp/synthesizer.py). The audio stream is the
session's `CallMedia`, on the process's one packet clock, exactly as for a call.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Mapping

import structlog

from gateway import metrics
from gateway.call import dialog_outcome
from gateway.media.call_media import MediaEngine, PortsExhausted
from gateway.media.sdp import NoCommonCodec, SdpError
from gateway.mrcp.sdp import SYNTHESIZER, MrcpOfferError, answer_with_control, synthesizer_offer
from gateway.mrcp.server import MrcpServer
from gateway.mrcp.synthesizer import Synthesizer
from gateway.sip.uas import Ended, InboundCall
from gateway.speech import CallSpeech

log = structlog.get_logger(__name__)


class MrcpSession:
    def __init__(self, call: InboundCall, speech: CallSpeech, media_engine: MediaEngine, server: MrcpServer,
                 voice_aliases: Mapping[str, str]) -> None:
        self.call = call
        self._speech = speech
        self._media_engine = media_engine
        self._server = server
        self._aliases = voice_aliases
        self._log = log.bind(call_id=call.call_id[:64])

    async def run(self) -> str:
        """Serve the session to its end; returns and counts the outcome. Never raises for one bad session."""
        try:
            outcome = await self._run()
        except Exception:  # one broken session must never take the gateway (or other sessions) down
            self._log.exception("mrcp_session_failed_unexpectedly")
            self.call.hangup()
            outcome = "failed"
        metrics.calls_total.labels(outcome=outcome).inc()
        self._log.info("mrcp_session_ended", outcome=outcome)
        return outcome

    async def _run(self) -> str:
        call = self.call
        try:
            control = synthesizer_offer(call.remote_sdp or "", tls_available=self._server.tls_port is not None)
        except (MrcpOfferError, SdpError) as exc:
            return self._reject(488, "Not Acceptable Here", str(exc), "mrcp_offer")
        try:
            media = await self._media_engine.open_call(call.call_id, call.remote_sdp or "",
                                                       signalling_source=call.source[0])
        except (NoCommonCodec, SdpError) as exc:
            return self._reject(488, "Not Acceptable Here", str(exc), "no_codec")
        except PortsExhausted as exc:
            return self._reject(503, "Service Unavailable", str(exc), "no_rtp_ports")
        session_id = secrets.token_hex(16)
        channel = f"{session_id}@{SYNTHESIZER}"  # the Channel-Identifier every request of the channel carries
        synthesizer = Synthesizer(channel, call.call_id, self._speech, media, self._aliases)
        self._server.add_channel(synthesizer)
        metrics.mrcp_sessions_active.inc()
        try:
            if call.ended:  # cancelled while the media was being set up
                return "cancelled"
            port = self._server.tls_port if control.proto == "TCP/TLS/MRCPv2" else self._server.port
            call.accept(answer_with_control(media.answer_sdp, control, port, session_id))
            self._log.info("mrcp_session_answered", channel=channel, codec=media.plan.codec,
                           connection=control.connection, source=f"{call.source[0]}:{call.source[1]}")
            return await self._until_ended(synthesizer)
        finally:
            self._server.remove_channel(channel)
            metrics.mrcp_sessions_active.dec()
            await synthesizer.close()
            await media.close()

    async def _until_ended(self, synthesizer: Synthesizer) -> str:
        ended = asyncio.create_task(self._dialog_ended())
        lost = asyncio.create_task(self._client_lost(synthesizer))
        try:
            await asyncio.wait({ended, lost}, return_when=asyncio.FIRST_COMPLETED)
            if ended.done():
                return ended.result()
            self._log.warning("mrcp_client_lost", timeout_s=self._server.settings.unattached_timeout_s)
            self.call.hangup()  # our BYE: the session's ports, engine slot and max_calls place come back
            return "client_lost"
        finally:
            for task in (ended, lost):
                task.cancel()
            await asyncio.gather(ended, lost, return_exceptions=True)

    async def _dialog_ended(self) -> str:
        while True:
            event = await self.call.events.get()
            if isinstance(event, Ended):
                return dialog_outcome(event)

    async def _client_lost(self, synthesizer: Synthesizer) -> None:
        """Returns once the session has had no control connection for `unattached_timeout_s`: a client
        that never connected, or whose connection closed and did not come back, is gone without a BYE."""
        timeout = self._server.settings.unattached_timeout_s
        while True:
            try:
                await asyncio.wait_for(synthesizer.attached.wait(), timeout)
            except TimeoutError:
                return
            await synthesizer.detached.wait()

    def _reject(self, status: int, reason: str, detail: str, kind: str) -> str:
        self._log.info("mrcp_session_rejected", status=status, detail=detail)
        metrics.calls_refused_total.labels(reason=kind).inc()
        text = "".join(c if c.isprintable() and c not in '"\\' else "?" for c in detail[:200])
        headers = {"Warning": f'399 cosyvoice-gateway "{text}"'}
        if status == 503:
            headers["Retry-After"] = str(self.call.retry_after_s)
        self.call.reject(status, reason, headers)
        return "rejected"
