"""Router settings: flags over SWITCHYARD_ROUTER_* environment over the YAML file's `router:`."""

from __future__ import annotations

from typing import Any

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from router.pd.settings import PDSettings
from switchyard.settings import ServiceSettings


class RouterSettings(ServiceSettings):
    section = "router"
    model_config = SettingsConfigDict(
        env_prefix="SWITCHYARD_ROUTER_", extra="ignore", env_nested_delimiter="__"
    )

    host: str = "127.0.0.1"
    port: int = 8000
    workers: list[str] = Field(default_factory=list, description="worker URLs (WorkerSpec syntax)")
    policy: str = "kv_aware"
    policy_options: dict[str, Any] = Field(default_factory=dict)
    api_key: str | None = None
    admin_api_key: str | None = None

    connect_timeout_s: float = 3.0
    first_byte_timeout_s: float = 600.0
    idle_timeout_s: float = 120.0
    max_body_bytes: int = 32 * 1024 * 1024

    max_attempts: int = 3
    retry_backoff_s: float = 0.02
    retry_backoff_max_s: float = 0.5
    retry_after_s: int = 1

    max_connections_per_worker: int = 0  # 0 = unbounded pool
    processes: int = Field(default=1, ge=1, description="router processes sharing the port")
    log_level: str = "warning"

    # KV-aware routing: where prefix knowledge comes from.
    tokenizer: str | None = Field(default=None, description="HF tokenizer dir for routing")
    kv_events: list[str] = Field(
        default_factory=list, description="WORKER_URL=tcp://HOST:PORT: who publishes KV events"
    )
    kvstore: str = Field(default="embedded", description="'embedded' or a kvstore service URL")
    balancer: str = Field(default="embedded", description="'embedded' or a balancer service URL")
    kvstore_api_key: str | None = Field(
        default=None,
        description="key sent to the kvstore service: its admin_api_key (placements need it)",
    )
    balancer_api_key: str | None = Field(
        default=None,
        description="key sent to the balancer service: its admin_api_key to add workers, "
        "else its api_key",
    )
    redis: str | None = Field(default=None, description="shared state for router replicas")
    block_size: int = 16
    speculative_ttl_s: float = 30.0
    event_lag_ttl_s: float = 2.0  # placements bridge the wait for engines' KV events

    # SLO-aware admission (Mooncake-style early rejection).
    slo_ttft_ms: float | None = None
    admission_max_wait_ms: float = 250.0

    # Disaggregated serving (prefill/decode/encode pools and the engine protocol).
    pd: PDSettings = Field(default_factory=PDSettings)
