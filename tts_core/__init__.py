"""Clean CosyVoice2 inference: frontend, Qwen2 speech LM, flow matching, HiFT, streaming runtime.

Knows nothing about SIP, RTP or asyncio. Model modules keep the official state-dict key names so
official and fine-tuned checkpoints load strictly. Nothing is loaded at import time.
"""
