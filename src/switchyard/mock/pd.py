"""Prefill/decode disaggregation on the wire, as vLLM's NixlConnector and SGLang's PD do it.

vLLM flow (toy proxy ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``):
the prefill engine gets ``kv_transfer_params.do_remote_decode=true`` and answers with
``kv_transfer_params`` = ``{do_remote_prefill: true, do_remote_decode: false,
remote_engine_id, remote_block_ids, remote_host, remote_port, remote_request_id,
tp_size}``, holding the blocks; the decode engine gets those params and "pulls".
Real NIXL reads GPU memory over RDMA; the mock's pull is ``POST /internal/kv/pull``
on ``remote_host:remote_port`` (the prefill mock's HTTP port, our own endpoint) with
``{"request_id", "block_ids"}``, which releases the held blocks.

SGLang flow (``sglang/srt/disaggregation/mini_lb.py``): both legs carry
``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room``. The prefill mock serves
``POST /bootstrap/pull`` ``{"room", "timeout_s"}`` on its bootstrap port (our own
endpoint; the real one serves ``/route`` for rank registration and moves KV over
Mooncake/NIXL): it waits for the room's prefill, releases its blocks and answers
``{"room", "num_tokens", "block_ids"}``; 504 if the prefill never came.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from switchyard.net.errors import TransportError
from switchyard.net.httpclient import ConnectionPool

_JSON = {"content-type": "application/json"}


class PullError(Exception):
    """The decode side could not get the prefilled KV (expired, unknown, timed out)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Held:
    rank: int
    block_ids: list[int]
    num_tokens: int
    since: float = field(default_factory=time.monotonic)


@dataclass
class Room:
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    request_id: str = ""
    held: Held | None = None
    since: float = field(default_factory=time.monotonic)


class HeldKV:
    """Prefill side: which request holds which blocks on which rank, and the SGLang rooms."""

    def __init__(self, hold_timeout_s: float) -> None:
        self.hold_timeout_s = hold_timeout_s
        self._by_request: dict[str, Held] = {}
        self._rooms: dict[int, Room] = {}

    def _prune(self) -> None:
        cutoff = time.monotonic() - self.hold_timeout_s
        for rid in [r for r, h in self._by_request.items() if h.since < cutoff]:
            del self._by_request[rid]
        for room in [k for k, r in self._rooms.items() if r.since < cutoff]:
            del self._rooms[room]

    def hold(self, request_id: str, held: Held, room: int | None = None) -> None:
        self._prune()
        self._by_request[request_id] = held
        if room is not None:
            entry = self._rooms.setdefault(room, Room())
            entry.request_id, entry.held = request_id, held
            entry.ready.set()

    def take(self, request_id: str) -> Held | None:
        return self._by_request.pop(request_id, None)

    async def take_room(self, room: int, timeout_s: float) -> tuple[str, Held]:
        """Wait for the prefill of ``room``; return and forget its held KV."""
        entry = self._rooms.setdefault(room, Room())
        try:
            await asyncio.wait_for(entry.ready.wait(), timeout_s)
        except TimeoutError:
            self._rooms.pop(room, None)
            raise PullError(504, f"bootstrap room {room}: no prefill within {timeout_s}s") from None
        self._rooms.pop(room, None)
        held = self._by_request.pop(entry.request_id, None) or entry.held
        if held is None:
            raise PullError(410, f"bootstrap room {room}: held KV already released")
        return entry.request_id, held


class KVPuller:
    """Decode side: the HTTP calls that stand in for the KV transfer, one POST of JSON to
    the peer per request, through the router's own client (``switchyard.net.httpclient``)."""

    def __init__(self) -> None:
        self._pool: ConnectionPool | None = None

    async def _post(self, url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        if self._pool is None:  # made on the serving loop; unbounded, each call has its timeout
            self._pool = ConnectionPool(connect_timeout_s=timeout_s)
        try:
            async with asyncio.timeout(timeout_s):
                resp = await self._pool.post(url, orjson.dumps(body), _JSON)
                try:
                    raw = await resp.read()
                finally:
                    resp.close()
        except (TransportError, TimeoutError) as exc:
            raise PullError(502, f"KV pull from {url} failed: {exc!r}") from exc
        data: Any = orjson.loads(raw) if raw else None
        if resp.status != 200:
            message = data.get("error", {}).get("message", "") if data else ""
            raise PullError(resp.status, f"KV pull from {url} failed: {message}")
        return data

    async def pull_vllm(self, params: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        host, port = params.get("remote_host"), params.get("remote_port")
        if not host or not port:
            raise PullError(400, "kv_transfer_params lacks remote_host/remote_port")
        body = {
            "request_id": params.get("remote_request_id"),
            "block_ids": params.get("remote_block_ids") or [],
            "engine_id": params.get("remote_engine_id"),
        }
        return await self._post(f"http://{host}:{port}/internal/kv/pull", body, timeout_s)

    async def pull_sglang(
        self, host: str, port: int, room: int, timeout_s: float
    ) -> dict[str, Any]:
        body = {"room": room, "timeout_s": timeout_s}
        return await self._post(f"http://{host}:{port}/bootstrap/pull", body, timeout_s + 5.0)

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None
