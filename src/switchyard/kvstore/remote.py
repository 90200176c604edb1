"""``RemoteKVStore``: the ``KVStore`` interface over HTTP, for ``--kvstore URL``.

Same methods as the embedded store. A kvstore service that is down or slow gives the
same answer as a Redis outage: "no information" (``degraded=True``), never an error.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import quote

import httpx
import orjson

from switchyard.kvstore.index import Match
from switchyard.kvstore.settings import KVStoreSettings
from switchyard.kvstore.store import LookupResult
from switchyard.net.control import async_client

log = logging.getLogger("switchyard.kvstore.remote")

DEFAULT_BLOCK_SIZE: int = KVStoreSettings.model_fields["block_size"].default
# Connections to the service: lookups and placements of concurrent requests go in parallel.
_LIMITS = httpx.Limits(max_connections=64, max_keepalive_connections=64, keepalive_expiry=30.0)


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
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else None
        # The service's block size, from its /health; the settings default until then.
        self.block_size = block_size or DEFAULT_BLOCK_SIZE
        # Each call as a whole, waiting for a connection included.
        self.timeout_s = timeout_s
        self.degraded = False
        self._session: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        if self._session is None:
            self._session = async_client(
                limits=_LIMITS, timeout=self.timeout_s, headers=self._headers
            )
        try:
            async with asyncio.timeout(self.timeout_s):
                r = await self._session.get(self.url + "/health")
            body = orjson.loads(r.content)
            self.block_size = int(body.get("block_size", self.block_size))
        except (httpx.HTTPError, TimeoutError, ValueError) as exc:
            log.warning("kvstore %s not reachable at start: %s", self.url, exc)

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.aclose()
            self._session = None

    def _note(self, ok: bool, exc: BaseException | None = None) -> None:
        if ok and self.degraded:
            log.warning("kvstore %s is back", self.url)
        elif not ok and not self.degraded:
            log.warning("kvstore %s unreachable (%s); routing without cache info", self.url, exc)
        self.degraded = not ok

    async def _post(self, path: str, body: dict[str, Any]) -> bytes:
        if self._session is None:
            await self.start()
        assert self._session is not None
        async with asyncio.timeout(self.timeout_s):
            r = await self._session.post(
                self.url + path,
                content=orjson.dumps(body),
                headers={"content-type": "application/json"},
            )
        r.raise_for_status()
        return r.content

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
        except (httpx.HTTPError, TimeoutError) as exc:
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
        except (httpx.HTTPError, TimeoutError) as exc:
            self._note(False, exc)

    async def clear_instance(self, instance: str, dp_rank: int | None = None) -> None:
        if self._session is None:
            await self.start()
        assert self._session is not None
        params = {} if dp_rank is None else {"dp_rank": str(dp_rank)}
        try:
            async with asyncio.timeout(self.timeout_s):
                r = await self._session.delete(
                    f"{self.url}/v1/instances/{quote(instance, safe='')}", params=params
                )
            r.raise_for_status()
            self._note(True)
        except (httpx.HTTPError, TimeoutError) as exc:
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
