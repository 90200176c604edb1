"""One request's generation: drives the engine iterator and writes the response.

Streamed chunks are pre-encoded (``openai_shapes.StreamEncoder``) and written as the
engine produces tokens; a complete response is built once at the end. A client that
disconnects cancels the run, which aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING, Any

from starlette.types import Receive, Send

from switchyard.mock import openai_shapes as shapes
from switchyard.mock.asgi import JSON, SSE, respond
from switchyard.mock.engine.api import TokenOutput
from switchyard.mock.faults import DropConnection
from switchyard.mock.planning import Plan
from switchyard.mock.request import Parsed

if TYPE_CHECKING:
    from switchyard.mock.app import EngineServer


async def watch_disconnect(receive: Receive, run: Run, task: asyncio.Task[Any] | None) -> None:
    while (await receive())["type"] != "http.disconnect":
        continue
    if not run.done and task is not None:
        run.disconnected = True
        task.cancel()


class Run:
    """One request's generation: drives the engine iterator and writes the response."""

    __slots__ = (
        "app",
        "plan",
        "p",
        "chat",
        "rid",
        "start",
        "headers",
        "send",
        "done",
        "disconnected",
    )

    def __init__(
        self,
        app: EngineServer,
        plan: Plan,
        parsed: Parsed,
        chat: bool,
        rid: str,
        start: float,
        headers: list[tuple[bytes, bytes]],
        send: Send,
    ) -> None:
        self.app = app
        self.plan = plan
        self.p = parsed
        self.chat = chat
        self.rid = rid
        self.start = start
        self.headers = headers
        self.send = send
        self.done = False
        self.disconnected = False

    async def go(self) -> None:
        app, plan, p = self.app, self.plan, self.p
        engine = app.engines[plan.rank]
        try:
            agen = engine.generate(plan.request)
        except ValueError:
            # The client reused a request id still in flight here: keep both apart.
            plan.request.request_id = f"{self.rid}-{os.urandom(4).hex()}"
            agen = engine.generate(plan.request)
        rm = app.metrics.ranks[plan.rank]
        created = int(time.time())
        model = app.s.model if p.lora is None else p.lora.name
        send = self.send
        n_prompt = len(p.prompt_ids)
        enc = shapes.StreamEncoder(self.chat, self.rid, created, model) if p.stream else None
        if enc is not None:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", SSE),
                        (b"cache-control", b"no-cache"),
                        *self.headers,
                    ],
                }
            )
        # The role chunk goes with the first output, as vLLM's chat stream sends it: a
        # router reads a stream's first chunk as its first token (its prefill done).
        opening = (
            enc.first(shapes.usage(n_prompt, 0, 0) if p.continuous_usage else None)
            if enc is not None
            else b""
        )
        faults = app.faults
        slow = faults.slow_stream_ms / 1000.0 if p.stream else 0.0
        drop_at = faults.drop_at() if p.stream and faults.drop_after_tokens else 0
        generated = 0
        cached = 0
        last = first_at = self.start
        out: TokenOutput | None = None
        reason = "length"
        try:
            async for out in agen:
                delta = out.num_generated - generated
                if out.num_cached_tokens > 0:
                    cached = out.num_cached_tokens
                if delta <= 0 and not out.finished:
                    continue
                now = time.perf_counter()
                if generated == 0 and delta > 0:
                    first_at = now
                    rm.ttft.observe(now - self.start)
                elif delta > 0:
                    rm.itl.observe((now - last) / delta, delta)
                last = now
                generated = out.num_generated
                if out.finished:
                    reason = out.finish_reason or "length"
                if enc is None:
                    continue
                if slow:
                    await asyncio.sleep(slow)
                use = shapes.usage(n_prompt, generated, cached) if p.continuous_usage else None
                fin = ("length" if reason == "length" else reason) if out.finished else None
                chunk = enc.chunk(delta, fin, use)
                if opening:
                    chunk, opening = opening + chunk, b""
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if drop_at and generated >= drop_at and not out.finished:
                    app.metrics.fault("drop")
                    raise DropConnection(f"injected drop after {generated} tokens")
        finally:
            # A client that left is not a finished request: vLLM 0.32 leaves it out of
            # request_success_total (tests/real/test_real_engine_state.py).
            if out is None or not out.finished:
                await agen.aclose()
        e2e_s = time.perf_counter() - self.start
        rm.e2e.observe(e2e_s)
        app.metrics.finished_request(
            plan.rank,
            prompt_tokens=n_prompt,
            cached_tokens=cached,
            generated=generated,
            max_tokens=plan.request.max_tokens,
            ttft_s=first_at - self.start,
            e2e_s=e2e_s,
        )
        rm.finished[reason if reason in rm.finished else "error"] += 1
        kvp = app.planner.hold_prefill(plan, out, n_prompt)
        use = shapes.usage(n_prompt, generated, cached)
        if enc is not None:
            tail = opening + (enc.usage_chunk(use) if p.include_usage else b"") + shapes.DONE
            self.done = True
            await send({"type": "http.response.body", "body": tail, "more_body": False})
            return
        text = shapes.filler(generated).decode()
        build = shapes.chat_body if self.chat else shapes.completion_body
        body = build(self.rid, created, model, text, reason, use, kvp)
        self.done = True
        await respond(send, 200, body, JSON, self.headers)
