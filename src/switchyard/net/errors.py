"""The failures of our own HTTP client (``switchyard.net.httpclient``), in one hierarchy,
so callers catch our classes and ``router.upstream.outcome_of`` maps them to outcomes once:

    TransportError
    ├── TransportTimeout        (also the builtin TimeoutError)
    │   ├── ConnectTimeout      connecting took longer than the pool's connect timeout
    │   └── ReadTimeout         no response head by the deadline, or a body gone idle
    ├── ConnectError            refused, unresolvable, TLS failed: no connection made
    │   └── ServerDisconnected  the connection ended (or was unreadable) before the head
    ├── PayloadCut              the connection ended (or was unreadable) after the head
    └── InvalidURL              (also ValueError) not an http(s) URL with a host

Only what callers tell apart today has a class: a malformed answer is not its own kind,
it counts as the connection ending where it happened (before or after the head). The
control plane (probes aside) uses httpx and meets httpx's own hierarchy instead.
"""

from __future__ import annotations


class TransportError(Exception):
    """A call through our HTTP client failed."""


class TransportTimeout(TransportError, TimeoutError):
    """A deadline of the call passed; still a ``TimeoutError`` for code that waits on it."""


class ConnectTimeout(TransportTimeout):
    """Connecting to the worker took longer than the pool's connect timeout."""


class ReadTimeout(TransportTimeout):
    """No response head by the call's deadline (waiting for a connection included), or no
    body bytes within the response's idle timeout."""


class ConnectError(TransportError):
    """No usable connection: refused, unresolvable, reset or closed before an answer."""


class ServerDisconnected(ConnectError):
    """The connection closed, or sent what is not HTTP, before the response head."""


class PayloadCut(TransportError):
    """The connection closed, or sent what is not HTTP, after the response head: the
    worker was reached and broke off its answer."""


class InvalidURL(TransportError, ValueError):
    """The URL is not http(s) with a host; a ``ValueError`` too, as bad input."""
