"""The data-plane HTTP client and the byte relay: upstream bytes go to the client as they arrive.

One pooled keep-alive aiohttp session serves every worker (measured 4x faster
than httpx on this path). Bodies are never decoded or re-encoded: compression is
left to the two ends and SSE chunks are forwarded as read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
from starlette.types import Send

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
    """The worker did not answer (first byte) or went silent (between chunks) in time."""


class Relay:
    def __init__(
        self,
        *,
        connect_timeout_s: float,
        first_byte_timeout_s: float,
        idle_timeout_s: float,
        max_connections_per_worker: int = 0,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.first_byte_timeout_s = first_byte_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_connections_per_worker = max_connections_per_worker
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0,
            limit_per_host=self.max_connections_per_worker,
            keepalive_timeout=60,
            ttl_dns_cache=300,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s),
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
        )

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("relay is not started")
        return self._session

    async def open(
        self, url: str, body: bytes, headers: dict[str, str], timeout_s: float | None = None
    ) -> aiohttp.ClientResponse:
        """Send the request and wait for the response head, at most ``timeout_s``
        (default and cap: ``first_byte_timeout_s``)."""
        limit = self.first_byte_timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(limit):
                return await self.session.post(url, data=body, headers=headers)
        except TimeoutError:
            raise UpstreamTimeout(f"no response from {url} within {limit:.1f}s") from None

    async def first_chunk(self, resp: aiohttp.ClientResponse, timeout_s: float) -> bytes:
        """The first body chunk of a stream (b"" if the stream is empty), within ``timeout_s``."""
        try:
            async with asyncio.timeout(max(timeout_s, 0.0)):
                return await resp.content.readany()
        except TimeoutError:
            raise UpstreamTimeout(f"no first token within {timeout_s:.1f}s") from None

    async def read_all(self, resp: aiohttp.ClientResponse) -> bytes:
        try:
            async with asyncio.timeout(self.idle_timeout_s):
                return await resp.read()
        except TimeoutError:
            raise UpstreamTimeout(f"response body stalled for {self.idle_timeout_s}s") from None

    async def stream(
        self,
        resp: aiohttp.ClientResponse,
        send: Send,
        first: bytes,
        on_progress: Callable[[int], None],
    ) -> bytes:
        """Forward the chunks after ``first`` (already sent) as they arrive; return the
        last two (where usage is).

        ``on_progress`` hears the chunk count every 16 chunks (about one token each
        from vLLM/SGLang), so the load model sees decode contexts grow. Raises
        UpstreamTimeout if the stream goes idle.
        """
        loop = asyncio.get_running_loop()
        idle = self.idle_timeout_s
        content = resp.content
        chunks = 1
        previous, last = b"", first
        try:
            async with asyncio.timeout(idle) as deadline:
                while True:
                    chunk = await content.readany()
                    if not chunk:
                        return previous + last
                    chunks += 1
                    if not chunks & 15:
                        on_progress(chunks)
                    previous, last = last, chunk
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    deadline.reschedule(loop.time() + idle)
        except TimeoutError:
            raise UpstreamTimeout(f"stream idle for more than {idle}s") from None


async def send_complete(
    send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    """A complete (non-streamed) answer: ``headers`` plus its content-length, then ``body``."""
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def response_headers(resp: aiohttp.ClientResponse, request_id: bytes) -> list[tuple[bytes, bytes]]:
    """The worker's headers minus hop-by-hop ones, with the request id guaranteed."""
    out = [(k.lower(), v) for k, v in resp.raw_headers if k.lower() not in HOP_BY_HOP]
    if not any(k == b"x-request-id" for k, _ in out):
        out.append((b"x-request-id", request_id))
    return out
