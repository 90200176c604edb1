"""Chats tokenized message by message give exactly the ids of one full render."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from tokenizers import Tokenizer

from switchyard.kvstore.store import KVStore, LookupResult
from switchyard.kvstore.tokenize import OFFLOAD_CHARS, RoutingTokenizer
from switchyard.router.kv import EmbeddedPrefixes, KVAwareness
from switchyard.router.metrics import KVMetrics
from tests.support import TOKENIZER_DIR

SYSTEM = "You review code.\nBe brief. " + "Shared system prompt words. " * 60


def _full(tok: RoutingTokenizer, messages: list[dict[str, Any]], agp: bool = True) -> list[int]:
    hf = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    return hf.encode(tok.render_chat(messages, agp), add_special_tokens=False).ids


def _chat(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"Question {i}: why does line {i} fail?"})
        messages.append({"role": "assistant", "content": f"Answer {i}.\nBecause of {i * 3}."})
    return messages


def _ours() -> RoutingTokenizer:
    return RoutingTokenizer.from_dir(TOKENIZER_DIR)


def test_our_template_is_tokenized_message_by_message() -> None:
    assert _ours().incremental


def test_each_turn_of_a_chat_gives_the_full_render_ids() -> None:
    tok = _ours()
    for turns in range(1, 6):
        messages = _chat(turns)[:-1]
        assert tok.encode_chat(messages) == _full(tok, messages)
        assert tok.encode_chat(messages, False) == _full(tok, messages, False)


def test_a_later_turn_tokenizes_only_the_answer_and_question_it_adds() -> None:
    tok = _ours()
    tok.encode_chat(_chat(3)[:-1])
    before = tok.cache_stats
    tok.encode_chat(_chat(4)[:-1])
    after = tok.cache_stats
    hits, misses = after["by_kind"]["message"]
    # The six earlier messages come from the conversation's line, not one by one.
    assert (hits, misses) == (before["by_kind"]["message"][0], before["by_kind"]["message"][1] + 2)
    assert after["conversations"]["hits"] == before["conversations"]["hits"] + 1
    assert tok.uncached_chars(_chat(4)[:-1]) == 0


def _with_template(template: str) -> RoutingTokenizer:
    hf = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    return RoutingTokenizer(tokenizer=hf, chat_template=template)


def test_a_template_numbering_its_messages_falls_back_to_a_full_render() -> None:
    tok = _with_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ loop.index }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert not tok.incremental and tok.uncached_chars(_chat(2)) is None
    assert tok.encode_chat(_chat(2)) == _full(tok, _chat(2))


def test_a_default_system_prompt_before_a_first_user_message_still_goes_incremental() -> None:
    # As Qwen2.5's template: a chat not opened by a system message gets a default one.
    tok = _with_template(
        "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
        "<|im_start|>system\nDefault.<|im_end|>\n{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert tok.incremental
    no_system = _chat(3)[1:]
    for messages in (_chat(3), no_system, no_system[:-2]):
        assert tok.encode_chat(messages) == _full(tok, messages)


def test_a_template_grouping_tool_results_goes_incremental_for_plain_chats_only() -> None:
    # As Qwen's templates: consecutive tool results share one user turn.
    tok = _with_template(
        "{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
        "<|im_start|>user{% endif %}\n<tool_response>{{ m['content'] }}</tool_response>"
        "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n"
        "{% endif %}{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert tok.incremental and tok.uncached_chars(_chat(2)) is not None
    tools = [
        *_chat(1),
        {"role": "tool", "content": "one", "tool_call_id": "a"},
        {"role": "tool", "content": "two", "tool_call_id": "b"},
    ]
    assert tok.uncached_chars(tools) is None
    assert tok.encode_chat(tools) == _full(tok, tools)


def test_plain_messages_of_a_verbatim_template_are_framed_without_rendering() -> None:
    tok = _ours()
    tok.encode_chat(_chat(1))  # learns the frames of the roles it meets
    messages = _chat(4)[:-1]
    expected = _full(tok, messages)
    renders = 0
    render = tok.render_chat

    def counted(*args: Any, **kwargs: Any) -> str:
        nonlocal renders
        renders += 1
        return render(*args, **kwargs)

    tok.render_chat = counted  # type: ignore[method-assign]
    assert tok.encode_chat(messages) == expected
    assert renders == 0


def test_a_template_trimming_content_is_rendered_not_framed() -> None:
    # As Llama 3's template: content | trim.
    tok = _with_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert tok.incremental
    messages = [*_chat(1), {"role": "user", "content": "  padded question  \n"}]
    assert tok.encode_chat(messages) == _full(tok, messages)


def test_a_template_rewriting_one_role_frames_the_others_only() -> None:
    # As Qwen3's template: an assistant's thinking is cut from its content.
    tok = _with_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' %}{{ m['content'].split('</think>')[-1] }}"
        "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert tok.incremental
    messages = [
        *_chat(1),
        {"role": "assistant", "content": "<think>long thought</think>Short answer."},
        {"role": "user", "content": "<think>not an assistant</think>kept whole"},
    ]
    assert tok.encode_chat(messages) == _full(tok, messages)
    assert tok._frames[("user", False)] is not None
    assert tok._frames[("assistant", False)] is None


def test_remembered_message_keys_keep_a_bounded_amount_of_content_alive() -> None:
    tok = _ours()
    big = [{"role": "user", "content": str(i) * 1_000_000} for i in range(10)]
    assert tok.uncached_chars(big) is not None
    held = sum(len(entry[0]["content"]) for entry in tok._keys.values())
    assert 0 < held <= 4_000_000


def test_a_template_without_special_tokens_between_messages_falls_back() -> None:
    tok = _with_template("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    assert not tok.incremental
    assert tok.encode_chat(_chat(2)) == _full(tok, _chat(2))


def test_the_cache_stays_within_its_byte_bound() -> None:
    bound = 64 * 1024
    tok = RoutingTokenizer.from_dir(TOKENIZER_DIR, cache_bytes=bound)
    for i in range(200):
        messages = [{"role": "user", "content": f"conversation {i}: " + "words here " * 40}]
        assert tok.encode_chat(messages) == _full(tok, messages)
        assert tok.cache_stats["bytes"] <= bound
    assert tok.cache_stats["entries"] < 200


def test_prompts_sharing_a_long_prefix_share_its_pieces() -> None:
    tok = _ours()
    shared = "The same long preamble of a document, sentence after sentence. " * 80
    tok.encode_prompt(shared + "first question")
    hits = tok.cache_stats["by_kind"]["piece"][0]
    ids = tok.encode_prompt(shared + "a second, different question")
    hf = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    assert ids == hf.encode(shared + "a second, different question").ids
    assert tok.cache_stats["by_kind"]["piece"][0] - hits >= 8


def test_long_text_tokenized_in_the_thread_gives_the_same_ids_in_request_order() -> None:
    tok = _ours()
    long_chat = [{"role": "user", "content": "alpha beta gamma " * OFFLOAD_CHARS}]
    short_chat = [{"role": "user", "content": "short"}]

    async def both() -> list[str]:
        done: list[str] = []

        async def one(name: str, messages: list[dict[str, Any]]) -> None:
            assert await tok.aencode_chat(messages) == _full(tok, messages)
            done.append(name)

        await asyncio.gather(one("long", long_chat), one("short", short_chat))
        return done

    assert asyncio.run(both()) == ["long", "short"]
    tok.close()


def test_cache_counters_move_by_what_the_tokenizer_counted_since_the_last_sync() -> None:
    registry = CollectorRegistry()
    owner = SimpleNamespace(tokenize_cache=KVMetrics(registry).tokenize_cache, _cache_seen={})
    tok = _ours()
    value = registry.get_sample_value
    name = "switchyard_router_tokenize_cache_total"
    tok.encode_chat(_chat(1))
    KVAwareness._count_cache(owner, tok)  # type: ignore[arg-type]
    assert value(name, {"kind": "message", "outcome": "miss"}) == 3
    assert value(name, {"kind": "message", "outcome": "hit"}) is None
    assert value(name, {"kind": "conversation", "outcome": "miss"}) == 1
    tok.encode_chat(_chat(2))  # extends the first: its three messages come from its line
    KVAwareness._count_cache(owner, tok)  # type: ignore[arg-type]
    assert value(name, {"kind": "message", "outcome": "hit"}) is None
    assert value(name, {"kind": "message", "outcome": "miss"}) == 5
    assert value(name, {"kind": "conversation", "outcome": "hit"}) == 1
    assert value(name, {"kind": "conversation", "outcome": "miss"}) == 1


def _probe(store: KVStore, messages: list[dict[str, Any]]) -> LookupResult | None:
    return asyncio.run(EmbeddedPrefixes(store).probe("m", {"messages": messages}, None, ["a"]))


def test_a_later_turn_is_matched_without_the_new_message_it_ends_with() -> None:
    store = KVStore(block_size=16, tokenizer=_ours())
    messages = _chat(3)[:-1]
    asyncio.run(store.tokenize("m", messages=messages[:-2]))
    result = _probe(store, messages)
    assert result is not None and not result.exact
    head = _full(store.tokenizer, messages[:-1], False)
    assert result.keys == store.keys_for(head)
    whole = len(_full(store.tokenizer, messages))
    assert abs(result.total_tokens - whole) <= 0.5 * (whole - len(head))


def test_a_new_last_message_is_left_for_after_the_answer_and_its_turn_then_cached() -> None:
    tok = _ours()
    messages = _chat(3)[:-1]
    asyncio.run(tok.aencode_chat(messages[:-2]))
    asyncio.run(tok.aencode_chat_head(messages))
    assert tok.uncached_chars(messages) == len(str(messages[-1]["content"])) + 16
    asyncio.run(tok.aencode_chat(messages))
    assert tok.uncached_chars(messages) == 0


def test_a_chat_whose_last_message_was_seen_is_looked_up_whole() -> None:
    store = KVStore(block_size=16, tokenizer=_ours())
    messages = _chat(3)[:-1]
    asyncio.run(store.tokenize("m", messages=messages))
    result = _probe(store, messages)  # from the conversation's line, whole
    assert result is not None and result.exact
    whole = _full(store.tokenizer, messages)
    assert result.keys == store.keys_for(whole) and result.total_tokens == len(whole)


def test_a_chat_with_a_long_new_message_is_probed_by_text_heads() -> None:
    store = KVStore(block_size=16, tokenizer=_ours())
    document = [{"role": "user", "content": "page of text " * OFFLOAD_CHARS}]
    result = _probe(store, document)
    assert result is not None and not result.exact
    assert len(result.keys) < len(_full(store.tokenizer, document)) // 16


_text = st.lists(
    st.sampled_from(list("ab Zé1\n\t.,'?") + ["<|im_end|>", " word", "\n\n", "Ünï 🙂"]),
    max_size=120,
).map("".join)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": _text}
)
_INCREMENTAL = _ours()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_message, min_size=1, max_size=8), st.booleans())
def test_incremental_ids_equal_full_render_ids_on_random_conversations(
    messages: list[dict[str, Any]], agp: bool
) -> None:
    assert _INCREMENTAL.encode_chat(messages, agp) == _full(_INCREMENTAL, messages, agp)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_message, min_size=1, max_size=8))
def test_a_chat_joined_from_its_segments_is_the_full_render(
    messages: list[dict[str, Any]],
) -> None:
    assert _INCREMENTAL.chat_text(messages) == _INCREMENTAL.render_chat(messages)
