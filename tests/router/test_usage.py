"""An answer's usage is read once from its last bytes, in each API's shape."""

import pytest

from switchyard.router.usage import Usage, read_usage, served_tokens

OPENAI = (
    b'data: {"usage": {"prompt_tokens": 120, "completion_tokens": 33,'
    b' "prompt_tokens_details": {"cached_tokens": 96}}}\n\ndata: [DONE]'
)
STREAM = (  # each chunk's usage, the last one whole
    b'data: {"usage":{"prompt_tokens":9,"completion_tokens":1}}\n\n'
    b'data: {"usage":{"prompt_tokens":9,"completion_tokens":4}}\n\n'
)
ANTHROPIC = (  # input tokens leave out those read from and written to the cache
    b'"usage":{"input_tokens":28,"output_tokens":4,'
    b'"cache_read_input_tokens":768,"cache_creation_input_tokens":32}'
)
RESPONSES = (  # input tokens are the whole prompt
    b'"usage":{"input_tokens":796,"input_tokens_details":{"cached_tokens":768},'
    b'"output_tokens":5,"output_tokens_details":{"reasoning_tokens":0}}'
)


@pytest.mark.parametrize(
    ("tail", "usage"),
    [
        (OPENAI, Usage(prompt=120, output=33, cached=96)),
        (STREAM, Usage(prompt=9, output=4, cached=0)),
        (ANTHROPIC, Usage(prompt=828, output=4, cached=768)),
        (RESPONSES, Usage(prompt=796, output=5, cached=768)),
    ],
    ids=["openai", "the-last-in-a-stream", "anthropic", "responses"],
)
def test_usage_is_read_in_each_apis_shape(tail: bytes, usage: Usage) -> None:
    assert read_usage(tail) == usage


def test_an_answer_without_usage_reads_none() -> None:
    assert read_usage(b'data: {"choices":[]}') is None
    assert read_usage(b"") is None


def test_served_tokens_are_the_engines_usage_where_the_answer_has_one() -> None:
    assert served_tokens(Usage(120, 33, 0), prompt_estimate=90, generated=30) == (120, 33)
    assert served_tokens(Usage(120, None, 0), prompt_estimate=90, generated=30) == (120, 30)


def test_served_tokens_without_usage_are_the_routers_estimate_and_the_relays_count() -> None:
    assert served_tokens(None, prompt_estimate=90, generated=30) == (90, 30)
