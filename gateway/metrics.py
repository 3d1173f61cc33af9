"""Prometheus metrics of the gateway: the one place metric names and labels are defined.

Every module that counts something imports its metric from here, so names stay consistent
(`gateway_*`, units in the name) and `/metrics` shows them all. Metrics live in one registry that
the HTTP API serves; tests may read values through `registry.get_sample_value`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from speech_audio.cache_metrics import PromptCacheCollector

registry = CollectorRegistry(auto_describe=True)

calls_active = Gauge("gateway_calls_active", "Calls currently answered or ringing", registry=registry)
calls_total = Counter(
    "gateway_calls_total",
    "Calls and MRCP sessions that ended, by outcome (completed, caller_hangup, cancelled, rejected, failed, "
    "ack_timeout, media_timeout, hold_timeout, announced_reject, prack_timeout, session_expired, client_lost)",
    ["outcome"],
    registry=registry,
)
sip_responses_total = Counter(
    "gateway_sip_responses_total", "SIP responses sent, by status code", ["code"], registry=registry
)
sip_requests_total = Counter(
    "gateway_sip_requests_total",
    "SIP requests received from allowed sources, by method (unknown methods count as OTHER)",
    ["method"],
    registry=registry,
)
# Label values must come from bounded sets: a peer that invents methods must not invent series.
SIP_METHOD_LABELS = frozenset({"INVITE", "ACK", "BYE", "CANCEL", "OPTIONS", "INFO", "UPDATE", "PRACK", "REGISTER",
                               "SUBSCRIBE", "NOTIFY", "PUBLISH", "MESSAGE", "REFER"})


def sip_method_label(method: str) -> str:
    return method if method in SIP_METHOD_LABELS else "OTHER"


sip_malformed_total = Counter(
    "gateway_sip_malformed_total", "Datagrams/stream messages that did not parse as SIP", registry=registry
)
sip_dropped_total = Counter(
    "gateway_sip_dropped_total",
    "SIP datagrams/messages dropped unparsed, by reason (oversize; not_allowed: from outside the trunks, "
    "a few of which get a cheap 403)",
    ["reason"],
    registry=registry,
)
sip_rate_limited_total = Counter(
    "gateway_sip_rate_limited_total",
    "Requests over a source's rate limit (sip.flood): answered 503 or dropped",
    ["action"],
    registry=registry,
)
sip_shed_total = Counter(
    "gateway_sip_shed_total",
    "Messages shed before parsing, by the sip.flood budget that was spent (requests, requests_total, junk, "
    "junk_total; tcp: keep-alives or a new connection over the source's budget)",
    ["budget"],
    registry=registry,
)
sip_tcp_refused_total = Counter(
    "gateway_sip_tcp_refused_total",
    "TCP connections closed at accept, by reason (not_allowed, max_connections, max_connections_per_source, "
    "over_budget: the source's sip.flood budget is spent)",
    ["reason"],
    registry=registry,
)
sip_tcp_closed_total = Counter(
    "gateway_sip_tcp_closed_total",
    "TCP connections the gateway closed, by reason (idle_timeout, read_timeout, framing, unread: more than "
    "sip.tcp.max_unsent_bytes queued for a peer that does not read, keepalive_flood: keep-alives over budget)",
    ["reason"],
    registry=registry,
)
http_connections_refused_total = Counter(
    "gateway_http_connections_refused_total",
    "HTTP connections closed at accept, by reason (max_connections, max_connections_per_source, descriptors)",
    ["reason"],
    registry=registry,
)
http_connections_closed_total = Counter(
    "gateway_http_connections_closed_total",
    "HTTP connections the gateway closed, by reason (header_timeout; idle keep-alive closes are aiohttp's)",
    ["reason"],
    registry=registry,
)
http_connections_open = Gauge("gateway_http_connections_open", "HTTP connections open now", registry=registry)
accept_errors_total = Counter(
    "gateway_accept_errors_total",
    "Failed accepts of a listening socket (EMFILE/ENFILE at the descriptor limit); logged once per 10 s",
    registry=registry,
)
rtp_packets_sent_total = Counter("gateway_rtp_packets_sent_total", "RTP packets sent", registry=registry)
rtp_packets_received_total = Counter(
    "gateway_rtp_packets_received_total", "RTP packets received from a call's media partner", registry=registry
)
rtp_packets_dropped_total = Counter(
    "gateway_rtp_packets_dropped_total",
    "RTP/RTCP packets received and dropped, by reason (foreign_source: not from the call's media partner, "
    "see media.rtp_latching; malformed: not RTP)",
    ["reason"],
    registry=registry,
)
rtp_send_failures_total = Counter(
    "gateway_rtp_send_failures_total",
    "RTP/RTCP packets the gateway could not send, by stream (rtp, rtcp) and reason (would_block: the socket "
    "buffer was full; error: the kernel refused the address or route). The call goes on",
    ["stream", "reason"],
    registry=registry,
)
rtp_port_pairs_free = Gauge(
    "gateway_rtp_port_pairs_free",
    "RTP/RTCP port pairs of media.rtp_port_range not held by a call (at 0, INVITEs get 503)",
    registry=registry,
)
playout_underruns_total = Counter(
    "gateway_playout_underruns_total",
    "20 ms packet slots where the playout buffer had no audio mid-prompt (filled with silence)",
    registry=registry,
)
dtmf_events_total = Counter(
    "gateway_dtmf_events_total", "RFC 4733 telephone-events received (one per key press)", registry=registry
)
dtmf_events_dropped_total = Counter(
    "gateway_dtmf_events_dropped_total",
    "Key presses dropped because a call exceeded media.dtmf_max_per_second",
    registry=registry,
)
first_packet_latency_seconds = Histogram(
    "gateway_first_packet_latency_seconds",
    "Time from INVITE received to the first RTP packet carrying speech",
    buckets=(0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0),
    registry=registry,
)
packet_clock_lateness_seconds = Histogram(
    "gateway_packet_clock_lateness_seconds",
    "How late each 20 ms packet clock tick ran behind its deadline",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05),
    registry=registry,
)
packet_clock_skipped_ticks_total = Counter(
    "gateway_packet_clock_skipped_ticks_total",
    "Packet clock slot ticks (2 ms each) skipped because the loop stalled past the catch-up bound: late packets "
    "for the calls of those slots",
    registry=registry,
)
gc_pause_seconds = Histogram(
    "gateway_gc_pause_seconds",
    "How long each cyclic garbage collection held the event loop, by generation (a full one walks every call's "
    "objects: a stall for every call's packets)",
    ["generation"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2),
    registry=registry,
)
engine_first_chunk_seconds = Histogram(
    "tts_first_chunk_latency_seconds",
    "Time from opening an engine stream to its first audio chunk (the engine's share of first-packet latency)",
    ["engine"],
    buckets=(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0),
    registry=registry,
)
synthesis_failures_total = Counter(
    "gateway_synthesis_failures_total", "Calls ended because the engine failed mid-prompt", registry=registry
)
engine_up = Gauge(
    "gateway_engine_up", "1 while the speech engine is ready to take calls, 0 while it is warming or down",
    registry=registry,
)
engine_restarts_total = Counter(
    "gateway_engine_restarts_total", "Times the watchdog restarted a dead or stuck speech engine", registry=registry
)
calls_refused_total = Counter(
    "gateway_calls_refused_total",
    "INVITEs refused before answer, by reason (bad_text, bad_header, no_prompt, unknown_voice, no_capacity, "
    "first_audio_bound, engine_unavailable, draining, max_calls, no_rtp_ports, no_codec, mrcp_offer, other)",
    ["reason"],
    registry=registry,
)
engine_worker_restarts_total = Counter(
    "gateway_engine_worker_restarts_total",
    "Engine worker processes restarted after they exited unasked (any code, any signal, or killed as hung)",
    ["worker"], registry=registry,
)
engine_worker_kills_total = Counter(
    "gateway_engine_worker_kills_total",
    "Engine worker processes the gateway killed to restart them, by reason (hung: listening but its link not "
    "serving for 5 s; start timeout: not listening within engine.worker.start_timeout_s)",
    ["worker", "reason"], registry=registry,
)
engine_workers_ready = Gauge(
    "gateway_engine_workers_ready", "Engine workers serving this gateway now (link up, engine ready)",
    registry=registry,
)
engine_worker_streams_lost_total = Counter(
    "gateway_engine_worker_streams_lost_total",
    "Streams ended because their engine worker died, went silent or its link broke (each call gets a BYE)",
    ["worker"], registry=registry,
)

# MRCPv2 synthesizer sessions (gateway/mrcp/)
mrcp_sessions_active = Gauge("gateway_mrcp_sessions_active", "MRCPv2 synthesizer sessions answered and not ended",
                             registry=registry)
mrcp_requests_total = Counter(
    "gateway_mrcp_requests_total",
    "MRCPv2 requests taken for a channel, by method (unknown methods count as OTHER)",
    ["method"],
    registry=registry,
)
MRCP_METHOD_LABELS = frozenset({"SPEAK", "STOP", "PAUSE", "RESUME", "BARGE-IN-OCCURRED", "CONTROL", "SET-PARAMS",
                                "GET-PARAMS", "DEFINE-LEXICON"})


def mrcp_method_label(method: str) -> str:
    return method if method in MRCP_METHOD_LABELS else "OTHER"


mrcp_speaks_total = Counter(
    "gateway_mrcp_speaks_total",
    "MRCPv2 SPEAKs ended or refused, by Completion-Cause (normal, parse-failure, uri-failure, error, "
    "language-unsupported); a SPEAK ended by STOP or barge-in counts as stopped",
    ["cause"],
    registry=registry,
)
mrcp_malformed_total = Counter(
    "gateway_mrcp_malformed_total",
    "MRCPv2 messages answered with a 4xx/5xx before reaching a channel (framing, start line, headers, unknown "
    "channel)",
    registry=registry,
)

# The prompt cache's families (speech_audio/cache_metrics.py): gateway_prompt_cache_hits_total{where},
# _misses_total, _fill_failures_total, _corrupt_files_total, _evictions_total{tier}, _bytes{tier}, _entries{tier}.
_prompt_cache = PromptCacheCollector("gateway_prompt_cache")
registry.register(_prompt_cache)


def watch_prompt_cache(cache) -> None:
    """Report this cache (the newest gateway's) at /metrics."""
    _prompt_cache.cache = cache
