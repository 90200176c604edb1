"""``RemoteKVStore``: the ``KVStore`` interface over HTTP, for ``--kvstore URL``.

Same methods as the embedded store. A kvstore service that is down or slow gives the
same answer as a Redis outage: "no information" (``degraded=True``), never an error.
Lookups and placements are on every routed request, so they go through the router's own
pool (``docs/decisions/0002-http-client.md``), not a general client.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import quote

import orjson

from switchyard.kvstore.index import Match
from switchyard.kvstore.settings import KVStoreSettings
from switchyard.kvstore.store import LookupResult
from switchyard.net.errors import TransportError
from switchyard.net.httpclient import ConnectionPool, Response

log = logging.getLogger("switchyard.kvstore.remote")

DEFAULT_BLOCK_SIZE: int = KVStoreSettings.model_fields["block_size"].default
# Connections to the service: lookups and placements of concurrent requests go in parallel.
_MAX_CONNECTIONS = 64
_KEEPALIVE_S = 30.0


class _Refused(Exception):
    """The service answered, but not with a 2xx."""


class RemoteKVStore:
    def __init__(
        self,
        url: str,
        *,
        block_size: int | None = None,
        timeout_s: float = 0.05,
        api_key: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        # Sent on every call; placements and instance clears need the service's admin key.
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        # The service's block size, from its /health; the settings default until then.
        self.block_size = block_size or DEFAULT_BLOCK_SIZE
        # Each call as a whole, waiting for a connection included.
        self.timeout_s = timeout_s
        self.degraded = False
        self._pool: ConnectionPool | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def _client(self) -> ConnectionPool:
        if self._pool is None:
            self._pool = ConnectionPool(
                connect_timeout_s=self.timeout_s,
                max_per_origin=_MAX_CONNECTIONS,
                keepalive_s=_KEEPALIVE_S,
            )
        return self._pool

    async def start(self) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                body = orjson.loads(await _body(await self._client().get(self.url + "/health")))
            self.block_size = int(body.get("block_size", self.block_size))
        except (TransportError, TimeoutError, ValueError, _Refused) as exc:
            log.warning("kvstore %s not reachable at start: %s", self.url, exc)

    async def stop(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    def _note(self, ok: bool, exc: BaseException | None = None) -> None:
        if ok and self.degraded:
            log.warning("kvstore %s is back", self.url)
        elif not ok and not self.degraded:
            log.warning("kvstore %s unreachable (%s); routing without cache info", self.url, exc)
        self.degraded = not ok

    async def _post(self, path: str, body: dict[str, Any]) -> bytes:
        if self._pool is None:
            await self.start()
        headers = {"content-type": "application/json", **self._headers}
        async with asyncio.timeout(self.timeout_s):
            answer = await self._client().post(self.url + path, orjson.dumps(body), headers)
            return await _body(answer)

    async def lookup(
        self,
        model: str | None,
        *,
        prompt: str | list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        token_ids: list[int] | None = None,
        candidates: list[str] | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> LookupResult:
        body = {
            "model": model,
            "prompt": prompt,
            "messages": messages,
            "token_ids": token_ids,
            "candidates": candidates,
            "lora_name": lora_name,
            "cache_salt": cache_salt,
            "include_keys": True,
        }
        try:
            raw = await self._post("/v1/lookup", {k: v for k, v in body.items() if v is not None})
        except (TransportError, TimeoutError, _Refused) as exc:
            self._note(False, exc)
            return LookupResult(self.block_size, 0, [], [], degraded=True)
        self._note(True)
        d = orjson.loads(raw)
        self.block_size = d["block_size"]
        return LookupResult(
            d["block_size"],
            d["total_tokens"],
            d.get("keys") or [],
            [
                Match(m["instance"], m["dp_rank"], m["tier"], m["matched_tokens"])
                for m in d["matches"]
            ],
            degraded=d.get("degraded", False),
            exact=d.get("exact", True),
            sized_keys={int(b): keys for b, keys in (d.get("sized_keys") or {}).items()},
            instance_block_sizes=d.get("instance_block_sizes") or {},
        )

    async def record_placement(
        self, keys: list[int], instance: str, dp_rank: int = 0, ttl_s: float | None = None
    ) -> None:
        body: dict[str, Any] = {"keys": keys, "instance": instance, "dp_rank": dp_rank}
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        try:
            await self._post("/v1/placements", body)
            self._note(True)
        except (TransportError, TimeoutError, _Refused) as exc:
            self._note(False, exc)

    async def clear_instance(self, instance: str, dp_rank: int | None = None) -> None:
        if self._pool is None:
            await self.start()
        url = f"{self.url}/v1/instances/{quote(instance, safe='')}"
        if dp_rank is not None:
            url += f"?dp_rank={dp_rank}"
        try:
            async with asyncio.timeout(self.timeout_s):
                await _body(await self._client().delete(url, self._headers))
            self._note(True)
        except (TransportError, TimeoutError, _Refused) as exc:
            self._note(False, exc)

    def subscribe(
        self,
        instance: str,
        endpoint: str,
        replay_endpoint: str | None = None,
        flavor: str = "vllm",
        dp_rank: int = 0,
    ) -> None:
        """Subscriptions belong to the service (its ``--subscribe``); refused here."""
        raise RuntimeError(
            f"a remote kvstore subscribes itself: start it with --subscribe {instance}={endpoint}"
        )


async def _body(answer: Response) -> bytes:
    """The whole body of a 2xx answer; ``_Refused`` for any other status."""
    try:
        body = await answer.read()
    finally:
        answer.close()
    if not 200 <= answer.status < 300:
        raise _Refused(f"HTTP {answer.status}")
    return body
