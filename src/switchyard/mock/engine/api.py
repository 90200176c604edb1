"""The contract between the engine model and what drives or serves it.

The HTTP front (``switchyard.mock.app``) only ever talks to :class:`AsyncEngine`
through these types, so the engine model can change without touching the API.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

FinishReason = Literal["length", "abort", "error"]


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    lora_name: str | None = None
    lora_id: int | None = None  # vLLM's lora_int_id, published in KV events
    cache_salt: str | None = None
    priority: int = 0
    # P/D, prefill side: keep the prompt's blocks allocated after the one token,
    # until ``release_held`` (the decode side pulled them) or the hold expires.
    hold_kv_after_prefill: bool = False
    # P/D, decode side: the first ``remote_prefilled_tokens`` prompt tokens arrive
    # from a remote prefill (blocks are allocated, no prefill compute is charged).
    remote_prefilled_tokens: int = 0
    # The filler token ids the server will emit (cycled), so blocks that fill with generated
    # tokens hash as the real engine's would and a later turn can hit them. None: token 0.
    output_token_ids: list[int] | None = None


@dataclass(slots=True)
class TokenOutput:
    """One step's progress for one request (streamed to the server as it happens)."""

    num_generated: int  # total output tokens so far
    finished: bool
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the local prefix cache
    held_block_ids: list[int] = field(default_factory=list)  # prefill role, when finished


@dataclass(slots=True)
class EngineStats:
    """What ``/metrics`` exposes; counters are cumulative since start."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1, blocks in use (not free, not merely cached) / total
    num_gpu_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of those, tokens found cached
    prompt_tokens_total: int
    generation_tokens_total: int
    num_preemptions: int
    requests_finished: int
    # Adapter name -> requests, as vLLM's scheduler stats count them for lora_requests_info.
    running_loras: dict[str, int] = field(default_factory=dict)
    waiting_loras: dict[str, int] = field(default_factory=dict)


def context_length_error(max_len: int, prompt_tokens: int, max_tokens: int) -> str | None:
    """vLLM's 400 message for a request whose prompt + output exceeds the served context, or
    None when it fits; refused at the API so one over-long request never reaches a rank."""
    total = prompt_tokens + max_tokens
    if total <= max_len:
        return None
    return (
        f"This model's maximum context length is {max_len} tokens. However, you requested "
        f"{total} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion). "
        "Please reduce the length of the messages or completion."
    )


class AsyncEngine(Protocol):
    """One DP rank of a simulated engine on the real clock."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[TokenOutput]:
        """Yield progress until finished; closing the iterator aborts the request."""

    def abort(self, request_id: str) -> None: ...

    def release_held(self, request_id: str) -> bool:
        """Free a prefill's held blocks once the decode side pulled them."""

    def stats(self) -> EngineStats: ...
