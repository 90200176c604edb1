"""Runs one disaggregated request: encode (images) → prefill → decode, in the engine's protocol.

Every path ends: each leg has a deadline, a failed prefill is retried on another prefill
worker and then (``fallback``) the whole request goes to a decode/unified worker, the
decode leg retries before its first byte (the router's Forwarder), and in the SGLang flow
a failure of either concurrent leg cancels the other, so a decode never waits on a dead
prefill.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import orjson
from starlette.types import Send

from switchyard.balancer.view import FleetView
from switchyard.balancer.worker import Role, Worker
from switchyard.router.errors import RouterError
from switchyard.router.forward import Forwarder
from switchyard.router.metrics import RouterMetrics
from switchyard.router.pd import wire
from switchyard.router.pd.decider import Decider
from switchyard.router.pd.legs import LegError, call_json
from switchyard.router.pd.metrics import PDMetrics
from switchyard.router.pd.pools import Pools, image_key
from switchyard.router.pd.settings import PDSettings
from switchyard.router.relay import Relay, send_complete
from switchyard.router.request import CHAT, COMPLETIONS, RoutedRequest
from switchyard.router.scheduler.framework import Context

if TYPE_CHECKING:
    from switchyard.router.kv import KVAwareness
    from switchyard.router.tracing import Tracing

PD_ROUTES = frozenset({CHAT, COMPLETIONS})


class _Watch:
    """Wraps ``send``: when the response head and first body chunk went to the client."""

    __slots__ = ("send", "head_at", "first_at", "is_sse")

    def __init__(self, send: Send) -> None:
        self.send = send
        self.head_at: float | None = None
        self.first_at: float | None = None
        self.is_sse = False

    @property
    def started(self) -> bool:
        return self.head_at is not None

    async def __call__(self, message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.head_at = time.perf_counter()
            self.is_sse = any(
                k == b"content-type" and v.startswith(b"text/event-stream")
                for k, v in message.get("headers", ())
            )
        elif self.first_at is None and message.get("body"):
            self.first_at = time.perf_counter()
        await self.send(message)


@dataclass(slots=True)
class _Job:
    """One request on its way through the pools."""

    req: RoutedRequest
    ctx: Context  # the decode-side scheduling context (prefix matches, DP rank choice)
    headers: dict[str, str]
    request_id: bytes
    watch: _Watch
    started: float

    @property
    def rid(self) -> str:
        return self.ctx.request_id


class PDOrchestrator:
    def __init__(
        self,
        settings: PDSettings,
        fleet: FleetView,
        relay: Relay,
        forwarder: Forwarder,
        metrics: RouterMetrics,
        *,
        max_attempts: int = 3,
        kv: KVAwareness | None = None,
    ) -> None:
        self.settings = settings
        self.protocol = settings.protocol or "vllm"
        self.fleet = fleet
        self.relay = relay
        self.forwarder = forwarder
        self.kv = kv
        self.pools = Pools(fleet, settings, has_kvstore=kv is not None)
        self.decider = Decider(settings.min_prefill_tokens)
        self.metrics = PDMetrics(metrics, fleet)
        # Streamed decode legs answer their head only once the KV is in: that head is
        # bounded by the transfer deadline (plus the prefill's own, as SGLang runs both at once).
        head_s = settings.kv_transfer_timeout_s
        if self.protocol == "sglang":
            head_s += settings.prefill_timeout_s
        self.transfer_relay = Relay(
            connect_timeout_s=relay.connect_timeout_s,
            first_byte_timeout_s=head_s,
            idle_timeout_s=relay.idle_timeout_s,
            max_connections_per_worker=relay.max_connections_per_worker,
            max_head_bytes=relay.max_head_bytes,
            ssl_context=relay.ssl_context,
        )
        self.stream_forwarder = Forwarder(
            fleet,
            self.transfer_relay,
            metrics,
            max_attempts=max_attempts,
            backoff_s=forwarder.backoff_s,
            backoff_max_s=forwarder.backoff_max_s,
            kv=forwarder.kv,
            ttft_model=forwarder.ttft_model,
            started_requests=forwarder.started_requests,
        )
        self.tracing: Tracing | None = None

    def set_tracing(self, tracing: Tracing | None) -> None:
        """Legs as spans (``encode``, ``prefill``, ``decode``, ``kv_transfer``) when set."""
        self.tracing = tracing
        self.stream_forwarder.tracing = tracing

    async def start(self) -> None:
        await self.transfer_relay.start()

    async def stop(self) -> None:
        await self.transfer_relay.stop()

    def applies(self, req: RoutedRequest) -> bool:
        """Generation requests for a model that has prefill or decode workers."""
        if req.route not in PD_ROUTES:
            return False
        return bool(
            self.fleet.candidates(req.model, Role.PREFILL)
            or self.fleet.candidates(req.model, Role.DECODE)
        )

    async def handle(
        self,
        req: RoutedRequest,
        headers: dict[str, str],
        request_id: bytes,
        send: Send,
        started: float,
        ctx: Context | None = None,
    ) -> tuple[int, str]:
        """Answer ``req`` through the pools; returns (status, id of the worker that answered).
        ``ctx``: the context the answering leg fills (its tail, the tokens it generated),
        from ``context``, for a caller that reads the answer's usage afterwards."""
        rid = request_id.decode("latin-1")
        if req.route == CHAT and self.fleet.candidates(req.model, Role.ENCODE):
            refs = wire.image_refs(req.data)
            if refs:
                req = await self._encode(req, refs, headers, rid)
        if ctx is None:
            ctx = self.pools.context(req, rid)
        else:  # made before the images were encoded, which changes the prompt
            ctx.prompt_tokens = req.prompt_tokens_estimate
        job = _Job(req, ctx, headers, request_id, _Watch(send), started)
        decode_workers = self.fleet.candidates(req.model, Role.DECODE)
        if self.kv is not None and decode_workers:
            # Also lets the decode leg's answer record where the prompt's KV now lives.
            await self.kv.annotate(job.ctx, req, decode_workers)
        decode = self.pools.ranked(Role.DECODE, job.ctx, decode_workers)
        decision = self.decider.decide(job.ctx, decode_workers)
        verdict = "disaggregate" if decision.disaggregate else "direct"
        self.metrics.child(self.metrics.decisions, verdict, decision.source).inc()
        if not decision.disaggregate:
            direct = self._direct_targets(job, decode)
            if direct:
                self._path("direct")
                return await self._forward(job, req, direct)
        if not decode:
            return await self._fallback(job, "no_decode")
        pctx, prefill = await self._prefill_order(job)
        if not prefill:
            return await self._fallback(job, "no_prefill")
        if self.protocol == "sglang":
            return await self._sglang(job, pctx, prefill, decode)
        return await self._vllm(job, pctx, prefill, decode)

    def context(self, req: RoutedRequest, request_id: bytes) -> Context:
        """A new request's decode-side context, for ``handle``."""
        return self.pools.context(req, request_id.decode("latin-1"))

    async def _prefill_order(self, job: _Job) -> tuple[Context, list[Worker]]:
        workers = self.fleet.candidates(job.req.model, Role.PREFILL)
        ctx = self.pools.context(job.req, job.rid)
        if self.kv is not None and workers and self.pools.needs_prefix(Role.PREFILL):
            await self.kv.annotate(ctx, job.req, workers)
        return ctx, self.pools.ranked(Role.PREFILL, ctx, workers)

    async def _prefilled(self, ctx: Context, worker: Worker) -> None:
        """The prompt's KV now lives on ``worker``: tell the KV store (approximate mode)."""
        if self.kv is not None:
            await self.kv.placed(ctx, worker, None)

    async def _prefill_leg(self, job: _Job, worker: Worker, body: bytes) -> dict[str, Any]:
        call = call_json(
            self.fleet,
            self.relay,
            worker,
            job.req.route,
            body,
            job.headers,
            timeout_s=self.settings.prefill_timeout_s,
            prompt_tokens=job.req.prompt_tokens_estimate,
            tracing=self.tracing,
        )
        if self.tracing is None:
            return await call
        with self.tracing.span("prefill", {"switchyard.worker": worker.id}):
            return await call

    # vLLM: prefill leg, then decode leg with the prefill's kv_transfer_params.

    async def _vllm(
        self, job: _Job, pctx: Context, prefill: list[Worker], decode: list[Worker]
    ) -> tuple[int, str]:
        req = job.req
        body = wire.vllm_prefill(req.data)
        answer: dict[str, Any] | None = None
        last: LegError | None = None
        prefill_done = 0.0
        for worker in prefill[: max(1, self.settings.prefill_attempts)]:
            leg_started = time.perf_counter()
            try:
                answer = await self._prefill_leg(job, worker, body)
            except LegError as exc:
                self._leg_failed("prefill", exc)
                if not exc.retryable:
                    return await self._pass_error(job, exc, worker)
                last = exc
                continue
            prefill_done = time.perf_counter()
            self._phase("prefill", prefill_done - leg_started)
            await self._prefilled(pctx, worker)
            break
        if answer is None:
            return await self._fallback(job, "prefill_failed", last)
        params = answer.get("kv_transfer_params")
        if not isinstance(params, dict) or not params:
            self.metrics.child(self.metrics.fallbacks, "no_kv_transfer_params").inc()
            decode_req = req
        else:
            decode_req = replace(req, body=wire.vllm_decode(req.data, params))
        self._path("disaggregated")
        result = await self._decode(job, decode_req, decode)
        self._observe_decode(job.watch, prefill_done)
        return result

    # SGLang: both legs at once with a shared bootstrap room; either failing aborts the other.

    async def _sglang(
        self, job: _Job, pctx: Context, prefill: list[Worker], decode: list[Worker]
    ) -> tuple[int, str]:
        last: LegError | None = None
        watch = job.watch
        for worker in prefill[: max(1, self.settings.prefill_attempts)]:
            port = worker.spec.bootstrap_port or self.settings.default_bootstrap_port
            body = wire.sglang_bootstrap(job.req.data, wire.bootstrap_host(worker.url), port)
            leg_started = time.perf_counter()
            prefill_task = asyncio.create_task(self._prefill_leg(job, worker, body))
            decode_task = asyncio.create_task(
                self._decode(job, replace(job.req, body=body), decode)
            )
            try:
                await asyncio.wait({prefill_task, decode_task}, return_when=asyncio.FIRST_COMPLETED)
                if prefill_task.done() and prefill_task.exception() is not None:
                    exc = prefill_task.exception()
                    assert isinstance(exc, LegError)
                    self._leg_failed("prefill", exc)
                    if not decode_task.done():
                        await _cancel(decode_task)
                        self.metrics.child(self.metrics.aborts, "decode", exc.reason).inc()
                    if watch.started:
                        raise RouterError(502, f"prefill leg failed mid-response: {exc.message}")
                    if not exc.retryable:
                        return await self._pass_error(job, exc, worker)
                    last = exc
                    continue
                if prefill_task.done():
                    prefill_done = time.perf_counter()
                    self._phase("prefill", prefill_done - leg_started)
                    await self._prefilled(pctx, worker)
                    self._path("disaggregated")
                    result = await decode_task
                    self._observe_decode(watch, prefill_done)
                    return result
                if decode_task.exception() is not None:
                    self.metrics.child(self.metrics.aborts, "prefill", "decode_failed").inc()
                result = await decode_task
                self._path("disaggregated")
                await asyncio.wait({prefill_task}, timeout=1.0)
                if not prefill_task.done():
                    self.metrics.child(self.metrics.aborts, "prefill", "decode_ended").inc()
                elif prefill_task.exception() is None:
                    self._phase("prefill", time.perf_counter() - leg_started)
                    await self._prefilled(pctx, worker)
                return result
            finally:
                await _cancel(prefill_task)
                await _cancel(decode_task)
        return await self._fallback(job, "prefill_failed", last)

    # E/P/D: the encode leg, whose handle (if any) rides along to prefill and decode.

    async def _encode(
        self, req: RoutedRequest, refs: list[str], headers: dict[str, str], rid: str
    ) -> RoutedRequest:
        if self.tracing is None:
            return await self._encode_leg(req, refs, headers, rid)
        with self.tracing.span("encode", {"switchyard.images": len(refs)}):
            return await self._encode_leg(req, refs, headers, rid)

    async def _encode_leg(
        self, req: RoutedRequest, refs: list[str], headers: dict[str, str], rid: str
    ) -> RoutedRequest:
        workers = self.fleet.candidates(req.model, Role.ENCODE)
        ctx = self.pools.context(req, rid, key=image_key(refs))
        body = orjson.dumps(wire.one_token(req.data))
        for worker in self.pools.ranked(Role.ENCODE, ctx, workers)[
            : max(1, self.settings.prefill_attempts)
        ]:
            leg_started = time.perf_counter()
            try:
                answer = await call_json(
                    self.fleet,
                    self.relay,
                    worker,
                    CHAT,
                    body,
                    headers,
                    timeout_s=self.settings.encode_timeout_s,
                    prompt_tokens=0,
                    tracing=self.tracing,
                )
            except LegError as exc:
                self._leg_failed("encode", exc)
                continue
            self._phase("encode", time.perf_counter() - leg_started)
            params = answer.get("ec_transfer_params")
            if not isinstance(params, dict) or not params:
                return req
            data = {**req.data, "ec_transfer_params": params}
            return replace(req, data=data, body=orjson.dumps(data))
        self.metrics.child(self.metrics.fallbacks, "encode_failed").inc()
        return req

    # Paths that send the whole request to one worker.

    def _direct_targets(self, job: _Job, decode: list[Worker]) -> list[Worker]:
        """Where a request that skips the prefill pool may go: vLLM decode workers prefill
        locally; SGLang decode workers only take bootstrapped requests, so unified ones."""
        unified = self.fleet.candidates(job.req.model, Role.UNIFIED)
        unified = self.pools.ranked(Role.UNIFIED, job.ctx, unified)
        if self.protocol == "vllm":
            return decode + unified
        return unified

    def _fallback_targets(self, req: RoutedRequest) -> list[Worker]:
        workers = self.fleet.candidates(req.model, Role.UNIFIED)
        if self.protocol == "vllm":
            workers = self.fleet.candidates(req.model, Role.DECODE) + workers
        return workers

    async def _fallback(
        self, job: _Job, reason: str, last: LegError | None = None
    ) -> tuple[int, str]:
        targets = self._fallback_targets(job.req) if self.settings.fallback else []
        if not targets:
            raise self._failure(reason, last)
        self.metrics.child(self.metrics.fallbacks, reason).inc()
        self._path("fallback")
        return await self._forward(job, job.req, self.pools.ranked(Role.DECODE, job.ctx, targets))

    def _failure(self, reason: str, last: LegError | None) -> RouterError:
        """The clear error a disaggregated request ends with when nothing can take it."""
        if last is not None and last.reason == "timeout":
            what = "KV transfer" if self.protocol == "sglang" else "prefill leg"
            return RouterError(
                504,
                f"Disaggregated request failed: {what} timed out after "
                f"{self.settings.prefill_timeout_s:g}s ({last.message})",
                code="kv_transfer_timeout" if self.protocol == "sglang" else "prefill_timeout",
            )
        detail = f": {last.message}" if last is not None else ""
        return RouterError(
            503 if reason.startswith("no_") else 502,
            f"Disaggregated request failed ({reason.replace('_', ' ')}{detail}) "
            "and no decode/unified worker can take it whole",
            code=f"pd_{reason}",
            headers={"retry-after": "1"},
        )

    async def _forward(
        self, job: _Job, req: RoutedRequest, ranked: list[Worker], *, transfer: bool = False
    ) -> tuple[int, str]:
        """Relay ``req`` from the first of ``ranked`` that answers. A streamed decode leg
        (``transfer``) sends its head once the KV is in, so a late head is a transfer timeout."""
        forwarder = self.stream_forwarder if req.stream else self.forwarder
        try:
            return await forwarder.forward(
                req, job.ctx, ranked, job.headers, job.request_id, job.watch, job.started
            )
        except RouterError as exc:
            if not (transfer and req.stream and exc.code == "upstream_timeout"):
                raise
            raise RouterError(
                504,
                f"KV transfer timed out: no decode worker started answering within "
                f"{self.transfer_relay.first_byte_timeout_s:g}s ({exc.message})",
                code="kv_transfer_timeout",
            ) from None

    async def _decode(self, job: _Job, req: RoutedRequest, ranked: list[Worker]) -> tuple[int, str]:
        """The decode leg of a disaggregated request (a ``decode`` span when traced)."""
        if self.tracing is None:
            return await self._forward(job, req, ranked, transfer=True)
        with self.tracing.span("decode"):
            return await self._forward(job, req, ranked, transfer=True)

    async def _pass_error(self, job: _Job, exc: LegError, worker: Worker) -> tuple[int, str]:
        """A leg's client error (bad request, context too long) goes back as the engine said it."""
        body = exc.body or b""
        headers = [(b"content-type", b"application/json"), (b"x-request-id", job.request_id)]
        await send_complete(job.watch, exc.status, headers, body)
        return exc.status, worker.id

    # Metrics.

    def _path(self, path: str) -> None:
        self.metrics.child(self.metrics.paths, self.protocol, path).inc()

    def _phase(self, phase: str, seconds: float) -> None:
        self.metrics.child(self.metrics.phase, self.protocol, phase).observe(max(0.0, seconds))

    def _leg_failed(self, leg: str, exc: LegError) -> None:
        self.metrics.child(self.metrics.leg_failures, leg, exc.reason).inc()

    def _observe_decode(self, watch: _Watch, prefill_done: float) -> None:
        if not watch.is_sse or watch.head_at is None or not prefill_done:
            return
        self._phase("transfer", watch.head_at - prefill_done)
        if self.tracing is not None:
            self.tracing.mark("kv_transfer", prefill_done, watch.head_at, {})
        if watch.first_at is not None:
            self._phase("decode_first_token", watch.first_at - watch.head_at)


async def _cancel(task: asyncio.Task[Any]) -> None:
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def build_orchestrator(
    settings: PDSettings,
    fleet: FleetView,
    relay: Relay,
    forwarder: Forwarder,
    metrics: RouterMetrics,
    *,
    max_attempts: int = 3,
    kv: KVAwareness | None = None,
) -> PDOrchestrator | None:
    """An orchestrator when P/D is configured (a protocol or P/D worker URLs), else None."""
    if settings.protocol is None and not (settings.prefill or settings.decode):
        return None
    return PDOrchestrator(
        settings, fleet, relay, forwarder, metrics, max_attempts=max_attempts, kv=kv
    )
