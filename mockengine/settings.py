"""Settings of ``switchyard mock``: one model for flags, env (SWITCHYARD_MOCK_*) and YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic_settings import SettingsConfigDict

from switchyard.settings import ServiceSettings

DEFAULT_TOKENIZER = str(Path(__file__).resolve().parent / "assets" / "tokenizer")

Flavor = Literal["vllm", "sglang"]
Role = Literal["unified", "prefill", "decode", "encode"]


class MockSettings(ServiceSettings):
    """Everything one mock engine process needs; engine timing fields default to the model's."""

    section = "mock"
    model_config = SettingsConfigDict(env_prefix="SWITCHYARD_MOCK_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8000
    flavor: Flavor = "vllm"
    model: str = "mock-model"
    tokenizer: str = DEFAULT_TOKENIZER
    max_model_len: int = 131072
    # vLLM chat defaults to the remaining context; a mock keeps loads controllable.
    default_max_tokens: int = 16
    role: Role = "unified"
    engine_id: str = ""

    # Engine model (None: keep EngineConfig's documented default).
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool | None = None
    step_base_us: float | None = None
    prefill_token_us: float | None = None
    decode_token_us: float | None = None
    context_token_us: float | None = None
    kv_transfer_us_per_block: float | None = None
    held_kv_timeout_s: float | None = None
    speed: float = 1.0
    seed: int = 0

    # Data parallel.
    dp_size: int = 1
    dp_external: bool = False

    # KV events (ZMQ PUB on kv_events_port + rank, replay on kv_events_replay_port + rank).
    kv_events_port: int | None = None
    kv_events_replay_port: int | None = None
    kv_events_encoding: Literal["array", "map"] = "array"
    kv_events_topic: str = ""

    # P/D and E/P/D.
    bootstrap_port: int | None = None
    pd_wait_timeout_s: float = 10.0
    encode_us_per_image: float = 20000.0

    # Faults (also settable at runtime through POST /admin/faults).
    fault_error_rate: float = 0.0
    fault_error_codes: list[int] = [500]
    fault_latency_rate: float = 0.0
    fault_latency_ms: float = 0.0
    fault_hang_rate: float = 0.0
    fault_crash_after: int = 0
    fault_slow_stream_ms: float = 0.0
    fault_drop_after_tokens: int = 0
    fault_drop_rate: float = 1.0
    fault_kv_gap: int = 0
