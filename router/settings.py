"""Router settings: flags over SWITCHYARD_ROUTER_* environment over the YAML file's `router:`."""

from __future__ import annotations

from typing import Any

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from switchyard.settings import ServiceSettings


class RouterSettings(ServiceSettings):
    section = "router"
    model_config = SettingsConfigDict(
        env_prefix="SWITCHYARD_ROUTER_", extra="ignore", env_nested_delimiter="__"
    )

    host: str = "127.0.0.1"
    port: int = 8000
    workers: list[str] = Field(default_factory=list, description="worker URLs (WorkerSpec syntax)")
    policy: str = "round_robin"
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
    log_level: str = "warning"
