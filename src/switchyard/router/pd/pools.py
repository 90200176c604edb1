"""Prefill, decode and encode pools: the fleet's workers by role, each with its own scheduler.

Prefix reuse lives on prefill workers, so the prefill pool is where a prefix-aware policy
pays; decode wants spread load; encode wants the same image on the same encoder
(consistent hash on the image URLs) so its embedding cache hits.
"""

from __future__ import annotations

import xxhash

from switchyard.balancer.view import FleetView
from switchyard.balancer.worker import Role, Worker
from switchyard.router.pd.settings import PDSettings
from switchyard.router.request import RoutedRequest
from switchyard.router.scheduler.framework import Context, Scheduler
from switchyard.router.scheduler.policies import build_scheduler


class Pools:
    def __init__(self, fleet: FleetView, settings: PDSettings, has_kvstore: bool = False) -> None:
        self.fleet = fleet
        opts = settings.policy_options
        prefill = settings.prefill_policy or ("kv_aware" if has_kvstore else "least_load")
        self.schedulers: dict[Role, Scheduler] = {
            Role.PREFILL: build_scheduler(prefill, opts.get("prefill")),
            Role.DECODE: build_scheduler(settings.decode_policy, opts.get("decode")),
            Role.ENCODE: build_scheduler(settings.encode_policy, opts.get("encode")),
            Role.UNIFIED: build_scheduler(settings.decode_policy, opts.get("decode")),
        }

    def context(self, req: RoutedRequest, request_id: str, key: str | None = None) -> Context:
        return Context(
            model=req.model,
            session_key=key if key is not None else req.session_key,
            prompt_tokens=req.prompt_tokens_estimate,
            request_id=request_id,
        )

    def needs_prefix(self, role: Role) -> bool:
        return self.schedulers[role].needs_prefix

    def ranked(self, role: Role, ctx: Context, workers: list[Worker]) -> list[Worker]:
        """``workers`` best first by the pool's scheduler."""
        if not workers:
            return []
        return self.schedulers[role].schedule(ctx, workers)


def image_key(refs: list[str]) -> str:
    """The consistent-hash key of a request's images."""
    return xxhash.xxh3_64_hexdigest("\n".join(refs).encode())
