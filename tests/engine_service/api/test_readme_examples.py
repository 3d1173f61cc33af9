"""The README's curl lines and bot example, run as written against a live server (real curl, real sockets)."""

from __future__ import annotations

import ast
import asyncio
import io
import json
import os
import shutil
import sys
import wave
from pathlib import Path

import numpy as np
import pytest

from tests.engine_service.api.api_server import KEY, serve

pytestmark = pytest.mark.timeout(120)

REPO_ROOT = Path(__file__).resolve().parents[3]
MARKER = "<!-- tests/engine_service/api/test_readme_examples.py runs this block -->"


def readme_blocks() -> list[str]:
    """The indented code block after each marker, dedented."""
    lines = (REPO_ROOT / "README.md").read_text().splitlines()
    blocks = []
    for start in [i for i, line in enumerate(lines) if line.strip() == MARKER]:
        block: list[str] = []
        for line in lines[start + 1:]:
            if line and not line.startswith("    "):
                if block:
                    break
                continue
            block.append(line[4:])
        blocks.append("\n".join(block).strip() + "\n")
    return blocks


async def run(command: list[str], cwd, server_url: str) -> str:
    env = {**os.environ, "TTS_URL": server_url, "TTS_KEY": KEY, "PYTHONPATH": str(REPO_ROOT)}
    process = await asyncio.create_subprocess_exec(*command, cwd=cwd, env=env, stdout=asyncio.subprocess.PIPE,
                                                   stderr=asyncio.subprocess.STDOUT)
    output, _ = await process.communicate()
    assert process.returncode == 0, output.decode()
    return output.decode()


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
async def test_readme_curl_lines(espeak, tmp_path):
    curl_block = readme_blocks()[0]
    assert curl_block.startswith("curl ")
    async with serve(espeak) as server:
        output = await run(["bash", "-euo", "pipefail", "-c", curl_block], tmp_path, server.url)
    voices = json.loads(output.splitlines()[0])
    assert [voice["name"] for voice in voices["voices"]] == ["en", "zh"]
    with wave.open(io.BytesIO((tmp_path / "hello.wav").read_bytes())) as reader:
        assert reader.getframerate() == 16000
        assert len(reader.readframes(10**7)) > 16000 * 2  # over a second of speech at 16 kHz
    jambonz = np.frombuffer((tmp_path / "jambonz.l16").read_bytes(), dtype="<i2")
    assert len(jambonz) > 8000 and np.abs(jambonz.astype(np.int32)).max() > 3000


async def test_readme_bot_example(espeak, tmp_path):
    bot_block = readme_blocks()[1]
    (tmp_path / "bot.py").write_text(bot_block)
    async with serve(espeak) as server:
        output = await run([sys.executable, "bot.py"], tmp_path, server.url)
    ends = [ast.literal_eval(line) for line in output.splitlines() if "sentence_end" in line]
    assert [end["text"] for end in ends] == ["Sure, I can help.", "What time?"]
    assert (tmp_path / "reply.pcm").stat().st_size == sum(end["audio_bytes"] for end in ends) > 16000 * 2
    assert ast.literal_eval(output.splitlines()[0])["type"] == "ready"


async def test_readme_openai_example(espeak, tmp_path):
    openai_block = readme_blocks()[2]
    assert "from openai import OpenAI" in openai_block
    (tmp_path / "speak.py").write_text(openai_block)
    async with serve(espeak) as server:
        await run([sys.executable, "speak.py"], tmp_path, server.url)
    with wave.open(io.BytesIO((tmp_path / "openai.wav").read_bytes())) as reader:
        assert reader.getframerate() == 24000
        assert len(reader.readframes(10**7)) > 24000 * 2  # over a second of speech
    assert (tmp_path / "openai.pcm").stat().st_size > 24000 * 2
