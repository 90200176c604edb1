"""Golden frames built from vLLM's and SGLang's source update the index as the engine meant."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest

from switchyard.kvstore.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    decode_batch_obj,
)
from switchyard.kvstore.index import Add, Remove
from switchyard.kvstore.ingest import Ingestor
from switchyard.kvstore.store import KVStore

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "kv_events"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
E = "http://127.0.0.1:8001"


def frames(name: str) -> list:
    """The golden batch split into one batch per event, to watch each step."""
    ts, events, *rank = msgpack.unpackb((FIXTURES / name).read_bytes(), raw=False)
    return [[ts, [ev], *rank] for ev in events]


async def matched(store: KVStore, tokens: list[int]) -> int:
    res = await store.lookup(None, token_ids=tokens)
    return max((m.matched_tokens for m in res.matches), default=0)


@pytest.mark.parametrize("name", ["vllm_array_batch.bin", "vllm_map_batch.bin"])
def test_both_vllm_encodings_decode_to_the_same_events(name: str) -> None:
    batch = decode_batch((FIXTURES / name).read_bytes())
    assert batch.data_parallel_rank == 0 and batch.ts == 1700000000.5
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert isinstance(cleared, AllBlocksCleared)
    assert stored.block_hashes == EXPECTED["vllm_block_hashes_uint64"]
    assert stored.token_ids == EXPECTED["vllm_token_ids"] and stored.medium == "GPU"
    assert removed.block_hashes == EXPECTED["vllm_block_hashes_uint64"][1:]


@pytest.mark.parametrize("name", ["vllm_array_batch.bin", "vllm_map_batch.bin"])
async def test_vllm_stored_removed_cleared_update_the_index(name: str) -> None:
    store = KVStore(block_size=16)
    tokens = EXPECTED["vllm_token_ids"]
    stored, removed, cleared = frames(name)
    await store.ingest(E, stored)
    assert await matched(store, tokens) == 32
    await store.ingest(E, removed)
    assert await matched(store, tokens) == 16
    await store.ingest(E, cleared)
    assert await matched(store, tokens) == 0


async def test_sglang_pages_chain_through_a_signed_parent_hash() -> None:
    store = KVStore(block_size=16)
    tokens = EXPECTED["sglang_token_ids"]
    page1, page2, removed = frames("sglang_array_batch.bin")
    assert page2[1][0][1][0] < 0  # page 2's hash is a negative int64
    await store.ingest(E, page1)
    await store.ingest(E, page2)
    assert await matched(store, tokens) == 32
    await store.ingest(E, removed)
    assert await matched(store, tokens) == 16


async def test_byte_hashes_map_and_remove_like_integers() -> None:
    store = KVStore(block_size=16)
    tokens = list(range(32))
    h1, h2 = b"\x01" * 32, b"\x02" * 32
    await store.ingest(E, [0.0, [["BlockStored", [h1], None, tokens[:16], 16, None, "GPU"]]])
    await store.ingest(E, [0.0, [["BlockStored", [h2], h1, tokens[16:], 16, None, "GPU"]]])
    assert await matched(store, tokens) == 32
    await store.ingest(E, [0.0, [["BlockRemoved", [h1], "GPU"]]])
    assert await matched(store, tokens) == 0


async def test_a_block_whose_parent_was_never_seen_is_skipped_not_misindexed() -> None:
    store = KVStore(block_size=16)
    await store.ingest(E, [0.0, [["BlockStored", [7], 12345, list(range(16)), 16, None, "GPU"]]])
    assert await matched(store, list(range(16))) == 0
    orphans = store.metrics.registry.get_sample_value("switchyard_kvstore_orphan_blocks_total")
    assert orphans == 1


async def test_dp_rank_and_medium_become_the_location() -> None:
    store = KVStore(block_size=16)
    tokens = list(range(16))
    await store.ingest(E, [0.0, [["BlockStored", [1], None, tokens, 16, None, "CPU"]], 3])
    res = await store.lookup(None, token_ids=tokens)
    assert [(m.instance, m.dp_rank, m.tier) for m in res.matches] == [(E, 3, "cpu")]


async def test_lora_name_in_events_matches_lookups_for_that_adapter() -> None:
    store = KVStore(block_size=16)
    tokens = list(range(16))
    event = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": 16,
        "lora_id": 1,
        "medium": "GPU",
        "lora_name": "sql-adapter",
        "extra_keys": [["sql-adapter", "tenant-7"]],
    }
    await store.ingest(E, [0.0, [event]])
    assert (await store.lookup(None, token_ids=tokens)).matches == []
    res = await store.lookup(None, token_ids=tokens, lora_name="sql-adapter", cache_salt="tenant-7")
    assert [m.matched_tokens for m in res.matches] == [16]


def test_map_batches_decode_alike_typed_and_through_the_general_path() -> None:
    payload = (FIXTURES / "vllm_map_batch.bin").read_bytes()
    assert decode_batch(payload) == decode_batch_obj(msgpack.unpackb(payload, raw=False))


def test_a_map_batch_with_an_unknown_event_type_keeps_its_known_events() -> None:
    removed = {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"}
    payload = msgpack.packb([1.0, [{"type": "BlockPinned", "block_hashes": [4]}, removed]])
    assert decode_batch(payload).events == [BlockRemoved([5], "GPU")]


def test_removals_in_a_row_become_one_remove_and_keep_their_place_among_stores() -> None:
    ing = Ingestor(E)
    tokens = list(range(64))
    first = EventBatch(0.0, [BlockStored([1, 2, 3], None, tokens[:48], 16, medium="GPU")])
    (added,) = ing.ops(first)
    assert isinstance(added, Add)
    k1, k2, k3 = added.keys
    batch = EventBatch(
        0.0,
        [
            BlockRemoved([3], "GPU"),
            BlockRemoved([2], "GPU"),
            BlockRemoved([99], "GPU"),  # never stored: nothing to remove
            BlockStored([4], 1, tokens[16:32], 16, medium="GPU"),
            BlockRemoved([1], "GPU"),
        ],
    )
    ops = ing.ops(batch)
    assert [type(op) for op in ops] == [Remove, Add, Remove]
    assert ops[0].keys == [k3, k2] and ops[2].keys == [k1]
    assert ing.stats.blocks_removed == 3
