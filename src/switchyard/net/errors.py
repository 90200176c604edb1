"""The failures of our own HTTP client (``switchyard.net.httpclient``), in one hierarchy,
so callers catch our classes and ``router.upstream.outcome_of`` maps them to outcomes once:

    TransportError
    ├── TransportTimeout          (also the builtin TimeoutError)
    │   ├── ConnectTimeout        connecting took longer than the pool's connect timeout
    │   ├── PoolTimeout           no connection free by the deadline: nothing was written
    │   └── ReadTimeout           no response head by the deadline, or a body gone idle
    ├── ConnectError              refused, unresolvable, TLS failed: no connection made
    │   └── ServerDisconnected    the connection ended before the head, after the request
    │                             was written: the worker may have started on it
    ├── RemoteProtocolError       the answer is not HTTP/1.1 we accept (malformed, 101,
    │   │                         Content-Length with Transfer-Encoding), before its head
    │   └── ResponseHeadTooLarge  the answer's head (interim answers included) over the cap
    ├── PayloadCut                the connection ended (or was unreadable) after the head
    ├── InvalidHeader             (also ValueError) a header name or value we will not write
    └── InvalidURL                (also ValueError) not an http(s) URL with a host

``maybe_started`` says whether the worker may have begun on the request: true once its
bytes were written. The pool itself resends a request only where that is false (a kept
connection found closed before writing), so a generation never runs twice through it.
The control plane (probes aside) uses httpx and meets httpx's own hierarchy instead.
"""

from __future__ import annotations


class TransportError(Exception):
    """A call through our HTTP client failed."""

    maybe_started = True


class TransportTimeout(TransportError, TimeoutError):
    """A deadline of the call passed; still a ``TimeoutError`` for code that waits on it."""


class ConnectTimeout(TransportTimeout):
    """Connecting to the worker took longer than the pool's connect timeout."""

    maybe_started = False


class PoolTimeout(TransportTimeout):
    """No connection to the worker came free (or was made) by the call's deadline; the
    request was never written."""

    maybe_started = False


class ReadTimeout(TransportTimeout):
    """No response head by the call's deadline, or no body bytes within the response's
    idle timeout: the request was written."""


class ConnectError(TransportError):
    """No usable connection: refused, unresolvable or TLS failed; nothing was written."""

    maybe_started = False


class ServerDisconnected(ConnectError):
    """The connection closed before the response head, after the request was written: the
    worker cannot be told apart from one that read it and died on it."""

    maybe_started = True


class RemoteProtocolError(TransportError):
    """The worker's answer broke HTTP/1.1 before its head was done (a malformed status
    line or header, a ``101 Switching Protocols`` we never ask for, both Content-Length and
    Transfer-Encoding); the connection is closed."""


class ResponseHeadTooLarge(RemoteProtocolError):
    """The answer's head, interim (1xx) answers included, passed the pool's cap; read no
    further, so an endless head costs no more than the cap."""


class PayloadCut(TransportError):
    """The connection closed, or sent what is not HTTP, after the response head: the
    worker was reached and broke off its answer."""


class InvalidHeader(TransportError, ValueError):
    """A header name or value with CR, LF or NUL (or a name that is no HTTP token), refused
    before any byte is written: written, it would split the request (smuggling)."""

    maybe_started = False


class InvalidURL(TransportError, ValueError):
    """The URL is not http(s) with a host; a ``ValueError`` too, as bad input."""

    maybe_started = False
