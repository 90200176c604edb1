"""The head of a long prompt tokenizes to a true prefix of the whole prompt's tokens."""

from __future__ import annotations

from switchyard.kvstore.tokenize import RoutingTokenizer
from tests.support import TOKENIZER_DIR

TEXT = "The quick brown fox jumps over the lazy dog near the riverbank. " * 40


def test_head_is_a_prefix_of_the_chat_encoding() -> None:
    tok = RoutingTokenizer.from_dir(TOKENIZER_DIR)
    messages = [{"role": "system", "content": TEXT}, {"role": "user", "content": "Why?"}]
    head = tok.encode_head(tok.render_chat(messages), 512, prompt=False)
    assert head is not None and len(head) > 50
    assert tok.encode_chat(messages)[: len(head)] == head


def test_head_is_a_prefix_of_the_prompt_encoding() -> None:
    tok = RoutingTokenizer.from_dir(TOKENIZER_DIR)
    head = tok.encode_head(TEXT, 300, prompt=True)
    assert head is not None
    assert tok.encode_prompt(TEXT)[: len(head)] == head


def test_short_text_has_no_head() -> None:
    tok = RoutingTokenizer.from_dir(TOKENIZER_DIR)
    assert tok.encode_head("short prompt", 512, prompt=True) is None
