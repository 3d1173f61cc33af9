"""The streaming chunk schedule: the official token counts per chunk, and per-request state."""

import pytest

from tts_core.streaming.chunk_schedule import ChunkPlanner, ChunkSchedule


def _drain(planner: ChunkPlanner, total_tokens: int):
    """Feed tokens one by one, as the LM produces them, and collect the chunks rendered."""
    chunks = []
    for n in range(1, total_tokens + 1):
        task = planner.next_chunk(n, lm_finished=False)
        if task:
            chunks.append(task)
    while (task := planner.next_chunk(total_tokens, lm_finished=True)) is not None:
        chunks.append(task)
    return chunks


def test_default_schedule_grows_hop_after_first_chunk():
    # prompt of 50 tokens (already aligned): first chunk at 28 tokens, then the hop grows 25 -> 50
    chunks = _drain(ChunkPlanner(ChunkSchedule(), prompt_tokens=50), total_tokens=90)
    assert [(c.token_offset, c.token_end, c.finalize) for c in chunks] == [
        (0, 28, False), (25, 78, False), (75, 90, True)]


def test_first_hop_is_padded_so_prompt_and_first_chunk_fill_whole_chunks():
    planner = ChunkPlanner(ChunkSchedule(), prompt_tokens=37)  # 37 + 13 = 50 = 2 chunks of 25
    first = _drain(planner, total_tokens=200)[0]
    assert first.token_end - ChunkSchedule().lookahead_tokens == 38


def test_fixed_hop_matches_official_fixed_hop_stream():
    # token2wav_stream golden: fixed hop 25, 4 chunks for 100 tokens with a 50-token prompt
    chunks = _drain(ChunkPlanner(ChunkSchedule(hop_tokens=25, max_hop_tokens=25), prompt_tokens=50), 95)
    assert [c.token_offset for c in chunks] == [0, 25, 50, 75]
    assert chunks[-1].finalize and not any(c.finalize for c in chunks[:-1])


def test_short_utterance_renders_once_when_lm_finishes():
    chunks = _drain(ChunkPlanner(ChunkSchedule(), prompt_tokens=150), total_tokens=12)
    assert [(c.token_offset, c.token_end, c.finalize) for c in chunks] == [(0, 12, True)]


def test_planners_do_not_share_hop_state():
    a = ChunkPlanner(ChunkSchedule(), prompt_tokens=50)
    b = ChunkPlanner(ChunkSchedule(), prompt_tokens=50)
    assert a.next_chunk(28, False) is not None and a.next_hop == 50
    assert b.next_hop == 25  # the official code would have grown b's hop too


def test_low_latency_first_hop():
    planner = ChunkPlanner(ChunkSchedule(first_hop_tokens=10), prompt_tokens=150)
    assert planner.tokens_needed() == 13
    assert planner.next_chunk(13, False).token_end == 13


@pytest.mark.parametrize(("first_hop", "prompt_tokens"), [(8, 150), (10, 150), (12, 50), (15, 137), (30, 150)])
def test_after_a_first_hop_off_the_chunk_grid_every_chunk_ends_on_it(first_hop: int, prompt_tokens: int):
    # The flow attends in 25-token chunks from the prompt's start: the second chunk ends so that it and every
    # later one end on a chunk, as the official schedule's do.
    planner = ChunkPlanner(ChunkSchedule(first_hop_tokens=first_hop), prompt_tokens=prompt_tokens)
    chunks = _drain(planner, 400)
    offsets = [c.token_offset for c in chunks]
    assert offsets[1] == first_hop
    assert all((prompt_tokens + offset) % 25 == 0 for offset in offsets[2:])
    assert all(b - a == 50 for a, b in zip(offsets[2:-1], offsets[3:]))
    # The second chunk holds at least as much speech as a short first one (it must be rendered before that
    # one's audio runs out), and is the shortest that does so and ends on the grid: the fewest decode steps.
    second = offsets[2] - offsets[1]
    least = min(first_hop, 25)
    assert least <= second < least + 25
