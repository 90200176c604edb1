"""Block keys and routing tokenization."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer, processors

from switchyard.kvstore.keys import block_keys, key_extra
from switchyard.kvstore.tokenize import _NEWLINE_CUT, _SPACE_CUT, RoutingTokenizer
from tests.support import TOKENIZER_DIR


@pytest.fixture(scope="module")
def tok() -> RoutingTokenizer:
    return RoutingTokenizer.from_dir(TOKENIZER_DIR)


def test_keys_cover_full_blocks_only() -> None:
    assert len(block_keys(list(range(47)), 16)) == 2


def test_keys_are_chained_so_a_shared_prefix_shares_keys() -> None:
    a = block_keys(list(range(64)), 16)
    b = block_keys(list(range(32)) + [9] * 32, 16)
    assert a[:2] == b[:2] and a[2] != b[2]


def test_equal_blocks_at_different_positions_get_different_keys() -> None:
    keys = block_keys([7] * 48, 16)
    assert len(set(keys)) == 3


def test_seed_lora_and_cache_salt_change_every_key() -> None:
    tokens = list(range(32))
    plain = block_keys(tokens, 16)
    for other in (
        block_keys(tokens, 16, seed=1),
        block_keys(tokens, 16, extra=key_extra("adapter-a")),
        block_keys(tokens, 16, extra=key_extra(None, "salt")),
    ):
        assert not set(other) & set(plain)
    assert key_extra(None, None) is None


def test_chat_and_its_rendered_completion_give_the_same_keys(tok: RoutingTokenizer) -> None:
    messages = [
        {"role": "system", "content": "You are a helpful assistant.\nAnswer briefly."},
        {"role": "user", "content": "What does the hash of a block depend on?"},
    ]
    rendered = (
        "<|im_start|>system\nYou are a helpful assistant.\nAnswer briefly.<|im_end|>\n"
        "<|im_start|>user\nWhat does the hash of a block depend on?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    chat = tok.encode_chat(messages)
    assert chat == tok.encode_prompt(rendered)
    assert block_keys(chat, 16) == block_keys(tok.encode_prompt(rendered), 16)


def test_content_parts_render_like_plain_strings(tok: RoutingTokenizer) -> None:
    plain = [{"role": "user", "content": "hello there"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]
    assert tok.encode_chat(plain) == tok.encode_chat(parts)


def test_cached_pieces_give_exactly_the_uncached_ids(tok: RoutingTokenizer) -> None:
    lines = [f"Line {i}: the parser reads token {i * 7} and moves on." for i in range(400)]
    system = "\n".join(lines) + "\n\n  odd   spacing\n\tand tabs\n"
    raw = RoutingTokenizer.from_dir(TOKENIZER_DIR)
    raw.cut_pieces = False
    for question in ("first question?", "second, different question!"):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        assert tok.encode_chat(msgs) == raw.encode_chat(msgs)
    assert tok.cut_pieces and tok.cache_stats["hits"] > 0


@given(st.text(alphabet=" \n\tab1_é.", max_size=120))
def test_cuts_fall_after_a_non_space_before_a_non_space_or_a_letter(text: str) -> None:
    blank = " \n\t"
    after_word = [i for i in range(1, len(text) - 1) if text[i - 1] not in blank]
    newlines = [i for i in after_word if text[i] == "\n" and text[i + 1] not in blank]
    spaces = [i for i in after_word if text[i] == " " and text[i + 1].isalpha()]
    assert [m.start() for m in _NEWLINE_CUT.finditer(text)] == newlines
    assert [m.start() for m in _SPACE_CUT.finditer(text)] == spaces


def test_approximate_mode_is_prefix_stable_and_says_so() -> None:
    approx = RoutingTokenizer.approximate()
    a = approx.encode_prompt("shared system prompt " * 20 + "question one")
    b = approx.encode_prompt("shared system prompt " * 20 + "another question")
    assert not approx.exact and a[:100] == b[:100] and a != b


def test_token_id_prompts_pass_through(tok: RoutingTokenizer) -> None:
    assert tok.encode_prompt([5, 6, 7]) == [5, 6, 7]


def test_prompts_get_the_special_tokens_the_tokenizer_adds_like_the_engine() -> None:
    hf = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    hf.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A <|endoftext|>",
        special_tokens=[("<|im_start|>", 1), ("<|endoftext|>", 0)],
    )
    text = "a prompt\nover two lines " * 40
    assert RoutingTokenizer(tokenizer=hf).encode_prompt(text) == hf.encode(text).ids
