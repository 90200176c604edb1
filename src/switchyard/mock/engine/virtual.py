"""The virtual clock: discrete-event simulation of one or many engines on the same core.

Each engine alternates exactly as under the real clock: a step starts at model time ``t``
with whatever is queued, its tokens appear at ``t + duration``, and the next step starts
then. Requests arriving mid-step wait for the next one. An engine with nothing to schedule
sleeps until the next arrival or the next due P/D transfer. Nothing here sleeps, so a
fleet of thousands of engines runs as fast as the steps can be computed.

Decode jump-ahead: while an engine's batch only decodes (nothing waiting or held, no
token completes a KV block or a request), its steps change nothing that anyone else sees:
no KV event, no block taken, no first token, no finish. Those plain steps are computed in
one go (the same durations, summed in the same order) and land as one event; an arrival,
a cancel or a stats read in the middle cuts the run at the first step boundary at or after
that time, so requests see the engine exactly as stepping would show it. Over a thousand
engines on the Mooncake trace, stepping every token was most of the simulator's CPU; with
16-token blocks a lone decode costs two events per block, not 16.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import cast

from switchyard.mock.engine.api import EngineRequest, EngineStats, FinishReason
from switchyard.mock.engine.config import EngineConfig
from switchyard.mock.engine.core import EngineCore, Seq
from switchyard.mock.engine.events import KVEventBatch

_ARRIVAL, _STEP_DONE, _WAKE, _CANCEL, _JUMP_DONE = 0, 1, 2, 3, 4

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


class _Jump:
    """A run of plain decode steps started at ``start``; step ``j`` ends at ``ends[j]``."""

    __slots__ = ("index", "start", "ends", "seqs")

    def __init__(self, index: int, start: float, ends: list[float], seqs: list[Seq]) -> None:
        self.index = index
        self.start = start
        self.ends = ends
        self.seqs = seqs


class _Engine:
    __slots__ = ("core", "busy", "wake_at", "jump")

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.busy = False
        self.wake_at: float | None = None
        self.jump: _Jump | None = None


def plain_decode_steps(core: EngineCore) -> int:
    """How many of the core's next steps are plain decode steps: every running request
    decodes one token that neither completes a KV block (no allocation, no event) nor
    ends the request, with nothing waiting, held or left to publish. 0 when any is not."""
    if core.waiting or core.held or core.pool.events:
        return 0
    running = core.running
    if not running or len(running) > core.config.max_num_batched_tokens:
        return 0
    bs = core.block_size
    caching = core.caching
    steps = 1 << 30
    for seq in running:
        computed = seq.num_computed
        if not seq.num_generated or computed != len(seq.tokens) - 1:
            return 0
        steps = min(
            steps,
            len(seq.blocks) * bs - computed,  # the step whose token needs a new block
            seq.max_tokens - seq.num_generated - 1,  # the step that ends the request
        )
        if caching:  # the step whose token fills a block (registered, published)
            steps = min(steps, (seq.num_cached_blocks + 1) * bs - 1 - computed)
    return max(steps, 0)


def advance_decode(core: EngineCore, seqs: list[Seq], steps: int) -> None:
    """Apply ``steps`` plain decode steps to ``seqs`` (the core's running batch) as
    ``EngineCore.step`` would, one token each per step."""
    for seq in seqs:
        ids = seq.output_ids
        g = seq.num_generated
        seq.tokens.extend(ids[(g + j) % len(ids)] for j in range(steps))
        seq.num_generated = g + steps
        seq.num_computed += steps
    core.generation_tokens_total += steps * len(seqs)


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
        jump_ahead: bool = True,
    ) -> None:
        sinks = list(event_sinks) if event_sinks is not None else [None] * len(configs)
        self.engines = [_Engine(EngineCore(c, 0, s)) for c, s in zip(configs, sinks, strict=True)]
        # Direct access for routers over thousands of engines (len(core.running), probes, ...).
        # Queues and the prefix cache are exact at any time; in a decode jump the running
        # requests' token counts lag until it lands (``stats`` settles it first).
        self.cores = [e.core for e in self.engines]
        self.router = router
        self.on_finish = on_finish
        self.on_first_token = on_first_token
        self.record_token_times = record_token_times
        # Off: one event per step, the reference the jump-ahead is held exact against.
        self.jump_ahead = jump_ahead
        self.now = 0.0
        self.results: dict[str, RequestResult] = {}
        self.finished: list[RequestResult] = []
        self._heap: list[tuple[float, int, int, object]] = []
        self._tie = itertools.count()

    def stats(self, engine_index: int) -> EngineStats:
        self._settle(engine_index, self.now)
        return self.engines[engine_index].core.stats()

    def release_held(self, engine_index: int, request_id: str) -> bool:
        """Free a P/D prefill's held blocks now (the decode side pulled them)."""
        self._settle(engine_index, self.now)
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
            elif kind == _JUMP_DONE:
                self._jump_done(t, payload)  # type: ignore[arg-type]
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
        self._settle(engine_index, t)
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
        self._settle(res.engine_index, t)
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
        if self.jump_ahead:
            steps = plain_decode_steps(core)
            if steps > 1:
                self._start_jump(index, t, steps)
                return
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

    def _start_jump(self, index: int, t: float, steps: int) -> None:
        """Plan ``steps`` plain decode steps from ``t``; their state lands at the end (or
        where ``_settle`` cuts the run)."""
        eng = self.engines[index]
        core = eng.core
        seqs = list(core.running)
        n = len(seqs)
        context = sum(s.num_computed for s in seqs)
        a, b, c, d = core._a, core._b, core._c, core._d
        prefill = 0
        ends: list[float] = []
        done = t
        for _ in range(steps):
            # EngineCore._execute's expression, term for term, so the floats agree.
            done = done + (a + b * prefill + c * n + d * context)
            ends.append(done)
            context += n
        jump = _Jump(index, t, ends, seqs)
        eng.busy = True
        eng.jump = jump
        heapq.heappush(self._heap, (done, next(self._tie), _JUMP_DONE, jump))

    def _jump_done(self, t: float, jump: _Jump) -> None:
        eng = self.engines[jump.index]
        if eng.jump is not jump:  # cut short by _settle
            return
        eng.jump = None
        self._land(jump, len(jump.ends))
        eng.busy = False
        self._start_step(jump.index, t)

    def _land(self, jump: _Jump, steps: int) -> None:
        """Apply a jump's first ``steps`` steps to the core and the requests' results."""
        advance_decode(self.engines[jump.index].core, jump.seqs, steps)
        record = self.record_token_times
        times = jump.ends[:steps]
        for seq in jump.seqs:
            res = cast(RequestResult, seq.sink)
            if record:
                res.token_times.extend(times)
            res.output_tokens = seq.num_generated

    def _settle(self, index: int, t: float) -> None:
        """Bring an engine in a jump to where stepping would have it at ``t``: the steps
        ended by then done, the one running at ``t`` (ending at or after it) executed and
        in flight as an ordinary step."""
        eng = self.engines[index]
        jump = eng.jump
        if jump is None:
            return
        eng.jump = None
        ends = jump.ends
        i = bisect.bisect_left(ends, t)  # steps ended before t; step i+1 ends at or after t
        self._land(jump, i)
        core = eng.core
        start = ends[i - 1] if i else jump.start
        result = core.step(start)
        heapq.heappush(
            self._heap, (ends[i], next(self._tie), _STEP_DONE, (index, result.progressed))
        )


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
