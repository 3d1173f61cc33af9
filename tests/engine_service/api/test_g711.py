"""The API's G.711 encoder agrees byte for byte with the gateway's on every 16-bit input."""

from __future__ import annotations

import numpy as np
import pytest

from engine_service.api.g711 import encode_g711
from gateway.media import g711 as gateway_g711


@pytest.mark.parametrize(("law", "codec"), [("pcmu", "PCMU"), ("pcma", "PCMA")])
def test_every_sample_value_encodes_like_the_gateway(law, codec):
    every = np.arange(65536, dtype=np.uint16).view(np.int16)
    assert encode_g711(every, law) == gateway_g711.encode(every, codec)


@pytest.mark.parametrize(("law", "silence"), [("pcmu", 0xFF), ("pcma", 0xD5)])
def test_silence_is_the_standard_idle_byte(law, silence):
    assert encode_g711(np.zeros(4, dtype=np.int16), law) == bytes([silence]) * 4
