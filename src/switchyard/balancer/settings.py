"""Balancer settings: one place for every threshold, so tests and YAML tune the same knobs."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field
from pydantic_settings import SettingsConfigDict

from switchyard.core.settings import ServiceSettings

DpPolicy = Literal["round_robin", "least_requests", "minimum_tokens", "step_balanced"]


class BalancerSettings(ServiceSettings):
    """Health, circuit breaking, outlier ejection, load model, DP policy and registry sources."""

    section = "balancer"
    headings = {
        "Service": ("host", "port", "log_level", "admin_api_key", "api_key"),
        "Registry sources": (
            "workers",
            "workers_file",
            "file_poll_interval_s",
            "kubernetes",
            "kubernetes_host",
            "kubernetes_namespace",
            "kubernetes_selector",
            "kubernetes_port",
            "kubernetes_watch_timeout_s",
        ),
        "Active probes": (
            "probe_interval_s",
            "probe_timeout_s",
            "probe_path",
            "unhealthy_threshold",
            "healthy_threshold",
            "probe_budget_per_s",
            "probe_max_interval_s",
            "model_refresh_interval_s",
            "model_refresh_on_miss_s",
        ),
        "Circuit breaker": (
            "cb_failure_threshold",
            "cb_open_timeout_s",
            "cb_half_open_trials",
            "cb_success_threshold",
        ),
        "Outlier ejection and slow start": (
            "outlier_window",
            "outlier_min_requests",
            "outlier_error_rate",
            "outlier_ejection_s",
            "outlier_max_ejected_fraction",
            "slow_start_s",
            "slow_start_min_weight",
        ),
        "Load": (
            "scrape_interval_s",
            "scrape_timeout_s",
            "scrape_staleness_s",
            "kv_usage_weight",
            "dp_policy",
            "step_seq_cost_us",
            "step_context_token_cost_us",
            "step_prefill_token_cost_us",
            "step_token_budget",
        ),
        "Shared state": (
            "redis_url",
            "redis_prefix",
            "lease_s",
            "sync_interval_s",
            "sibling_sync_interval_s",
            "ticket_ttl_s",
        ),
    }
    # The prefix applies to aliases too: old names keep their SWITCHYARD_BALANCER_ variable.
    model_config = SettingsConfigDict(
        env_prefix="SWITCHYARD_BALANCER_", extra="ignore", env_prefix_target="all"
    )

    # Service
    host: str = Field(default="127.0.0.1", description="bind address")
    port: int = Field(default=8100, description="bind port")
    log_level: str = Field(default="warning", description="uvicorn log level")
    # Keys (one, or several separated by commas), sent as "Authorization: Bearer KEY".
    # The admin API is off without admin_api_key; the data API (picks, tickets, workers)
    # is open without api_key and then also takes the admin key.
    admin_api_key: str | None = Field(
        default=None,
        validation_alias=AliasChoices("admin_api_key", "admin_key"),
        description="Bearer key for /admin (the admin API is off without it)",
    )
    api_key: str | None = Field(
        default=None, description="Bearer key for picks, tickets and /v1/workers"
    )

    # Registry sources
    workers: list[str] = Field(
        default=[], description="worker, repeatable: 'http://h:p;role=prefill;dp=4'"
    )
    workers_file: str | None = Field(default=None, description="watched YAML/JSON worker list")
    file_poll_interval_s: float = Field(
        default=1.0,
        validation_alias=AliasChoices("file_poll_interval_s", "file_poll_interval"),
        description="seconds between reads of workers_file",
    )
    kubernetes: bool = Field(default=False, description="discover engine pods in Kubernetes")
    kubernetes_host: str | None = Field(
        default=None, description="Kubernetes API URL (default: in-cluster or kubeconfig)"
    )
    kubernetes_namespace: str = Field(default="default", description="namespace to watch")
    kubernetes_selector: str = Field(
        default="app.kubernetes.io/part-of=switchyard", description="pod label selector"
    )
    kubernetes_port: int = Field(default=8000, description="engine port on discovered pods")
    kubernetes_watch_timeout_s: int = Field(
        default=30,
        validation_alias=AliasChoices("kubernetes_watch_timeout_s", "kubernetes_watch_timeout"),
        description="one Kubernetes watch call",
    )

    # Active probes
    probe_interval_s: float = Field(
        default=2.0,
        validation_alias=AliasChoices("probe_interval_s", "probe_interval"),
        description="between active health probes",
    )
    probe_timeout_s: float = Field(
        default=1.0,
        validation_alias=AliasChoices("probe_timeout_s", "probe_timeout"),
        description="one health probe",
    )
    probe_path: str = Field(default="/health", description="health probe path")
    unhealthy_threshold: int = Field(default=1, description="failed probes before a worker leaves")
    healthy_threshold: int = Field(default=2, description="good probes before it returns")
    # Large fleets (balancer.probe): stable workers back off to workers / budget seconds.
    probe_budget_per_s: float = Field(
        default=100.0,
        gt=0,
        description="probes (and idle scrapes) per second a large fleet is spread to",
    )
    probe_max_interval_s: float = Field(
        default=30.0,
        gt=0,
        description="longest probe or idle-scrape interval of a stable worker",
    )
    model_refresh_interval_s: float = Field(
        default=30.0,
        validation_alias=AliasChoices("model_refresh_interval_s", "model_refresh_interval"),
        description="between /v1/models refreshes",
    )
    model_refresh_on_miss_s: float = Field(
        default=1.0,
        ge=0,
        description="least time between the re-reads of all workers' models that "
        "requests for an unlisted model cause",
    )

    # Circuit breaker (passive)
    cb_failure_threshold: int = Field(
        default=3, description="consecutive failures that open the circuit"
    )
    cb_open_timeout_s: float = Field(
        default=5.0,
        validation_alias=AliasChoices("cb_open_timeout_s", "cb_open_timeout"),
        description="open circuit before half-open trials",
    )
    cb_half_open_trials: int = Field(default=1, description="requests admitted while half-open")
    cb_success_threshold: int = Field(default=1, description="successes that close the circuit")

    # Outlier ejection by error rate
    outlier_window: int = Field(
        default=50, description="recent requests the error rate is taken over"
    )
    outlier_min_requests: int = Field(default=20, description="requests needed before ejecting")
    outlier_error_rate: float = Field(default=0.5, description="error rate that ejects a worker")
    outlier_ejection_s: float = Field(
        default=30.0,
        validation_alias=AliasChoices("outlier_ejection_s", "outlier_ejection_time"),
        description="how long an outlier stays ejected",
    )
    outlier_max_ejected_fraction: float = Field(
        default=0.5, description="never eject more of the fleet than this"
    )

    # Slow start for new or recovered workers
    slow_start_s: float = Field(
        default=0.0,
        validation_alias=AliasChoices("slow_start_s", "slow_start_seconds"),
        description="weight ramp of new or recovered workers",
    )
    slow_start_min_weight: float = Field(
        default=0.1, description="weight a slow-starting worker begins at"
    )

    # Engine metrics scrape
    scrape_interval_s: float = Field(
        default=1.0,
        validation_alias=AliasChoices("scrape_interval_s", "scrape_interval"),
        description="between engine /metrics scrapes",
    )
    scrape_timeout_s: float = Field(
        default=1.0,
        validation_alias=AliasChoices("scrape_timeout_s", "scrape_timeout"),
        description="one /metrics scrape",
    )
    scrape_staleness_s: float = Field(
        default=5.0,
        validation_alias=AliasChoices("scrape_staleness_s", "scrape_staleness"),
        description="scraped load older than this is ignored",
    )
    kv_usage_weight: float = Field(
        default=4.0, description="weight of engine KV usage in the load score"
    )

    # DP rank choice and its step-time model, in µs: per running sequence, per context
    # token attended, per prefill token within the step's token budget. Defaults are the
    # mock engine's BLIS-fit terms (Llama-3.1-8B on H100), so only their ratios matter.
    dp_policy: DpPolicy = Field(default="step_balanced", description="DP rank choice")
    step_seq_cost_us: float = Field(
        default=6.0,
        validation_alias=AliasChoices("step_seq_cost_us", "step_seq_cost"),
        description="step time per running sequence",
    )
    step_context_token_cost_us: float = Field(
        default=0.04,
        validation_alias=AliasChoices("step_context_token_cost_us", "step_context_token_cost"),
        description="step time per context token",
    )
    step_prefill_token_cost_us: float = Field(
        default=17.25,
        validation_alias=AliasChoices("step_prefill_token_cost_us", "step_prefill_token_cost"),
        description="step time per prefill token",
    )
    step_token_budget: int = Field(
        default=8192, description="per-step prefill token budget of the step model"
    )

    # Redis sharing across router replicas
    redis_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("redis_url", "redis"),
        description="Redis URL: share in-flight counts and admin changes",
    )
    redis_prefix: str = Field(default="switchyard:balancer", description="key prefix in Redis")
    lease_s: float = Field(
        default=3.0,
        validation_alias=AliasChoices("lease_s", "lease_seconds"),
        description="TTL of this instance's counts in Redis (and among a router's processes)",
    )
    sync_interval_s: float = Field(
        default=0.25,
        validation_alias=AliasChoices("sync_interval_s", "sync_interval"),
        description="between Redis syncs",
    )
    sibling_sync_interval_s: float = Field(
        default=0.25,
        gt=0,
        description="between syncs of in-flight counts among one router's processes, a "
        "keep-alive: every change is also sent at once",
    )

    # Tickets handed out by the service (`POST /v1/pick`) that are never ended expire.
    ticket_ttl_s: float = Field(
        default=600.0,
        validation_alias=AliasChoices("ticket_ttl_s", "ticket_ttl"),
        description="unended pick tickets expire after this",
    )
