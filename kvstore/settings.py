"""Settings of the KV store (section ``kvstore``; env ``SWITCHYARD_KVSTORE_…``)."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic_settings import SettingsConfigDict

from switchyard.settings import ServiceSettings


@dataclass(frozen=True, slots=True)
class Subscription:
    instance: str
    endpoint: str
    replay_endpoint: str | None = None
    flavor: str = "vllm"
    dp_rank: int = 0


def parse_subscription(spec: str) -> Subscription:
    """``INSTANCE=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,flavor=sglang][,rank=N]``."""
    instance, sep, rest = spec.partition("=")
    if not sep or not rest:
        raise ValueError(f"subscription {spec!r}: expected INSTANCE=tcp://HOST:PORT[,replay=…]")
    endpoint, *opts = rest.split(",")
    extra: dict[str, str] = {}
    for opt in opts:
        k, eq, v = opt.partition("=")
        if not eq or k not in ("replay", "flavor", "rank"):
            raise ValueError(f"subscription {spec!r}: unknown option {opt!r}")
        extra[k] = v
    return Subscription(
        instance.strip(),
        endpoint.strip(),
        extra.get("replay"),
        extra.get("flavor", "vllm"),
        int(extra.get("rank", "0")),
    )


class KVStoreSettings(ServiceSettings):
    section = "kvstore"
    model_config = SettingsConfigDict(env_prefix="SWITCHYARD_KVSTORE_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8300
    # Keys (one, or several separated by commas), sent as "Authorization: Bearer KEY".
    # admin_api_key guards events, subscriptions, placements and instance deletes (off
    # without it); api_key guards lookups (open without it; the admin key works too).
    api_key: str | None = None
    admin_api_key: str | None = None
    redis: str | None = None  # redis://host:port/db; memory index when unset
    redis_prefix: str = "switchyard:kv:"
    redis_idle_ttl_s: float = 3600.0
    subscribe: list[str] = []
    tokenizer: str | None = None  # HF dir; else engine /tokenize; else approximate
    tokenize_url: str | None = None
    block_size: int = 16
    seed: int = 0
    capacity_blocks: int = 2_000_000
    speculative_ttl_s: float = 30.0
    lookup_timeout_ms: float = 20.0
    log_level: str = "warning"

    def subscriptions(self) -> list[Subscription]:
        return [parse_subscription(s) for s in self.subscribe]
