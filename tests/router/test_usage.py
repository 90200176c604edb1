"""An answer's usage is read once from its last bytes, in each API's shape."""

from switchyard.router.usage import Usage, read_usage, served_tokens


def test_the_openai_shape_gives_prompt_completion_and_cached_tokens() -> None:
    tail = (
        b'data: {"usage": {"prompt_tokens": 120, "completion_tokens": 33,'
        b' "prompt_tokens_details": {"cached_tokens": 96}}}\n\ndata: [DONE]'
    )
    assert read_usage(tail) == Usage(prompt=120, output=33, cached=96)


def test_the_last_usage_in_a_stream_is_the_one_read() -> None:
    tail = (
        b'data: {"usage":{"prompt_tokens":9,"completion_tokens":1}}\n\n'
        b'data: {"usage":{"prompt_tokens":9,"completion_tokens":4}}\n\n'
    )
    assert read_usage(tail) == Usage(prompt=9, output=4, cached=0)


def test_anthropic_input_tokens_leave_out_those_read_and_written_to_the_cache() -> None:
    tail = (
        b'"usage":{"input_tokens":28,"output_tokens":4,'
        b'"cache_read_input_tokens":768,"cache_creation_input_tokens":32}'
    )
    assert read_usage(tail) == Usage(prompt=828, output=4, cached=768)


def test_responses_input_tokens_are_the_whole_prompt() -> None:
    tail = (
        b'"usage":{"input_tokens":796,"input_tokens_details":{"cached_tokens":768},'
        b'"output_tokens":5,"output_tokens_details":{"reasoning_tokens":0}}'
    )
    assert read_usage(tail) == Usage(prompt=796, output=5, cached=768)


def test_an_answer_without_usage_reads_none() -> None:
    assert read_usage(b'data: {"choices":[]}') is None
    assert read_usage(b"") is None


def test_served_tokens_are_the_engines_usage_where_the_answer_has_one() -> None:
    assert served_tokens(Usage(120, 33, 0), prompt_estimate=90, generated=30) == (120, 33)
    assert served_tokens(Usage(120, None, 0), prompt_estimate=90, generated=30) == (120, 30)


def test_served_tokens_without_usage_are_the_routers_estimate_and_the_relays_count() -> None:
    assert served_tokens(None, prompt_estimate=90, generated=30) == (90, 30)
