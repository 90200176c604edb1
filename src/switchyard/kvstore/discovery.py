"""Where an engine publishes its KV events, asked of the engine itself.

vLLM serves ``GET /kv_event_sources``: a JSON object from DP rank (``"0"``, ``"1"``, …)
to that rank's events configuration (``endpoint``, ``replay_endpoint``, ``topic``,
``publisher``, …), the endpoints already offset by the rank. A wildcard host
(``tcp://*:5557``, ``tcp://[::]:5557``) means the engine bound the socket, so it is
reached at the worker's own host. Any other ``tcp://HOST:PORT`` is where the engine
connects to a collector (llm-d's layout), unless vLLM resolved ``tcp://*:0`` to its
node address; a subscriber connects there too, which is harmless when no one binds.
An engine without the route (SGLang, older vLLM) answers 404: it has no sources to find.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from switchyard.kvstore.settings import worker_url as worker_url
from switchyard.net.control import async_client

log = logging.getLogger("switchyard.kvstore.discovery")

SOURCES_PATH = "/kv_event_sources"


@dataclass(frozen=True, slots=True)
class EventSource:
    """One DP rank's publisher, as a subscriber reaches it."""

    instance: str
    dp_rank: int
    endpoint: str
    replay_endpoint: str | None
    topic: str
    engine_binds: bool


def _host_of(url: str) -> str:
    host = urlsplit(url if "://" in url else "http://" + url).hostname or "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def engine_binds(endpoint: str) -> bool:
    """vLLM binds wildcard, ipc and inproc endpoints and connects to every other one."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def reachable(endpoint: str, worker_url: str) -> str:
    """The endpoint with a wildcard host replaced by the worker's host."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    rest = endpoint[len("tcp://") :]
    host, sep, port = rest.rpartition(":")
    if not sep:
        return endpoint
    if host in ("*", "0.0.0.0", "[::]", "::", "[::0]"):
        return f"tcp://{_host_of(worker_url)}:{port}"
    return endpoint


def parse_sources(instance: str, body: Any) -> list[EventSource]:
    """The ranks of a ``/kv_event_sources`` answer that publish over ZMQ."""
    if not isinstance(body, dict):
        raise ValueError(f"{instance}{SOURCES_PATH}: expected an object, got {type(body).__name__}")
    out: list[EventSource] = []
    for rank_text, config in body.items():
        if not isinstance(config, dict):
            raise ValueError(f"{instance}{SOURCES_PATH}: rank {rank_text} is not an object")
        try:
            rank = int(rank_text)
        except ValueError as exc:
            raise ValueError(f"{instance}{SOURCES_PATH}: rank {rank_text!r} is no number") from exc
        publisher = config.get("publisher") or (
            "zmq" if config.get("enable_kv_cache_events") else "null"
        )
        endpoint = config.get("endpoint")
        if publisher != "zmq" or not isinstance(endpoint, str) or endpoint.startswith("inproc"):
            continue
        replay = config.get("replay_endpoint")
        out.append(
            EventSource(
                instance=instance,
                dp_rank=rank,
                endpoint=reachable(endpoint, instance),
                replay_endpoint=reachable(replay, instance) if isinstance(replay, str) else None,
                topic=str(config.get("topic") or ""),
                engine_binds=engine_binds(endpoint),
            )
        )
    return sorted(out, key=lambda s: s.dp_rank)


async def fetch_sources(
    client: httpx.AsyncClient, url: str, timeout_s: float = 2.0
) -> list[EventSource] | None:
    """The worker's sources; ``[]`` when it has none, ``None`` when it did not answer."""
    try:
        async with asyncio.timeout(timeout_s):
            r = await client.get(url.rstrip("/") + SOURCES_PATH)
        if r.status_code in (404, 405):
            return []
        if r.status_code != 200:
            return None
        body = r.json()
    except (httpx.HTTPError, TimeoutError, ValueError):
        return None
    try:
        return parse_sources(url.rstrip("/"), body)
    except ValueError as exc:
        log.warning("%s", exc)
        return []


Found = Callable[[str, list[EventSource]], None]


class SourceDiscovery:
    """Asks each watched worker for its sources until it answers, then reports them once.

    A worker that is still starting (vLLM takes a minute) is asked again every
    ``retry_s``, up to ``retry_max_s`` apart; an answer, even an empty one, ends it.
    """

    def __init__(self, found: Found, *, retry_s: float = 1.0, retry_max_s: float = 10.0) -> None:
        self.found = found
        self.retry_s = retry_s
        self.retry_max_s = retry_max_s
        self.sources: dict[str, list[EventSource]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._client: httpx.AsyncClient | None = None

    def watch(self, url: str, rank_urls: list[str] | None = None) -> None:
        """Discover ``url`` (and the per-rank API servers of an external-DP worker)."""
        if url in self._tasks and not self._tasks[url].done():
            return
        self._tasks[url] = asyncio.get_running_loop().create_task(
            self._discover(url, rank_urls or []), name=f"kv-discover {url}"
        )

    def forget(self, url: str) -> None:
        task = self._tasks.pop(url, None)
        if task is not None:
            task.cancel()
        self.sources.pop(url, None)

    async def _discover(self, url: str, rank_urls: list[str]) -> None:
        delay = self.retry_s
        while True:
            if self._client is None:
                self._client = async_client()
            answers = [await fetch_sources(self._client, u) for u in [url, *rank_urls]]
            if all(a is not None for a in answers):
                # Sources of a worker are named by the worker, whichever server answered.
                found = {
                    s.dp_rank: EventSource(
                        url, s.dp_rank, s.endpoint, s.replay_endpoint, s.topic, s.engine_binds
                    )
                    for a in answers
                    for s in a or []
                }
                sources = [found[r] for r in sorted(found)]
                self.sources[url] = sources
                if sources:
                    log.info("%s: KV events from %d rank(s) discovered", url, len(sources))
                self.found(url, sources)
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.retry_max_s)

    async def wait(self) -> None:
        """Until every pending discovery has answered (tests, tools)."""
        pending = [t for t in self._tasks.values() if not t.done()]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()
        if self._client is not None:
            await self._client.aclose()
            self._client = None
