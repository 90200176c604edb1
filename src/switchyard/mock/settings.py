"""Settings of ``switchyard mock``: one model for flags, env (SWITCHYARD_MOCK_*) and YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from switchyard.core.settings import ServiceSettings

DEFAULT_TOKENIZER = str(Path(__file__).resolve().parent / "assets" / "tokenizer")

Flavor = Literal["vllm", "sglang"]
Role = Literal["unified", "prefill", "decode", "encode"]

# The engine core's timing and capacity: unset ones keep the engine model's own values.
ENGINE_FIELDS = (
    "block_size",
    "num_gpu_blocks",
    "max_num_seqs",
    "max_num_batched_tokens",
    "scheduling_policy",
    "enable_prefix_caching",
    "step_base_us",
    "prefill_token_us",
    "decode_token_us",
    "context_token_us",
    "kv_transfer_us_per_block",
    "held_kv_timeout_s",
)


class MockSettings(ServiceSettings):
    """Everything one mock engine process needs; engine timing fields default to the model's."""

    section = "mock"
    headings = {
        "Service": (
            "host",
            "port",
            "flavor",
            "model",
            "tokenizer",
            "max_model_len",
            "default_max_tokens",
            "role",
            "engine_id",
        ),
        "Engine model": (*ENGINE_FIELDS, "speed", "seed"),
        "Data parallel": ("dp_size", "dp_external"),
        "KV events": (
            "kv_events_port",
            "kv_events_replay_port",
            "kv_events_encoding",
            "kv_events_topic",
        ),
        "LoRA": (
            "enable_lora",
            "max_loras",
            "lora_modules",
            "lora_load_ms",
            "runtime_lora_updating",
        ),
        "P/D": ("bootstrap_port", "pd_wait_timeout_s", "encode_us_per_image"),
        "Faults": (
            "fault_error_rate",
            "fault_error_codes",
            "fault_latency_rate",
            "fault_latency_ms",
            "fault_hang_rate",
            "fault_crash_after",
            "fault_slow_stream_ms",
            "fault_drop_after_tokens",
            "fault_drop_rate",
            "fault_kv_gap",
        ),
    }
    model_config = SettingsConfigDict(env_prefix="SWITCHYARD_MOCK_", extra="ignore")

    host: str = Field(default="127.0.0.1", description="bind address")
    port: int = Field(default=8000, description="HTTP port (rank r on port+r with --dp-external)")
    flavor: Flavor = Field(
        default="vllm", description="API extras, metrics and hashing of this engine"
    )
    model: str = Field(default="mock-model", description="served model name")
    tokenizer: str = Field(
        default=DEFAULT_TOKENIZER, description="HF tokenizer dir with chat_template"
    )
    max_model_len: int = Field(default=131072, description="context length, tokens")
    # vLLM chat defaults to the remaining context; a mock keeps loads controllable.
    default_max_tokens: int = Field(default=16, description="max_tokens when a request omits it")
    role: Role = Field(default="unified", description="P/D role")
    engine_id: str = Field(default="", description="remote_engine_id for P/D")

    # Engine model (None: keep EngineConfig's documented default).
    block_size: int | None = Field(default=None, description="tokens per KV block")
    num_gpu_blocks: int | None = Field(default=None, description="KV blocks per rank")
    max_num_seqs: int | None = Field(default=None, description="max running requests per rank")
    max_num_batched_tokens: int | None = Field(default=None, description="per-step token budget")
    scheduling_policy: Literal["fcfs", "priority"] | None = Field(
        default=None,
        description="waiting order: arrival, or vLLM's (priority, arrival) with the "
        "request's priority (lower first)",
    )
    enable_prefix_caching: bool | None = Field(default=None, description="prefix caching")
    step_base_us: float | None = Field(default=None, description="per-step fixed cost")
    prefill_token_us: float | None = Field(default=None, description="per uncached prefill token")
    decode_token_us: float | None = Field(default=None, description="per decode sequence")
    context_token_us: float | None = Field(default=None, description="per attended context token")
    kv_transfer_us_per_block: float | None = Field(
        default=None, description="P/D KV pull per block"
    )
    held_kv_timeout_s: float | None = Field(default=None, description="prefill hold expiry")
    speed: float = Field(default=1.0, description="time compression factor")
    seed: int = Field(default=0, description="random seed")

    # Data parallel.
    dp_size: int = Field(default=1, description="data-parallel ranks")
    dp_external: bool = Field(default=False, description="one port per DP rank")

    # KV events (ZMQ PUB on kv_events_port + rank, replay on kv_events_replay_port + rank).
    kv_events_port: int | None = Field(default=None, description="ZMQ PUB port (+rank)")
    kv_events_replay_port: int | None = Field(default=None, description="ZMQ replay port (+rank)")
    kv_events_encoding: Literal["array", "map"] = Field(
        default="map", description="map (vLLM 0.32; SGLang's default: array) or array"
    )
    kv_events_topic: str = Field(default="", description="ZMQ topic")

    # LoRA adapters, as vLLM's flags name them.
    enable_lora: bool = Field(default=False, description="serve LoRA adapters")
    max_loras: int = Field(default=1, ge=1, description="adapters one step may run (GPU slots)")
    lora_modules: list[str] = Field(
        default_factory=list, description="adapter known at start, name=path, repeatable"
    )
    lora_load_ms: float = Field(
        default=20.0, ge=0, description="model time to load an adapter into a slot"
    )
    # vLLM gates these routes with the env VLLM_ALLOW_RUNTIME_LORA_UPDATING; the mock
    # honours that variable too.
    runtime_lora_updating: bool = Field(
        default=False, description="serve /v1/load_lora_adapter and /v1/unload_lora_adapter"
    )

    # P/D and E/P/D.
    bootstrap_port: int | None = Field(default=None, description="SGLang prefill bootstrap port")
    pd_wait_timeout_s: float = Field(default=10.0, description="decode wait for prefill KV")
    encode_us_per_image: float = Field(default=20000.0, description="encoder time per image")

    # Faults (also settable at runtime through POST /admin/faults).
    fault_error_rate: float = Field(default=0.0, description="fraction answered with an error")
    fault_error_codes: list[int] = Field(
        default_factory=lambda: [500], description="error statuses, repeatable"
    )
    fault_latency_rate: float = Field(default=0.0, description="fraction delayed")
    fault_latency_ms: float = Field(default=0.0, description="delay of a latency spike")
    fault_hang_rate: float = Field(default=0.0, description="fraction never answered")
    fault_crash_after: int = Field(default=0, description="exit when request N+1 arrives")
    fault_slow_stream_ms: float = Field(default=0.0, description="extra delay per chunk")
    fault_drop_after_tokens: int = Field(default=0, description="cut streams after N tokens")
    fault_drop_rate: float = Field(default=1.0, description="fraction of streams cut")
    fault_kv_gap: int = Field(default=0, description="skip N KV-event seqs at start")

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    def lora_module_paths(self) -> dict[str, str]:
        """``lora_modules`` as name -> path (vLLM's ``name=path`` form)."""
        out: dict[str, str] = {}
        for item in self.lora_modules:
            name, sep, path = item.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"lora_modules takes name=path, not {item!r}")
            out[name.strip()] = path.strip()
        return out

    @model_validator(mode="after")
    def _lora_modules_parse(self) -> MockSettings:
        self.lora_module_paths()
        return self

    @model_validator(mode="before")
    @classmethod
    def _flavor_encoding(cls, data: Any) -> Any:
        """Unless set, events go out as the flavour's engine sends them: vLLM 0.32 as maps
        (msgspec tagged structs; tests/fixtures/vllm_real/events.msgpack), SGLang as arrays."""
        if isinstance(data, dict) and data.get("kv_events_encoding") is None:
            encoding = "array" if data.get("flavor") == "sglang" else "map"
            return {**data, "kv_events_encoding": encoding}
        return data
