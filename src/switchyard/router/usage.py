"""An answer's token usage, read once from its last bytes for everything that counts it:
the KV hit counters, flow control's fair share and rate limits, the learnt token ratio
and the trace. Read from the end, where an answer's ``usage`` is, so a long answer is
not scanned; in the OpenAI shape (``prompt_tokens``) or, where that is absent, the
Anthropic and Responses shape (``input_tokens``)."""

from __future__ import annotations

import re
from typing import NamedTuple

_NUMBER = re.compile(rb"\s*:\s*(\d+)")
_OPENAI = re.compile(rb'"(prompt|completion|cached)_tokens"\s*:\s*(\d+)')
_CACHED = b'"cached_tokens"'
_INPUT = b'"input_tokens"'
_OUTPUT = b'"output_tokens"'
_CACHE_READ = b'"cache_read_input_tokens"'
_CACHE_WRITTEN = b'"cache_creation_input_tokens"'


class Usage(NamedTuple):
    """What the engine counted: the whole prompt, the tokens it generated (None where
    the answer's usage leaves them out) and the prompt tokens it found cached."""

    prompt: int
    output: int | None
    cached: int


def _last_number(body: bytes, key: bytes) -> int | None:
    """The integer after the last ``key`` in ``body``."""
    at = body.rfind(key)
    if at < 0:
        return None
    found = _NUMBER.match(body, at + len(key))
    return int(found[1]) if found else None


def read_usage(tail: bytes) -> Usage | None:
    """The usage an answer (or a stream's last bytes) reports, if it reports one."""
    at = tail.rfind(b'"usage"')
    if at < 0:
        return None
    prompt = output = None
    cached = 0
    for key, value in _OPENAI.findall(tail, at):  # one pass over the usage object
        if key == b"prompt":
            prompt = int(value)
        elif key == b"completion":
            output = int(value)
        else:
            cached = int(value)
    if prompt is not None:
        return Usage(prompt, output, cached)
    return _api_usage(tail)


def _api_usage(tail: bytes) -> Usage | None:
    """Usage in the Anthropic or the Responses shape."""
    inputs = _last_number(tail, _INPUT)
    if inputs is None:
        return None
    output = _last_number(tail, _OUTPUT)
    read = _last_number(tail, _CACHE_READ)
    if read is not None:
        # Anthropic's input tokens leave out those read from and written to the cache
        written = _last_number(tail, _CACHE_WRITTEN)
        return Usage(inputs + read + (written or 0), output, read)
    # the Responses API's input tokens are the whole prompt
    cached = _last_number(tail, _CACHED)
    return Usage(inputs, output, cached or 0)


def served_tokens(usage: Usage | None, prompt_estimate: int, generated: int) -> tuple[int, int]:
    """(prompt, output) tokens an answer cost: the engine's ``usage`` where the answer
    held one, else the router's prompt estimate and the relay's token count."""
    if usage is None:
        return prompt_estimate, generated
    output = usage.output
    return usage.prompt, generated if output is None else output
