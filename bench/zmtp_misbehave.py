"""A router whose KV-event publishers misbehave: one announces a 2^40-byte frame, one stops.

Starts two mock engines and a real router process (``--policy kv_aware``, one process)
whose ``--kv-events`` point at two publishers run here on loopback, speaking ZMTP byte by
byte:

- "huge": once armed, every connection gets a frame header announcing 2^40 bytes, then
  zeros for as long as it is read. The router's subscriber must drop the connection from
  the header (``--kv-events-max-frame-bytes``), count it and reconnect, its memory flat.
- "silent": publishes an event batch every 0.2 s and answers PINGs, then stops as a
  ``SIGSTOP``-ped engine does: no byte read or written, the connection left open, new
  connections accepted and never greeted. Then it resumes.

Prints the router's RSS before and after the huge frames, the frame cap, whether the
router still answers ``/health`` and a completion, the time from the stop until the
router's ``/metrics`` shows the silent worker's feed stale (and that worker estimated),
and the time from the resume until it is fresh again.

Run: python -m bench.zmtp_misbehave [--huge-s 5] [--stopped-s 3]
"""

from __future__ import annotations

import argparse
import asyncio
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import ExitStack
from typing import Any

import httpx
import psutil

from switchyard.loadtest.procs import Server, free_port
from switchyard.loadtest.prom import values
from switchyard.mock.engine.events import BlockStored, KVEventBatch
from switchyard.mock.kvevents import encode_batch
from switchyard.net.zmtp import HEARTBEAT_S, HEARTBEAT_TIMEOUT_S, MAX_FRAME_BYTES

MODEL = "mock-model"
GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\x00") + bytes(32)
CAP_PER_CONNECTION = 1 << 30  # zeros the huge publisher offers one connection at most


def _frame(body: bytes, flags: int = 0) -> bytes:
    if len(body) > 255:
        return bytes([flags | 0x02]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def _command(name: bytes, data: bytes = b"") -> bytes:
    return _frame(bytes([len(name)]) + name + data, 0x04)


READY = _command(b"READY", b"\x0bSocket-Type" + struct.pack(">I", 3) + b"PUB")


async def _read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    flags = (await reader.readexactly(1))[0]
    size_bytes = await reader.readexactly(8 if flags & 0x02 else 1)
    size = int.from_bytes(size_bytes, "big")
    return flags, await reader.readexactly(size)


async def _handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(GREETING + READY)
    await reader.readexactly(64)
    await _read_frame(reader)  # READY
    await _read_frame(reader)  # the subscription


async def _pongs(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        flags, body = await _read_frame(reader)
        if flags & 0x04 and body[1 : 1 + body[0]] == b"PING":
            writer.write(_command(b"PONG", body[1 + body[0] + 2 :]))


class Huge:
    """Behaves until armed; then announces 2^40 bytes on every connection and streams."""

    def __init__(self) -> None:
        self.armed = False
        self.connections = 0
        self.bytes_sent = 0
        self._writers: set[asyncio.StreamWriter] = set()

    def arm(self) -> None:
        self.armed = True
        for writer in list(self._writers):  # the router reconnects into the lie
            writer.close()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            await _handshake(reader, writer)
            if not self.armed:
                await _pongs(reader, writer)
                return
            self.connections += 1
            writer.write(bytes([0x02]) + (1 << 40).to_bytes(8, "big"))
            chunk = bytes(1 << 16)
            sent = 0
            while sent < CAP_PER_CONNECTION:
                writer.write(chunk)
                await writer.drain()
                sent += len(chunk)
                self.bytes_sent += len(chunk)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()


class Stoppable:
    """Publishes a batch every ``every_s`` and answers PINGs until stopped; stopped, it
    neither reads nor writes and greets no new connection; resumed, it behaves again."""

    def __init__(self, every_s: float = 0.2) -> None:
        self.every_s = every_s
        self.running = asyncio.Event()
        self.running.set()
        self.seq = 0

    def batch(self) -> bytes:
        tokens = list(range(self.seq * 16, self.seq * 16 + 16))
        stored = BlockStored([1_000_000 + self.seq], None, tokens, 16)
        payload = encode_batch(KVEventBatch(time.time(), [stored]))
        frames = [b"", self.seq.to_bytes(8, "big"), payload]
        self.seq += 1
        return b"".join(_frame(f, 0x01 if i < 2 else 0) for i, f in enumerate(frames))

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if not self.running.is_set():
                await self.running.wait()  # a stopped process: accepted, never greeted
                return  # the router gave this connection up long ago
            await _handshake(reader, writer)
            pongs = asyncio.ensure_future(self._pong_while_running(reader, writer))
            try:
                while self.running.is_set() and not pongs.done():
                    writer.write(self.batch())
                    await asyncio.sleep(self.every_s)
                await self.running.wait()
            finally:
                pongs.cancel()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _pong_while_running(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while True:
            await self.running.wait()  # stopped: the router's PINGs wait in the socket
            flags, body = await _read_frame(reader)
            if flags & 0x04 and body[1 : 1 + body[0]] == b"PING" and self.running.is_set():
                writer.write(_command(b"PONG", body[1 + body[0] + 2 :]))


class Publishers:
    """Both publishers on an event loop of their own thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.huge = Huge()
        self.silent: Stoppable
        self.ports: dict[str, int] = {}

    def start(self) -> Publishers:
        self.thread.start()
        self.call(self._start).result(10)
        return self

    async def _start(self) -> None:
        self.silent = Stoppable()
        for name, serve in (("huge", self.huge.serve), ("silent", self.silent.serve)):
            port = free_port()
            self._servers = getattr(self, "_servers", [])
            self._servers.append(await asyncio.start_server(serve, "127.0.0.1", port))
            self.ports[name] = port

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        async def run() -> Any:
            out = fn()
            return await out if asyncio.iscoroutine(out) else out

        return asyncio.run_coroutine_threadsafe(run(), self.loop)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def _metric(url: str, name: str, **labels: str) -> float | None:
    found = values(httpx.get(url + "/metrics", timeout=5).text, name, **labels)
    return sum(found) if found else None


def _wait(predicate: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> float | None:
    """Seconds until ``predicate`` held, polled every ``poll_s``; None past ``timeout_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if predicate():
            return time.monotonic() - t0
        time.sleep(poll_s)
    return None


def _answers(url: str) -> str:
    health = httpx.get(url + "/health", timeout=5).status_code
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    chat = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    ok = chat.status_code == 200 and bool(chat.json()["choices"][0]["message"]["content"])
    return f"/health {health}, completion {chat.status_code}{' ok' if ok else ' FAILED'}"


def run(huge_s: float, stopped_s: float) -> None:
    with ExitStack() as stack:
        pubs = Publishers().start()
        stack.callback(pubs.stop)
        engines = []
        for _ in range(2):
            port = free_port()
            argv = ["mock", "--port", str(port), "--model", MODEL, "--speed", "100"]
            engines.append(stack.enter_context(Server(argv, port).start()))
        huge_worker, silent_worker = (e.url for e in engines)
        port = free_port()
        argv = ["router", "--port", str(port), "--processes", "1", "--policy", "kv_aware"]
        argv += ["-w", huge_worker, "-w", silent_worker]
        argv += ["--kv-events", f"{huge_worker}=tcp://127.0.0.1:{pubs.ports['huge']}"]
        argv += ["--kv-events", f"{silent_worker}=tcp://127.0.0.1:{pubs.ports['silent']}"]
        router = stack.enter_context(Server(argv, port).start())
        assert router.proc is not None
        proc = psutil.Process(router.proc.pid)
        url = router.url

        def fresh() -> bool:
            stale = _metric(url, "switchyard_kvstore_feed_stale", instance=silent_worker)
            batches = _metric(url, "switchyard_kvstore_event_batches_total", instance=silent_worker)
            return stale == 0 and (batches or 0) > 0

        if _wait(fresh, 30) is None:
            raise SystemExit("the silent publisher's events never reached the router")
        print(f"frame cap: {MAX_FRAME_BYTES:,} bytes (default --kv-events-max-frame-bytes)")
        print(f"heartbeats: every {HEARTBEAT_S:g} s, dead after {HEARTBEAT_TIMEOUT_S:g} s")
        print(f"router: {_answers(url)}")

        rss_before = proc.memory_info().rss
        pubs.call(pubs.huge.arm).result(5)
        time.sleep(huge_s)  # the liar streams zeros at every connection meanwhile
        rss_after = proc.memory_info().rss
        dropped = _metric(
            url,
            "switchyard_kvstore_feed_disconnects_total",
            instance=huge_worker,
            reason="frame_too_large",
        )
        print(
            f"huge publisher, {huge_s:g} s: {pubs.huge.connections} connections announced "
            f"2^40 bytes, {pubs.huge.bytes_sent / 2**20:,.1f} MiB sent in all; "
            f"router dropped {int(dropped or 0)} for frame_too_large"
        )
        print(
            f"router RSS: {rss_before / 2**20:,.1f} MiB before, {rss_after / 2**20:,.1f} MiB "
            f"after ({(rss_after - rss_before) / 2**20:+,.1f} MiB)"
        )
        print(f"router: {_answers(url)}")

        pubs.call(pubs.silent.running.clear).result(5)

        def stale() -> bool:
            return _metric(url, "switchyard_kvstore_feed_stale", instance=silent_worker) == 1

        took = _wait(stale, 30)
        estimating = _metric(url, "switchyard_router_kv_estimating", worker=silent_worker)
        print(
            f"silent publisher stopped: feed stale after {took:.2f} s "
            f"(bound {HEARTBEAT_TIMEOUT_S + HEARTBEAT_S:g} s), "
            f"worker estimated: {estimating == 1}"
            if took is not None
            else "silent publisher stopped: feed NOT marked stale within 30 s"
        )
        print(f"router: {_answers(url)}")
        time.sleep(stopped_s)
        pubs.call(pubs.silent.running.set).result(5)
        back = _wait(fresh, 30)
        estimating = _metric(url, "switchyard_router_kv_estimating", worker=silent_worker)
        print(
            f"silent publisher resumed: feed fresh again after {back:.2f} s, "
            f"worker estimated: {estimating == 1}"
            if back is not None
            else "silent publisher resumed: feed NOT fresh within 30 s"
        )
        silent = _metric(
            url,
            "switchyard_kvstore_feed_disconnects_total",
            instance=silent_worker,
            reason="silent",
        )
        print(f"silent publisher: {int(silent or 0)} disconnect(s) for silence counted")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--huge-s", type=float, default=5.0, help="seconds of 2^40-byte frames")
    parser.add_argument("--stopped-s", type=float, default=3.0, help="seconds stopped")
    args = parser.parse_args()
    run(args.huge_s, args.stopped_s)


if __name__ == "__main__":
    main()
