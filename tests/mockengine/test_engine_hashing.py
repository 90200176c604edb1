"""Block hashing as the real engines compute it, checked against the hand-built goldens."""

from __future__ import annotations

import json
from pathlib import Path

from switchyard.mock.engine.hashing import BlockHasher, sglang_block_digest, vllm_block_digest

GOLDEN = json.loads(
    (Path(__file__).parent.parent / "fixtures" / "kv_events" / "expected.json").read_text()
)


def test_vllm_chain_publishes_the_golden_uint64_hashes() -> None:
    h = BlockHasher("vllm", 16)
    digests = h.chain(GOLDEN["vllm_token_ids"], 0, None)
    assert [h.published(d) for d in digests] == GOLDEN["vllm_block_hashes_uint64"]


def test_sglang_chain_publishes_the_golden_int64_hashes() -> None:
    h = BlockHasher("sglang", 16)
    digests = h.chain(GOLDEN["sglang_token_ids"], 0, None)
    assert [h.published(d) for d in digests] == GOLDEN["sglang_block_hashes_int64"]


def test_vllm_chain_equals_block_by_block_hashing_with_lora_and_salt() -> None:
    tokens = list(range(5000, 5000 + 16 * 40))
    ref, parent = [], None
    for i in range(40):
        keys = ("adapter", "salt") if i == 0 else ("adapter",)
        parent = vllm_block_digest(parent, tokens[i * 16 : (i + 1) * 16], keys)
        ref.append(parent)
    h = BlockHasher("vllm", 16)
    assert h.chain(tokens, 0, None, "adapter", "salt") == ref
    assert h.chain(tokens, 7, ref[6], "adapter", "salt") == ref[7:]


def test_sglang_chain_links_pages_through_the_parent_digest() -> None:
    tokens = list(range(64))
    h = BlockHasher("sglang", 16)
    digests = h.chain(tokens, 0, None)
    assert digests[2] == sglang_block_digest(digests[1], tokens[32:48])


def test_partial_trailing_block_is_not_hashed() -> None:
    assert len(BlockHasher("vllm", 16).chain(list(range(47)), 0, None)) == 2


def test_chain_can_stop_at_an_end_block() -> None:
    h = BlockHasher("vllm", 16)
    tokens = list(range(160))
    assert h.chain(tokens, 0, None, end_block=3) == h.chain(tokens, 0, None)[:3]
