"""Settings of the KV store (section ``kvstore``; env ``SWITCHYARD_KVSTORE_…``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from switchyard.core.settings import ServiceSettings
from switchyard.kvstore.keys import KEY_CACHE_BYTES
from switchyard.net.zmtp import HEARTBEAT_S, HEARTBEAT_TIMEOUT_S, MAX_FRAME_BYTES, ZmtpOptions

# Bound of the routing tokenizer's message and piece caches together. Here, not in
# ``tokenize``, so reading settings does not import a tokenizer library.
TOKENIZE_CACHE_BYTES = 256 << 20


def worker_url(url: str) -> str:
    """A worker base URL as the router names instances (scheme, no trailing slash)."""
    text = url.strip()
    text = (text if "://" in text else "http://" + text).rstrip("/")
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--worker {url!r}: expected http://HOST:PORT")
    return text


@dataclass(frozen=True, slots=True)
class Subscription:
    instance: str
    endpoint: str
    replay_endpoint: str | None = None
    flavor: str = "vllm"
    dp_rank: int = 0


_TCP = re.compile(r"^tcp://(\[[0-9a-fA-F:.]+\]|[^:/\s]+):\d{1,5}$")


def zmq_endpoint(endpoint: str) -> bool:
    """``tcp://HOST:PORT`` or ``ipc://PATH``."""
    return bool(_TCP.match(endpoint)) or (endpoint.startswith("ipc://") and len(endpoint) > 6)


def parse_subscription(spec: str) -> Subscription:
    """``[INSTANCE=]tcp://HOST:PORT[,replay=tcp://HOST:PORT][,flavor=sglang][,rank=N]``.

    Without ``INSTANCE=`` the endpoint names the instance itself.
    """
    bare = spec.strip().startswith(("tcp://", "ipc://"))
    instance, sep, rest = ("", "=", spec.strip()) if bare else spec.partition("=")
    if not sep or not rest:
        raise ValueError(
            f"--subscribe {spec!r}: expected [INSTANCE=]tcp://HOST:PORT[,replay=tcp://…]"
        )
    endpoint, *opts = [part.strip() for part in rest.split(",")]
    if not zmq_endpoint(endpoint):
        raise ValueError(f"--subscribe {spec!r}: the endpoint must be tcp://HOST:PORT")
    extra: dict[str, str] = {}
    for opt in opts:
        k, eq, v = opt.partition("=")
        if not eq or k not in ("replay", "flavor", "rank"):
            raise ValueError(f"--subscribe {spec!r}: unknown option {opt!r}")
        extra[k] = v
    if extra.get("flavor", "vllm") not in ("vllm", "sglang"):
        raise ValueError(f"--subscribe {spec!r}: flavor must be vllm or sglang")
    if not extra.get("rank", "0").isdigit():
        raise ValueError(f"--subscribe {spec!r}: rank must be a number")
    return Subscription(
        instance.strip() or endpoint,
        endpoint,
        extra.get("replay"),
        extra.get("flavor", "vllm"),
        int(extra.get("rank", "0")),
    )


# The memory index's bound; MemoryIndex built without settings uses the same value.
CAPACITY_BLOCKS = 2_000_000


class KVStoreSettings(ServiceSettings):
    section = "kvstore"
    headings = {
        "Service": ("host", "port", "api_key", "admin_api_key", "log_level"),
        "Event sources": (
            "subscription_hosts",
            "subscribe",
            "workers",
            "kv_listen",
            "events_max_frame_bytes",
            "events_heartbeat_s",
            "events_heartbeat_timeout_s",
        ),
        "Tokenization": ("tokenizer", "tokenize_url", "tokenize_cache_bytes", "key_cache_bytes"),
        "Index": (
            "redis_url",
            "redis_prefix",
            "redis_idle_ttl_s",
            "block_size",
            "seed",
            "capacity_blocks",
            "speculative_ttl_s",
            "lookup_timeout_ms",
        ),
    }
    model_config = SettingsConfigDict(env_prefix="SWITCHYARD_KVSTORE_", extra="ignore")

    host: str = Field(default="127.0.0.1", description="bind address")
    port: int = Field(default=8300, description="HTTP port")
    # Keys (one, or several separated by commas), sent as "Authorization: Bearer KEY".
    # admin_api_key guards events, subscriptions, placements and instance deletes (off
    # without it); api_key guards lookups (open without it; the admin key works too).
    api_key: str | None = Field(default=None, description="Bearer key for /v1/lookup")
    admin_api_key: str | None = Field(
        default=None,
        description="Bearer key for events, placements, subscriptions, instances (off without)",
    )
    # POST /v1/subscriptions connects only to loopback, the hosts of workers, subscribe and
    # kv_listen, and these (names, IPs or CIDRs; "*" for any host): see kvstore.allowlist.
    subscription_hosts: list[str] = Field(
        default=[], description="more hosts the subscription API may connect to (* for any)"
    )
    redis_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("redis_url", "redis"),
        description="redis://HOST:PORT/DB; the memory index when unset",
    )
    redis_prefix: str = Field(default="switchyard:kv:", description="key prefix in Redis")
    redis_idle_ttl_s: float = Field(default=3600.0, description="Redis entries idle this long go")
    subscribe: list[str] = Field(
        default=[],
        description="[INSTANCE=]tcp://HOST:PORT[,replay=ENDPOINT][,flavor=sglang][,rank=N]",
    )
    workers: list[str] = Field(
        default=[], description="worker URL whose /kv_event_sources (vLLM) names its publishers"
    )
    kv_listen: str | None = Field(
        default=None, description="tcp://HOST:PORT to bind for engines that connect their events"
    )
    events_max_frame_bytes: int = Field(
        default=MAX_FRAME_BYTES,
        gt=0,
        description="largest frame read from a publisher, bytes; one over it drops the connection",
    )
    events_heartbeat_s: float = Field(
        default=HEARTBEAT_S, gt=0, description="PING each publisher every N s"
    )
    events_heartbeat_timeout_s: float = Field(
        default=HEARTBEAT_TIMEOUT_S,
        gt=0,
        description="a publisher silent this long (no frame, no PONG) is dead: reconnect, "
        "its feed stale until it resyncs",
    )
    tokenizer: str | None = Field(
        default=None, description="HF tokenizer dir; else tokenize_url; else approximate"
    )
    tokenize_url: str | None = Field(default=None, description="engine base URL for /tokenize")
    tokenize_cache_bytes: int = Field(
        default=TOKENIZE_CACHE_BYTES,
        gt=0,
        description="memory for cached token ids of chat messages and prompt pieces, bytes",
    )
    key_cache_bytes: int = Field(
        default=KEY_CACHE_BYTES,
        gt=0,
        description="memory for cached block keys of prompts seen before, bytes",
    )
    # Tokens per KV block until an engine's events tell its own (the one default).
    block_size: int = Field(default=16, gt=0, description="KV block size until events tell")
    seed: int = Field(default=0, description="block-key hash seed")
    capacity_blocks: int = Field(
        default=CAPACITY_BLOCKS, gt=0, description="memory index bound (LRU), blocks"
    )
    speculative_ttl_s: float = Field(default=30.0, description="TTL of placement entries")
    lookup_timeout_ms: float = Field(default=20.0, description="lookups degrade after this")
    log_level: str = Field(default="warning", description="uvicorn log level")

    @field_validator("subscribe")
    @classmethod
    def _subscriptions_parse(cls, value: list[str]) -> list[str]:
        for spec in value:
            parse_subscription(spec)
        return value

    @field_validator("workers")
    @classmethod
    def _worker_urls(cls, value: list[str]) -> list[str]:
        return [worker_url(url) for url in value]

    @field_validator("kv_listen")
    @classmethod
    def _listen_endpoint(cls, value: str | None) -> str | None:
        if value is not None and not zmq_endpoint(value):
            raise ValueError(f"--kv-listen {value!r}: expected tcp://HOST:PORT")
        return value

    @model_validator(mode="after")
    def _heartbeats(self) -> KVStoreSettings:
        self.zmtp()
        return self

    def zmtp(self) -> ZmtpOptions:
        """The subscriptions' frame cap and heartbeats (``ValueError`` if they disagree)."""
        return ZmtpOptions(
            self.events_max_frame_bytes, self.events_heartbeat_s, self.events_heartbeat_timeout_s
        )

    def subscriptions(self) -> list[Subscription]:
        return [parse_subscription(s) for s in self.subscribe]
