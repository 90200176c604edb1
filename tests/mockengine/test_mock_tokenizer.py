"""The mock's tokenizer gives the ids of the model directory's tokenizer, whole or cached."""

from __future__ import annotations

import random

from tokenizers import Tokenizer

from switchyard.mock import tokenizer as mock_tokenizer
from switchyard.mock.tokenizer import ModelTokenizer
from tests.support import TOKENIZER_DIR

WORDS = "the quick brown fox jumps over é 你好 a\n  b\tc end. <|im no|> 12,345".split(" ")


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def reference(prompt: str) -> list[int]:
    raw = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    return raw.encode(prompt, add_special_tokens=False).ids


def test_every_turn_of_a_chat_tokenizes_as_the_whole_rendered_text_does() -> None:
    tok = ModelTokenizer(TOKENIZER_DIR)
    rng = random.Random(3)
    messages = [{"role": "system", "content": text(rng, 400)}]
    for _ in range(5):
        messages.append({"role": "user", "content": text(rng, 80)})
        prompt = tok.render_chat(messages)
        assert tok.tokenize_chat(messages) == reference(prompt)
        messages.append({"role": "assistant", "content": text(rng, 30) + "\n"})


def test_a_prompt_without_special_tokens_tokenizes_whole() -> None:
    tok = ModelTokenizer(TOKENIZER_DIR)
    prompt = text(random.Random(4), 200)
    assert tok.encode(prompt) == reference(prompt)


def test_the_piece_cache_stays_within_its_token_bound(monkeypatch) -> None:
    monkeypatch.setattr(mock_tokenizer, "PIECE_CACHE_TOKENS", 500)
    tok = ModelTokenizer(TOKENIZER_DIR)
    rng = random.Random(5)
    for _ in range(20):
        prompt = "<|im_start|>" + text(rng, 100) + "<|im_end|>"
        assert tok.encode(prompt) == reference(prompt)
    assert 0 < tok._piece_tokens <= 500
