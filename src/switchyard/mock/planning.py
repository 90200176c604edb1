"""Where and how one request runs: its DP rank and its P/D role (hold, pull or neither).

A prefill leg (vLLM ``do_remote_decode`` or an SGLang bootstrap room on a prefill mock)
generates one token and holds its KV blocks; a decode leg (vLLM ``do_remote_prefill`` or
an SGLang room on a decode mock) pulls them first and skips the prefill it received.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.types import Scope

from switchyard.mock.asgi import ClientError, header
from switchyard.mock.engine.api import EngineRequest, TokenOutput
from switchyard.mock.engine.driver import RealClockEngine
from switchyard.mock.epd import Encoder
from switchyard.mock.metrics import EngineMetrics
from switchyard.mock.pd import Held, HeldKV, KVPuller, PullError
from switchyard.mock.request import Parsed
from switchyard.mock.settings import MockSettings


@dataclass(slots=True)
class Plan:
    """How to run one request on one rank (P/D decisions included)."""

    rank: int
    request: EngineRequest
    prefill_hold: str  # "" | "vllm" | "sglang"
    room: int | None
    remote_prefilled: int


class Planner:
    """Picks the rank, applies the P/D role, and hands a prefill's blocks to ``held``."""

    def __init__(
        self,
        settings: MockSettings,
        engines: dict[int, RealClockEngine],
        inflight: dict[int, int],
        puller: KVPuller,
        held: HeldKV,
        metrics: EngineMetrics,
        encoder: Encoder,
        engine_id: str,
        port: int,
        output_ids: list[int],
    ) -> None:
        self.s = settings
        self.engines = engines
        self.inflight = inflight
        self.puller = puller
        self.held = held
        self.metrics = metrics
        self.encoder = encoder
        self.engine_id = engine_id
        self.port = port
        self.output_ids = output_ids

    def pick_rank(self, scope: Scope) -> int:
        raw = header(scope, b"x-data-parallel-rank")
        if raw is not None:
            try:
                rank = int(raw)
            except ValueError:
                raise ClientError(400, "X-data-parallel-rank must be an integer") from None
            if rank not in self.engines:
                raise ClientError(
                    400, f"X-data-parallel-rank {rank} not served here (ranks {list(self.engines)})"
                )
            return rank
        inflight = self.inflight
        if len(inflight) == 1:
            return next(iter(inflight))
        return min(inflight, key=inflight.__getitem__)

    async def plan(self, scope: Scope, rid: str, p: Parsed) -> tuple[Plan, bytes]:
        """Decide rank and P/D behaviour; the decode side's KV pull happens here."""
        rank = self.pick_rank(scope)
        req = EngineRequest(
            request_id=rid,
            prompt_token_ids=p.prompt_ids,
            max_tokens=p.max_tokens,
            output_token_ids=self.output_ids,
            cache_salt=p.cache_salt,
            priority=p.priority,
            lora_name=p.lora.name if p.lora is not None else None,
            lora_id=p.lora.lora_id if p.lora is not None else None,
        )
        plan = Plan(rank, req, "", None, 0)
        kvp = p.kv_transfer_params
        role = self.s.role
        if kvp and kvp.get("do_remote_decode"):
            req.max_tokens = 1
            req.hold_kv_after_prefill = True
            plan.prefill_hold = "vllm"
        elif kvp and kvp.get("do_remote_prefill"):
            try:
                await self.puller.pull_vllm(kvp, self.s.pd_wait_timeout_s)
                plan.remote_prefilled = len(p.prompt_ids)
            except PullError:
                # As vLLM with kv_load_failure_policy=recompute: prefill the prompt locally.
                self.metrics.ranks[rank].kv_pull_failures += 1
        elif p.bootstrap is not None and role == "prefill":
            req.max_tokens = 1
            req.hold_kv_after_prefill = True
            plan.prefill_hold = "sglang"
            plan.room = p.bootstrap[2]
        elif p.bootstrap is not None and role == "decode":
            host, port, room = p.bootstrap
            try:
                await self.puller.pull_sglang(host, port, room, self.s.pd_wait_timeout_s)
            except PullError as exc:
                raise ClientError(exc.status, str(exc)) from exc
            plan.remote_prefilled = len(p.prompt_ids)
        req.remote_prefilled_tokens = plan.remote_prefilled
        if plan.remote_prefilled:
            self.metrics.ranks[rank].remote_prefills += 1
        if p.num_images and role != "encode" and not plan.remote_prefilled:
            # A remotely prefilled prompt arrives as KV: its images were encoded upstream.
            await self.encoder.delay(p.num_images - p.num_encoded)
        return plan, str(plan.remote_prefilled).encode()

    def hold_prefill(
        self, plan: Plan, out: TokenOutput | None, num_prompt: int
    ) -> dict[str, Any] | None:
        """A finished prefill leg's blocks go to ``held``; vLLM's decode gets their address."""
        if not plan.prefill_hold or out is None:
            return None
        held = Held(plan.rank, list(out.held_block_ids), num_prompt)
        engine_rid = plan.request.request_id
        self.held.hold(engine_rid, held, plan.room)
        if plan.prefill_hold != "vllm":
            return None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_block_ids": held.block_ids,
            "remote_host": self.s.host,
            "remote_port": self.port,
            "remote_request_id": engine_rid,
            "tp_size": 1,
        }
