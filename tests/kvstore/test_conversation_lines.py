"""A chat taken from its conversation's line gives the ids and block keys of a full render."""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from switchyard.kvstore.keys import block_keys
from switchyard.kvstore.memory import MemoryIndex
from switchyard.kvstore.store import KVStore
from switchyard.kvstore.tokenize import RoutingTokenizer
from tests.support import TOKENIZER_DIR

_HF = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))


def _full(tok: RoutingTokenizer, messages: list[dict[str, Any]], agp: bool = True) -> list[int]:
    return _HF.encode(tok.render_chat(messages, agp), add_special_tokens=False).ids


_text = st.lists(
    st.sampled_from(list("ab Zé1\n\t.,'?") + ["<|im_end|>", " word", "\n\n", "Ünï 🙂"]),
    max_size=60,
).map("".join)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": _text}
)
# A conversation's turns: each one keeps a prefix of the one before (all of it, or less: an
# edit or a regeneration) and adds messages. One tokenizer for every example, with a small
# bound, so lines of earlier examples are met, branched from and evicted.
_turns = st.lists(
    st.tuples(st.integers(0, 8), st.lists(_message, min_size=1, max_size=3)),
    min_size=1,
    max_size=6,
)
_TOK = RoutingTokenizer.from_dir(TOKENIZER_DIR, conversation_bytes=40_000)
_SEEN: list[dict[str, Any]] = []


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_message, max_size=4), _turns, st.booleans(), st.booleans())
def test_every_turn_from_a_line_equals_a_full_render_in_ids_and_keys(
    start: list[dict[str, Any]],
    turns: list[tuple[int, list[dict[str, Any]]]],
    agp: bool,
    reuse_earlier: bool,
) -> None:
    chat = [*(_SEEN[:3] if reuse_earlier else []), *start]
    for keep, added in turns:
        chat = [dict(m) for m in chat[:keep]] + added  # equal messages, new objects
        assert _TOK.encode_chat(chat, agp) == _full(_TOK, chat, agp)
        plan = _TOK.plan_chat(chat, head=True)
        assert plan is not None
        prefix = asyncio.run(_TOK.aencode_plan(plan))
        if plan.left_out:
            expected = _full(_TOK, chat[:-1], False) if len(chat) > 1 else []
        else:
            expected = _full(_TOK, chat)
        assert prefix.ids() == expected and prefix.tokens == len(expected)
        for size, extra in ((4, None), (16, "lora=a\x00salt=")):
            assert prefix.keys(size, 7, extra) == block_keys(expected, size, 7, extra)
    _SEEN[:] = chat
    stats = _TOK.cache_stats["conversations"]
    assert stats["bytes"] <= 40_000


def test_a_later_turn_is_found_by_comparing_messages_and_only_its_new_ones_are_tokenized() -> None:
    tok = RoutingTokenizer.from_dir(TOKENIZER_DIR)
    system = {"role": "system", "content": "Rules. " * 400}
    chat: list[dict[str, Any]] = [system, {"role": "user", "content": "First?"}]
    tok.encode_chat(chat)
    chat = [dict(m) for m in chat] + [
        {"role": "assistant", "content": "One."},
        {"role": "user", "content": "Second?"},
    ]
    before = tok.cache_stats
    plan = tok.plan_chat(chat)
    assert plan is not None and plan.shared == 2 and len(plan.new) == 2
    assert plan.new_chars < 100
    tok._finish(plan.text, tok._encode)
    assert tok._commit(plan).ids() == _full(tok, chat)
    after = tok.cache_stats
    assert after["conversations"]["hits"] == before["conversations"]["hits"] + 1
    assert after["by_kind"]["message"][1] == before["by_kind"]["message"][1] + 2


def test_a_line_keeps_its_own_copy_of_the_messages_it_was_given() -> None:
    tok = RoutingTokenizer.from_dir(TOKENIZER_DIR)
    chat = [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello."},
    ]
    tok.encode_chat(chat)
    chat[2]["content"] = "Changed after the call."
    again = [dict(m) for m in chat]  # as the next request would parse it
    assert tok.encode_chat(again) == _full(tok, again)


def test_lines_stay_within_their_bound_and_least_recently_used_go_first() -> None:
    tok = RoutingTokenizer.from_dir(TOKENIZER_DIR, conversation_bytes=20_000)
    for i in range(50):
        chat = [
            {"role": "system", "content": f"System {i}. " * 40},
            {"role": "user", "content": f"Question {i}?"},
        ]
        assert tok.encode_chat(chat) == _full(tok, chat)
        assert tok.conversations.bytes <= 20_000
    assert 0 < len(tok.conversations) < 50
    assert tok.plan_chat(chat) is not None and tok.conversations.hits > 0


def test_a_chat_lookup_keys_blocks_from_its_line_as_from_its_ids() -> None:
    store = KVStore(
        MemoryIndex(), block_size=16, tokenizer=RoutingTokenizer.from_dir(TOKENIZER_DIR)
    )
    chat = [{"role": "system", "content": "Context words. " * 200}]
    for turn in range(4):
        chat = [*chat, {"role": "user", "content": f"Turn {turn}, a question?"}]
        result = asyncio.run(store.lookup("m", messages=chat, candidates=["a"]))
        ids = _full(store.tokenizer, chat)
        assert result.total_tokens == len(ids)
        assert result.keys == block_keys(ids, 16)
        chat = [*chat, {"role": "assistant", "content": f"Answer {turn}."}]
