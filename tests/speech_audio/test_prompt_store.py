"""The prompt store keeps line audio in memory and on disk, and never returns a damaged file."""

from __future__ import annotations

import numpy as np

from speech_audio.prompt_store import PromptKey, PromptStore

KEY = PromptKey("Welcome to the bank.", "en", "espeak:1", 8000, "-19.0")


def _speech(n: int = 8000) -> np.ndarray:
    return (np.sin(np.arange(n) * 0.3) * 8000).astype(np.int16)


def test_an_entry_written_survives_a_new_store_on_the_same_directory(tmp_path):
    PromptStore(tmp_path, 1 << 20).write(KEY, _speech(), 8000)
    again = PromptStore(tmp_path, 1 << 20)
    assert again.stats().disk_entries == 1
    assert np.array_equal(again.disk_get(KEY), _speech())
    assert np.array_equal(again.memory_get(KEY), _speech())  # read once, then kept in memory


def test_every_part_of_the_key_names_another_entry(tmp_path):
    store = PromptStore(tmp_path, 1 << 20)
    store.write(KEY, _speech(), 8000)
    for other in (PromptKey("Welcome to the bank!", "en", "espeak:1", 8000, "-19.0"),
                  PromptKey(KEY.text, "zh", "espeak:1", 8000, "-19.0"),
                  PromptKey(KEY.text, "en", "espeak:2", 8000, "-19.0"),  # a new model or voice data
                  PromptKey(KEY.text, "en", "espeak:1", 16000, "-19.0"),
                  PromptKey(KEY.text, "en", "espeak:1", 8000, "engine")):
        assert store.disk_get(other) is None


def test_a_flipped_byte_or_a_truncated_file_is_deleted_and_counted_never_returned(tmp_path):
    store = PromptStore(tmp_path, 1 << 20)
    for damage in (lambda b: b[:100] + bytes([b[100] ^ 0x40]) + b[101:], lambda b: b[: len(b) // 2],
                   lambda b: b[:10]):
        store.write(KEY, _speech(), 8000)
        path = store.path_of(KEY)
        path.write_bytes(damage(path.read_bytes()))
        assert store.disk_get(KEY) is None
        assert not path.exists()
    assert store.stats().corrupt == 3
    assert store.stats().disk_entries == 0


def test_memory_keeps_the_most_recently_used_within_its_bytes_and_counts_evictions():
    store = PromptStore(None, max_memory_bytes=3 * 16000)
    keys = [PromptKey(f"prompt {i}", "en", "m", 8000, "-19.0") for i in range(4)]
    for key in keys[:3]:
        store.remember(key, _speech())
    store.memory_get(keys[0])  # used: now the most recent
    store.remember(keys[3], _speech())
    assert store.memory_get(keys[1]) is None
    assert all(store.memory_get(key) is not None for key in (keys[0], keys[2], keys[3]))
    assert store.stats().memory_evictions == 1
    assert store.stats().memory_bytes == 3 * 16000


def test_disk_over_its_budget_removes_the_least_recently_used_file(tmp_path):
    store = PromptStore(tmp_path, 1 << 20, max_disk_bytes=2 * 16100)
    keys = [PromptKey(f"prompt {i}", "en", "m", 8000, "-19.0") for i in range(3)]
    for key in keys:
        store.write(key, _speech(), 8000)
    assert not store.path_of(keys[0]).exists()
    assert store.path_of(keys[1]).exists() and store.path_of(keys[2]).exists()
    assert store.stats().disk_evictions == 1
