"""The prompt estimate flow control weighs: characters over a learnt characters-per-token,
moved toward each prompt the router tokenized or the engine counted."""

from __future__ import annotations

import orjson
import pytest

from switchyard.router.request import CHAT, TokenRatio, parse


def chat(text: str) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})


def test_the_estimate_starts_at_four_characters_a_token() -> None:
    req = parse(CHAT, chat("x" * 400), None)
    assert req.prompt_tokens_estimate == req.prompt_chars // 4 + 1


def test_a_denser_traffic_moves_the_ratio_and_the_estimate() -> None:
    ratio = TokenRatio()
    for _ in range(200):
        ratio.observe(7400, 1000)  # a word list: 7.4 characters a token
    assert ratio.value == pytest.approx(7.4, rel=0.01)
    req = parse(CHAT, chat("word " * 2000), None)
    before = req.prompt_tokens_estimate
    req.chars_per_token = ratio.value
    assert req.prompt_tokens_estimate == pytest.approx(before * 4 / 7.4, rel=0.01)


def test_one_observation_moves_the_ratio_a_little() -> None:
    ratio = TokenRatio()
    ratio.observe(800, 100)
    assert 4.0 < ratio.value < 4.5


@pytest.mark.parametrize(("chars", "tokens"), [(0, 10), (100, 0), (-5, 3)])
def test_an_empty_count_teaches_nothing(chars: int, tokens: int) -> None:
    ratio = TokenRatio()
    ratio.observe(chars, tokens)
    assert ratio.value == 4.0


def test_an_absurd_count_is_bounded() -> None:
    ratio = TokenRatio()
    for _ in range(500):
        ratio.observe(10**6, 1)
    assert ratio.value == pytest.approx(16.0, rel=0.01)
