"""The real-clock driver: one DP rank of the engine model behind ``api.AsyncEngine``.

One asyncio task runs the step loop against absolute deadlines (a late step is caught up,
not accumulated), idles on an event when there is nothing to schedule, and hands each
step's tokens to per-request channels: a deque plus one future, so thousands of streams
cost no task and no queue object per token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

from switchyard.mock.engine.api import EngineRequest, EngineStats, TokenOutput
from switchyard.mock.engine.config import EngineConfig
from switchyard.mock.engine.core import HELD, EngineCore, Seq
from switchyard.mock.engine.events import KVEventBatch

log = logging.getLogger(__name__)

# Behind schedule by more than this (wall seconds), restart the deadline instead of bursting.
_MAX_LAG_S = 0.25

EventSink = Callable[[KVEventBatch], None]


class _Channel:
    __slots__ = ("buf", "waiter")

    def __init__(self) -> None:
        self.buf: deque[TokenOutput] = deque()
        self.waiter: asyncio.Future[None] | None = None

    def push(self, out: TokenOutput) -> None:
        self.buf.append(out)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)


class _Stream:
    """One request's outputs. Closing it, cancelling a wait on it or dropping it before the
    end aborts the request (also when it was never iterated, unlike an async generator)."""

    __slots__ = ("_engine", "_seq", "_channel", "_done")

    def __init__(self, engine: RealClockEngine, seq: Seq, channel: _Channel) -> None:
        self._engine = engine
        self._seq = seq
        self._channel = channel
        self._done = False

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> TokenOutput:
        channel = self._channel
        buf = channel.buf
        while not buf:
            if self._done:
                raise StopAsyncIteration
            waiter = channel.waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            except BaseException:
                self._abort()
                raise
            finally:
                channel.waiter = None
        out = buf.popleft()
        if out.finished:
            self._done = True
            self._seq.sink = None
        return out

    async def aclose(self) -> None:
        self._abort()

    def _abort(self) -> None:
        if not self._done:
            self._done = True
            self._seq.sink = None
            self._engine.core.abort(self._seq.request_id)

    def __del__(self) -> None:
        # Garbage collection can run in the middle of a step: defer the abort to the loop.
        if not self._done:
            self._done = True
            loop = self._engine._loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(self._engine.core.abort, self._seq.request_id)


class RealClockEngine:
    """Drives :class:`EngineCore` in wall time scaled by ``config.speed``."""

    def __init__(
        self, config: EngineConfig, dp_rank: int = 0, event_sink: EventSink | None = None
    ) -> None:
        self.config = config
        self.dp_rank = dp_rank
        self.core = EngineCore(config, dp_rank, event_sink)
        self._speed = config.speed
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._t0 = 0.0

    # ------------------------------------------------------------------ AsyncEngine

    async def start(self) -> None:
        if self._task is not None:
            return
        loop = self._loop = asyncio.get_running_loop()
        self._t0 = loop.time()
        self._task = loop.create_task(self._run(), name=f"engine-rank-{self.dp_rank}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        for rid in list(self.core.seqs):
            self.abort(rid)

    def generate(self, request: EngineRequest) -> _Stream:
        if self._task is None or self._task.done():
            raise RuntimeError("engine is not running")
        seq = self.core.add_request(request)
        channel = _Channel()
        seq.sink = channel
        self._wake.set()
        return _Stream(self, seq, channel)

    def abort(self, request_id: str) -> None:
        seq = self.core.abort(request_id)
        self._wake.set()
        if seq is not None and isinstance(seq.sink, _Channel):
            seq.sink.push(TokenOutput(seq.num_generated, True, "abort", seq.num_cached_tokens))

    def release_held(self, request_id: str) -> bool:
        self._wake.set()
        return self.core.release_held(request_id)

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``/reset_prefix_cache``: refused (False) while blocks are in use."""
        return self.core.reset_prefix_cache()

    def stats(self) -> EngineStats:
        return self.core.stats()

    # ------------------------------------------------------------------ step loop

    def model_now(self) -> float:
        return (asyncio.get_running_loop().time() - self._t0) * self._speed

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        core = self.core
        speed = self._speed
        t0 = self._t0
        deadline = loop.time()
        while True:
            wall = loop.time()
            if deadline < wall - _MAX_LAG_S:
                deadline = wall
            model_now = (deadline - t0) * speed
            if not core.ready(model_now):
                await self._idle(loop, t0, model_now)
                deadline = loop.time()
                continue
            try:
                result = core.step(model_now, ts=time.time())
            except Exception:
                log.exception("engine step failed; failing all requests")
                self._fail_all()
                raise
            if not result.num_scheduled:
                # Queued work that cannot get blocks (held by P/D prefills): wait for a change.
                await self._idle(loop, t0, model_now)
                deadline = loop.time()
                continue
            deadline += result.duration / speed
            delay = deadline - loop.time()
            await asyncio.sleep(delay if delay > 0 else 0)
            for seq in result.progressed:
                channel = seq.sink
                if channel is None:
                    continue
                if seq.finished:
                    held = [b.block_id for b in seq.blocks] if seq.state == HELD else []
                    out = TokenOutput(
                        seq.num_generated, True, seq.finish_reason, seq.num_cached_tokens, held
                    )
                else:
                    out = TokenOutput(seq.num_generated, False, None, seq.num_cached_tokens)
                channel.push(out)  # type: ignore[attr-defined]

    async def _idle(
        self, loop: asyncio.AbstractEventLoop, t0: float, stepped_at: float | None = None
    ) -> None:
        """Sleep until a request arrives or a transfer / hold comes due.

        ``stepped_at`` is the model time of the last look at the queue (the step lags the
        wall clock): a transfer that landed since is still due, so its timer fires at once
        instead of being skipped and leaving the loop asleep.
        """
        self._wake.clear()
        now = (loop.time() - t0) * self._speed
        self.core.expire_held(now)
        due = self.core.next_wakeup(now if stepped_at is None else min(now, stepped_at))
        handle = loop.call_at(t0 + due / self._speed, self._wake.set) if due is not None else None
        try:
            await self._wake.wait()
        finally:
            if handle is not None:
                handle.cancel()

    def _fail_all(self) -> None:
        for rid in list(self.core.seqs):
            seq = self.core.abort(rid)
            if seq is not None and isinstance(seq.sink, _Channel):
                seq.sink.push(TokenOutput(seq.num_generated, True, "error", seq.num_cached_tokens))


def make_ranks(
    config: EngineConfig,
    dp_size: int,
    event_sink_factory: Callable[[int], EventSink | None] | None = None,
) -> list[RealClockEngine]:
    """``dp_size`` independent ranks (own scheduler, own KV cache), as vLLM DP runs them."""
    return [
        RealClockEngine(config, rank, event_sink_factory(rank) if event_sink_factory else None)
        for rank in range(dp_size)
    ]
