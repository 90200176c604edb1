"""Balancer settings: one place for every threshold, so tests and YAML tune the same knobs."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field
from pydantic_settings import SettingsConfigDict

from switchyard.settings import ServiceSettings

DpPolicy = Literal["round_robin", "least_requests", "minimum_tokens", "step_balanced"]


class BalancerSettings(ServiceSettings):
    """Health, circuit breaking, outlier ejection, load model, DP policy and registry sources."""

    section = "balancer"
    # The prefix applies to aliases too: old names keep their SWITCHYARD_BALANCER_ variable.
    model_config = SettingsConfigDict(
        env_prefix="SWITCHYARD_BALANCER_", extra="ignore", env_prefix_target="all"
    )

    # Service
    host: str = "127.0.0.1"
    port: int = 8100
    # Keys (one, or several separated by commas), sent as "Authorization: Bearer KEY".
    # The admin API is off without admin_api_key; the data API (picks, tickets, workers)
    # is open without api_key and then also takes the admin key.
    admin_api_key: str | None = Field(
        default=None, validation_alias=AliasChoices("admin_api_key", "admin_key")
    )
    api_key: str | None = None

    # Registry sources
    workers: list[str] = []
    workers_file: str | None = None
    file_poll_interval: float = 1.0
    kubernetes: bool = False
    kubernetes_host: str | None = None
    kubernetes_namespace: str = "default"
    kubernetes_selector: str = "app.kubernetes.io/part-of=switchyard"
    kubernetes_port: int = 8000
    kubernetes_watch_timeout: int = 30

    # Active probes
    probe_interval: float = 2.0
    probe_timeout: float = 1.0
    probe_path: str = "/health"
    unhealthy_threshold: int = 1
    healthy_threshold: int = 2
    model_refresh_interval: float = 30.0

    # Circuit breaker (passive)
    cb_failure_threshold: int = 3
    cb_open_timeout: float = 5.0
    cb_half_open_trials: int = 1
    cb_success_threshold: int = 1

    # Outlier ejection by error rate
    outlier_window: int = 50
    outlier_min_requests: int = 20
    outlier_error_rate: float = 0.5
    outlier_ejection_time: float = 30.0
    outlier_max_ejected_fraction: float = 0.5

    # Slow start for new or recovered workers
    slow_start_seconds: float = 0.0
    slow_start_min_weight: float = 0.1

    # Engine metrics scrape
    scrape_interval: float = 1.0
    scrape_timeout: float = 1.0
    scrape_staleness: float = 5.0
    kv_usage_weight: float = 4.0

    # DP rank choice and its step-time model, in µs: per running sequence, per context
    # token attended, per prefill token within the step's token budget. Defaults are the
    # mock engine's BLIS-fit terms (Llama-3.1-8B on H100), so only their ratios matter.
    dp_policy: DpPolicy = "step_balanced"
    step_seq_cost: float = 6.0
    step_context_token_cost: float = 0.04
    step_prefill_token_cost: float = 17.25
    step_token_budget: int = 8192

    # Redis sharing across router replicas
    redis_url: str | None = None
    redis_prefix: str = "switchyard:balancer"
    lease_seconds: float = 3.0
    sync_interval: float = 0.25

    # Tickets handed out by the service (`POST /v1/pick`) that are never ended expire.
    ticket_ttl: float = 600.0
