"""P/D settings: the ``pd:`` block of the router's settings (flags, env, YAML).

``SWITCHYARD_ROUTER_PD__PROTOCOL=sglang`` or YAML ``router: {pd: {protocol: sglang}}``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from switchyard.balancer.worker import Role, WorkerSpec
from switchyard.core.settings import Group

Protocol = Literal["vllm", "sglang"]


class PDSettings(Group):
    """How the router runs disaggregated requests; inert until a protocol or P/D worker exists."""

    heading: ClassVar[str] = "P/D"

    protocol: Protocol | None = Field(default=None, description="P/D wire protocol")
    prefill: list[str] = Field(
        default_factory=list, description="prefill worker URL, repeatable; ';bootstrap=N'"
    )
    decode: list[str] = Field(default_factory=list, description="decode worker URL, repeatable")
    encode: list[str] = Field(
        default_factory=list, description="encode worker URL (E/P/D), repeatable"
    )

    # One scheduler per pool (names in router/scheduler/policies.py). Prefill: None picks
    # kv_aware when the router has a KV store (prefix reuse lives on prefill workers),
    # else least_load.
    prefill_policy: str | None = Field(
        default=None, description="prefill pool policy (default: kv_aware with a KV store)"
    )
    decode_policy: str = Field(default="least_load", description="decode pool policy")
    encode_policy: str = Field(default="consistent_hash", description="encode pool policy")
    policy_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per pool policy options as JSON"
    )

    min_prefill_tokens: int = Field(
        default=0, ge=0, description="skip the prefill pool below this many uncached tokens"
    )

    # Failure handling.
    prefill_attempts: int = Field(default=2, ge=1, description="prefill tries over workers")
    prefill_timeout_s: float = Field(default=60.0, gt=0, description="one prefill leg")
    kv_transfer_timeout_s: float = Field(default=30.0, gt=0, description="KV pull by decode")
    encode_timeout_s: float = Field(default=30.0, gt=0, description="one encode leg")
    fallback: bool = Field(default=True, description="serve unified when P/D fails")
    default_bootstrap_port: int = Field(
        default=8998, description="SGLang bootstrap port when a prefill URL names none"
    )

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
