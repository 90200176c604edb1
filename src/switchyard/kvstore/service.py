"""The KV store as its own service: FastAPI control plane, OpenAPI documented.

Lookups take ``api_key`` when one is set. Everything that changes the index or makes the
store connect somewhere (events, placements, subscriptions, instance deletes) and the
instance listing need ``admin_api_key``, and are off without it (see ``switchyard.core.auth``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Query, Request, Response
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from switchyard.core.auth import admin_access, data_access, startup_line
from switchyard.core.errors import APIError, install_error_handlers
from switchyard.kvstore.allowlist import EndpointAllowList
from switchyard.kvstore.events import EventDecodeError
from switchyard.kvstore.settings import KVStoreSettings, zmq_endpoint
from switchyard.kvstore.store import KVStore

log = logging.getLogger("switchyard.kvstore.service")

# Bounds of client-given numbers: a data-parallel rank, a placement's lifetime, token ids
# (uint32, as block keys hash them) and block keys (uint64).
MAX_DP_RANK = 4095
MAX_TTL_S = 86_400.0
TokenId = Annotated[int, Field(ge=0, lt=2**32)]
BlockKey = Annotated[int, Field(ge=0, lt=2**64)]


class ContentPart(BaseModel):
    """A chat content part as the router accepts it: a string ``type``; ``text`` a string."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """A chat message as the router accepts it: a string role; text or parts as content."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None


class LookupRequest(BaseModel):
    model: str | None = None
    prompt: str | list[TokenId] | None = Field(None, description="Completion prompt or token ids.")
    messages: list[ChatMessage] | None = Field(None, description="Chat messages.")
    token_ids: list[TokenId] | None = None
    candidates: list[str] | None = Field(None, description="Only these instances (base URLs).")
    lora_name: str | None = None
    cache_salt: str | None = None
    include_keys: bool = Field(False, description="Return the block keys (for placements).")


class MatchOut(BaseModel):
    instance: str
    dp_rank: int
    tier: str
    matched_tokens: int


class LookupResponse(BaseModel):
    block_size: int
    total_tokens: int
    matches: list[MatchOut]
    degraded: bool = False
    exact: bool = True
    keys: list[int] | None = None
    sized_keys: dict[int, list[int]] | None = Field(
        None, description="With include_keys, the keys at each other block size in use."
    )
    instance_block_sizes: dict[str, int] | None = Field(
        None, description="Candidates whose block size (learned from events) differs."
    )


class EventsPush(BaseModel):
    instance: str = Field(description="Engine base URL the events belong to.")
    seq: int | None = Field(None, description="Publisher sequence number, for gap detection.")
    dp_rank: int = 0
    batch: list[Any] | dict[str, Any] = Field(
        description="EventBatch as [ts, events, rank?] or {ts, events, data_parallel_rank}; "
        "events as tagged arrays or maps with 'type'; byte hashes as hex strings."
    )


class SubscriptionIn(BaseModel):
    instance: str = Field(max_length=2048)
    endpoint: str = Field(
        max_length=2048, description="The engine's ZMQ PUB endpoint, tcp://HOST:PORT."
    )
    replay_endpoint: str | None = Field(None, max_length=2048)
    flavor: Literal["vllm", "sglang"] = "vllm"
    dp_rank: int = Field(0, ge=0, le=MAX_DP_RANK)


class Placement(BaseModel):
    keys: list[BlockKey]
    instance: str = Field(max_length=2048)
    dp_rank: int = Field(0, ge=0, le=MAX_DP_RANK)
    ttl_s: float | None = Field(None, gt=0, le=MAX_TTL_S)


class LocationOut(BaseModel):
    dp_rank: int
    tier: str
    blocks: int


class FeedOut(BaseModel):
    source: str
    endpoint: str | None
    replay_endpoint: str | None
    last_seq: int | None
    last_ts: float | None
    gaps: int
    replays: int


class InstanceOut(BaseModel):
    instance: str
    locations: list[LocationOut]
    feeds: list[FeedOut]


def create_app(store: KVStore, settings: KVStoreSettings | None = None) -> FastAPI:
    """The service over ``store``; ``settings`` gives its keys (none: lookups open, admin off)."""
    settings = settings or KVStoreSettings()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        log.log(
            logging.INFO if settings.admin_api_key else logging.WARNING,
            startup_line("kvstore", settings.admin_api_key, settings.api_key),
        )
        await store.start()
        try:
            yield
        finally:
            await store.stop()

    app = FastAPI(
        title="Switchyard KV store",
        description="Cross-request KV-cache metadata: which engine holds which prefix.",
        lifespan=lifespan,
    )
    app.state.store = store
    install_error_handlers(app)
    lookups = [Depends(data_access(settings.api_key, settings.admin_api_key))]
    admin = [Depends(admin_access(settings.admin_api_key))]
    allowed = EndpointAllowList.from_settings(settings)

    @app.post("/v1/lookup", response_model=LookupResponse, dependencies=lookups)
    async def lookup(req: LookupRequest) -> LookupResponse:
        """Per engine location, the longest cached prefix of this request, in tokens."""
        if req.prompt is None and req.messages is None and req.token_ids is None:
            raise APIError(400, "One of prompt, messages or token_ids is required")
        messages = None
        if req.messages is not None:
            messages = [m.model_dump(exclude_unset=True) for m in req.messages]
        try:
            res = await store.lookup(
                req.model,
                prompt=req.prompt,
                messages=messages,
                token_ids=req.token_ids,
                candidates=req.candidates,
                lora_name=req.lora_name,
                cache_salt=req.cache_salt,
            )
        except TemplateError as exc:
            raise APIError(
                400, f"The chat template refused these messages: {exc}", param="messages"
            ) from exc
        return LookupResponse(
            block_size=res.block_size,
            total_tokens=res.total_tokens,
            matches=[
                MatchOut(
                    instance=m.instance,
                    dp_rank=m.dp_rank,
                    tier=m.tier,
                    matched_tokens=m.matched_tokens,
                )
                for m in res.matches
            ],
            degraded=res.degraded,
            exact=res.exact,
            keys=res.keys if req.include_keys else None,
            sized_keys=res.sized_keys if req.include_keys and res.sized_keys else None,
            instance_block_sizes=res.instance_block_sizes or None,
        )

    @app.post("/v1/events", status_code=204, dependencies=admin)
    async def push_events(
        request: Request,
        instance: str | None = Query(None, description="For msgpack bodies."),
        seq: int | None = Query(None, description="For msgpack bodies."),
        dp_rank: int = Query(0, description="For msgpack bodies."),
    ) -> Response:
        """Engine KV events pushed over HTTP: JSON ``EventsPush``, or the raw msgpack
        ``EventBatch`` payload (``Content-Type: application/msgpack``) with query params."""
        ctype = request.headers.get("content-type", "")
        try:
            if "msgpack" in ctype or "octet-stream" in ctype:
                if not instance:
                    raise APIError(
                        400, "The instance query parameter is required", param="instance"
                    )
                await store.ingest(instance, await request.body(), seq=seq, dp_rank=dp_rank)
            else:
                push = EventsPush.model_validate_json(await request.body())
                await store.ingest(push.instance, push.batch, seq=push.seq, dp_rank=push.dp_rank)
        except EventDecodeError as exc:
            store.metrics.decode_errors.inc()
            raise APIError(400, str(exc), code="event_decode_error") from exc
        except ValueError as exc:
            raise APIError(422, str(exc)) from exc
        return Response(status_code=204)

    @app.post("/v1/placements", status_code=204, dependencies=admin)
    async def placements(p: Placement) -> Response:
        """Speculative entries: the router sent these blocks to this engine."""
        await store.record_placement(p.keys, p.instance, p.dp_rank, p.ttl_s)
        return Response(status_code=204)

    @app.post("/v1/subscriptions", status_code=204, dependencies=admin)
    async def subscribe(sub: SubscriptionIn) -> Response:
        """Follow one more engine publisher (e.g. from the balancer's worker registry).

        Both endpoints must be on the allow-list (``kvstore.allowlist``): 403 otherwise."""
        for param, endpoint in (
            ("endpoint", sub.endpoint),
            ("replay_endpoint", sub.replay_endpoint),
        ):
            why = None if endpoint is None else allowed.refusal(endpoint)
            if why is not None:
                status = 400 if not zmq_endpoint(endpoint or "") else 403
                raise APIError(status, why, param=param, code="endpoint_not_allowed")
        try:
            store.subscribe(
                sub.instance, sub.endpoint, sub.replay_endpoint, sub.flavor, sub.dp_rank
            )
        except ValueError as exc:
            raise APIError(422, str(exc), param="endpoint") from exc
        return Response(status_code=204)

    @app.delete("/v1/subscriptions", status_code=204, dependencies=admin)
    async def unsubscribe(endpoint: str = Query(description="The publisher endpoint.")) -> Response:
        """Stop following a publisher (its indexed blocks stay until cleared)."""
        await store.unsubscribe(endpoint)
        return Response(status_code=204)

    @app.get("/v1/instances", response_model=list[InstanceOut], dependencies=admin)
    async def instances() -> list[InstanceOut]:
        """Known engine instances: indexed blocks per (rank, tier) and event feeds."""
        out: dict[str, InstanceOut] = {}
        for info in await store.locations():
            loc = info.location
            entry = out.setdefault(
                loc.instance, InstanceOut(instance=loc.instance, locations=[], feeds=[])
            )
            entry.locations.append(
                LocationOut(dp_rank=loc.dp_rank, tier=loc.tier, blocks=info.blocks)
            )
        for f in store.feeds():
            entry = out.setdefault(
                f.instance, InstanceOut(instance=f.instance, locations=[], feeds=[])
            )
            entry.feeds.append(
                FeedOut(
                    source=f.source,
                    endpoint=f.endpoint,
                    replay_endpoint=f.replay_endpoint,
                    last_seq=f.last_seq,
                    last_ts=f.last_ts,
                    gaps=f.gaps,
                    replays=f.replays,
                )
            )
        return sorted(out.values(), key=lambda i: i.instance)

    @app.delete("/v1/instances/{instance:path}", status_code=204, dependencies=admin)
    async def delete_instance(instance: str, dp_rank: int | None = None) -> Response:
        """Forget an instance's blocks (all ranks, or one)."""
        await store.clear_instance(instance, dp_rank)
        return Response(status_code=204)

    @app.get("/metrics")
    async def metrics() -> Response:
        await store.index_size()
        return Response(generate_latest(store.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "backend": store.index.kind,
            "degraded": store.degraded,
            "block_size": store.block_size,
        }

    return app
