"""A fixed-answer streaming backend for relay benchmarks: N SSE events per request, one write each.

``python -m bench.sse_backend PORT EVENTS [vllm]``: ``vllm`` sends vLLM's completion chunks
with token ids, as a request with ``return_token_ids`` gets them.

Plain asyncio on uvloop, so the backend is never what limits the relay figure.
"""

from __future__ import annotations

import asyncio
import sys

import uvloop

EVENT = b'data: {"id":"cmpl-b","object":"text_completion","choices":[{"index":0,"text":"tok"}]}\n\n'
# vLLM's completion chunk as a request with return_token_ids gets it (``vllm`` argument).
VLLM_EVENT = (
    b'data: {"id":"cmpl-b","object":"text_completion","created":1765000000,'
    b'"model":"bench","choices":[{"index":0,"text":" tok","logprobs":null,'
    b'"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":[11234]}]}\n\n'
)


class Handler(asyncio.Protocol):
    def __init__(self, events: int, event: bytes = EVENT) -> None:
        self.events = events
        self.event = event
        self.buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        head, sep, rest = self.buffer.partition(b"\r\n\r\n")
        if not sep:
            return
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        if len(rest) < length:
            return
        self.buffer = rest[length:]
        if head.startswith(b"GET"):
            body = b'{"object":"list","data":[{"id":"bench","object":"model"}]}'
            self.transport.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body)
            )
            return
        asyncio.get_running_loop().create_task(self.stream())

    async def stream(self) -> None:
        t = self.transport
        t.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"%x\r\n%s\r\n" % (len(self.event), self.event)
        for _ in range(self.events):
            t.write(chunk)
            await asyncio.sleep(0)
        done = b"data: [DONE]\n\n"
        t.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))


async def main(port: int, events: int, event: bytes = EVENT) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Handler(events, event), "127.0.0.1", port)
    await server.serve_forever()


if __name__ == "__main__":
    vllm = sys.argv[3:] == ["vllm"]
    uvloop.run(main(int(sys.argv[1]), int(sys.argv[2]), VLLM_EVENT if vllm else EVENT))
