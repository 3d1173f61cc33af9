"""The media path of a call: engine audio -> 8 kHz -> playout buffer -> shared 20 ms clock -> G.711 -> RTP/UDP.

Pure protocol modules (`g711`, `rtp`, `dtmf`, `sdp`) and pure policy (`port_pool`, `rtp_peer`: whose
RTP counts, `token_bucket`) have no sockets and no clocks; `packet_clock`, `rtp_session` and
`call_media` wire them to the event loop and the network. The call layer uses only
`call_media` (`MediaEngine`, `CallMedia`, `MediaSettings`) and `sdp.NoCommonCodec`.
"""
