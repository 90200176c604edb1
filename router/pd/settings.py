"""P/D settings: the ``pd:`` block of the router's settings (flags, env, YAML).

``SWITCHYARD_ROUTER_PD__PROTOCOL=sglang`` or YAML ``router: {pd: {protocol: sglang}}``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from balancer.worker import Role, WorkerSpec

Protocol = Literal["vllm", "sglang"]


class PDSettings(BaseModel):
    """How the router runs disaggregated requests; inert until a protocol or P/D worker exists."""

    protocol: Protocol | None = None
    prefill: list[str] = Field(default_factory=list, description="prefill worker URLs")
    decode: list[str] = Field(default_factory=list, description="decode worker URLs")
    encode: list[str] = Field(default_factory=list, description="encode worker URLs")

    # One scheduler per pool (names of router/scheduler/policies.py). Prefill: None picks
    # kv_aware when the router has a KV store (prefix reuse lives on prefill workers),
    # else least_load.
    prefill_policy: str | None = None
    decode_policy: str = "least_load"
    encode_policy: str = "consistent_hash"
    policy_options: dict[str, dict[str, Any]] = Field(default_factory=dict)

    # Conditional disaggregation: below this many uncached prompt tokens, skip the prefill pool.
    min_prefill_tokens: int = 0

    # Failure handling.
    prefill_attempts: int = 2
    prefill_timeout_s: float = 60.0
    kv_transfer_timeout_s: float = 30.0
    encode_timeout_s: float = 30.0
    fallback: bool = True
    default_bootstrap_port: int = 8998

    def worker_specs(self) -> list[WorkerSpec]:
        """The prefill/decode/encode URLs as worker specs with their role set."""
        specs = []
        for role, urls in (
            (Role.PREFILL, self.prefill),
            (Role.DECODE, self.decode),
            (Role.ENCODE, self.encode),
        ):
            for text in urls:
                spec = WorkerSpec.parse(text)
                spec.role = role
                specs.append(spec)
        return specs
