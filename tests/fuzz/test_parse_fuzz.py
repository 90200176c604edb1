"""Hypothesis on the router's request parser and on chat tokenization.

The parser must turn every body into a routed request or a 4xx in the OpenAI shape,
never another exception; every chat the parser accepts must tokenize and render.
Examples are bounded so the file runs in seconds.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from switchyard.kvstore.tokenize import RoutingTokenizer
from switchyard.router.errors import RouterError
from switchyard.router.request import CHAT, COMPLETIONS, EMBEDDINGS, RoutedRequest, parse
from tests.support import TOKENIZER_DIR

pytestmark = pytest.mark.timeout(120)

BOUNDED = settings(
    max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
ROUTES = st.sampled_from([CHAT, COMPLETIONS, EMBEDDINGS])
TEXT = st.text(max_size=40)
SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | TEXT
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.just({"url": "x"})}),
    st.dictionaries(st.sampled_from(["type", "text"]), JSON, max_size=2),
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]) | JSON},
    optional={"content": TEXT | st.lists(PART, max_size=3) | JSON, "name": JSON},
)
BODY = st.fixed_dictionaries(
    {"model": st.just("m") | JSON},
    optional={
        "messages": st.lists(MESSAGE, max_size=4) | JSON,
        "prompt": TEXT | st.lists(st.integers(), max_size=5) | JSON,
        "input": TEXT | JSON,
        "stream": st.booleans() | JSON,
        "user": JSON,
    },
)


def parsed_or_client_error(route: str, body: bytes) -> RoutedRequest | None:
    """The parse result, or None when the parser refused the body with a 4xx."""
    try:
        return parse(route, body, None)
    except RouterError as exc:
        assert 400 <= exc.status < 500, exc.message
        assert exc.message
        return None


@BOUNDED
@given(route=ROUTES, body=st.binary(max_size=200))
def test_parse_refuses_any_bytes_with_a_4xx_or_parses_them(route: str, body: bytes) -> None:
    req = parsed_or_client_error(route, body)
    assert req is None or isinstance(req.data, dict)


@BOUNDED
@given(route=ROUTES, data=JSON | BODY)
def test_parse_refuses_any_json_with_a_4xx_or_routes_it(route: str, data: Any) -> None:
    req = parsed_or_client_error(route, json.dumps(data).encode())
    if req is not None:
        assert req.model and isinstance(req.stream, bool) and req.prompt_chars >= 0


@pytest.fixture(scope="module", params=["approximate", "hf"])
def tokenizer(request: pytest.FixtureRequest) -> RoutingTokenizer:
    if request.param == "hf":
        return RoutingTokenizer.from_dir(TOKENIZER_DIR)
    return RoutingTokenizer.approximate()


@BOUNDED
@given(body=BODY)
def test_every_chat_the_router_accepts_tokenizes_and_renders(
    tokenizer: RoutingTokenizer, body: dict[str, Any]
) -> None:
    req = parsed_or_client_error(CHAT, json.dumps(body).encode())
    if req is None:
        return
    messages = req.data["messages"]
    ids = tokenizer.encode_chat(messages)
    assert all(isinstance(t, int) and t >= 0 for t in ids)
    assert isinstance(tokenizer.render_chat(messages), str)


@BOUNDED
@given(messages=st.lists(MESSAGE, min_size=1, max_size=4))
def test_chat_rendering_without_a_template_takes_any_message_content(
    messages: list[dict[str, Any]],
) -> None:
    """A model's own chat template may refuse odd messages (callers validate first, as the
    router and the kvstore service do); the plain rendering takes anything."""
    ids = RoutingTokenizer.approximate().encode_chat(messages)
    assert all(isinstance(t, int) and t >= 0 for t in ids)
