"""The flow-control dispatcher core: who goes next when the fleet has room again.

Order: strictly by priority band (higher first); within a band, the tenant with the least
virtual token counter (VTC: the tokens it was served, an output token costing
``output_weight`` prompt tokens, halved every ``half_life_s``); within a tenant, first come
first served, or earliest deadline first. Pure code on an injected clock: no I/O, no asyncio,
so the router, simulations and unit tests drive the same decisions.

Fairness follows VTC (Sheng et al., "Fairness in Serving LLMs", OSDI'24): a tenant that
(re)joins the queue after being idle is lifted to the least counter of the tenants queued
(or, with nothing queued, of the tenant served last), so idling banks no credit. A
dispatched request is charged its prompt tokens at once, as an advance that its answer's
charge settles, so a burst of free slots goes round the tenants instead of all to one.

Data structures, for ``n`` queued requests and ``T`` tenants in a band:

- each band keeps a heap of its tenants keyed by counter, one live entry per tenant. A
  charge only raises a counter, so entries go stale low and are re-keyed lazily when they
  reach the top: push and pop are O(log n + log T) amortised;
- decay multiplies every counter by the same factor, which keeps the heap order, so
  counters are stored in units of a fixed origin (a charge at time ``t`` adds
  ``cost * 2**((t - origin) / half_life)``) and rescaled in place once in a long while;
- each tenant keeps one heap per model (keyed by arrival, or by deadline), so ``pop`` can
  skip a model with no capacity without scanning its requests; with such a model, ``pop``
  also passes over the tenants that only have its requests (O(T log T) at worst);
- each band keeps a FIFO of its requests for the TTL and the caps' retry hints. Requests
  removed (client gone, expired) are dropped lazily from the heaps and FIFO, which are
  compacted when such leftovers outnumber the live entries.
"""

from __future__ import annotations

import heapq
import itertools
import math
from bisect import insort
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from switchyard.router.flow.identity import Identity

# Counters are rescaled when their stored units have grown by 2**this since the origin.
_RESCALE_HALF_LIVES = 30.0
# Lazily dropped leftovers are compacted when they outnumber live entries by this much.
_COMPACT_SLACK = 32
# Refusals hint a retry within [1 s, TTL] (this with no TTL): how long the oldest has waited.
_MAX_RETRY_AFTER_S = 60.0


@dataclass(slots=True, eq=False)
class Queued:
    """One waiting request. ``payload`` is the app's waiter, opaque here."""

    identity: Identity
    model: str
    size_bytes: int
    prompt_tokens: int
    enqueued_at: float  # clock time
    payload: Any = None
    queued: bool = field(default=False, init=False)  # in the queue now
    seq: int = field(default=-1, init=False, repr=False)
    # its tenant's tokens pushed in its band before it: what is left of them stands ahead
    mark: int = field(default=0, init=False, repr=False)

    @property
    def weight(self) -> int:
        """Its prompt tokens, at least one: what it takes of the fleet's prefill."""
        return self.prompt_tokens if self.prompt_tokens > 0 else 1


class Refused(Exception):
    """A request the queue will not take; ``reason`` is machine-readable."""

    def __init__(self, reason: str, retry_after_s: float) -> None:
        super().__init__(f"{reason}: retry after {retry_after_s:.0f} s")
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class QueueLimits:
    """Caps per band (0: no cap), the TTL (0: none), the order within a tenant, and VTC."""

    max_requests_per_band: int = 1000
    max_bytes_per_band: int = 256 * 1024 * 1024
    ttl_s: float = 30.0
    ordering: Literal["fcfs", "edf"] = "fcfs"
    output_weight: float = 2.0  # VTC: an output token costs this many prompt tokens
    half_life_s: float = 60.0  # VTC decay (0: none)

    def __post_init__(self) -> None:
        if self.ordering not in ("fcfs", "edf"):
            raise ValueError(f"ordering must be 'fcfs' or 'edf', not {self.ordering!r}")


class _Tenant:
    """A tenant's counter, in the queue's stored units, and its requests queued anywhere."""

    __slots__ = ("name", "scaled", "advanced", "live")

    def __init__(self, name: str) -> None:
        self.name = name
        self.scaled = 0.0
        self.advanced = 0  # prompt tokens charged at dispatch, not yet settled by charge()
        self.live = 0


# (key, seq, item): key is the arrival sequence (FCFS) or the deadline (EDF).
_Entry = tuple[float, int, Queued]


class _Member:
    """A tenant's requests in one band, one heap per model."""

    __slots__ = ("tenant", "by_model", "live", "dead", "pushed", "left")

    def __init__(self, tenant: _Tenant) -> None:
        self.tenant = tenant
        self.by_model: dict[str, list[_Entry]] = {}
        self.live = 0
        self.dead = 0  # removed requests still in the heaps
        self.pushed = 0  # the weights ever pushed, and ever left, while it was in the band
        self.left = 0

    @property
    def tokens(self) -> int:
        """The weights of its queued requests."""
        return self.pushed - self.left


class _Band:
    __slots__ = ("members", "heap", "fifo", "count", "bytes", "tokens", "orphans")

    def __init__(self) -> None:
        self.members: dict[str, _Member] = {}
        self.heap: list[tuple[float, int, _Member]] = []
        self.fifo: deque[Queued] = deque()
        self.count = 0
        self.bytes = 0
        self.tokens = 0
        self.orphans = 0  # heap entries of members that left the band


class FlowQueue:
    """Waiting requests across bands and tenants; see the module docstring for the order."""

    def __init__(self, limits: QueueLimits, clock: Callable[[], float]) -> None:
        self.limits = limits
        self._clock = clock
        self._bands: dict[int, _Band] = {}
        self._order: list[int] = []  # negated priorities of the bands, ascending
        self._tenants: dict[str, _Tenant] = {}
        self._seq = itertools.count()
        # requests queued: an attribute, not ``__len__``, as every request's fast path
        # reads it and a Python ``__len__`` costs a call
        self.size = 0
        self._origin = clock()
        self._last_served: _Tenant | None = None

    # -- VTC units ---------------------------------------------------------------------

    def _scale(self, now: float) -> float:
        """Stored units per token at ``now``; rescales everything when it has grown large."""
        half_life = self.limits.half_life_s
        if half_life <= 0:
            return 1.0
        exponent = (now - self._origin) / half_life
        if exponent > _RESCALE_HALF_LIVES:
            self._rescale(math.exp2(exponent))
            self._origin = now
            return 1.0
        return math.exp2(exponent)

    def _rescale(self, factor: float) -> None:
        for name, tenant in list(self._tenants.items()):
            tenant.scaled /= factor
            if tenant.live == 0 and tenant.scaled < 1.0:  # forgotten: a rejoin lifts it anyway
                del self._tenants[name]
                if self._last_served is tenant:
                    self._last_served = None
        for band in self._bands.values():
            # One positive factor for all keeps the heap order.
            band.heap[:] = [(key / factor, seq, m) for key, seq, m in band.heap]

    def counter(self, tenant: str) -> float:
        """The tenant's decayed VTC now, in prompt-token units."""
        record = self._tenants.get(tenant)
        if record is None:
            return 0.0
        return record.scaled / self._scale(self._clock())

    def waiting(self, tenant: str) -> int:
        """How many of ``tenant``'s requests wait now, in any band."""
        record = self._tenants.get(tenant)
        return 0 if record is None else record.live

    def charge(self, tenant: str, prompt_tokens: int, output_tokens: int) -> None:
        """Count what ``tenant`` was served (an answer's usage); the prompt tokens settle
        first against what was advanced at dispatch, so nothing is counted twice."""
        record = self._tenant(tenant)
        # comparisons, not min()/max(): this runs for every answered request
        prompt = prompt_tokens if prompt_tokens > 0 else 0
        advanced = record.advanced
        settled = advanced if advanced < prompt else prompt
        record.advanced = advanced - settled
        output = output_tokens if output_tokens > 0 else 0
        cost = (prompt - settled) + self.limits.output_weight * output
        if cost > 0:
            scale = self._scale(self._clock())  # first: it may rescale the stored counters
            record.scaled += cost * scale

    def _tenant(self, name: str) -> _Tenant:
        record = self._tenants.get(name)
        if record is None:
            record = self._tenants[name] = _Tenant(name)
        return record

    # -- push ----------------------------------------------------------------------------

    def push(self, item: Queued) -> None:
        """Queue ``item``, or raise ``Refused`` when its band is over a cap."""
        if item.queued:
            raise ValueError("this request is already queued")
        limits = self.limits
        priority = item.identity.priority
        band = self._bands.get(priority)
        count, size = (band.count, band.bytes) if band is not None else (0, 0)
        if 0 < limits.max_requests_per_band <= count:
            raise Refused("queue_full", self._retry_after(band))
        if 0 < limits.max_bytes_per_band < size + item.size_bytes:
            raise Refused("queue_bytes_full", self._retry_after(band))
        if band is None:
            band = self._bands[priority] = _Band()
            insort(self._order, -priority)
        tenant = self._tenant(item.identity.tenant)
        if tenant.live == 0:
            self._lift(tenant)
        member = band.members.get(tenant.name)
        if member is None:
            member = band.members[tenant.name] = _Member(tenant)
            heapq.heappush(band.heap, (tenant.scaled, next(self._seq), member))
        seq = next(self._seq)
        item.seq = seq
        item.queued = True
        heap = member.by_model.get(item.model)
        if heap is None:
            heap = member.by_model[item.model] = []
        heapq.heappush(heap, (self._key(item, seq), seq, item))
        weight = item.weight
        item.mark = member.pushed
        member.pushed += weight
        member.live += 1
        tenant.live += 1
        band.count += 1
        band.bytes += item.size_bytes
        band.tokens += weight
        band.fifo.append(item)
        if len(band.fifo) > 2 * band.count + _COMPACT_SLACK:
            band.fifo = deque(i for i in band.fifo if i.queued)
        self.size += 1

    def _key(self, item: Queued, seq: int) -> float:
        if self.limits.ordering == "fcfs":
            return float(seq)
        deadline_ms = item.identity.deadline_ms
        if deadline_ms is not None:
            return item.enqueued_at + deadline_ms / 1000.0
        # No deadline of its own: it is due when it would expire.
        ttl = self.limits.ttl_s
        return item.enqueued_at + ttl if ttl > 0 else math.inf

    def _lift(self, tenant: _Tenant) -> None:
        """Raise a (re)joining tenant to the least counter queued, so idling banks no credit."""
        floor: float | None = None
        for band in self._bands.values():
            least = self._clean_top(band)
            if least is not None and (floor is None or least < floor):
                floor = least
        if floor is None and self._last_served is not None:
            floor = self._last_served.scaled
        if floor is not None and floor > tenant.scaled:
            tenant.scaled = floor

    def _clean_top(self, band: _Band) -> float | None:
        """The least counter among the band's tenants, after re-keying stale entries."""
        heap = band.heap
        while heap:
            key, _, member = heap[0]
            if band.members.get(member.tenant.name) is not member:
                heapq.heappop(heap)
                band.orphans -= 1
            elif key < member.tenant.scaled:
                heapq.heapreplace(heap, (member.tenant.scaled, next(self._seq), member))
            else:
                return key
        return None

    def _retry_after(self, band: _Band | None) -> float:
        """How long the band's oldest request has waited, within [1 s, TTL]."""
        ttl = self.limits.ttl_s
        cap = ttl if ttl > 0 else _MAX_RETRY_AFTER_S
        if band is None:
            return 1.0
        fifo = band.fifo
        while fifo and not fifo[0].queued:
            fifo.popleft()
        waited = self._clock() - fifo[0].enqueued_at if fifo else 0.0
        return max(1.0, min(cap, waited))

    # -- pop -----------------------------------------------------------------------------

    def pop(self, can_serve: Callable[[str, int], bool] | None = None) -> Queued | None:
        """The next request to dispatch, removed from the queue, or None.

        ``can_serve(model, prompt_tokens)``: whether the model has room now for such a
        request; one without is passed over, so one saturated model does not block
        another's, nor a long prompt a short one.
        """
        if not self.size:
            return None
        verdicts: dict[tuple[str, int], bool] = {}
        for negated in self._order:
            band = self._bands[-negated]
            skipped: list[tuple[float, int, _Member]] = []
            chosen: tuple[_Member, list[_Entry]] | None = None
            while self._clean_top(band) is not None:
                entry = heapq.heappop(band.heap)
                member = entry[2]
                heap = self._first_servable(member, can_serve, verdicts)
                if heap is None:
                    skipped.append(entry)
                    continue
                chosen = (member, heap)
                break
            for entry in skipped:
                heapq.heappush(band.heap, entry)
            if chosen is not None:
                member, heap = chosen
                item = heapq.heappop(heap)[2]
                if not heap:
                    del member.by_model[item.model]
                self._take(item, band, member, in_heap=False, listed=False)
                tenant = member.tenant
                if item.prompt_tokens > 0:
                    scale = self._scale(self._clock())  # first: it may rescale the counters
                    tenant.advanced += item.prompt_tokens
                    tenant.scaled += item.prompt_tokens * scale
                if band.members.get(tenant.name) is member:
                    heapq.heappush(band.heap, (tenant.scaled, next(self._seq), member))
                self._last_served = tenant
                return item
        return None

    @staticmethod
    def _first_servable(
        member: _Member,
        can_serve: Callable[[str, int], bool] | None,
        verdicts: dict[tuple[str, int], bool],
    ) -> list[_Entry] | None:
        """The tenant's model heap whose first request goes next, among servable models."""
        best: list[_Entry] | None = None
        for model, heap in list(member.by_model.items()):
            while heap and not heap[0][2].queued:
                heapq.heappop(heap)
                member.dead -= 1
            if not heap:
                del member.by_model[model]
                continue
            key = (model, heap[0][2].prompt_tokens)
            servable = verdicts.get(key)
            if servable is None:
                servable = verdicts[key] = can_serve is None or can_serve(*key)
            if servable and (best is None or heap[0][:2] < best[0][:2]):
                best = heap
        return best

    # -- leaving without dispatch ---------------------------------------------------------

    def remove(self, item: Queued) -> bool:
        """Take out a request whose client has gone; False when it was not queued."""
        if not item.queued:
            return False
        band = self._bands[item.identity.priority]
        self._take(item, band, band.members[item.identity.tenant], in_heap=True)
        return True

    def expire(self) -> list[Queued]:
        """Remove and return the requests queued for ``ttl_s`` or longer, oldest first."""
        ttl = self.limits.ttl_s
        if ttl <= 0 or not self.size:
            return []
        now = self._clock()
        expired: list[Queued] = []
        for negated in list(self._order):
            band = self._bands[-negated]
            fifo = band.fifo
            while fifo:
                item = fifo[0]
                if item.queued and now - item.enqueued_at < ttl:
                    break
                fifo.popleft()
                if item.queued:
                    self._take(item, band, band.members[item.identity.tenant], in_heap=True)
                    expired.append(item)
        expired.sort(key=lambda i: i.seq)
        return expired

    def _take(
        self, item: Queued, band: _Band, member: _Member, *, in_heap: bool, listed: bool = True
    ) -> None:
        """Bookkeeping for a request leaving the queue. ``in_heap``: still in its model heap
        (dropped lazily) rather than popped from it; ``listed``: its tenant's entry is still
        in the band's heap (so it becomes an orphan if the tenant leaves the band)."""
        item.queued = False
        tenant = member.tenant
        weight = item.weight
        member.left += weight
        member.live -= 1
        tenant.live -= 1
        band.count -= 1
        band.bytes -= item.size_bytes
        band.tokens -= weight
        self.size -= 1
        if member.live == 0:
            del band.members[tenant.name]
            band.orphans += listed
            if band.orphans > len(band.members) + _COMPACT_SLACK:
                band.heap = [(m.tenant.scaled, next(self._seq), m) for m in band.members.values()]
                heapq.heapify(band.heap)
                band.orphans = 0
        elif in_heap:
            member.dead += 1
            if member.dead > member.live + _COMPACT_SLACK:
                for model, heap in list(member.by_model.items()):
                    heap[:] = [entry for entry in heap if entry[2].queued]
                    if heap:
                        heapq.heapify(heap)
                    else:
                        del member.by_model[model]
                member.dead = 0
        if band.count == 0:
            del self._bands[item.identity.priority]
            self._order.remove(-item.identity.priority)

    # -- views -----------------------------------------------------------------------------

    def sizes(self) -> dict[tuple[int, str], int]:
        """Queued requests by (band, tenant), for metrics."""
        return {
            (priority, name): member.live
            for priority, band in self._bands.items()
            for name, member in band.members.items()
        }

    def oldest(self, identity: Identity) -> float | None:
        """When the longest-waiting of ``identity``'s tenant's requests in its band was
        queued (first come first served: the head of its line), or None."""
        band = self._bands.get(identity.priority)
        member = band.members.get(identity.tenant) if band is not None else None
        if member is None:
            return None
        oldest: float | None = None
        for heap in member.by_model.values():
            while heap and not heap[0][2].queued:
                heapq.heappop(heap)
                member.dead -= 1
            if heap and (oldest is None or heap[0][2].enqueued_at < oldest):
                oldest = heap[0][2].enqueued_at
        return oldest

    def tokens_ahead(self, identity: Identity, prompt_tokens: int) -> int:
        """The prompt tokens dispatched before a new request of ``identity`` with
        ``prompt_tokens``, its own included: see ``_ahead``."""
        band = self._bands.get(identity.priority)
        member = band.members.get(identity.tenant) if band is not None else None
        own = (member.tokens if member is not None else 0) + max(prompt_tokens, 1)
        return self._ahead(identity, own)

    def tokens_ahead_of(self, item: Queued) -> int:
        """The prompt tokens still to be dispatched before queued ``item``, its own
        included (in its tenant's order of arrival: exact under FCFS, near under EDF)."""
        member = self._bands[item.identity.priority].members[item.identity.tenant]
        return self._ahead(item.identity, max(item.mark - member.left, 0) + item.weight)

    def _ahead(self, identity: Identity, own: int) -> int:
        """``own`` tokens of ``identity``'s tenant to go, with every higher band's before
        them and, from each other tenant of the band, as many as ``own`` at most: VTC
        serves the tenants of a band equal tokens in turn."""
        total = own
        for negated in self._order:
            priority = -negated
            band = self._bands[priority]
            if priority > identity.priority:
                total += band.tokens
            elif priority == identity.priority:
                for name, member in band.members.items():
                    if name != identity.tenant:
                        total += min(member.tokens, own)
            else:
                break
        return total

    def by_model(self) -> dict[str, tuple[int, float]]:
        """Queued requests by model: (count, when its longest-waiting one was queued), for
        the scaling signals read at scrape time."""
        out: dict[str, tuple[int, float]] = {}
        for band in self._bands.values():
            for item in band.fifo:
                if item.queued:
                    count, first = out.get(item.model, (0, item.enqueued_at))
                    out[item.model] = (count + 1, min(first, item.enqueued_at))
        return out

    def drain(self) -> list[Queued]:
        """Empty the queue (shutdown): every queued request, higher bands first, oldest first
        within a band. Counters are kept."""
        drained = [
            item for negated in self._order for item in self._bands[-negated].fifo if item.queued
        ]
        for item in drained:
            item.queued = False
        for tenant in self._tenants.values():
            tenant.live = 0
        self._bands.clear()
        self._order.clear()
        self.size = 0
        return drained
