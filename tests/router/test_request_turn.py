"""A request's turn labels the schedule-time histogram: first and later chat turns apart."""

from __future__ import annotations

import orjson

from switchyard.router.request import CHAT, COMPLETIONS, parse


def turn_of(route: str, body: dict) -> str:
    return parse(route, orjson.dumps(body), None).turn


def test_a_chat_with_no_answer_yet_is_a_first_turn() -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    assert turn_of(CHAT, {"model": "m", "messages": messages}) == "first"


def test_a_chat_with_an_earlier_answer_is_a_later_turn() -> None:
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
    ]
    assert turn_of(CHAT, {"model": "m", "messages": messages}) == "later"


def test_a_completion_is_a_prompt_not_a_turn() -> None:
    assert turn_of(COMPLETIONS, {"model": "m", "prompt": "p"}) == "prompt"
