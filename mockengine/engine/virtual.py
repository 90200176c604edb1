"""The virtual clock: discrete-event simulation of one or many engines on the same core.

Each engine alternates exactly as under the real clock: a step starts at model time ``t``
with whatever is queued, its tokens appear at ``t + duration``, and the next step starts
then. Requests arriving mid-step wait for the next one. An engine with nothing to schedule
sleeps until the next arrival or the next due P/D transfer. Nothing here sleeps, so a
fleet of thousands of engines runs as fast as the steps can be computed.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from mockengine.engine.api import EngineRequest, EngineStats, FinishReason
from mockengine.engine.config import EngineConfig
from mockengine.engine.core import EngineCore
from mockengine.engine.events import KVEventBatch

_ARRIVAL, _STEP_DONE, _WAKE, _CANCEL = 0, 1, 2, 3

# A router policy: (fleet, now, request) -> engine index, called at the arrival time.
Router = Callable[["VirtualFleet", float, EngineRequest], int]
# Called at a request's finish time (``fleet.now``); may submit follow-ups (a P/D decode
# leg, the next turn of a conversation) and release P/D holds.
OnFinish = Callable[["VirtualFleet", "RequestResult"], None]
# Called at a request's first-token time: a router's accounting moves it from queued
# prefill to decode then.
OnFirstToken = Callable[["VirtualFleet", "RequestResult"], None]


@dataclass(slots=True)
class RequestResult:
    request_id: str
    engine_index: int
    arrival: float
    prompt_tokens: int
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0
    output_tokens: int = 0
    finish_reason: FinishReason | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    @property
    def itl(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


class _Engine:
    __slots__ = ("core", "busy", "wake_at")

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.busy = False
        self.wake_at: float | None = None


class VirtualFleet:
    """Many engine cores on one virtual clock, with an optional routing hook."""

    def __init__(
        self,
        configs: Sequence[EngineConfig],
        router: Router | None = None,
        event_sinks: Sequence[Callable[[KVEventBatch], None] | None] | None = None,
        record_token_times: bool = True,
        on_finish: OnFinish | None = None,
        on_first_token: OnFirstToken | None = None,
    ) -> None:
        sinks = list(event_sinks) if event_sinks is not None else [None] * len(configs)
        self.engines = [_Engine(EngineCore(c, 0, s)) for c, s in zip(configs, sinks, strict=True)]
        # Direct access for routers over thousands of engines (len(core.running), probes, ...).
        self.cores = [e.core for e in self.engines]
        self.router = router
        self.on_finish = on_finish
        self.on_first_token = on_first_token
        self.record_token_times = record_token_times
        self.now = 0.0
        self.results: dict[str, RequestResult] = {}
        self.finished: list[RequestResult] = []
        self._heap: list[tuple[float, int, int, object]] = []
        self._tie = itertools.count()

    def stats(self, engine_index: int) -> EngineStats:
        return self.engines[engine_index].core.stats()

    def release_held(self, engine_index: int, request_id: str) -> bool:
        """Free a P/D prefill's held blocks now (the decode side pulled them)."""
        eng = self.engines[engine_index]
        released = eng.core.release_held(request_id)
        if released and not eng.busy:
            self._start_step(engine_index, self.now)
        return released

    def submit(self, t: float, engine_index: int | None, request: EngineRequest) -> None:
        """Schedule an arrival; ``engine_index=None`` asks the router at time ``t``."""
        heapq.heappush(self._heap, (t, next(self._tie), _ARRIVAL, (engine_index, request)))

    def cancel(self, t: float, request_id: str) -> None:
        """Abort a request at time ``t`` (a client timeout or disconnect), if it has
        arrived and not finished by then."""
        heapq.heappush(self._heap, (t, next(self._tie), _CANCEL, request_id))

    def run(self, until: float | None = None) -> list[RequestResult]:
        """Advance until no event is left (or ``until``); returns requests finished so far."""
        heap = self._heap
        pop = heapq.heappop
        while heap:
            if until is not None and heap[0][0] > until:
                self.now = until
                break
            t, _, kind, payload = pop(heap)
            self.now = t
            if kind == _STEP_DONE:
                self._step_done(t, payload)  # type: ignore[arg-type]
            elif kind == _ARRIVAL:
                self._arrive(t, *payload)  # type: ignore[misc]
            elif kind == _CANCEL:
                self._cancel(t, payload)  # type: ignore[arg-type]
            else:
                eng = self.engines[payload]  # type: ignore[call-overload]
                if eng.wake_at == t:
                    eng.wake_at = None
                if not eng.busy:
                    self._start_step(payload, t)  # type: ignore[arg-type]
        return self.finished

    def _arrive(self, t: float, engine_index: int | None, request: EngineRequest) -> None:
        if engine_index is None:
            if self.router is None:
                raise ValueError("no engine index and no router")
            engine_index = self.router(self, t, request)
        eng = self.engines[engine_index]
        seq = eng.core.add_request(request)
        result = RequestResult(request.request_id, engine_index, t, len(request.prompt_token_ids))
        seq.sink = result
        self.results[request.request_id] = result
        if not eng.busy:
            self._start_step(engine_index, t)

    def _cancel(self, t: float, request_id: str) -> None:
        res = self.results.get(request_id)
        if res is None or res.finish_time is not None:
            return
        self.engines[res.engine_index].core.abort(request_id)
        res.finish_time = t
        res.finish_reason = "abort"
        self.finished.append(res)
        if self.on_finish is not None:
            self.on_finish(self, res)
        if not self.engines[res.engine_index].busy:
            self._start_step(res.engine_index, t)

    def _start_step(self, index: int, t: float) -> None:
        eng = self.engines[index]
        core = eng.core
        result = core.step(t) if core.ready(t) else None
        if result is None or not result.num_scheduled:
            # Idle, or queued work that cannot get blocks (held by P/D prefills).
            core.expire_held(t)
            due = core.next_wakeup(t)
            if due is not None and (eng.wake_at is None or due < eng.wake_at):
                eng.wake_at = due
                heapq.heappush(self._heap, (due, next(self._tie), _WAKE, index))
            return
        eng.busy = True
        done = t + result.duration
        heapq.heappush(self._heap, (done, next(self._tie), _STEP_DONE, (index, result.progressed)))

    def _step_done(self, t: float, payload: tuple[int, list]) -> None:
        index, progressed = payload
        record = self.record_token_times
        first = self.on_first_token
        done: list[RequestResult] = []
        for seq in progressed:
            res: RequestResult = seq.sink
            if res.finish_time is not None:  # cancelled while its step was running
                continue
            if res.first_token_time is None:
                res.first_token_time = t
                res.num_cached_tokens = seq.num_cached_tokens
                if first is not None:
                    first(self, res)
            if record:
                res.token_times.append(t)
            res.output_tokens = seq.num_generated
            if seq.finished:
                res.finish_time = t
                res.finish_reason = seq.finish_reason
                done.append(res)
        self.engines[index].busy = False
        self.finished.extend(done)
        if self.on_finish is not None:
            for res in done:
                self.on_finish(self, res)
        if not self.engines[index].busy:
            self._start_step(index, t)


def simulate(
    config: EngineConfig, arrivals: Iterable[tuple[float, EngineRequest]]
) -> list[RequestResult]:
    """Run one engine over ``(arrival_time, request)`` pairs; results in arrival order."""
    fleet = VirtualFleet([config])
    order: list[str] = []
    for t, req in arrivals:
        fleet.submit(t, 0, req)
        order.append(req.request_id)
    fleet.run()
    return [fleet.results[rid] for rid in order]
