"""The memory index never grows past its capacity, and evicts the least recently used."""

from __future__ import annotations

from switchyard.kvstore.index import Location
from switchyard.kvstore.keys import block_keys
from switchyard.kvstore.memory import MemoryIndex

A = "http://127.0.0.1:8001"


def test_capacity_bounds_the_number_of_indexed_blocks() -> None:
    idx = MemoryIndex(capacity_blocks=640)
    for start in range(0, 100 * 160, 160):
        idx.add_sync(block_keys(list(range(start, start + 160)), 16), Location(A))
    assert len(idx) <= 640
    assert idx.evicted_blocks == 1000 - len(idx)
    assert idx.locations_sync()[0].blocks == len(idx)


def test_a_prefix_that_keeps_hitting_survives_eviction() -> None:
    idx = MemoryIndex(capacity_blocks=256)
    hot = block_keys(list(range(64)), 16)
    idx.add_sync(hot, Location(A))
    for start in range(10_000, 10_000 + 60 * 80, 80):
        idx.add_sync(block_keys(list(range(start, start + 80)), 16), Location(A))
        assert idx.lookup_sync(hot, block_size=16)[0].matched_tokens == 64
    cold = block_keys(list(range(10_000, 10_080)), 16)
    assert idx.lookup_sync(cold, block_size=16) == []


def test_a_placement_again_within_its_ttl_extends_it_for_every_block() -> None:
    now = [0.0]
    idx = MemoryIndex(clock=lambda: now[0])
    keys = block_keys(list(range(160)), 16)
    idx.add_sync(keys, Location(A), ttl_s=10.0)
    now[0] = 8.0
    idx.add_sync(keys, Location(A), ttl_s=10.0)
    now[0] = 12.0
    assert idx.lookup_sync(keys, block_size=16)[0].matched_tokens == 160
    now[0] = 18.5
    assert idx.lookup_sync(keys, block_size=16) == []


def test_repeated_speculative_placements_queue_one_expiry_each_not_one_per_block() -> None:
    idx = MemoryIndex(clock=lambda: 0.0)
    keys = block_keys(list(range(1600)), 16)
    for _ in range(50):
        idx.add_sync(keys, Location(A), ttl_s=30.0)
    assert len(idx._spec_heap) == 50


def test_a_longer_turn_moves_only_the_blocks_past_the_prefix_it_moved_lately() -> None:
    idx = MemoryIndex(capacity_blocks=10_000)
    chat = block_keys(list(range(1600)), 16)
    idx.add_sync(chat, Location(A))
    assert idx.lookup_sync(chat[:80], block_size=16)[0].matched_tokens == 80 * 16
    moved = idx._moved
    assert idx.lookup_sync(chat, block_size=16)[0].matched_tokens == 1600
    assert idx._moved - moved == 20
    assert list(idx._map)[-20:] == chat[80:]
