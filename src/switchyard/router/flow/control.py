"""Flow control's asyncio side: admit a request at once, queue it, or refuse it clearly.

The decisions live in the pure ``FlowQueue`` (who goes next), ``saturated`` (is a worker
full) and ``TenantRateLimiter`` (may this tenant spend more); this module is the glue that
gives each waiting request a future and answers it. A request is routed only once it is
granted, so the KV-aware choice is made against the fleet as it is at dispatch.

- Fast path: nothing waits and some candidate of the model is not saturated: granted with
  a few attribute reads and one scan over the candidates, no allocation (one grant object
  is kept per tenant); a long prompt under a prefill cap is granted as ``starting``, as
  a dispatched one is.
- Slow path: a sheddable request (negative priority) is refused ``shed`` at once; any
  other is pushed and waits for ``pump``, which runs on every release, on every
  ``begun`` and, only while something waits, on a short timer (an idle router runs none).
- A dispatched request counts as ``starting`` until the app says it ``begun`` (its worker
  chosen): the router's in-flight counts, which ``saturated`` reads, only grow once the
  request reaches a worker, so without it one pump would release the whole queue at once.
- A model served by prefill and decode pools waits the same way, for a free prefill
  worker and a free decode worker (``_pd_can_serve``); it is charged its prompt at
  dispatch and settled on the decode leg's usage.
- Under ``--processes N`` each process tells its siblings, over the router's bus, while it
  has requests waiting (at once when it starts to, again every ``ANNOUNCE_S`` while it
  does), and keeps to its part of the caps while others do (see ``saturated``).

Every waiter ends: granted, 429 ``queue_full``/``queue_timeout``, 503 ``shutting_down``,
or removed when its client goes (the caller's task is cancelled).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from switchyard.balancer.worker import Role
from switchyard.router.errors import RouterError
from switchyard.router.flow.identity import Identity
from switchyard.router.flow.queue import FlowQueue, Queued, QueueLimits, Refused
from switchyard.router.flow.ratelimit import (
    RateLimited,
    RateLimits,
    Reservation,
    Share,
    TenantRateLimiter,
)
from switchyard.router.flow.saturation import SHORT_PROMPT_SHARE, Thresholds, saturated

if TYPE_CHECKING:
    from switchyard.balancer.siblings import SiblingBus
    from switchyard.balancer.view import FleetView
    from switchyard.balancer.worker import Worker
    from switchyard.router.metrics import FlowMetrics
    from switchyard.router.settings import Flow as FlowSettings

REASON_HEADER = "x-switchyard-reason"
PUMP_INTERVAL_S = 0.02
# sibling-bus topic: b"1" while a process has requests waiting, b"2" while they wait and
# none has left its queue for ``STALL_S``, else b"0"
TOPIC = b"flow"
# A process whose waiting requests saw no dispatch for this long (of time with requests
# waiting) says it has stalled: its siblings' prompts, each within their part of the
# prefill cap, can keep every worker from draining, which its long prompts wait for; the
# siblings then put prompts that do not fit one step ahead only on drained workers in
# their turn, until it moves.
STALL_S = 2.0
ANNOUNCE_S = 0.5  # a waiting process says so again this often
# A sibling not heard saying it waits for this long is taken not to (it may have died).
CONTENDER_TTL_S = 3 * ANNOUNCE_S
# A drained worker's turn (``saturation``) passes from one contending process to the next
# this often, on the monotonic clock, which the processes of one host share, so they agree
# whose turn it is without a message. Short, since a turn whose holder has no long prompt
# waiting leaves that worker's prefill idle until it passes.
TURN_S = 0.2
# Dispatches remembered to tell the rate the queue drains at, in prompt tokens a second;
# fewer seen: no estimate.
_RATE_SAMPLES = 16
# A request is refused on arrival when its expected wait passes this share of the TTL:
# the drain rate swings with the siblings' share of the caps and the engines' pace, and
# a request let in near the TTL may time out after waiting all of it, the slowest
# refusal there is.
_HOPELESS_SHARE = 0.25
# A queued request is looked at again this long after it arrived, still within the
# second in which a refusal is due, when what left the queue since tells more than the
# arrival's estimate did (none, before enough dispatches); it is refused then if its
# remaining wait passes this larger share of the TTL.
SECOND_LOOK_S = 0.5
_SECOND_LOOK_SHARE = 0.5
# An answer's tokens are charged to its tenant's fair share within this long, or before
# the queue next orders requests (or a scrape), if sooner: summed per tenant meanwhile,
# since a charge an answer costs several times an addition.
SETTLE_S = 0.1


class Grant:
    """A request's permission to be routed; handed back to ``FlowControl.release`` once."""

    __slots__ = ("tenant", "model", "reservation", "starting")

    def __init__(
        self, tenant: str, model: str, reservation: Reservation | None, starting: bool
    ) -> None:
        self.tenant = tenant
        self.model = model
        self.reservation = reservation
        self.starting = starting  # dispatched from the queue, its worker not yet chosen


class _Waiter:
    """A queued request's side of the wait: its future and its rate-limit reservation."""

    __slots__ = ("future", "reservation")

    def __init__(self, future: asyncio.Future[Grant], reservation: Reservation | None) -> None:
        self.future = future
        self.reservation = reservation


def refusal(status: int, reason: str, message: str, retry_after_s: float | None) -> RouterError:
    """The router's answer to a request flow control will not run."""
    headers = {REASON_HEADER: reason}
    if retry_after_s is not None:
        headers["retry-after"] = str(max(1, int(retry_after_s + 0.999)))
    return RouterError(status, message, code=reason, headers=headers)


def _hopeless(wait_s: float, ttl_s: float) -> RouterError:
    """The refusal of a request that would wait ``wait_s``, too near the TTL."""
    return refusal(
        429,
        "queue_full",
        f"This request would wait about {wait_s:.0f} s for a worker, too near "
        f"the queue's {ttl_s:g} s; retry later",
        min(max(1.0, wait_s - ttl_s * _HOPELESS_SHARE), ttl_s),
    )


def thresholds_of(settings: FlowSettings) -> Thresholds:
    """When a worker counts as saturated, from the router's ``flow`` settings."""
    return Thresholds(
        queue_depth=settings.queue_depth,
        kv_usage=settings.kv_usage,
        metrics_staleness_s=settings.metrics_staleness_s,
        max_inflight=settings.max_inflight_per_worker,
        max_queued_prefill_tokens=settings.max_queued_prefill_tokens,
    )


def queue_limits_of(settings: FlowSettings) -> QueueLimits:
    """The queue's caps, TTL, ordering and fair-share weights, from the ``flow`` settings."""
    return QueueLimits(
        max_requests_per_band=settings.max_requests_per_band,
        max_bytes_per_band=settings.max_bytes_per_band,
        ttl_s=settings.queue_ttl_s,
        ordering=settings.ordering,
        output_weight=settings.output_weight,
        half_life_s=settings.half_life_s,
    )


class FlowControl:
    def __init__(
        self,
        fleet: FleetView,
        settings: FlowSettings,
        metrics: FlowMetrics,
        clock: Callable[[], float] = time.monotonic,
        retry_after_s: float = 1.0,
        share: Share | None = None,
        siblings: SiblingBus | None = None,
    ) -> None:
        """``retry_after_s``: what a refused client is told when no better figure is known;
        ``share``: how the rate limits are shared with other processes and replicas;
        ``siblings``: the bus to this router's other processes, to share the caps with."""
        self.fleet = fleet
        self.metrics = metrics
        self.clock = clock
        self.retry_after_s = retry_after_s
        self.thresholds = thresholds_of(settings)
        self.decode_thresholds = replace(self.thresholds, max_queued_prefill_tokens=0)
        self.queue = FlowQueue(queue_limits_of(settings), clock)
        limits = RateLimits(settings.tenant_tokens_per_minute, settings.tenant_requests_per_minute)
        self.limiter = TenantRateLimiter(limits, clock, share) if limits.enabled else None
        self.share = share if self.limiter is not None else None
        self.closed = False
        self._grants: dict[str, Grant] = {}  # the fast path's, one per tenant, reused
        self._starting: dict[str, int] = {}  # model -> dispatched, worker not yet chosen
        self._timer: asyncio.TimerHandle | None = None
        # (when on the busy clock, prompt tokens): the clock stands still while nothing
        # waits, so an idle hour does not read as a slow queue once requests wait again
        self._dispatched: deque[tuple[float, int]] = deque()
        self._dispatched_tokens = 0
        self._idle_s = 0.0  # time with nothing queued, before ``_idle_since``
        self._idle_since: float | None = clock()
        self._arrivals: deque[Queued] = deque()  # queued, awaiting their second look
        self._pump_soon = False
        self.siblings = siblings
        self._waiting_siblings: dict[str, float] = {}  # origin -> when it last said so
        self._stalled_siblings: dict[str, float] = {}  # origin -> when it last said so
        self._progress_at = 0.0  # on the busy clock: the last dispatch, or the wait began
        self._announced: bytes = b"0"
        self._sorted_ids: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
        self._announced_at: float | None = None  # when this process last said it waits
        self._unsettled: dict[str, list[int]] = {}  # tenant -> [prompt, output] tokens
        self._settle_due = False
        if siblings is not None:
            siblings.on(TOPIC, self._heard)
        metrics.watch(self.queue.sizes, self.saturated_models, self.settle)

    async def start(self) -> None:
        if self.share is not None:
            await self.share.start()

    async def stop(self) -> None:
        self.shutdown()
        if self.share is not None:
            await self.share.stop()

    # -- capacity ----------------------------------------------------------------------

    def _contending(self, now: float) -> list[str]:
        """The siblings heard lately saying they have requests waiting."""
        waiting = self._waiting_siblings
        if not waiting:
            return []
        return [origin for origin, heard in waiting.items() if now - heard <= CONTENDER_TTL_S]

    def contenders(self, now: float) -> int:
        """This process and the siblings that have requests waiting."""
        return 1 + len(self._contending(now))

    def turns(self, model: str, candidates: list[Worker], now: float) -> frozenset[str] | None:
        """The workers of ``model`` on which it is this process's turn to put a prompt
        longer than its part once drained; None while no sibling contends (every one).
        Worker ``i`` of the sorted ids is the turn of contender ``(i + epoch) % k``, the
        contenders sorted by bus id and the epoch counted in ``TURN_S``."""
        siblings = self.siblings
        contending = self._contending(now)
        if siblings is None or not contending:
            return None
        contending.append(siblings.instance)
        contending.sort()
        k = len(contending)
        me = contending.index(siblings.instance)
        ids = tuple(w.id for w in candidates)
        cached = self._sorted_ids.get(model)
        if cached is None or cached[0] != ids:
            cached = self._sorted_ids[model] = (ids, tuple(sorted(ids)))
        epoch = int(now / TURN_S)
        return frozenset(w for i, w in enumerate(cached[1]) if (i + epoch) % k == me)

    def free_workers(self, candidates: list[Worker], now: float) -> int:
        """How many of ``candidates`` are not saturated."""
        free = 0
        thresholds = self.thresholds
        contenders = self.contenders(now)
        for worker in candidates:
            if not saturated(worker, thresholds, now, contenders):
                free += 1
        return free

    def can_serve(
        self, model: str, prompt_tokens: int = 0, candidates: list[Worker] | None = None
    ) -> bool:
        """Whether a request for ``model`` of ``prompt_tokens`` may be routed now: some
        candidate has room for it beyond the dispatched requests still choosing one. A model
        no worker serves is "served" at once, so routing answers it (404 or 503) rather than
        the queue holding it. ``candidates``: the fleet's for ``model`` now, where the caller
        has them already."""
        if candidates is None:
            candidates = self.fleet.candidates(model)
        if not candidates:
            return self._pd_can_serve(model, prompt_tokens)
        # free workers the dispatched ones will take
        needed = self._starting.get(model, 0) if self._starting else 0
        thresholds = self.thresholds
        now = self.clock()
        if self._waiting_siblings:
            contenders = self.contenders(now)
            turns = self.turns(model, candidates, now) if contenders > 1 else None
            drained_only = self._yielding(now)
        else:  # alone: the whole caps, every worker's turn
            contenders, turns, drained_only = 1, None, False
        for worker in candidates:  # stops at the first free one beyond those
            turn = turns is None or worker.id in turns
            if not saturated(
                worker, thresholds, now, contenders, prompt_tokens, turn, drained_only
            ):
                if not needed:
                    return True
                needed -= 1
        return False

    def _pd_can_serve(self, model: str, prompt_tokens: int) -> bool:
        """``can_serve`` for a model served by prefill and decode pools: as many free
        pairs as the dispatched requests still choosing take, and one more. A prefill
        worker is judged with the request's prompt; a decode worker on its engine's queue,
        KV usage and in-flight cap only, since the prompt it is sent is prefilled
        elsewhere. A pool left empty is no bound (a decode pool alone prefills locally,
        and is judged as a unified one; no pool at all: routing answers)."""
        prefill = self.fleet.candidates(model, Role.PREFILL)
        decode = self.fleet.candidates(model, Role.DECODE)
        if not prefill and not decode:
            return True
        now = self.clock()
        contenders = self.contenders(now)
        free = None
        for pool, thresholds in (
            (prefill, self.thresholds),
            (decode, self.decode_thresholds if prefill else self.thresholds),
        ):
            if pool:
                count = sum(
                    1 for w in pool if not saturated(w, thresholds, now, contenders, prompt_tokens)
                )
                free = count if free is None else min(free, count)
        return free is not None and free > self._starting.get(model, 0)

    def saturated_models(self) -> list[str]:
        """The models whose every candidate (or every prefill or decode candidate) is
        saturated now (for /metrics)."""
        now = self.clock()
        out = []
        for model in self.fleet.models():
            candidates = self.fleet.candidates(model)
            if candidates:
                if not self.free_workers(candidates, now):
                    out.append(model)
            elif not self._pd_can_serve(model, 0):
                out.append(model)
        return out

    def engine_priority(self, identity: Identity) -> int:
        """vLLM's ``priority`` (lower first) for ``identity``'s request as it leaves for its
        worker, so an engine that orders its waiting queue by priority keeps the router's
        order there too: a higher band first, and in a band a tenant with nothing left
        waiting here before one whose backlog still waits (a flood's next prompt, queued
        on the engine to keep it busy, goes after a quiet tenant's request that came
        later)."""
        return -2 * identity.priority + (1 if self.queue.waiting(identity.tenant) else 0)

    # -- admission ---------------------------------------------------------------------

    def grant_now(
        self,
        tenant: str,
        model: str,
        prompt_tokens: int = 0,
        candidates: list[Worker] | None = None,
    ) -> Grant | None:
        """The fast path: a grant when nothing waits, no rate limit applies and some
        candidate of ``model`` (``candidates``, where the caller has them) has room for
        ``prompt_tokens``; else None (``admit`` decides)."""
        if (
            self.limiter is not None
            or self.queue.size
            or not self.can_serve(model, prompt_tokens, candidates)
        ):
            return None
        if self._claims(prompt_tokens):
            return self._starting_grant(tenant, model, None)
        grant = self._grants.get(tenant)
        if grant is None:
            grant = self._grants[tenant] = Grant(tenant, model, None, False)
        return grant

    def _claims(self, prompt_tokens: int) -> bool:
        """Whether a prompt granted at once takes a worker's room for one long prompt
        (``saturation``): longer than a short one, under a prefill cap."""
        cap = self.thresholds.max_queued_prefill_tokens
        return bool(cap) and prompt_tokens * SHORT_PROMPT_SHARE > cap

    def _starting_grant(self, tenant: str, model: str, reservation: Reservation | None) -> Grant:
        """A grant counted among the starting until its worker is chosen, as a dispatched
        one is: the worker's counts grow only then, and a burst of long prompts granted
        at once would meanwhile all see the same drained worker and queue on it."""
        self._starting[model] = self._starting.get(model, 0) + 1
        return Grant(tenant, model, reservation, True)

    async def admit(
        self,
        identity: Identity,
        model: str,
        size_bytes: int,
        prompt_tokens: int,
        max_tokens: int | None = None,
    ) -> Grant:
        """Grant ``identity``'s request for ``model`` now or once its turn comes; raise
        ``RouterError`` for a refusal (429 with Retry-After and the reason header; 503 once
        shutting down). A cancelled caller (client gone) leaves the queue."""
        tenant = identity.tenant
        reservation = None
        if self.limiter is not None:
            try:
                reservation = self.limiter.reserve(tenant, prompt_tokens, max_tokens)
            except RateLimited as limited:
                self.metrics.outcome("rate_limited")
                raise refusal(
                    429,
                    "rate_limited",
                    f"This tenant is over its {limited.kind} per minute; retry later",
                    limited.retry_after_s,
                ) from None
        if not self.queue.size and self.can_serve(model, prompt_tokens):
            if self._claims(prompt_tokens):
                return self._starting_grant(tenant, model, reservation)
            return Grant(tenant, model, reservation, False)
        return await self._wait(identity, model, size_bytes, prompt_tokens, reservation)

    async def _wait(
        self,
        identity: Identity,
        model: str,
        size_bytes: int,
        prompt_tokens: int,
        reservation: Reservation | None,
    ) -> Grant:
        try:
            if self.closed:
                self.metrics.outcome("shutdown")
                raise refusal(503, "shutting_down", "The router is shutting down", None)
            if identity.sheddable and not self.can_serve(model, prompt_tokens):
                self.metrics.outcome("shed")
                raise refusal(
                    429,
                    "shed",
                    "Every worker is saturated; sheddable request refused",
                    self.retry_after_s,
                )
            self._refuse_if_hopeless(identity, prompt_tokens)
            waiter = _Waiter(asyncio.get_running_loop().create_future(), reservation)
            item = Queued(identity, model, size_bytes, prompt_tokens, self.clock(), waiter)
            if self._unsettled:  # a tenant (re)joining is lifted to the counters queued
                self.settle()
            try:
                self.queue.push(item)
            except Refused as refused:
                self.metrics.outcome("queue_full")
                raise refusal(
                    429,
                    "queue_full",
                    "The router's queue is full; retry later",
                    refused.retry_after_s,
                ) from None
        except RouterError:
            self._cancel(reservation)
            raise
        self._busy()
        if self.queue.limits.ttl_s:
            self._arrivals.append(item)
        self.pump()
        future = waiter.future
        try:
            return await future
        except asyncio.CancelledError:
            if self.queue.remove(item):
                self.metrics.outcome("client_gone")
                self._cancel(reservation)
            elif future.done() and not future.cancelled() and future.exception() is None:
                self.release(future.result(), 0, 0)  # granted as the client went: never ran
            raise
        except RouterError:
            self._cancel(reservation)
            raise

    def drain_rate(self) -> float | None:
        """Prompt tokens a second that left the queue over the last ``_RATE_SAMPLES``
        dispatches, the time since the last one included so that a stalled queue counts
        as slow; None until that many were seen. In tokens, not requests, since a quiet
        tenant's short prompts leave many times faster than a flood's long ones."""
        times = self._dispatched
        if len(times) < _RATE_SAMPLES:
            return None
        span = self._busy_clock() - times[0][0]
        return self._dispatched_tokens / span if span > 0 else None

    def _busy(self) -> None:
        """Requests wait now: the busy clock runs again."""
        if self._idle_since is not None:
            self._idle_s += self.clock() - self._idle_since
            self._idle_since = None
            self._progress_at = self._busy_clock()

    def stalled(self) -> bool:
        """Requests wait here and none left the queue for ``STALL_S``."""
        return bool(self.queue.size) and self._busy_clock() - self._progress_at > STALL_S

    def _yielding(self, now: float) -> bool:
        """A sibling heard lately saying its queue has stalled."""
        stalled = self._stalled_siblings
        return bool(stalled) and any(now - heard <= CONTENDER_TTL_S for heard in stalled.values())

    def _busy_clock(self) -> float:
        """Time with requests queued, the current stretch included."""
        now = self.clock()
        idle = self._idle_s
        if self._idle_since is not None:
            idle += now - self._idle_since
        return now - idle

    def expected_wait_s(self, identity: Identity, prompt_tokens: int) -> float | None:
        """How long a new request of ``identity`` with ``prompt_tokens`` would wait in the
        queue: the tokens dispatched before it (``FlowQueue.tokens_ahead``) at the drain
        rate. None while no rate is known."""
        rate = self.drain_rate()
        if rate is None:
            return None
        return self.queue.tokens_ahead(identity, prompt_tokens) / rate

    def _refuse_if_hopeless(self, identity: Identity, prompt_tokens: int) -> None:
        """Refuse at once a request that would wait too near the queue's TTL (past
        ``_HOPELESS_SHARE`` of it): its client learns in milliseconds, not when the TTL has
        passed (a flood's excess, while every other tenant's requests still fit). The
        wait is the estimate, or how long the head of its tenant's line in its band has
        waited if longer: the wait its line has actually had, which holds the line to the
        share of the TTL when the estimate runs short (engines slowing, bursts of
        dispatches), since those behind the head wait at least as long in turn."""
        ttl = self.queue.limits.ttl_s
        if not ttl or not self.queue.size:
            return
        wait = self.expected_wait_s(identity, prompt_tokens)
        head = self.queue.oldest(identity)
        if head is not None:
            wait = max(wait or 0.0, self.clock() - head)
        if wait is not None and wait > ttl * _HOPELESS_SHARE:
            self.metrics.outcome("queue_full")
            raise _hopeless(wait, ttl)

    def _second_look(self) -> None:
        """Refuse the queued requests, past ``SECOND_LOOK_S`` since they came, whose
        remaining wait at the drain rate now passes ``_SECOND_LOOK_SHARE`` of the TTL."""
        arrivals = self._arrivals
        if not arrivals:
            return
        now = self.clock()
        ttl = self.queue.limits.ttl_s
        rate = self.drain_rate()
        while arrivals and now - arrivals[0].enqueued_at >= SECOND_LOOK_S:
            item = arrivals.popleft()
            if not item.queued or not ttl or rate is None:
                continue
            wait = self.queue.tokens_ahead_of(item) / rate
            if wait > ttl * _SECOND_LOOK_SHARE and self.queue.remove(item):
                waiter: _Waiter = item.payload
                if not waiter.future.done():
                    self.metrics.outcome("queue_full")
                    waiter.future.set_exception(_hopeless(wait, ttl))

    def _cancel(self, reservation: Reservation | None) -> None:
        if reservation is not None and self.limiter is not None:
            self.limiter.cancel(reservation)

    def begun(self, grant: Grant) -> None:
        """``grant``'s worker is chosen: it no longer holds a place among the starting, and
        the next waiting request may be judged against the fleet's counts."""
        if grant.starting:
            grant.starting = False
            self._started(grant.model)

    def release(self, grant: Grant, prompt_tokens: int, output_tokens: int) -> None:
        """The request ended having been served ``prompt_tokens`` and ``output_tokens``:
        charge its tenant's fair share and its rate limit, then dispatch who waits."""
        if grant.starting:
            grant.starting = False
            self._started(grant.model)
        if prompt_tokens or output_tokens:
            unsettled = self._unsettled.get(grant.tenant)
            if unsettled is None:
                self._unsettled[grant.tenant] = [prompt_tokens, output_tokens]
                if not self._settle_due:
                    self._settle_due = True
                    asyncio.get_running_loop().call_later(SETTLE_S, self._settle_later)
            else:
                unsettled[0] += prompt_tokens
                unsettled[1] += output_tokens
        if grant.reservation is not None and self.limiter is not None:
            self.limiter.settle(grant.reservation, prompt_tokens, output_tokens)
        if self.queue.size:
            self.pump()

    def settle(self) -> None:
        """Charge each tenant's fair share, and count into the metrics, the tokens it was
        served since the last settle."""
        unsettled, self._unsettled = self._unsettled, {}
        for tenant, (prompt_tokens, output_tokens) in unsettled.items():
            self.queue.charge(tenant, prompt_tokens, output_tokens)
            self.metrics.served(tenant, prompt_tokens, output_tokens)

    def _settle_later(self) -> None:
        self._settle_due = False
        self.settle()

    def prefilled(self) -> None:
        """A worker produced a first token: its queued prefill shrank, so a waiting
        request may fit now (rather than at the next tick)."""
        if self.queue.size:
            self.pump()

    def _started(self, model: str) -> None:
        left = self._starting[model] - 1
        if left:
            self._starting[model] = left
        else:
            del self._starting[model]
        if self.queue.size and not self._pump_soon:
            # after the caller's task has gone on to its worker, whose in-flight count is
            # then up to date
            self._pump_soon = True
            asyncio.get_running_loop().call_soon(self._pump_later)

    def _pump_later(self) -> None:
        self._pump_soon = False
        self.pump()

    # -- dispatch ----------------------------------------------------------------------

    def pump(self) -> None:
        """Dispatch waiting requests while capacity allows; keep the timer while any wait."""
        queue = self.queue
        if self._unsettled:  # the order below reads the tenants' counters
            self.settle()
        for expired in queue.expire():
            self._refuse_expired(expired)
        self._second_look()
        while queue.size:
            item = queue.pop(self.can_serve)
            if item is None:
                break
            self._dispatch(item)
        if queue.size:
            if self._timer is None:
                self._timer = asyncio.get_running_loop().call_later(PUMP_INTERVAL_S, self._tick)
        else:
            if self._idle_since is None:
                self._idle_since = self.clock()
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        if self.siblings is not None:
            self._announce(bool(queue.size))

    def _announce(self, waiting: bool) -> None:
        """Tell the siblings whether requests wait here, and whether they have stalled: at
        once when that changes, and again every ``ANNOUNCE_S`` while they wait."""
        assert self.siblings is not None
        last = self._announced_at
        if waiting:
            state = b"2" if self.stalled() else b"1"
            now = self.clock()
            if state == self._announced and last is not None and now - last < ANNOUNCE_S:
                return
            changed = state != self._announced
            self._announced_at = now
            self._announced = state
            self.siblings.publish(TOPIC, state, key="waiting", lazy=not changed)
        elif last is not None:
            self._announced_at = None
            self._announced = b"0"
            self.siblings.publish(TOPIC, b"0", key="waiting")

    def _heard(self, origin: str, payload: bytes) -> None:
        """A sibling's word on whether requests wait there (and have stalled); one that
        stops waiting or stalling leaves this process more room, so the queue is looked at
        again."""
        now = self.clock()
        freed = False
        if payload in (b"1", b"2"):
            self._waiting_siblings[origin] = now
        else:
            freed = self._waiting_siblings.pop(origin, None) is not None
        if payload == b"2":
            self._stalled_siblings[origin] = now
        else:
            freed |= self._stalled_siblings.pop(origin, None) is not None
        if freed and self.queue.size:
            self.pump()

    def _tick(self) -> None:
        self._timer = None
        self.pump()

    def _dispatch(self, item: Queued) -> None:
        waiter: _Waiter = item.payload
        if waiter.future.done():  # its task was cancelled a moment ago: nothing to run
            self._cancel(waiter.reservation)
            return
        model = item.model
        dispatched = self._dispatched
        if len(dispatched) == _RATE_SAMPLES:
            self._dispatched_tokens -= dispatched.popleft()[1]
        self._progress_at = self._busy_clock()
        dispatched.append((self._progress_at, item.weight))
        self._dispatched_tokens += item.weight
        self._starting[model] = self._starting.get(model, 0) + 1
        waiter.future.set_result(Grant(item.identity.tenant, model, waiter.reservation, True))
        self.metrics.dispatched(item.identity.priority, self.clock() - item.enqueued_at)

    def _refuse_expired(self, item: Queued) -> None:
        future = item.payload.future
        if not future.done():
            self.metrics.outcome("queue_timeout")
            future.set_exception(
                refusal(
                    429,
                    "queue_timeout",
                    "No worker had room for this request in time; retry later",
                    self.retry_after_s,
                )
            )

    def shutdown(self) -> None:
        """Answer every waiting request 503 at once, and any later one that would wait (one
        with room goes on: a draining router still serves)."""
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.siblings is not None:
            self._announce(False)
        self._arrivals.clear()
        for item in self.queue.drain():
            future = item.payload.future
            if not future.done():
                self.metrics.outcome("shutdown")
                future.set_exception(
                    refusal(503, "shutting_down", "The router is shutting down", None)
                )
