"""Router settings: flags over SWITCHYARD_ROUTER_* environment over the YAML file's `router:`.

The knobs come in groups, each one value with its own repr (``settings.timeouts``,
``settings.limits``, ``settings.retry``, ``settings.migration``, ``settings.tls``,
``settings.admission``, ``settings.kv``, ``settings.flow``, ``settings.tracing``,
``settings.pd``), so a reader
sees the eight timeouts as one thing.
"""

from __future__ import annotations

import math
import os
import ssl
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from switchyard.core.keys import tenant_keys
from switchyard.core.settings import NO_FLAG, Group, ServiceSettings
from switchyard.kvstore.settings import zmq_endpoint
from switchyard.net.zmtp import HEARTBEAT_S, HEARTBEAT_TIMEOUT_S, MAX_FRAME_BYTES, ZmtpOptions
from switchyard.router.pd.settings import PDSettings


def usable_cores(cgroup_cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """The CPUs this process may run on, capped by its cgroup's CPU quota (a container
    limited to 2 CPUs on a 64-core node sees all 64 in its affinity mask)."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = cgroup_cpu_max.read_text().split()
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


class Timeouts(Group):
    """How long the router waits: for workers, for clients, and on shutdown."""

    heading: ClassVar[str] = "Timeouts"

    connect_s: float = Field(default=3.0, gt=0, description="connect to a worker")
    first_byte_s: float = Field(
        default=600.0, gt=0, description="longest wait for a worker's first byte"
    )
    first_byte_base_s: float = Field(
        default=5.0,
        gt=0,
        description="first-byte deadline before another worker is tried: this plus "
        "first_byte_slack x the TTFT the worker's learned rate predicts (until one is "
        "learned: admission.prior_tokens_per_s)",
        json_schema_extra=NO_FLAG,
    )
    first_byte_slack: float = Field(
        default=4.0,
        ge=1,
        description="how many times its predicted prefill a worker may take",
        json_schema_extra=NO_FLAG,
    )
    output_token_allowance_s: float = Field(
        default=0.25,
        gt=0,
        description="seconds per max_tokens a non-streamed answer adds to its first-byte "
        "deadline (a completion without it: 16, the API's default; a chat without it gets "
        "the learned time of whole answers instead)",
        json_schema_extra=NO_FLAG,
    )
    idle_s: float = Field(default=120.0, gt=0, description="gap between stream chunks")
    header_s: float = Field(
        default=10.0,
        gt=0,
        description="a client's request head must arrive within this (408 and close beyond)",
    )
    body_s: float = Field(
        default=60.0,
        gt=0,
        description="a client's request body must arrive within this after its head "
        "(connection closed beyond)",
    )
    keep_alive_s: float = Field(
        default=30.0, gt=0, description="close a client connection idle this long after an answer"
    )
    shutdown_s: float = Field(
        default=30.0,
        ge=0,
        description="on SIGTERM, the process exits within this long: in-flight requests "
        "run until 1 s before it (less drain_s), then are cancelled",
    )
    drain_s: float = Field(
        default=0.0,
        ge=0,
        description="on SIGTERM, /ready answers 503 this long before the listener closes "
        "(for load balancers to notice)",
    )


class Limits(Group):
    """How much the router accepts: request sizes, connections and in-flight requests."""

    heading: ClassVar[str] = "Limits"

    max_header_bytes: int = Field(
        default=32 * 1024,
        ge=1024,
        description="cap on request line and headers (414 or 431 beyond it)",
    )
    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1, description="request body cap")
    max_client_connections: int = Field(
        default=2048,
        ge=0,
        description="open client connections per router process; beyond, 503 "
        "too_many_connections (0: unbounded)",
    )
    max_connections_per_worker: int = Field(
        default=0, ge=0, description="connection pool per worker (0: unbounded)"
    )
    max_response_head_bytes: int = Field(
        default=64 * 1024,
        ge=1024,
        description="a worker's answer head (status line, headers, interim 1xx answers) cap; "
        "beyond it the call fails, the connection is closed and the client gets 502",
    )
    max_in_flight_per_tenant: int = Field(
        default=0,
        ge=0,
        description="requests one tenant (of api_key's TENANT:KEY; keys bound to none share "
        "'default') may have in flight per router process; beyond, 429 (0: no limit)",
    )


class Retry(Group):
    """How a failed attempt is retried on another worker, and what refused clients are told."""

    heading: ClassVar[str] = "Retry"

    max_attempts: int = Field(default=3, ge=1, description="tries per request over workers")
    backoff_s: float = Field(default=0.02, ge=0, description="first retry backoff")
    backoff_max_s: float = Field(default=0.5, ge=0, description="retry backoff cap")
    after_s: int = Field(default=1, ge=0, description="Retry-After on 429/503 answers")
    started_requests: Literal["never", "embeddings", "always"] = Field(
        default="always",
        description="retry on another worker a request the worker may have started (its "
        "connection closed after the request was written, no first byte or token in time, "
        "an answer cut before any byte was relayed): always (the first attempt's "
        "connection is closed, so vLLM and SGLang abort it), embeddings (only requests "
        "that generate nothing), or never. Requests no worker can have started (refused, "
        "connect timeout, never written) and 502/503 answers are retried in any case",
    )


class Migration(Group):
    """How a stream whose worker fails after its first byte resumes on another worker, so
    its client sees one stream (docs/operations.md, "When engines fail")."""

    heading: ClassVar[str] = "Migration"

    enabled: bool = Field(
        default=True,
        description="resume a streamed completion or chat on another worker when its worker "
        "cuts the stream, sends an error event or stalls after the first byte (off: the "
        "stream ends with an error event)",
    )
    max_per_request: int = Field(
        default=2, ge=1, description="migrations of one stream before it ends with an error event"
    )
    max_kept_bytes: int = Field(
        default=2 * 1024 * 1024,
        ge=1,
        description="bytes of a stream kept to resume it (a vLLM chunk with its token ids is "
        "about 250 bytes a token); a longer stream cannot migrate",
    )
    stall_factor: float = Field(
        default=20.0,
        gt=0,
        description="a stream that may migrate stalls after this many times its worker's "
        "learned gap between chunks without one (at least migration.stall_floor_s, at most "
        "timeouts.idle_s)",
    )
    stall_floor_s: float = Field(
        default=5.0, gt=0, description="the shortest wait before a stream counts as stalled"
    )


class TLS(Group):
    """How the router reaches https:// workers: whom it trusts and who it says it is."""

    heading: ClassVar[str] = "TLS to workers"

    ca_file: str | None = Field(
        default=None,
        description="PEM bundle of the CAs workers' certificates are verified against "
        "(default: the system's)",
    )
    cert_file: str | None = Field(
        default=None, description="PEM client certificate, for workers that require one"
    )
    key_file: str | None = Field(
        default=None, description="PEM private key of cert_file (default: in cert_file)"
    )
    verify: bool = Field(
        default=True,
        description="verify workers' certificates and host names (off: encrypted but not "
        "authenticated, for self-signed test fleets only)",
    )

    @model_validator(mode="after")
    def _key_needs_cert(self) -> TLS:
        if self.key_file and not self.cert_file:
            raise ValueError("--tls-key-file needs --tls-cert-file")
        return self

    def context(self) -> ssl.SSLContext:
        """One client context for every https worker, built from these settings."""
        context = ssl.create_default_context(cafile=self.ca_file)
        if not self.verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if self.cert_file:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context


class Admission(Group):
    """SLO-aware admission (Mooncake-style early rejection): refuse what would miss its TTFT."""

    heading: ClassVar[str] = "Admission"

    slo_ttft_ms: float | None = Field(
        default=None, gt=0, description="default TTFT objective for admission"
    )
    max_wait_ms: float = Field(
        default=250.0,
        ge=0,
        description="longest wait for a worker to meet the TTFT objective when its prediction "
        "is within margin_ratio of it",
    )
    margin_ratio: float = Field(
        default=0.25,
        ge=0,
        description="over the TTFT objective by more than this fraction: reject at once; "
        "within it: wait up to max_wait_ms",
        json_schema_extra=NO_FLAG,
    )
    prior_tokens_per_s: float = Field(
        default=10_000.0,
        gt=0,
        description="prefill rate assumed for a worker until its answers or calibration teach one",
        json_schema_extra=NO_FLAG,
    )
    calibrate: bool = Field(
        default=False,
        description="at start-up, one short and one long canary per worker to learn its TTFT "
        "overhead and prefill rate",
    )


class KV(Group):
    """KV-aware routing: where prefix knowledge comes from and how long guesses last."""

    heading: ClassVar[str] = "KV-aware routing"

    events: list[str] = Field(
        default_factory=list,
        description="WORKER_URL=tcp://HOST:PORT of its KV-event publisher (vLLM workers "
        "without it are asked for their /kv_event_sources)",
    )
    listen: str | None = Field(
        default=None,
        description="tcp://HOST:PORT to bind for engines that connect their KV events",
    )
    block_size: int | None = Field(
        default=None,
        ge=1,
        description="KV block size, tokens, until an engine's events tell its own "
        "(default: the kvstore's)",
    )
    parity: bool = Field(
        default=True,
        description="hash-parity self-check: a canary chat per worker at start-up and every "
        "parity_interval_s (needs --tokenizer)",
    )
    parity_interval_s: float = Field(
        default=300.0,
        ge=0,
        description="hash-parity self-check per worker: every N s (0: only at start-up)",
    )
    speculative_ttl_s: float = Field(
        default=30.0,
        ge=0,
        description="TTL of placements recorded without KV events",
        json_schema_extra=NO_FLAG,
    )
    event_lag_ttl_s: float = Field(
        default=2.0,
        ge=0,
        description="placements bridge the wait for engines' KV events",
        json_schema_extra=NO_FLAG,
    )
    max_prompt_tokens: int = Field(
        default=1 << 20,
        ge=1,
        description="longest prompt (estimated tokens) looked up for cached prefixes; longer "
        "ones are routed by load (their token lists would hold the loop and the memory)",
        json_schema_extra=NO_FLAG,
    )
    events_max_frame_bytes: int = Field(
        default=MAX_FRAME_BYTES,
        gt=0,
        description="largest frame read from a KV-event publisher, bytes; one over it drops "
        "the connection",
    )
    events_heartbeat_s: float = Field(
        default=HEARTBEAT_S, gt=0, description="PING each KV-event publisher every N s"
    )
    events_heartbeat_timeout_s: float = Field(
        default=HEARTBEAT_TIMEOUT_S,
        gt=0,
        description="a KV-event publisher silent this long (no frame, no PONG) is dead: "
        "reconnect, and estimate that worker's cache until its events resync",
    )

    @field_validator("listen")
    @classmethod
    def _listen_endpoint(cls, value: str | None) -> str | None:
        if value is not None and not zmq_endpoint(value):
            raise ValueError(f"--kv-listen {value!r}: expected tcp://HOST:PORT")
        return value

    @model_validator(mode="after")
    def _heartbeats(self) -> KV:
        ZmtpOptions(
            self.events_max_frame_bytes, self.events_heartbeat_s, self.events_heartbeat_timeout_s
        )
        return self


class Flow(Group):
    """Flow control: when every worker that could serve a request is saturated, it waits in
    the router (by priority, then a fair share between tenants) rather than on an engine."""

    heading: ClassVar[str] = "Flow control"

    enabled: bool = Field(
        default=True,
        description="queue requests in the router while every candidate worker is saturated "
        "(off: every request is routed at once, as without flow control)",
    )
    queue_depth: int = Field(
        default=5,
        ge=0,
        description="a worker whose engine reports this many waiting requests is saturated",
    )
    kv_usage: float = Field(
        default=0.8,
        ge=0,
        le=1,
        description="a worker whose engine reports this KV cache usage (0..1) is saturated",
    )
    metrics_staleness_s: float = Field(
        default=2.0,
        gt=0,
        description="a busy worker whose engine metrics are older than this is saturated",
    )
    max_inflight_per_worker: int = Field(
        default=0,
        ge=0,
        description="a worker with this many of this router's requests in flight is "
        "saturated (0: no such bound)",
    )
    max_queued_prefill_tokens: int = Field(
        default=8192,
        ge=0,
        description="a worker with this many of this router's prompt tokens not yet "
        "prefilled is saturated: about one engine step's token budget (0: no such bound)",
    )
    max_requests_per_band: int = Field(
        default=1000,
        ge=1,
        description="requests waiting per priority band; beyond, 429 queue_full",
    )
    max_bytes_per_band: int = Field(
        default=256 * 1024 * 1024,
        ge=1,
        description="request body bytes waiting per priority band; beyond, 429 queue_full",
    )
    queue_ttl_s: float = Field(
        default=30.0,
        gt=0,
        description="longest wait in the queue; beyond, 429 queue_timeout",
    )
    ordering: Literal["fcfs", "edf"] = Field(
        default="fcfs",
        description="order of one tenant's waiting requests: fcfs, or edf (earliest "
        "x-slo-ttft-ms deadline first)",
    )
    output_weight: float = Field(
        default=2.0,
        ge=0,
        description="fair share: an output token costs this many prompt tokens",
        json_schema_extra=NO_FLAG,
    )
    half_life_s: float = Field(
        default=60.0,
        gt=0,
        description="fair share: a tenant's served tokens count half after this long",
        json_schema_extra=NO_FLAG,
    )
    tenant_header: str | None = Field(
        default=None,
        description="trusted request header naming the tenant instead of the API key "
        "(x-llm-d-inference-fairness-id is read as an alias); only behind a trusted proxy",
    )
    max_priority: dict[str, int] = Field(
        default_factory=dict,
        description="highest priority each tenant may ask for (tenant -> integer; '*' for "
        "every other tenant); a higher x-priority is lowered to it",
        json_schema_extra=NO_FLAG,
    )
    engine_priority: bool = Field(
        default=False,
        description="send each request vLLM's priority field, for engines whose "
        "scheduling policy is 'priority': higher bands first, then a tenant with nothing "
        "waiting in the router before one whose backlog waits (off: a client's own "
        "priority field goes through)",
    )
    tenant_tokens_per_minute: dict[str, int] = Field(
        default_factory=dict,
        description="tokens (prompt and output) per minute each tenant may be served "
        "(tenant -> integer; '*' for every tenant); beyond, 429 rate_limited",
        json_schema_extra=NO_FLAG,
    )
    tenant_requests_per_minute: dict[str, int] = Field(
        default_factory=dict,
        description="requests per minute each tenant may send (tenant -> integer; '*' for "
        "every tenant); beyond, 429 rate_limited",
        json_schema_extra=NO_FLAG,
    )

    @field_validator("tenant_header")
    @classmethod
    def _lower_header(cls, value: str | None) -> str | None:
        return value.lower() if value else None

    @field_validator("tenant_tokens_per_minute", "tenant_requests_per_minute")
    @classmethod
    def _no_negative_limit(cls, value: dict[str, int]) -> dict[str, int]:
        for tenant, limit in value.items():
            if limit < 0:
                raise ValueError(f"rate limit of {tenant!r} is negative")
        return value


class Tracing(Group):
    """OpenTelemetry traces of the requests the router routes, sent over OTLP. The standard
    ``OTEL_*`` variables apply beneath these (service name, headers, sampler, endpoint)."""

    heading: ClassVar[str] = "Tracing"

    otlp_traces_endpoint: str | None = Field(
        default=None,
        description="OTLP collector URL for traces, read as vLLM reads it: gRPC (e.g. "
        "http://collector:4317) unless the URL ends in /v1/traces (http/protobuf, e.g. "
        "http://collector:4318/v1/traces) or tracing.protocol says otherwise; unset: "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT, else no tracing",
    )
    sample_ratio: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="fraction of requests without a sampled parent that are traced "
        "(parent-based: a client's traceparent decides for its own); unset: "
        "OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG, else 1",
    )
    protocol: Literal["http/protobuf", "grpc"] | None = Field(
        default=None,
        description="OTLP protocol; unset: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or "
        "OTEL_EXPORTER_OTLP_PROTOCOL, else from tracing.otlp_traces_endpoint (gRPC unless "
        "it ends in /v1/traces), else http/protobuf (an endpoint from the OTEL_* "
        "variables, OpenTelemetry's default); grpc needs the otlp-grpc extra",
    )


# Where each setting that moved into a group used to live, read for one release.
MOVED = {
    "connect_timeout_s": "timeouts.connect_s",
    "first_byte_timeout_s": "timeouts.first_byte_s",
    "first_byte_base_s": "timeouts.first_byte_base_s",
    "first_byte_slack": "timeouts.first_byte_slack",
    "output_token_allowance_s": "timeouts.output_token_allowance_s",
    "idle_timeout_s": "timeouts.idle_s",
    "header_timeout_s": "timeouts.header_s",
    "body_timeout_s": "timeouts.body_s",
    "keep_alive_timeout_s": "timeouts.keep_alive_s",
    "shutdown_timeout_s": "timeouts.shutdown_s",
    "shutdown_drain_s": "timeouts.drain_s",
    "max_header_bytes": "limits.max_header_bytes",
    "max_body_bytes": "limits.max_body_bytes",
    "max_client_connections": "limits.max_client_connections",
    "max_connections_per_worker": "limits.max_connections_per_worker",
    "tenant_max_in_flight": "limits.max_in_flight_per_tenant",
    "max_attempts": "retry.max_attempts",
    "retry_backoff_s": "retry.backoff_s",
    "retry_backoff_max_s": "retry.backoff_max_s",
    "retry_after_s": "retry.after_s",
    "slo_ttft_ms": "admission.slo_ttft_ms",
    "admission_max_wait_ms": "admission.max_wait_ms",
    "admission_margin_ratio": "admission.margin_ratio",
    "admission_prior_tokens_per_s": "admission.prior_tokens_per_s",
    "admission_calibrate": "admission.calibrate",
    "kv_events": "kv.events",
    "kv_listen": "kv.listen",
    "block_size": "kv.block_size",
    "kv_parity": "kv.parity",
    "parity_interval_s": "kv.parity_interval_s",
    "speculative_ttl_s": "kv.speculative_ttl_s",
    "event_lag_ttl_s": "kv.event_lag_ttl_s",
    "kv_max_prompt_tokens": "kv.max_prompt_tokens",
}


def _pairs(items: list[str], flag: str, form: str, twice: str) -> dict[str, str]:
    """``KEY=VALUE`` items as a mapping; ``ValueError`` naming ``flag`` for a malformed item
    or a key ``twice`` (one parser for every such list, so they refuse alike)."""
    out: dict[str, str] = {}
    for item in items:
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or not key or not value:
            raise ValueError(f"{flag} {item!r}: expected {form}")
        if key in out:
            raise ValueError(f"{flag}: {key!r} is {twice} twice")
        out[key] = value
    return out


class RouterSettings(ServiceSettings):
    section = "router"
    moved = MOVED
    headings = {
        "Service": ("host", "port", "processes", "log_level", "log_format"),
        "Fleet and routing": (
            "workers",
            "policy",
            "policy_options",
            "model_aliases",
            "model_policies",
            "tokenizer",
            "kvstore",
            "balancer",
            "redis_url",
        ),
        "Auth": (
            "api_key",
            "admin_api_key",
            "worker_api_key",
            "metrics_auth",
            "kvstore_api_key",
            "balancer_api_key",
            "client_kv_transfer",
        ),
    }
    model_config = SettingsConfigDict(
        env_prefix="SWITCHYARD_ROUTER_", extra="ignore", env_nested_delimiter="__"
    )

    host: str = Field(default="127.0.0.1", description="bind address")
    port: int = Field(default=8000, description="bind port")
    processes: int | Literal["auto"] = Field(
        default="auto",
        description="router processes sharing the port (auto: one per core this process may "
        "use); they share in-flight counts, admin changes and placements",
    )
    log_level: str = Field(default="warning", description="uvicorn and router log level")
    log_format: Literal["text", "json"] = Field(
        default="text",
        description="router log lines: text, or json (one object a line, with the request id "
        "and trace id of a line logged while routing a request)",
    )

    workers: list[str] = Field(
        default_factory=list,
        description="worker URL, repeatable; options as 'http://h:p;role=prefill;dp=4'",
    )
    policy: str = Field(
        default="kv_aware",
        description="round_robin, random, least_load, power_of_two, consistent_hash, "
        "cache_aware, kv_aware, latency or custom",
    )
    policy_options: dict[str, Any] = Field(
        default_factory=dict, description="policy options as JSON (see the README's policies)"
    )
    model_aliases: list[str] = Field(
        default_factory=list,
        description="PUBLIC=SERVED: clients name the model PUBLIC, workers serving SERVED "
        "answer (bodies' model rewritten both ways; /v1/models lists PUBLIC), repeatable; "
        "in YAML also a mapping",
    )
    model_policies: list[str] = Field(
        default_factory=list,
        description="MODEL=POLICY: a model routed by a policy of its own (with the "
        "policy_options), repeatable; in YAML also a mapping",
    )
    tokenizer: str | None = Field(
        default=None, description="HF tokenizer dir (tokenizer.json + chat template)"
    )
    kvstore: str = Field(default="embedded", description="'embedded' or a kvstore service URL")
    balancer: str = Field(
        default="embedded",
        description="'embedded' (configured by the balancer section and SWITCHYARD_BALANCER_*) "
        "or a balancer service URL",
    )
    redis_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("redis_url", "redis"),
        description="Redis URL: state shared by router replicas",
    )

    api_key: str | None = Field(
        default=None,
        description="Bearer keys clients must send, comma-separated; TENANT:KEY binds a key "
        "to a tenant that labels its requests",
    )
    admin_api_key: str | None = Field(default=None, description="Bearer key for /admin")
    worker_api_key: str | None = Field(
        default=None,
        description="Bearer key the router sends to the workers (clients' Authorization "
        "never reaches them)",
    )
    metrics_auth: Literal["auto", "none", "api_key", "admin_key"] = Field(
        default="auto",
        description="key /metrics, /docs and /openapi.json need: none, api_key, admin_key, "
        "or auto (admin_key once an admin key is set, else none)",
    )
    kvstore_api_key: str | None = Field(
        default=None,
        description="key sent to the kvstore service: its admin_api_key (placements need it)",
    )
    balancer_api_key: str | None = Field(
        default=None,
        description="key sent to the balancer service: its admin_api_key to add workers, "
        "else its api_key",
    )
    client_kv_transfer: bool = Field(
        default=False,
        description="accept clients' kv_transfer_params and bootstrap_* body fields "
        "(only behind an outer P/D proxy; else they are refused with 400)",
    )

    timeouts: Timeouts = Field(default_factory=Timeouts)
    limits: Limits = Field(default_factory=Limits)
    retry: Retry = Field(default_factory=Retry)
    migration: Migration = Field(default_factory=Migration)
    tls: TLS = Field(default_factory=TLS)
    admission: Admission = Field(default_factory=Admission)
    kv: KV = Field(default_factory=KV)
    flow: Flow = Field(default_factory=Flow)
    tracing: Tracing = Field(default_factory=Tracing)
    # Disaggregated serving (prefill/decode/encode pools and the engine protocol).
    pd: PDSettings = Field(default_factory=PDSettings)

    @field_validator("api_key")
    @classmethod
    def _tenant_keys(cls, value: str | None) -> str | None:
        tenant_keys(value)
        return value

    @field_validator("model_aliases", "model_policies", mode="before")
    @classmethod
    def _pair_mapping(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return [f"{key}={target}" for key, target in value.items()]
        return value

    @field_validator("model_aliases")
    @classmethod
    def _alias_pairs(cls, value: list[str]) -> list[str]:
        for public, served in _pairs(value, "--model-alias", "PUBLIC=SERVED", "aliased").items():
            if public == served:
                raise ValueError(f"--model-alias {public}={served}: a model cannot alias itself")
        return value

    @field_validator("model_policies")
    @classmethod
    def _policy_pairs(cls, value: list[str]) -> list[str]:
        _pairs(value, "--model-policy", "MODEL=POLICY", "given")
        return value

    @property
    def policies(self) -> dict[str, str]:
        """``model_policies`` as model -> policy name."""
        return _pairs(self.model_policies, "--model-policy", "MODEL=POLICY", "given")

    @property
    def aliases(self) -> dict[str, str]:
        """``model_aliases`` as public name -> served name."""
        return _pairs(self.model_aliases, "--model-alias", "PUBLIC=SERVED", "aliased")

    @field_validator("processes")
    @classmethod
    def _positive_processes(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("--processes: at least 1, or auto")
        return value

    @model_validator(mode="after")
    def _one_listener(self) -> RouterSettings:
        if self.kv.listen and self.processes != "auto" and self.processes > 1:
            raise ValueError(
                f"--kv-listen binds one socket, which one of --processes {self.processes} "
                "could hold: use --processes 1 (or auto)"
            )
        return self

    @property
    def process_count(self) -> int:
        """``processes`` resolved: auto is one per core this process may use (``usable_cores``),
        or one with ``kv.listen`` (engines connect to a single socket, which one process binds)."""
        if self.processes == "auto":
            return 1 if self.kv.listen else usable_cores()
        return self.processes
