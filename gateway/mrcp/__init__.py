"""The MRCPv2 synthesizer server (RFC 6787): the TTS plug of UniMRCP clients (Asterisk, FreeSWITCH) and IVRs.

An INVITE whose SDP offers `m=application ... TCP/MRCPv2` comes in on the gateway's SIP port like any call
and becomes an `MrcpSession` (session.py) instead of a `CallSession`. `message` (the wire codec), `sdp`
(the control stream's offer/answer), `params` (header fields) and `speech_text` (SPEAK bodies) are pure;
`synthesizer` (one channel's state machine), `server` (the TCP control listener) and `session` wire them to
the engine, the media and the loop.
"""
