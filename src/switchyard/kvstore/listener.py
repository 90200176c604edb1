"""One bound SUB socket for engines that connect (``--kv-listen tcp://HOST:PORT``).

vLLM connects its PUB socket instead of binding it when its endpoint names a host
(``tcp://collector:5557``): that is llm-d's layout, where every engine connects to one
collector and the ZMQ topic names the pod, ``kv@<pod-ip>@<model>``. Frames arrive as
``[topic, seq, payload]`` from all engines on one socket; the topic tells them apart,
so each topic is its own publisher (own sequence numbers, own block-hash map).

A topic names its instance (a worker base URL) in one of three ways, tried in order:
the worker's own ``/kv_event_sources`` listed it; it is a worker URL itself; it is
llm-d's ``kv@<ip>@<model>`` and exactly one known worker has that host.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import zmq

from switchyard.kvstore.events import decode_seq
from switchyard.net.zmqrecv import ZmqContext, messages

log = logging.getLogger("switchyard.kvstore.listener")

TopicHandler = Callable[[bytes, int, bytes], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class TopicSource:
    instance: str
    dp_rank: int = 0
    replay_endpoint: str | None = None


def _host(url: str) -> str | None:
    return urlsplit(url).hostname


def same_socket(a: str, b: str) -> bool:
    """Whether two tcp endpoints name the same socket of this machine (port and host)."""
    if not (a.startswith("tcp://") and b.startswith("tcp://")):
        return a == b
    ha, _, pa = a[6:].rpartition(":")
    hb, _, pb = b[6:].rpartition(":")
    local = {"*", "0.0.0.0", "127.0.0.1", "localhost", "[::]", "[::1]"}
    return pa == pb and (ha == hb or ha in local or hb in local)


class TopicMap:
    """Which instance (and DP rank) a topic's events belong to."""

    def __init__(self) -> None:
        self.by_topic: dict[str, TopicSource] = {}
        self.workers: set[str] = set()

    def map(
        self, topic: str, instance: str, dp_rank: int = 0, replay_endpoint: str | None = None
    ) -> None:
        if topic:
            self.by_topic[topic] = TopicSource(instance, dp_rank, replay_endpoint)

    def add_worker(self, url: str) -> None:
        self.workers.add(url)

    def remove_worker(self, url: str) -> None:
        self.workers.discard(url)
        for topic in [t for t, s in self.by_topic.items() if s.instance == url]:
            del self.by_topic[topic]

    def resolve(self, topic: str) -> TopicSource | None:
        found = self.by_topic.get(topic)
        if found is not None:
            return found
        if topic.startswith(("http://", "https://")):
            return TopicSource(topic.rstrip("/"))
        parts = topic.split("@")
        if len(parts) >= 2 and parts[0] == "kv":
            ip = parts[1].strip("[]")
            owners = [w for w in self.workers if _host(w) == ip]
            if len(owners) == 1:
                return TopicSource(owners[0])
            if not self.workers:
                # No fleet to match against (a standalone kvstore): the topic names itself.
                return TopicSource(topic)
        return None


class Listener:
    """Receives every connecting engine's frames on one bound socket."""

    def __init__(self, ctx: ZmqContext, endpoint: str, on_frame: TopicHandler) -> None:
        self._ctx = ctx
        self.endpoint = endpoint
        self._on_frame = on_frame
        self._task: asyncio.Task[None] | None = None
        self._bound = asyncio.Event()
        self.error: BaseException | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"kv-listen {self.endpoint}")

    async def bound(self) -> None:
        """Until the socket is bound; raises what binding raised."""
        await self._bound.wait()
        if self.error is not None:
            raise self.error

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            sock.bind(self.endpoint)
        except zmq.ZMQError as exc:
            self.error = OSError(f"--kv-listen {self.endpoint}: cannot bind: {exc}")
            log.error("%s", self.error)
            self._bound.set()
            sock.close(linger=0)
            return
        self._bound.set()
        try:
            async for frames in messages(sock):
                if len(frames) < 3:
                    continue
                try:
                    await self._on_frame(frames[0], decode_seq(frames[-2]), frames[-1])
                except Exception:
                    log.exception("%s: event handling failed", frames[0].decode(errors="replace"))
        finally:
            sock.close(linger=0)
