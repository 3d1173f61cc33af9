"""cosyvoice-gateway: SIP/RTP telephony front end for streaming speech engines."""
