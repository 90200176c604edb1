"""Which client headers reach the engines, and which request ids the router accepts.

Forwarding is an allow-list: the headers that describe the content, trace the request or
name its session. Everything else (cookies, the client's ``Authorization``, routing
headers such as ``x-data-parallel-rank`` that only the router sets) stays at the router.
The engines get ``Authorization`` only as the router's own ``worker_api_key``.
"""

from __future__ import annotations

import itertools
import os

# Longest client ``x-request-id`` echoed and forwarded; a longer one is replaced.
MAX_REQUEST_ID_CHARS = 128

# Client header -> the name it is forwarded under (decoded once, here).
FORWARDED_HEADERS: dict[bytes, str] = {
    name: name.decode()
    for name in (
        b"content-type",
        b"accept",
        b"accept-encoding",
        b"user-agent",
        b"x-session-id",
        b"traceparent",
        b"tracestate",
        b"baggage",
        b"anthropic-version",  # Messages: passed on, though vLLM does not require it
        b"anthropic-beta",
    )
}


def valid_request_id(value: bytes) -> bool:
    """A client id the router may echo, log and forward: 1-128 printable ASCII characters."""
    return (
        0 < len(value) <= MAX_REQUEST_ID_CHARS
        and value.isascii()
        and value.decode("ascii").isprintable()
    )


def new_request_id() -> bytes:
    """An id for a request that brought none (or one the router would not echo): this
    process's random prefix and a count, 32 hex digits: one ``os.urandom`` a request would
    be a system call each."""
    return b"%s%016x" % (_ID_PREFIX, next(_ID_COUNT))


_ID_PREFIX = os.urandom(8).hex().encode()  # each router process imports this anew
_ID_COUNT = itertools.count()
