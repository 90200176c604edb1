"""The byte relay: upstream bytes go to the client as they arrive.

One connection pool (``switchyard.net.httpclient``) serves every worker. Bodies are never
decoded or re-encoded: compression is left to the two ends and SSE chunks are
forwarded as read.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING

from starlette.types import Send

from switchyard.net.httpclient import MAX_HEAD_BYTES, ConnectionPool, PieceWriter, Response

if TYPE_CHECKING:
    from switchyard.router.migration import Keeper

# Headers that describe one connection, not the message: never forwarded either way.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
    }
)


class UpstreamTimeout(Exception):
    """The worker did not answer (first byte) or went silent (between chunks) in time.

    ``maybe_started``: the request had been written (a connect or pool timeout: not)."""

    def __init__(self, message: str, *, maybe_started: bool = True) -> None:
        super().__init__(message)
        self.maybe_started = maybe_started


class EngineErrorEvent(Exception):
    """A stream that may migrate carried the engine's error event after its first byte."""


class Relay:
    def __init__(
        self,
        *,
        connect_timeout_s: float,
        first_byte_timeout_s: float,
        idle_timeout_s: float,
        max_connections_per_worker: int = 0,
        max_head_bytes: int = MAX_HEAD_BYTES,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """``max_head_bytes``: a worker's answer head cap; ``ssl_context``: for https
        workers (None: the default context)."""
        self.connect_timeout_s = connect_timeout_s
        self.first_byte_timeout_s = first_byte_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_connections_per_worker = max_connections_per_worker
        self.max_head_bytes = max_head_bytes
        self.ssl_context = ssl_context
        self._pool: ConnectionPool | None = None

    async def start(self) -> None:
        self._pool = ConnectionPool(
            connect_timeout_s=self.connect_timeout_s,
            max_per_origin=self.max_connections_per_worker,
            max_head_bytes=self.max_head_bytes,
            ssl_context=self.ssl_context,
        )

    async def stop(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    @property
    def pool(self) -> ConnectionPool:
        if self._pool is None:
            raise RuntimeError("relay is not started")
        return self._pool

    async def open(
        self, url: str, body: bytes, headers: dict[str, str], timeout_s: float | None = None
    ) -> Response:
        """POST ``body`` and wait for the response head, at most ``timeout_s``
        (default and cap: ``first_byte_timeout_s``)."""
        limit = self.first_byte_timeout_s if timeout_s is None else timeout_s
        try:
            return await self.pool.post(url, body, headers, limit)
        except TimeoutError as exc:
            raise UpstreamTimeout(
                f"no response from {url} within {limit:.1f}s",
                maybe_started=getattr(exc, "maybe_started", True),
            ) from None

    async def first_chunk(self, resp: Response, timeout_s: float) -> bytes:
        """The first body chunk of a stream (b"" if the stream is empty), within ``timeout_s``."""
        if resp.ready:
            return await resp.readany()
        try:
            async with asyncio.timeout(max(timeout_s, 0.0)):
                return await resp.readany()
        except TimeoutError:
            raise UpstreamTimeout(f"no first token within {timeout_s:.1f}s") from None

    async def read_all(self, resp: Response) -> bytes:
        if resp.finished:  # a short answer comes with its head: no timer needed
            return await resp.read()
        try:
            async with asyncio.timeout(self.idle_timeout_s):
                return await resp.read()
        except TimeoutError:
            raise UpstreamTimeout(f"response body stalled for {self.idle_timeout_s}s") from None

    async def stream(
        self,
        resp: Response,
        send: Send,
        first: bytes,
        on_progress: Callable[[int], None],
        write: PieceWriter | None = None,
    ) -> bytes:
        """Forward the chunks after ``first`` (already sent) as they arrive; return the
        last two (where usage is).

        ``write``, where the server offers one (``router.connections``), takes each chunk
        straight from the upstream connection's callback (``Response.pipe``); else each
        goes through ``send``. ``on_progress`` hears the chunk count every 16 chunks (about
        one token each from vLLM/SGLang), so the load model sees decode contexts grow.
        Raises UpstreamTimeout if the stream goes idle.
        """
        idle = self.idle_timeout_s
        resp.idle_timeout(idle)
        chunks = 1
        previous, last = b"", first
        try:
            if write is not None:

                def forward(chunk: bytes) -> asyncio.Future[None] | None:
                    nonlocal chunks, previous, last
                    chunks += 1
                    if not chunks & 15:
                        on_progress(chunks)
                    previous, last = last, chunk
                    return write(chunk)

                await resp.pipe(forward)
                return previous + last
            while True:
                chunk = await resp.readany()
                if not chunk:
                    return previous + last
                chunks += 1
                if not chunks & 15:
                    on_progress(chunks)
                previous, last = last, chunk
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except TimeoutError:
            raise UpstreamTimeout(f"stream idle for more than {idle}s") from None

    async def stream_kept(
        self,
        resp: Response,
        send: Send,
        on_progress: Callable[[int], None],
        write: PieceWriter | None,
        keeper: Keeper,
        idle_s: float,
    ) -> bytes:
        """``stream`` for a stream that may migrate: each piece goes through ``keeper``
        (kept, its token ids nulled) on its way to the client, and the stream may go
        ``idle_s`` without a chunk. Raises ``EngineErrorEvent`` where the engine sent an
        error event, ``UpstreamTimeout`` where the stream went idle."""
        resp.idle_timeout(idle_s)
        if idle_s < self.idle_timeout_s:  # a stream that can no longer migrate may idle longer
            keeper.on_full = lambda: resp.idle_timeout(self.idle_timeout_s)
        feed = keeper.feed
        try:
            if write is not None:

                def forward(chunk: bytes) -> asyncio.Future[None] | None:
                    out = feed(chunk)
                    if not keeper.reads & 15:
                        on_progress(keeper.reads)
                    if keeper.error is not None:
                        resp.fail(EngineErrorEvent("the engine sent an error event"))
                    return write(out) if out else None

                await resp.pipe(forward)
            else:
                while True:
                    chunk = await resp.readany()
                    if not chunk:
                        break
                    out = feed(chunk)
                    if not keeper.reads & 15:
                        on_progress(keeper.reads)
                    if out:
                        await send({"type": "http.response.body", "body": out, "more_body": True})
                    if keeper.error is not None:
                        raise EngineErrorEvent("the engine sent an error event")
        except TimeoutError:
            raise UpstreamTimeout(f"stream idle for more than {idle_s:.1f}s") from None
        rest = keeper.flush()
        if rest:
            await send({"type": "http.response.body", "body": rest, "more_body": True})
        return keeper.tail()


async def send_complete(
    send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    """A complete (non-streamed) answer: ``headers`` plus its content-length, then ``body``."""
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# A worker's header names, lowered, or None for a hop-by-hop one: workers send a handful of
# names, each lowered and looked up once. Past the cap a new name is lowered each time.
_FORWARDED_NAMES: dict[bytes, bytes | None] = {}
_MAX_FORWARDED_NAMES = 1024


def _forwarded_name(name: bytes) -> bytes | None:
    lowered = name.lower()
    forwarded = None if lowered in HOP_BY_HOP else lowered
    if len(_FORWARDED_NAMES) < _MAX_FORWARDED_NAMES:
        _FORWARDED_NAMES[name] = forwarded
    return forwarded


def response_headers(resp: Response, request_id: bytes) -> list[tuple[bytes, bytes]]:
    """The worker's headers minus hop-by-hop ones, with the request id guaranteed."""
    names = _FORWARDED_NAMES
    out = []
    for name, value in resp.raw_headers:
        forwarded = names[name] if name in names else _forwarded_name(name)
        if forwarded is not None:
            out.append((forwarded, value))
    if not any(k == b"x-request-id" for k, _ in out):
        out.append((b"x-request-id", request_id))
    return out
