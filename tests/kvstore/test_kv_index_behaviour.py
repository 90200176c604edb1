"""Index semantics, identical on the memory and the Redis backend."""

from __future__ import annotations

import asyncio

import pytest

from switchyard.kvstore.index import Add, Clear, KVIndex, Location, Remove
from switchyard.kvstore.keys import block_keys

BS = 16

pytestmark = pytest.mark.timeout(30)

A = "http://127.0.0.1:8001"
B = "http://127.0.0.1:8002"


def keys_of(n_blocks: int, start: int = 0) -> list[int]:
    return block_keys(list(range(start, start + n_blocks * 16)), 16)


def found(matches: list) -> dict[tuple[str, int, str], int]:
    return {(m.instance, m.dp_rank, m.tier): m.matched_tokens for m in matches}


async def test_match_is_the_consecutive_run_from_block_zero(index: KVIndex) -> None:
    keys = keys_of(8)
    await index.add(keys[:3] + keys[4:], Location(A))
    assert found(await index.lookup(keys, block_size=BS)) == {(A, 0, "gpu"): 48}


async def test_a_location_missing_block_zero_has_no_match(index: KVIndex) -> None:
    keys = keys_of(4)
    await index.add(keys[1:], Location(A))
    assert await index.lookup(keys, block_size=BS) == []


async def test_each_location_gets_its_own_run_best_first(index: KVIndex) -> None:
    keys = keys_of(6)
    await index.add(keys[:2], Location(A))
    await index.add(keys[:5], Location(B, dp_rank=1))
    matches = await index.lookup(keys, block_size=BS)
    assert [(m.instance, m.dp_rank, m.matched_tokens) for m in matches] == [(B, 1, 80), (A, 0, 32)]


async def test_candidates_restrict_the_answer(index: KVIndex) -> None:
    keys = keys_of(4)
    await index.add(keys, Location(A))
    await index.add(keys, Location(B))
    assert found(await index.lookup(keys, candidates=[B], block_size=BS)) == {(B, 0, "gpu"): 64}
    assert await index.lookup(keys, candidates=[], block_size=BS) == []


async def test_tiers_are_separate_locations_weighted_below_gpu(index: KVIndex) -> None:
    keys = keys_of(4)
    await index.add(keys, Location(A, tier="cpu"))
    await index.add(keys, Location(B, tier="gpu"))
    matches = await index.lookup(keys, block_size=BS)
    assert [(m.instance, m.tier) for m in matches] == [(B, "gpu"), (A, "cpu")]
    assert matches[1].matched_tokens == 64 and matches[1].weighted_tokens == pytest.approx(51.2)


async def test_remove_cuts_the_run_at_the_removed_block(index: KVIndex) -> None:
    keys = keys_of(5)
    await index.add(keys, Location(A))
    await index.remove(keys[2:3], Location(A))
    assert found(await index.lookup(keys, block_size=BS)) == {(A, 0, "gpu"): 32}


async def test_clear_forgets_one_rank_or_the_whole_instance(index: KVIndex) -> None:
    keys = keys_of(3)
    for rank in (0, 1):
        await index.add(keys, Location(A, rank))
    await index.add(keys, Location(B))
    await index.clear(A, 1)
    assert set(found(await index.lookup(keys, block_size=BS))) == {(A, 0, "gpu"), (B, 0, "gpu")}
    await index.clear(A)
    assert set(found(await index.lookup(keys, block_size=BS))) == {(B, 0, "gpu")}


async def test_apply_runs_a_batch_in_order(index: KVIndex) -> None:
    keys = keys_of(4)
    await index.apply(
        [
            Add(keys, Location(A)),
            Clear(A),
            Add(keys[:2], Location(A)),
            Add(keys, Location(B)),
            Remove(keys[3:], Location(B)),
        ]
    )
    assert found(await index.lookup(keys, block_size=BS)) == {(B, 0, "gpu"): 48, (A, 0, "gpu"): 32}


async def test_speculative_entries_expire(index: KVIndex) -> None:
    keys = keys_of(3)
    await index.add(keys, Location(A), ttl_s=0.15)
    assert found(await index.lookup(keys, block_size=BS)) == {(A, 0, "gpu"): 48}
    await asyncio.sleep(0.25)
    assert await index.lookup(keys, block_size=BS) == []


async def test_engine_confirmed_entries_outlive_a_speculative_ttl(index: KVIndex) -> None:
    keys = keys_of(3)
    await index.add(keys, Location(A), ttl_s=0.15)
    await index.add(keys[:2], Location(A))
    await index.add(keys[:1], Location(A), ttl_s=0.15)
    await asyncio.sleep(0.25)
    assert found(await index.lookup(keys, block_size=BS)) == {(A, 0, "gpu"): 32}


async def test_locations_count_their_blocks(index: KVIndex) -> None:
    await index.add(keys_of(3), Location(A))
    await index.add(keys_of(2, start=999), Location(A))
    await index.add(keys_of(1), Location(B, 2, "cpu"))
    counts = {
        (i.location.instance, i.location.dp_rank, i.location.tier): i.blocks
        for i in await index.locations()
    }
    assert counts[(A, 0, "gpu")] == 5 and counts[(B, 2, "cpu")] == 1
    assert await index.size() == 6
