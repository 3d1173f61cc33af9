"""An ended call is freed by reference counting: it leaves nothing for the cyclic GC to find.

What a call leaves in reference cycles waits for a full (generation 2) collection, and that collection runs on
the event loop's thread and walks every live call's objects too: the packet clock of every call stalls for it
(gateway/gc_pauses.py). Real calls from SIPp over loopback; the automatic collector is off while they run, so
whatever they leave in cycles is still there for `gc.collect()` to report.
"""

from __future__ import annotations

import asyncio
import gc
import shutil

import pytest

from integration_harness import SCENARIOS, rtp_recorder, run_sipp, start_gateway

pytestmark = [pytest.mark.sipp, pytest.mark.timeout(90),
              pytest.mark.skipif(shutil.which("sipp") is None, reason="sipp (sip-tester) not installed")]

T1_MS = 10
TEXT = "Long enough for the caller to put us on hold and off hold again."  # ~4 s from the instant engine
TIMERS = {"sip.session_timers": {"expires_s": 6, "min_se_s": 2}}  # the scenario asks for 4 s, refresher uas


def _gateway_objects(objects: list) -> list[str]:
    return sorted({f"{type(o).__module__}.{type(o).__qualname__}" for o in objects
                   if type(o).__module__.startswith(("gateway.", "engines."))})


# we hang up after the prompt; the caller hangs up mid-prompt; a re-INVITE (hold, resume) is answered by the
# call layer's offer handler; as session-timer refresher we send the refresh (SessionRefresh's callbacks)
@pytest.mark.parametrize(("scenario", "settings"), [("gw_listen.xml", {}), ("gw_caller_bye.xml", {}),
                                                    ("gw_hold_resume.xml", {}), ("gw_timer_uas_refresh.xml", TIMERS)])
async def test_an_ended_call_leaves_no_garbage_cycles(tmp_path, scenario, settings):
    gateway = await start_gateway("instant", t1_ms=T1_MS, extra=settings)
    recorder = await rtp_recorder()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # keep what a collection finds in gc.garbage, to name it
    try:
        rc, errors = await run_sipp(SCENARIOS / scenario, gateway.sip.udp_address, tmp_path, keys={
            "text": TEXT, "rtp_rx": str(recorder.port), "codec_pt": "0", "codec_name": "PCMU"})
        assert rc == 0, errors
        assert await gateway.calls_ended(5)
        assert recorder.packets  # the call was answered and spoke
        # the call's last transactions (an INVITE's Accepted state, a BYE's Timer K) end within 64*T1: after
        # that, everything the call made is either freed or garbage
        await asyncio.sleep(64 * T1_MS / 1000 + 0.3)
        gc.collect()
        assert _gateway_objects(gc.garbage) == []
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        recorder.transport.close()
        await gateway.stop()

